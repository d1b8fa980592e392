"""Streamed fp32 weighted mean of model checkpoints into a Hugging Face model directory.

This is the tensor half of federated averaging: the strategy decides who takes part and with
which weight, this module computes. It reads one key at a time from every client's checkpoint
(FSDP rank files of any world size or HF safetensors, see :mod:`.reader`), accumulates in fp32,
and streams the result into ``model.safetensors``, so memory is a few tensors of the largest key
(:func:`weighted_mean` says how many) whatever the number of clients. Reads run ahead on a
background thread (:mod:`.read_ahead`), so the disk, the content hash and the arithmetic overlap.
The output stays fp32 (no bf16 rounding between rounds) and
loads with ``AutoModelForCausalLM.from_pretrained``. :func:`aggregate_by_key` writes the same
layout with another per-key rule (a strategy's median, trimmed mean, ...).

Tied weights: FSDP state dicts hold both ``lm_head.weight`` and ``model.embed_tokens.weight``
when a model ties them, while ``save_pretrained`` writes only the embedding. The output follows
``save_pretrained`` (the tied copy is left out, the model re-ties on load), and key comparisons
ignore a tied copy that is present on one side only.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fedagent_flwr.atomic import fsync_dir
from fedagent_flwr.checkpoint.hf_files import MODEL_FILE, config_dir, copy_hf_files, tied_weight_keys
from fedagent_flwr.checkpoint.key_checks import (
    all_finite,
    check_compatible,
    check_finite,
    compare_keys,
    effective_keys,
    normalise_weights,
)
from fedagent_flwr.checkpoint.mean_audit import verify_mean
from fedagent_flwr.checkpoint.read_ahead import ReadAhead, ReadItem, ring_bytes
from fedagent_flwr.checkpoint.reader import CheckpointReader
from fedagent_flwr.checkpoint.ref import CheckpointError
from fedagent_flwr.checkpoint.safetensors_writer import LateMetadata, SafetensorsStreamWriter
from fedagent_flwr.checkpoint.update_stats import (
    DEFAULT_MAX_BYTES,
    UpdateStats,
    UpdateStatsAccumulator,
    sq_norm_float64,
)

__all__ = [
    "MODEL_FILE",
    "AggregateReport",
    "KeyRule",
    "aggregate_by_key",
    "aggregation_entries",
    "check_compatible",
    "normalise_weights",
    "tied_weight_keys",
    "verify_mean",
    "weighted_mean",
]


@dataclass(frozen=True)
class AggregateReport:
    """What :func:`weighted_mean` wrote and what it cost."""

    out_dir: Path
    num_tensors: int  # tensors written to model.safetensors
    num_params: int  # elements written
    weights: tuple[float, ...]  # normalised, in source order
    bytes_read: int  # tensor bytes read from all sources
    seconds: float
    tied_keys: tuple[str, ...] = ()  # keys left out because the model ties them to another key
    # The clients' updates against the reference (norms, cosines); None without a reference.
    update_stats: UpdateStats | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (for provenance records and logs)."""
        data = asdict(self)
        data["out_dir"] = str(self.out_dir)
        data["weights"] = list(self.weights)
        data["tied_keys"] = list(self.tied_keys)
        data["update_stats"] = self.update_stats.to_dict() if self.update_stats is not None else None
        return data


#: holds every source's fp32 tensor for ``key`` (source order) and ``weights`` the normalised weights.
KeyRule = Callable[[str, list[torch.Tensor], list[float]], torch.Tensor]


@dataclass
class _KeyContext:
    """What every key of one aggregation shares: reused buffers, names, optional statistics."""

    acc: torch.Tensor  # the largest key's size: the running weighted sum
    # (n + 1, largest) with full statistics (every client's copy kept); else (1, largest) where a
    # buffer is needed (sequential reads, or the clients' update norms), (0, largest) otherwise.
    rows: torch.Tensor
    names: list[str]  # "source i (directory)": errors name the culprit so the strategy can drop it
    reference: CheckpointReader | None
    stats: UpdateStatsAccumulator | None
    ahead: ReadAhead | None = None  # the sources' tensors read ahead, in the order they are used

    def start(self, key: str) -> torch.Tensor | None:
        """The reference's fp32 value of ``key`` when statistics are kept (one read per key)."""
        if self.stats is None or self.reference is None:
            return None
        return self.reference.read(key)

    def fetch(
        self, key: str, index: int, reader: CheckpointReader, buffer: torch.Tensor | None
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """Source ``index``'s ``key`` and what to call once done with it (before the next fetch).

        From the read-ahead when one runs (read only: its hash may still be running), else read
        now, into ``buffer`` (a float key's fp32 buffer) or, without one, as a new tensor in the
        stored dtype.
        """
        if self.ahead is not None:
            slot = self.ahead.take(key, index)
            return slot.tensor, slot.release
        if buffer is None:
            return reader.read(key, dtype=None), _nothing
        reader.read_into(key, buffer)
        return buffer, _nothing

    def stop_reading_ahead(self) -> None:
        """Read on the calling thread from now on (to re-read a key already consumed)."""
        if self.ahead is not None:
            self.ahead.abort()
            self.ahead = None
            if self.rows.shape[0] == 0:  # the sequential path reads into a row
                self.rows = torch.empty(1, self.acc.numel(), dtype=torch.float32)


# How a writer gets one floating-point key: (key, readers, weights, shape, context) -> tensor.
_KeyCombiner = Callable[[str, list[CheckpointReader], list[float], tuple[int, ...], _KeyContext], torch.Tensor]


def weighted_mean(
    sources: Sequence[tuple[CheckpointReader, float]],
    out_dir: str | os.PathLike[str],
    reference: CheckpointReader | None = None,
    num_threads: int | None = 1,
    update_stats: bool = True,
    stats_max_bytes: int = DEFAULT_MAX_BYTES,
    model_files: str | os.PathLike[str] | None = None,
    read_ahead: bool = True,
) -> AggregateReport:
    """Write the weighted mean of ``sources`` as an fp32 HF model directory at ``out_dir``.

    Weights are normalised to sum to 1. Every source must have the same keys and shapes (and
    match ``reference`` when given, typically the round's starting global model). Config,
    generation config, tokenizer and chat-template files come from ``model_files`` (a directory
    with ``config.json``: the run's base model, see :mod:`.model_files`), else from
    ``reference``; only a call with neither takes them from the first source. The directory is built under a temporary
    sibling and renamed into place when complete; an existing ``out_dir`` is refused, and on
    any error nothing is left behind.

    ``num_threads`` sets torch's intra-op threads for the duration of the call (restored after;
    ``None`` leaves them alone). The per-key work is a memory-bound multiply-add, which one
    thread does at memory speed, while waking a thread pool once per tensor can cost more than
    the add itself (measured: ~12 ms per op with 2 threads vs 0.2 ms with 1 on a 2-vCPU host).
    The other core is kept for the reads and the content hash running alongside.

    ``read_ahead`` (default) reads the sources' tensors on a background thread, in the order
    they are averaged, while the last ones are averaged (:mod:`.read_ahead`); ``False`` reads and
    averages in turn on the calling thread. The mean is bitwise the same either way. Memory,
    with L the bytes of the largest tensor as fp32 and n the number of sources: 3 L with
    read-ahead (the running sum and a ring of two tensors), 2 L without (the sum and one read
    buffer). Update statistics add the reference's tensor and a row for the client's update:
    5 L with read-ahead, 3 L without (the read buffer is that row); the cosines keep every
    client's update and the aggregate's instead of one row: (n + 5) L and (n + 3) L (within
    ``stats_max_bytes``). Read-ahead is off when ``reference`` is also one of the sources (one
    reader object is never read from two threads).

    A source holding NaN or Inf is refused (CheckpointError naming it) before anything is
    written. With a ``reference`` and ``update_stats`` the report carries the clients' update
    statistics (:mod:`.update_stats`), which cost one more read of the reference and, for the
    cosines, up to ``stats_max_bytes`` of memory; the mean itself is bitwise the same either way.
    """
    return _write_aggregate(sources, out_dir, reference, num_threads, "weighted_mean", _mean_of_key,
                            update_stats, stats_max_bytes, model_files, read_ahead=read_ahead)


def aggregate_by_key(
    sources: Sequence[tuple[CheckpointReader, float]],
    out_dir: str | os.PathLike[str],
    rule: KeyRule,
    *,
    name: str,
    reference: CheckpointReader | None = None,
    num_threads: int | None = 1,
    update_stats: bool = True,
    stats_max_bytes: int = DEFAULT_MAX_BYTES,
    model_files: str | os.PathLike[str] | None = None,
    metadata: dict[str, str] | None = None,
    late_metadata: LateMetadata | None = None,
) -> AggregateReport:
    """Like :func:`weighted_mean`, with the tensor arithmetic of ``rule`` (median, trimmed mean, ...).

    Same checks, output layout (fp32 HF safetensors, tied copies left out) and atomic write;
    integer tensors must agree across sources and are copied. ``rule`` is called once per
    floating-point key with every source's full fp32 tensor of that key, so memory is the
    number of sources times the largest tensor. ``name`` is recorded in the output's header
    (``fedagent.aggregation``) so audits know which rule wrote it; ``metadata`` adds the rule's own
    header entries (a server optimiser's settings and starting model), ``late_metadata`` entries
    whose values exist only once every key is computed (its state's content hash): they are filled
    in after the last key, before the directory is renamed into place.
    """

    def combine(key: str, readers: list[CheckpointReader], weights: list[float], shape: tuple[int, ...],
                context: _KeyContext) -> torch.Tensor:
        tensors = [reader.read(key) for reader in readers]  # every tensor at once: no read-ahead here
        for tensor, source in zip(tensors, context.names):
            check_finite(key, tensor, source)
        start = context.start(key)
        result = rule(key, [t.clone() for t in tensors] if start is not None else tensors, list(weights))
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != shape:
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            raise CheckpointError(f"aggregation rule {name!r} returned {got} for '{key}', expected shape {shape}")
        result = result.to(torch.float32)
        check_finite(key, result, f"the output of aggregation rule {name!r}")
        if start is not None and context.stats is not None:
            if context.stats.mode == "full":
                context.stats.add_key(start.reshape(-1), torch.stack([t.reshape(-1) for t in tensors]))
            else:
                for index, tensor in enumerate(tensors):
                    context.stats.add_client_sq(index, sq_norm_float64(tensor.sub_(start)))
                context.stats.count_params(result.numel())
            context.stats.add_mean_sq(sq_norm_float64(result - start))
        return result

    return _write_aggregate(sources, out_dir, reference, num_threads, name, combine, update_stats, stats_max_bytes,
                            model_files, extra_metadata=metadata, late_metadata=late_metadata)


def _write_aggregate(
    sources: Sequence[tuple[CheckpointReader, float]],
    out_dir: str | os.PathLike[str],
    reference: CheckpointReader | None,
    num_threads: int | None,
    rule_name: str,
    combine: _KeyCombiner,
    update_stats: bool = True,
    stats_max_bytes: int = DEFAULT_MAX_BYTES,
    model_files: str | os.PathLike[str] | None = None,
    read_ahead: bool = False,
    extra_metadata: dict[str, str] | None = None,
    late_metadata: LateMetadata | None = None,
) -> AggregateReport:
    """The checks, layout and atomic write shared by every tensor rule (see :func:`weighted_mean`
    and, for the metadata, :func:`aggregate_by_key`).

    ``read_ahead`` feeds ``combine`` through :meth:`_KeyContext.fetch` from a background reader;
    only a combiner that fetches every source of a key in order, one at a time, may ask for it.
    """
    started = time.perf_counter()
    readers = [reader for reader, _ in sources]
    names = [f"source {index} ({reader.directory})" for index, reader in enumerate(readers)]
    weights = normalise_weights([weight for _, weight in sources], names)  # refuses no sources, too
    out_dir = Path(out_dir)
    if out_dir.exists() or out_dir.is_symlink():
        raise CheckpointError(f"output directory {out_dir} already exists; refusing to overwrite it")

    hf_dir = config_dir(readers[0], reference, model_files)
    ties = tied_weight_keys(hf_dir)
    head = readers[0]
    for reader, name in zip(readers[1:], names[1:]):
        compare_keys(reader, head, ties, name, names[0])
    if reference is not None:
        for reader, name in zip(readers, names):
            compare_keys(reader, reference, ties, name, f"reference ({reference.directory})")
    entries = _entries(head, ties)
    tied_out = tuple(k for k in head.keys() if k not in {key for key, _, _ in entries})

    metadata = {
        "format": "pt",
        "fedagent.aggregation": rule_name,
        "fedagent.sources": json.dumps(
            [
                {"path": str(r.directory), "sha256": r.ref.sha256, "weight": w,
                 # a LoRA adapter's value is its base plus its update: the audit needs both
                 **({"base": r.base_ref.path, "base_sha256": r.base_ref.sha256} if r.base_ref is not None else {})}
                for r, w in zip(readers, weights)
            ]
        ),
    }
    clash = sorted(set(metadata) & set(extra_metadata or {}))
    if clash:
        raise CheckpointError(f"aggregation rule {rule_name!r} may not set the header entry {clash[0]!r}")
    metadata.update(extra_metadata or {})
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.staging-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    bytes_before = sum(r.bytes_read for r in readers)
    num_params = 0
    threads_before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    context: _KeyContext | None = None
    try:
        copy_hf_files(hf_dir, staging)
        # Buffers sized for the largest tensor, reused for every key: memory stays at a few
        # tensors whatever the model or the number of clients (weighted_mean's docstring), and
        # pages are faulted in once.
        largest = max((math.prod(shape) for _, shape, dtype in entries if dtype.is_floating_point), default=0)
        stats = (UpdateStatsAccumulator(weights, largest, stats_max_bytes)
                 if update_stats and reference is not None else None)
        ahead = read_ahead and not any(reference is reader for reader in readers)
        # Full statistics keep every client's copy plus one row for the aggregate's update;
        # otherwise one row: the read buffer, or with read-ahead the clients' update.
        rows = len(readers) + 1 if stats is not None and stats.mode == "full" else int(stats is not None or not ahead)
        context = _KeyContext(acc=torch.empty(largest, dtype=torch.float32),
                              rows=torch.empty(rows, largest, dtype=torch.float32),
                              names=names, reference=reference, stats=stats)
        if ahead:
            # Integer keys are read as each source stores them, as the reads in turn do: cast to
            # the first source's dtype, a source's 1.5 would pass as 1 in the agreement check.
            plan = [ReadItem(key, index, reader, shape, dtype if dtype.is_floating_point else reader.dtype(key))
                    for key, shape, dtype in entries for index, reader in enumerate(readers)]
            context.ahead = ReadAhead(plan, ring_bytes(max((item.nbytes for item in plan), default=0)))
        with SafetensorsStreamWriter(staging / MODEL_FILE, entries, metadata, late_metadata) as writer:
            for key, shape, dtype in entries:
                if dtype.is_floating_point:
                    value = combine(key, readers, weights, shape, context)
                else:
                    value = _agreed_integer_tensor(key, readers, context)
                writer.write(key, value)
                num_params += value.numel()
            if context.ahead is not None:  # every hash in flight done (or its error raised)
                context.ahead.close()
                context.ahead = None
        context = None
        # A source whose hash was deferred to reading is checked now, before anything built from
        # it is committed: a mismatch raises (naming the source) and the staging dir goes away.
        for reader in readers:
            reader.verify_content()
        fsync_dir(staging)
        # Checked again: another process may have created it while we were writing.
        if out_dir.exists() or out_dir.is_symlink():
            raise CheckpointError(f"output directory {out_dir} appeared during aggregation")
        os.rename(staging, out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        if context is not None:  # no read or hash may outlive the call
            context.stop_reading_ahead()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads_before)
    return AggregateReport(
        out_dir=out_dir,
        num_tensors=len(entries),
        num_params=num_params,
        weights=tuple(weights),
        bytes_read=sum(r.bytes_read for r in readers) - bytes_before,
        seconds=time.perf_counter() - started,
        tied_keys=tied_out,
        update_stats=stats.result() if stats is not None else None,
    )


# ---------------------------------------------------------------------------------------------
# Helpers


def aggregation_entries(
    sources: Sequence[tuple[CheckpointReader, float]],
    reference: CheckpointReader | None = None,
    model_files: str | os.PathLike[str] | None = None,
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(key, shape, output dtype) of every tensor :func:`weighted_mean` and :func:`aggregate_by_key`
    write for these arguments, in the order they write them, which is the order ``rule`` is called
    for the floating-point keys. A rule that streams a file of its own per key (a server
    optimiser's state) declares that file's keys from it; the keys are not checked here."""
    head = sources[0][0]
    return _entries(head, tied_weight_keys(config_dir(head, reference, model_files)))


def _entries(head: CheckpointReader, ties: dict[str, str]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The output's (key, shape, dtype) list: the first source's keys without tied copies."""
    return [(key, head.shape(key), _output_dtype(head.dtype(key))) for key in effective_keys(head, ties)]


def _agreed_integer_tensor(key: str, readers: list[CheckpointReader], context: _KeyContext) -> torch.Tensor:
    """Integer buffers (counters, index tables) cannot be averaged; they must agree."""
    value: torch.Tensor | None = None
    for index, reader in enumerate(readers):
        tensor, release = context.fetch(key, index, reader, None)
        try:
            if value is None:  # a read-ahead slot is reused once released: keep a copy
                value = tensor.clone() if context.ahead is not None else tensor
            elif not torch.equal(tensor, value):
                raise CheckpointError(
                    f"integer tensor '{key}' differs between source 0 and source {index} "
                    f"({reader.directory}); it cannot be averaged"
                )
        finally:
            release()
    assert value is not None  # there is always a source
    return value


def _output_dtype(stored: torch.dtype) -> torch.dtype:
    """fp32 for every floating-point dtype (no rounding between rounds); integers as stored."""
    return torch.float32 if stored.is_floating_point else stored


def _mean_of_key(
    key: str,
    readers: list[CheckpointReader],
    weights: list[float],
    shape: tuple[int, ...],
    context: _KeyContext,
) -> torch.Tensor:
    """Stream the weighted sum of ``key``, one source at a time, then check it for NaN/Inf.

    The arithmetic (first source times its weight, then add each next one scaled) is the same
    with or without statistics and read-ahead, so the written mean does not depend on them.
    The sources' tensors are never modified: a read-ahead slot may still be being hashed.
    """
    count = math.prod(shape)
    acc = context.acc[:count].view(shape)
    stats = context.stats
    start = context.start(key)
    full = stats is not None and stats.mode == "full"
    sequential = context.ahead is None
    for index, (reader, weight) in enumerate(zip(readers, weights)):
        row = context.rows[index if full else 0, :count].view(shape) if full or sequential else None
        incoming, release = context.fetch(key, index, reader, row)
        try:
            if index == 0:
                torch.mul(incoming, weight, out=acc)
            else:
                acc.add_(incoming, alpha=weight)
            if stats is not None and start is not None:
                if full:
                    if row is not None and incoming is not row:
                        row.copy_(incoming)  # kept for the cosines at the end of the key
                else:
                    diff = context.rows[0, :count].view(shape)
                    stats.add_client_sq(index, sq_norm_float64(torch.sub(incoming, start, out=diff)))
        finally:
            release()
    if not all_finite(acc):
        _refuse_non_finite_source(key, readers, context)
    if stats is not None and start is not None:
        # The aggregate's own update is measured directly: derived from the clients' products
        # it would lose all precision exactly when updates cancel, the case worth seeing.
        diff = context.rows[len(readers) if full else 0, :count].view(shape)
        stats.add_mean_sq(sq_norm_float64(torch.sub(acc, start, out=diff)))
        if full:
            stats.add_key(start.reshape(-1), context.rows[: len(readers), :count])
    return acc


def _refuse_non_finite_source(key: str, readers: list[CheckpointReader], context: _KeyContext) -> None:
    """Name the first source whose ``key`` holds NaN or Inf (CheckpointError).

    The sum is checked rather than every source: a weight is > 0, so a NaN or Inf in any source
    makes the weighted sum NaN or Inf at that element, and a finite sum proves every source
    finite, in one pass over the output instead of one per source. Only here, on the rare
    non-finite sum, is each source read again to find the culprit (on this thread, so the
    read-ahead stops). A mean of finite values that overflows float32 names no source and is
    written as before.
    """
    context.stop_reading_ahead()
    for index, reader in enumerate(readers):
        check_finite(key, reader.read(key), context.names[index])


def _nothing() -> None:
    """Nothing to hand back (the sequential path)."""
