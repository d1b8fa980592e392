"""The audit of a server optimiser's round (FedAvgM, FedAdam, FedYogi, FedAdagrad), in float64.

:mod:`.verify` recomputes weighted means; a round written by a server optimiser
(:mod:`fedagent_flwr.serverapp.strategy.server_optimizer`) is a step from the previous global model
``x`` towards the clients' weighted mean ``a``, with buffers kept across rounds, so its audit needs
more inputs, all of which the run recorded:

- the clients' checkpoints (the global model's ``fedagent.sources``: path, sha256, weight; hashes
  checked, as for a weighted mean);
- ``x``: the global model's ``fedagent.previous_global`` (path and content hash, checked);
- the previous buffers: the state file beside ``x`` (``round_<k>/server_optimizer/<global or
  global_critic>.safetensors``) when ``x`` is a global model this rule wrote inside the run, its
  bytes checked against the ``fedagent.state_sha256`` in ``x``'s header (a header without one, as
  for the new state, fails the round unless ``allow_unhashed``: ``--allow-unhashed``); zeros
  otherwise (the base model, a model from outside the run, PPO's first critic, which FedAvg's mean
  wrote);
- the rule's ``fedagent.hyperparameters``, ``fedagent.round`` (FedAdam's bias correction uses the
  server round, Flower's ``r + 1`` exponent) and ``fedagent.step`` (checked: 1 where the buffers
  start at zero, the previous state's step + 1 otherwise).

The step is restated here from Flower's formulas (``FedAvgM``: ``g = x - a``, ``momentum = mu
momentum + g``, ``x - lr momentum``; ``FedOpt``: ``delta = a - x``, ``m = beta_1 m + (1 - beta_1)
delta``, FedAdam/FedYogi/FedAdagrad's ``v``, ``x + step m / (sqrt(v) + tau)``), never by calling the
strategy's code: an independent oracle, as :func:`.mean_audit.verify_mean` is for the mean. Both the
new global model and the new state's buffers are compared with the files on disk; the round's error
reported is the larger of the two max abs errors. A client's tied copy that the written file leaves
out (``lm_head.weight`` of tied embeddings, rebuilt from its partner on load) is held to its partner
within the tolerance, as in the mean's audit (:func:`.audit_rows.tie_error`): the difference counts
as the global model's error. The buffers are small numbers (``v`` is about ``delta^2``), so a change
to a state file below the bound is caught by its hash instead (and by the next round's step, which
the change would move).

**Pass or fail: a per-element bound, not a flat tolerance.** The strategy computes in fp32 and
from fp32 inputs: ``delta = a - x`` is a difference of two nearly equal numbers, so its rounding
(about ``eps32 |x|``, 6e-8 for a weight near 1) is large next to ``delta`` itself (an LLM's change
is 1e-6..1e-4 a round), and the step multiplies it by a gain: where ``sqrt(v)`` is below ``tau``
the update is about ``(step / tau) m``, up to ``eta / tau`` = 100 with Flower's defaults. A correct
FedAdagrad round with weights near 1 is then 1e-5 off the float64 recomputation, far above 1e-6.
So every element is held to ``|written - expected| <= tolerance + bound``, with the bound the
first-order propagation of fp32 rounding through the same formulas (``eps32`` = 2^-23; a factor 2
of margin on each rounding, never on the tolerance):

- ``delta``: ``e = 2 eps32 ((n + 1) sum_i w_i |a_i| + |x|)`` for ``n`` sources (the weighted
  sum's roundings, the weights' fp32 rounding, the subtraction);
- FedAvgM: ``g = x - a`` carries ``e``; ``momentum`` carries ``e + 2 eps32 (mu |momentum_old| +
  |momentum|)``; the model ``lr`` times that, plus ``2 eps32 (lr |g| + |x_new|)``;
- FedOpt: ``m`` carries ``(1 - beta_1) e`` (``e`` when ``m = delta``) plus its own rounding;
  ``delta^2`` carries ``2 |delta| e + e^2``, so ``v`` carries ``(1 - beta_2)`` (FedAdam, FedYogi)
  or 1 (FedAdagrad) times that, plus its rounding, and FedYogi's whole ``2 (1 - beta_2) delta^2``
  where ``v - delta^2`` is too close to zero for its sign to be sure; ``sqrt(v)`` then moves by at
  most ``ds = sqrt(v) - sqrt(max(v - e_v, 0))``, and the model carries ``step (e_m / d_low + |m|
  ds / (d d_low)) + 4 eps32 |update| + 2 eps32 |x_new|`` with ``d = sqrt(v) + tau`` and ``d_low =
  d - ds``: the gain ``step (1 - beta_1) / (sqrt(v) + tau)`` on ``delta``'s rounding, and the
  roundings of the last operations.

Each round starts from the files the run wrote (``x`` and the previous state as stored), so the
bound does not grow with the rounds. ``tolerance`` is added to the global model's bound only; the
state's buffers are held to their fp32 bound alone, since a flat tolerance would be large next to
``v`` (~``delta^2``) and ``m``, and a buffer off by it would move the next round's step unseen.
The audit prints the worst ratio of error to bound (``worst 0.3 of it``; an element that must be
exactly 0 and is not counts as infinite). What the bound cannot see: a change below it, to every
round in the same direction (up to about 8% of FedAdagrad's honest step on weights near 1); the
content hashes are the defence there.

**What is trusted.** The previous global model's path comes from the header: it is opened only if it
lies inside the run directory or is the run's base model (``base_model`` of the run record, whose
``base_model_sha256`` it must then match), and its content hash must be the recorded one. It is
reported as removed, not failed, only where the run record says retention removed it. And it must be
the run record's previous model: the latest earlier round's aggregate, or the base model before the
first (a header pointing at an older round's model or at a client's checkpoint fails), with the
content the run record committed for it, compared whatever the header records. A hash not
recorded (the header's of ``x``, the run record's of ``x`` or of the base model) fails unless
``--allow-unhashed`` (:mod:`.audit_hashes`). Once the round is read, each file this audit hashed
must still have the stat it was hashed at, through its path and through the descriptor read: the
sources and ``x`` (always hashed, for its reference) through :meth:`.CheckpointReader.verify_content`,
both states and the written global model, where their hashes were taken, through
:meth:`.AuditDigests.check_read`. A file rewritten between its hash and
the end of the reads fails the round by name ("changed while it was read"), as the values compared
came partly from bytes no hash covered. A NaN or Inf in any input read or value computed fails
the round with the file and tensor named (:func:`.verify_step.require_finite`): NaN compares false
with every bound.

**Memory.** Each key is recomputed in chunks of whole rows of at most :data:`.audit_rows.CHUNK_ELEMENTS`
elements, read with :meth:`.CheckpointReader.read_rows` and safetensors slices, so the audit holds a
few dozen float64 copies of a chunk, not of the key; the arithmetic (:mod:`.verify_step`) is
element-wise, so the errors and ratios are the whole key's whatever the chunks.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedagent_flwr.checkpoint.audit_digests import AuditDigests
from fedagent_flwr.checkpoint.audit_hashes import unhashed
from fedagent_flwr.checkpoint.audit_rows import handle_rows, reader_rows, row_chunks, tie_error
from fedagent_flwr.checkpoint.audit_sources import (
    InputRemoved,
    RoundStart,
    open_recorded_source,
    same_path,
    trusted_global_dir,
)
from fedagent_flwr.checkpoint.hf_files import MODEL_FILE, tied_weight_keys
from fedagent_flwr.checkpoint.key_checks import count_non_finite, effective_keys, normalise_weights
from fedagent_flwr.checkpoint.open_ref import open_checkpoint
from fedagent_flwr.checkpoint.reader import CheckpointReader
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef
from fedagent_flwr.checkpoint.safetensors_file import SafetensorsFile
from fedagent_flwr.checkpoint.verify_step import (
    EPS32,
    buffers_of,
    max_of,
    non_finite_in_audit,
    recompute_step,
    require_finite,
    worst_ratio,
)

__all__ = ["OPTIMIZER_RULES", "InputRemoved", "OptimizerAudit", "header_of", "state_path", "verify_optimizer_round"]

#: The rules this audit recomputes (``fedagent.aggregation`` of the global model's header).
OPTIMIZER_RULES = ("fedavgm", "fedadam", "fedyogi", "fedadagrad")
# The layout and header entries as server_optimizer's docstring documents them, restated here so
# that the audit reads what the run wrote, not what the strategy's code would compute.
_STATE_DIR, _STATE_SHA256, _PREVIOUS = "server_optimizer", "fedagent.state_sha256", "fedagent.previous_global"
_GLOBAL_DIR = re.compile(r"round_\d+/(global|global_critic)")


@dataclass
class OptimizerAudit:
    """What the audit of one round found: the errors, their worst ratio to the per-element bound
    (tolerance + fp32 rounding bound, module docstring; above 1 fails), the step, and problems that
    fail the round whatever the errors (a hash that differs, a step count that does not follow)."""

    rule: str
    step: int
    global_error: float = 0.0
    state_error: float = 0.0
    ratio: float = 0.0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def error(self) -> float:
        """The larger of the two max abs errors."""
        return max(self.global_error, self.state_error)

    @property
    def within_bound(self) -> bool:
        """Every element within its bound (problems aside)."""
        return self.ratio <= 1.0


def header_of(model_file: Path) -> dict[str, str]:
    """The safetensors metadata of ``model_file`` (CheckpointError when it cannot be read)."""
    with SafetensorsFile(model_file) as handle:
        return handle.metadata()


def state_path(global_dir: Path) -> Path:
    """Where the state written with the global model (or critic) at ``global_dir`` lies."""
    return global_dir.parent / _STATE_DIR / f"{global_dir.name}.safetensors"


def verify_optimizer_round(global_dir: Path, run_root: Path, server_round: int, check_hashes: bool = True,
                           removed_by_run: Callable[[Path], bool] = lambda path: False, *,
                           tolerance: float = 1e-6, base_model: str | None = None,
                           base_model_sha256: str | None = None,
                           expected_previous: tuple[str, str | None] | None = None,
                           allow_unhashed: bool = False, digests: AuditDigests | None = None) -> OptimizerAudit:
    """Recompute the round that wrote ``global_dir`` (module docstring) and compare.

    ``check_hashes`` False skips the content-hash comparisons (a run recorded with another content
    hash version); ``removed_by_run(path)`` says whether the run record notes that its retention
    removed that global model or state file (then the round is not checked, :class:`InputRemoved`,
    rather than failed); ``tolerance`` is added to every element's fp32 bound; ``base_model`` and
    ``base_model_sha256`` are the run record's (the one previous model allowed outside ``run_root``);
    ``expected_previous`` is the run record's model this round must have stepped from (the latest
    earlier aggregate, or the base model), as path and content hash; ``allow_unhashed`` makes a hash
    the run did not record a note instead of a failure (:func:`.audit_hashes.unhashed`: an optimiser
    state is then compared by its values alone); ``digests``, the audit's, hashes each file once
    (:mod:`.audit_digests`; None: this round's own). Each key is recomputed in chunks of
    :data:`.audit_rows.CHUNK_ELEMENTS` elements.
    Raises CheckpointError when the round cannot be recomputed at all (an input missing, altered or
    not trusted)."""
    header = header_of(global_dir / MODEL_FILE)
    rule = header.get("fedagent.aggregation", "")
    if rule not in OPTIMIZER_RULES:
        raise CheckpointError(f"{global_dir / MODEL_FILE} was not written by a server optimiser ({rule!r})")
    if _PREVIOUS not in header:
        raise CheckpointError(f"{global_dir / MODEL_FILE} records no previous global model (written before "
                              "fedagent-flwr recorded one): this round cannot be recomputed")
    try:
        settings = {k: float(v) for k, v in json.loads(header["fedagent.hyperparameters"]).items()}
        buffers = list(json.loads(header["fedagent.buffers"]))
        step, recorded_round = int(header["fedagent.step"]), int(header["fedagent.round"])
        previous = json.loads(header[_PREVIOUS])
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{global_dir / MODEL_FILE} has an unreadable optimiser header ({exc!r})") from None
    audit = OptimizerAudit(rule, step)
    if recorded_round != server_round:
        audit.problems.append(f"its header says round {recorded_round}")
    expected_buffers = buffers_of(rule, settings)
    if buffers != expected_buffers:
        audit.problems.append(f"it records buffers {buffers}, its settings keep {expected_buffers}")
    x_dir = trusted_global_dir(Path(previous["path"]), f"previous global model {previous['path']}", run_root,
                               base_model, removed_by_run)
    digests = digests or AuditDigests()
    with ExitStack() as stack:
        sources = _sources(header, global_dir, run_root, check_hashes, stack, allow_unhashed, audit.notes, digests,
                           RoundStart(expected_previous, base_model, removed_by_run))
        x_ref = CheckpointRef.for_directory(x_dir, fmt="hf-safetensors", hasher=digests.directory_hash)
        if check_hashes:
            if not previous.get("sha256"):
                unhashed(f"{global_dir / MODEL_FILE} records no content hash of its previous global model {x_dir}",
                         allow_unhashed, audit.notes)
            elif x_ref.sha256 != previous["sha256"]:
                raise CheckpointError(f"previous global model {x_dir} changed since round {server_round} stepped "
                                      "from it (hash differs)")
            if same_path(x_dir, base_model) and not base_model_sha256:
                unhashed("the run record has no base_model_sha256 of the base model this round stepped from",
                         allow_unhashed, audit.notes)
            elif same_path(x_dir, base_model) and x_ref.sha256 != base_model_sha256:
                raise CheckpointError(f"previous global model {x_dir} is not the run's base model (its hash differs "
                                      "from the run record's base_model_sha256)")
        hashing = _Hashing(check_hashes, allow_unhashed, removed_by_run, digests)
        if expected_previous is not None:
            _check_chain(previous, expected_previous, x_ref.sha256, hashing, global_dir, base_model, audit.notes)
        x_reader = stack.enter_context(closing(open_checkpoint(x_ref, check_hash=False)))
        x_reader.watch_unchanged(digests.hashed_stats(x_dir))  # as hashed just above (for_directory)
        old_state = _previous_state(x_dir, run_root, rule, buffers, step, audit, hashing, stack)
        new_state = _new_state(global_dir, header, buffers, step, audit, hashing, stack)
        written = stack.enter_context(SafetensorsFile(global_dir / MODEL_FILE))
        ties = tied_weight_keys(global_dir)
        keys = set(effective_keys(sources[0][0], ties))
        if set(written.keys()) != keys:
            raise CheckpointError(f"{global_dir} holds keys {sorted(set(written.keys()) ^ keys)[:5]} that differ "
                                  "from the sources")
        wanted = {f"{n}/{k}" for k in keys if sources[0][0].dtype(k).is_floating_point for n in buffers}
        if old_state is not None and set(old_state.keys()) != wanted:
            raise CheckpointError(f"previous optimiser state of {x_dir} does not hold the buffers {buffers} of "
                                  "this model's keys")
        if new_state is not None and set(new_state.keys()) != wanted:
            audit.problems.append(f"{state_path(global_dir)} does not hold the buffers {buffers} of this model's keys")
            new_state = None
        weights = normalise_weights([w for _, w in sources])
        inputs = _Inputs(rule, settings, server_round, buffers, tolerance, global_dir,
                         [(reader, weight) for (reader, _), weight in zip(sources, weights)], x_reader, written,
                         old_state, new_state)
        for key in sorted(keys):
            _audit_key(inputs, key, audit)
        tied = tie_error([reader for reader, _ in sources], ties)  # module docstring: held to the tolerance
        audit.global_error = max(audit.global_error, tied)
        audit.ratio = max(audit.ratio, tied / tolerance if tolerance else math.inf if tied else 0.0)
        for reader, _ in sources:  # a file trusted at opening must be unchanged now that it was read
            reader.verify_content()
        x_reader.verify_content()  # so must x and the two states, which the step was recomputed from,
        for handle in (written, old_state, new_state):  # and the written global model compared with it
            if handle is not None:
                digests.check_read(handle.path, handle.held_stat())
    return audit


@dataclass
class _Hashing:
    """How the round's hashes are checked: compared at all (a run recorded with this content-hash
    version), a missing state hash let through (``--allow-unhashed``), retention's record, and the
    audit's digests (each file hashed once: :mod:`.audit_digests`)."""

    compare: bool
    allow_unhashed: bool
    removed_by_run: Callable[[Path], bool]
    digests: AuditDigests


@dataclass
class _Inputs:
    """What the recomputation of one round reads, opened: the clients' checkpoints with their
    normalised weights, ``x``, the written global model and the two states (None: none)."""

    rule: str
    settings: dict[str, float]
    server_round: int
    buffers: list[str]
    tolerance: float
    global_dir: Path
    sources: list[tuple[CheckpointReader, float]]
    x: CheckpointReader
    written: SafetensorsFile
    old_state: SafetensorsFile | None
    new_state: SafetensorsFile | None


def _audit_key(inputs: _Inputs, key: str, audit: OptimizerAudit) -> None:
    """Recompute ``key`` chunk by chunk (:data:`.audit_rows.CHUNK_ELEMENTS`): each chunk's errors and ratios
    join the audit's maxima, so the result is the whole key's. CheckpointError for an integer
    tensor that differs, a shape that is not the sources', or a non-finite written value."""
    reference = inputs.sources[0][0]
    shape, floating = reference.shape(key), reference.dtype(key).is_floating_point
    _check_shapes(inputs, key, shape, floating)
    bad = 0  # non-finite values written, over every chunk (the error names their number)
    for rows in row_chunks(shape):
        actual = handle_rows(inputs.written, key, rows)
        if not floating:
            if not torch.equal(actual, reader_rows(reference, key, rows, dtype=None)):
                raise CheckpointError(f"{inputs.global_dir}: integer tensor '{key}' differs from the sources")
            continue
        bad += count_non_finite(actual)
        if not bad:  # once one is found the key is refused: its other chunks are only counted
            _audit_rows(inputs, key, rows, actual, audit)
    if bad:
        raise non_finite_in_audit(key, bad, str(inputs.global_dir / MODEL_FILE))


def _audit_rows(inputs: _Inputs, key: str, rows: tuple[int, int] | None, actual: torch.Tensor,
                audit: OptimizerAudit) -> None:
    """Recompute rows ``rows`` of ``key`` (module docstring) and fold their errors into ``audit``."""
    mean = torch.zeros(actual.shape, dtype=torch.float64)
    magnitude = torch.zeros_like(mean)  # sum_i w_i |a_i|: the scale of the mean's fp32 roundings
    for index, (reader, weight) in enumerate(inputs.sources):
        tensor = reader_rows(reader, key, rows).double()
        require_finite(tensor, key, f"source {index} {reader.directory}", rows)
        mean += weight * tensor
        magnitude += weight * tensor.abs()
    x = reader_rows(inputs.x, key, rows).double()
    require_finite(x, key, f"previous global model {inputs.x.directory}", rows)
    state = {n: handle_rows(inputs.old_state, f"{n}/{key}", rows).double() if inputs.old_state is not None
             else torch.zeros_like(x) for n in inputs.buffers}
    for name, values in state.items():
        require_finite(values, f"{name}/{key}", f"previous optimiser state {state_path(inputs.x.directory)}", rows)
    slack = 2.0 * EPS32 * ((len(inputs.sources) + 1) * magnitude + x.abs())  # delta's fp32 error
    expected, bound, state_bounds = recompute_step(inputs.rule, inputs.settings, inputs.server_round, x, mean, state,
                                                   slack)
    # finite inputs can still give NaN or Inf (a hyperparameter such as tau = 0 or NaN in the header)
    computed = {"expected value": expected, "bound": bound, **{f"expected {n}": state[n] for n in inputs.buffers},
                **{f"bound of {n}": b for n, b in state_bounds.items()}}
    for what, values in computed.items():
        require_finite(values, key, f"{inputs.global_dir}: the recomputed {what} ({inputs.rule} "
                       f"{inputs.settings})", rows)
    error = (actual.double() - expected).abs()
    audit.global_error = max(audit.global_error, max_of(error))
    audit.ratio = max(audit.ratio, worst_ratio(error, inputs.tolerance + bound))
    if inputs.new_state is not None:
        for name in inputs.buffers:
            stored = handle_rows(inputs.new_state, f"{name}/{key}", rows).double()
            require_finite(stored, f"{name}/{key}", f"optimiser state {state_path(inputs.global_dir)}", rows)
            error = (stored - state[name]).abs()
            audit.state_error = max(audit.state_error, max_of(error))
            # the buffers by their fp32 bound alone: a flat tolerance is large next to v (~delta^2)
            # and m, and a buffer off by it would move the next round's step unseen
            audit.ratio = max(audit.ratio, worst_ratio(error, state_bounds[name]))


def _check_shapes(inputs: _Inputs, key: str, shape: tuple[int, ...], floating: bool) -> None:
    """CheckpointError unless every file read for ``key`` holds it in the sources' shape (rows are
    read by index: a shorter tensor would otherwise be compared with part of the key)."""
    found = [(inputs.global_dir / MODEL_FILE, key, inputs.written.shape(key))]
    # every client's too: a longer one would otherwise be read only up to the first source's rows
    found += [(reader.directory, key, reader.shape(key)) for reader, _ in inputs.sources[1:]]
    if floating:
        found.append((inputs.x.directory, key, inputs.x.shape(key)))
        for state, path in ((inputs.old_state, state_path(inputs.x.directory)),
                            (inputs.new_state, state_path(inputs.global_dir))):
            names = [f"{name}/{key}" for name in inputs.buffers] if state is not None else []
            found += [(path, name, state.shape(name)) for name in names if state is not None]
    for where, name, got in found:
        if got != shape:
            raise CheckpointError(f"{where}: '{name}' has shape {got}, the first source "
                                  f"{inputs.sources[0][0].directory} has {shape}")


def _check_chain(previous: dict[str, Any], expected: tuple[str, str | None], actual: str, hashing: _Hashing,
                 global_dir: Path, base_model: str | None, notes: list[str]) -> None:
    """CheckpointError unless the header's previous global model is the run record's: a round steps
    from the latest earlier aggregate (or the base model), not from any trusted directory, and that
    file's content (hash ``actual``) must be what the run record committed, whatever the header
    records (an empty hash of it, let through by ``--allow-unhashed``, must not skip this); the run
    record's hash of that aggregate must be there (:func:`.audit_hashes.unhashed`; the base model's
    is the caller's check)."""
    path, sha256 = expected
    if not same_path(Path(previous["path"]), path):
        raise CheckpointError(f"{global_dir / MODEL_FILE} steps from {previous['path']}, but the run record's "
                              f"previous global model is {path}")
    if hashing.compare and sha256 and actual != sha256:
        # a header hash, if any, equals ``actual`` here (the caller compared them first)
        when = " and before this round stepped from it" if previous.get("sha256") else ""
        raise CheckpointError(f"previous global model {path} has content hash {actual[:12]}..., the run record "
                              f"committed {sha256[:12]}... for it: it was replaced after its commit{when}")
    if hashing.compare and not sha256 and not same_path(Path(path), base_model):
        unhashed(f"the run record has no content hash of {path} (the commit of the model this round stepped from)",
                 hashing.allow_unhashed, notes)


def _sources(header: dict[str, str], global_dir: Path, run_root: Path, check_hashes: bool, stack: ExitStack,
             allow_unhashed: bool, notes: list[str], digests: AuditDigests,
             start: RoundStart) -> list[tuple[CheckpointReader, float]]:
    """The clients' checkpoints the header names, opened (hashes checked unless told not to; one
    that is not recorded fails, :func:`.audit_hashes.unhashed`; a LoRA source's base must be the
    round's starting model ``start``: :func:`.audit_sources.open_recorded_source`)."""
    if "fedagent.sources" not in header:
        raise CheckpointError(f"{global_dir / MODEL_FILE} records no sources")
    sources = []
    for source in json.loads(header["fedagent.sources"]):
        reader = open_recorded_source(source, global_dir / MODEL_FILE, run_root, check_hashes, allow_unhashed, notes,
                                      digests, start)
        sources.append((stack.enter_context(closing(reader)), float(source["weight"])))
    if not sources:
        raise CheckpointError(f"{global_dir / MODEL_FILE} records no sources")
    return sources


def _previous_state(x_dir: Path, run_root: Path, rule: str, buffers: list[str], step: int, audit: OptimizerAudit,
                    hashing: _Hashing, stack: ExitStack) -> SafetensorsFile | None:
    """The state the step started from, opened (None: the buffers start at zero); its hash checked,
    one that ``x`` does not record failing unless ``--allow-unhashed``."""
    try:
        inside = x_dir.resolve().relative_to(run_root.resolve()).as_posix()
    except ValueError:
        inside = ""
    x_header = header_of(x_dir / MODEL_FILE)
    stepped = bool(buffers) and bool(_GLOBAL_DIR.fullmatch(inside)) and x_header.get("fedagent.aggregation") == rule
    if not stepped:
        if step != 1:
            audit.problems.append(f"step {step} recorded, but {x_dir} has no {rule} state to continue (step 1)")
        return None
    path = state_path(x_dir)
    if not path.is_file():
        if hashing.removed_by_run(path):
            raise InputRemoved(f"previous optimiser state {path} removed by the run after the round was committed")
        raise CheckpointError(f"previous optimiser state {path} is missing")
    recorded = x_header.get(_STATE_SHA256)
    if not recorded:  # missing or empty alike (audit_hashes)
        unhashed(f"previous optimiser state {path} has no content hash recorded in {x_dir / MODEL_FILE} "
                 f"({_STATE_SHA256})", hashing.allow_unhashed, audit.notes)
    elif hashing.compare and hashing.digests.file_digest(path).hex() != recorded:
        raise CheckpointError(f"previous optimiser state {path} changed since it was written (hash differs from "
                              f"the one {x_dir / MODEL_FILE} records)")
    handle = stack.enter_context(SafetensorsFile(path))
    old_step = int(handle.metadata().get("fedagent.step", "0"))
    if old_step + 1 != step:
        audit.problems.append(f"step {step} recorded, the previous state {path} is step {old_step}")
    return handle


def _new_state(global_dir: Path, header: dict[str, str], buffers: list[str], step: int, audit: OptimizerAudit,
               hashing: _Hashing, stack: ExitStack) -> SafetensorsFile | None:
    """The state written with the round, opened and its hash checked (None: no buffers, or removed);
    a global model that records no hash of it fails the round unless ``--allow-unhashed``."""
    if not buffers:
        return None
    path = state_path(global_dir)
    if not path.is_file():
        if hashing.removed_by_run(path):
            audit.notes.append("its state was removed by the run: global model checked only")
            return None
        raise CheckpointError(f"optimiser state {path} is missing")
    recorded = header.get(_STATE_SHA256)
    if not recorded:  # missing or empty alike (audit_hashes); its values are still compared
        unhashed(f"{global_dir / MODEL_FILE} records no content hash of its optimiser state {path} ({_STATE_SHA256})",
                 hashing.allow_unhashed, audit.notes)
    elif hashing.compare and hashing.digests.file_digest(path).hex() != recorded:
        audit.problems.append(f"{path} differs from the hash its global model recorded")
    handle = stack.enter_context(SafetensorsFile(path))
    if int(handle.metadata().get("fedagent.step", "-1")) != step:
        audit.problems.append(f"{path} is not step {step}")
    return handle
