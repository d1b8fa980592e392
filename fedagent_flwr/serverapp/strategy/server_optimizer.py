"""Server-side optimisers over checkpoint references: the streamed step and its state on disk.

Flower's ``FedAvgM``, ``FedAdam``, ``FedYogi`` and ``FedAdagrad`` treat the clients' weighted mean
as a pseudo-gradient step of a server optimiser: with ``x`` the current global model and ``a``
FedAvg's weighted mean of the clients' models, ``delta = a - x`` feeds momentum (FedAvgM) or
Adam-style moments (FedOpt) kept on the server across rounds. Those strategies average
``ArrayRecord`` s in memory; here the models are checkpoints on disk, so
:class:`ServerOptimizerFSDP` runs the same step tensor by tensor inside ``aggregate_by_key``
(fp32, one key of every source, of ``x`` and of each buffer in memory at a time, whatever the
model size) and streams both the new global model and the new optimiser state to disk.

**Where the state lives.** Next to the global model it belongs to, never inside it (clients
download that directory): the state after round r of the actor is
``<run_root>/round_<r>/server_optimizer/global.safetensors`` (PPO's critic:
``.../global_critic.safetensors``), one safetensors file with a ``<buffer>/<key>`` tensor per
buffer and floating-point key, written under a temporary name and renamed into place once its
last key is written, just before the round's global model (whose header records its hash; a
state the global model did not follow is removed, and a redone round overwrites one). Round r+1
finds it from its starting model's directory alone, so a resumed run
(:mod:`fedagent_flwr.serverapp.resume`: it restarts from the last committed global model, removes
what uncommitted rounds wrote and redoes them) needs no extra bookkeeping, and redoing round r
reads round r-1's file, which nothing ever rewrites, so it gives the same bits. A round that
keeps the previous global model (no usable client) keeps its state too.

**When there is no state.** The run's base model (round 1), and a global model outside the
run's ``round_<r>/`` directories, start the buffers at zero (a new run continuing from another
run's model starts a fresh optimiser). A global model that this rule wrote but whose state file
is missing stops the run (:class:`ServerOptimizerStateError`): silently restarting the moments
would change the result. PPO's first critic has no global critic to step from, so round 1
averages the critics as FedAvg does and the critic's optimiser starts in round 2.

**Tamper-evidence.** The global model's safetensors header records what the step started from and
the state it wrote: ``fedagent.previous_global`` (path and content hash of ``x``), the rule's
``fedagent.hyperparameters``, ``fedagent.round``, ``fedagent.step``, ``fedagent.buffers`` and
``fedagent.state_sha256``, the sha256 of the state file's bytes (filled in once the state is
complete, before the global model is renamed into place: :class:`~fedagent_flwr.checkpoint.
safetensors_writer.LateMetadata`). Why there and not in the state file itself or a sidecar beside
it: whoever replaces the state file (another round's, another run's, a damaged copy) replaces its
own metadata or sidecar with it, and a hash of a file stored next to the file proves only that
the two were copied together. The global model's header is part of the global model's content
hash, which the run record commits with the round and a resume checks before it starts
(:mod:`fedagent_flwr.serverapp.resume`), so the state's hash is as trustworthy as the model it
belongs to. The next round (or a resumed run) hashes the state file before it reads a buffer
(one more read of the file a round, as client safetensors checkpoints are hashed at opening) and
stops with :class:`ServerOptimizerStateError` naming the file when it differs; the file is then read
key by key (:class:`.SafetensorsFile`, positioned reads), so its stat at that check is compared once
more after the step's last read, before the new global model is committed, and a file rewritten or
shortened meanwhile stops the run the same way (nothing of that round is kept). A state whose model
records no hash (written before fedagent-flwr recorded one) is loaded unchecked with a one-line
warning, so older runs still resume.
``python -m fedagent_flwr.checkpoint.verify`` audits these rounds from the same records
(:mod:`fedagent_flwr.checkpoint.verify_optimizer`).

The state's writer hashes the file's bytes as it writes them (``sha256=True``: its header is final
from the start, unlike the global model's), so recording ``fedagent.state_sha256`` reads nothing
back (for a 7B model with Adam, ~56 GB a round that are no longer read a second time).
"""

from __future__ import annotations

import json
import math
import re
from abc import abstractmethod
from collections.abc import Sequence
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, ClassVar

import torch
from flwr.common import log

from fedagent_flwr.atomic import fsync_dir
from fedagent_flwr.checkpoint import (
    AggregateReport,
    CheckpointError,
    CheckpointReader,
    SafetensorsStreamWriter,
    aggregate_by_key,
    aggregation_entries,
)
from fedagent_flwr.checkpoint.audit_digests import AuditDigests
from fedagent_flwr.checkpoint.hf_files import MODEL_FILE
from fedagent_flwr.checkpoint.receipts import FileStat, fresh_stat, stat_now
from fedagent_flwr.checkpoint.safetensors_file import SafetensorsFile
from fedagent_flwr.checkpoint.safetensors_writer import LateMetadata
from fedagent_flwr.serverapp.failures import RunFailedError
from fedagent_flwr.serverapp.resume import STATE_DIR, state_file

from .fedavg_fsdp import FedAvgFSDP

__all__ = ["PREVIOUS_GLOBAL", "STATE_DIR", "STATE_SHA256", "ServerOptimizerFSDP", "ServerOptimizerStateError",
           "checked_number", "state_file"]

#: Global-model header entries of a server optimiser's round (module docstring, "Tamper-evidence").
STATE_SHA256, PREVIOUS_GLOBAL = "fedagent.state_sha256", "fedagent.previous_global"

_GLOBAL_DIR = re.compile(r"round_\d+/(global|global_critic)")


class ServerOptimizerStateError(RunFailedError):
    """A server optimiser's state that is missing, does not fit its model, is not the file its model
    recorded, or changed while a round read it: the run stops with this one line (not a client's
    fault, so no client is refused for it)."""


def checked_number(name: str, value: Any, *, above: float | None = None, at_least: float | None = None,
                   below: float | None = None) -> float:
    """``value`` as a float, or ValueError naming ``strategy.kwargs.<name>`` and the allowed range.

    Numbers written as strings (``1e-4`` read by a YAML 1.1 loader) are accepted; booleans,
    NaN and infinities are not."""
    bounds = [f"> {above}" if above is not None else "", f">= {at_least}" if at_least is not None else "",
              f"< {below}" if below is not None else ""]
    wanted = " and ".join(b for b in bounds if b) or "finite"
    problem = f"strategy.kwargs.{name} = {value!r} must be a number {wanted}"
    if isinstance(value, bool):
        raise ValueError(problem)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(problem) from None
    if (not math.isfinite(number) or (above is not None and not number > above)
            or (at_least is not None and not number >= at_least) or (below is not None and not number < below)):
        raise ValueError(problem)
    return number


class ServerOptimizerFSDP(FedAvgFSDP):
    """FedAvgFSDP whose new global model is a server optimiser's step from the current one.

    A subclass names its rule (:attr:`rule_name`, recorded as ``fedagent.aggregation`` in the
    global model's header and in its state file), the buffers it keeps per floating-point key
    (:meth:`buffers`) and the step (:meth:`server_step`). Integer tensors are copied as FedAvg
    copies them. Everything else (selection, checks, refusals, PPO critics, resume) is FedAvgFSDP's.
    """

    rule_name: ClassVar[str] = ""

    def buffers(self) -> tuple[str, ...]:
        """Names of the per-key tensors kept across rounds (none: no state file is written)."""
        return ()

    def plain_mean(self) -> bool:
        """True when the settings make the step FedAvg's mean itself (then FedAvg's code writes it)."""
        return False

    def hyperparameters(self) -> dict[str, float]:
        """The settings recorded in the state file (for audits)."""
        return {}

    @abstractmethod
    def server_step(self, server_round: int, x: torch.Tensor, delta: torch.Tensor,
                    state: dict[str, torch.Tensor]) -> torch.Tensor:
        """The new fp32 value of one key from the current one ``x`` and ``delta = mean - x``.

        ``state`` holds the key's previous buffers (none in the optimiser's first step); the
        step puts every buffer of :meth:`buffers` in it, updated. ``x``, ``delta`` and the
        buffers are the caller's own copies: they may be changed in place."""

    def aggregate_checkpoints(
        self, server_round: int, sources: Sequence[tuple[CheckpointReader, float]], out_dir: Path,
        reference: CheckpointReader | None,
    ) -> AggregateReport:
        """The server step from ``reference`` (the current global model or critic) towards the
        clients' weighted mean, streamed key by key, with the optimiser state of ``out_dir``
        written beside it (see the module docstring)."""
        if reference is None or self.plain_mean():
            if reference is None:
                log(INFO, "round %d: no global %s to step from yet: weighted mean; %s starts next round",
                    server_round, out_dir.name, self.rule_name)
            return super().aggregate_checkpoints(server_round, sources, out_dir, reference)
        start = reference  # the current global model (or critic): x
        names = self.buffers()
        entries = [(key, shape) for key, shape, dtype in aggregation_entries(sources, reference, self.model_files)
                   if dtype.is_floating_point]
        previous = _PreviousState.find(reference, self.run_root, self.rule_name, names, entries)
        step = previous.step + 1 if previous is not None else 1
        writer: SafetensorsStreamWriter | None = None
        recorded = {"fedagent.server_optimizer": self.rule_name, "fedagent.buffers": json.dumps(list(names)),
                    "fedagent.round": str(server_round), "fedagent.step": str(step),
                    "fedagent.hyperparameters": json.dumps(self.hyperparameters())}
        metadata = {"format": "pt", **recorded}
        # The global model's header says what the step started from (an audit re-opens it) and, once
        # the state is complete, the state's hash (the next round checks it before using it).
        header = {**recorded, PREVIOUS_GLOBAL: json.dumps({"path": str(reference.directory),
                                                           "sha256": reference.ref.sha256})}

        def close_state() -> dict[str, str]:
            # Called once every key is computed, before the global model is renamed into place: the
            # state lands first, so a global model never exists without the state it names.
            assert writer is not None
            if previous is not None:  # the buffers read were the bytes hashed at opening
                previous.check_unchanged()
            writer.close()
            # Hashed while it was written (sha256=True below): no second read of the whole state.
            return {STATE_SHA256: writer.digest().hex()}

        def rule(key: str, tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
            # FedAvg's mean with weighted_mean's arithmetic (first source scaled, then each next added)
            delta = torch.mul(tensors[0], weights[0])
            for tensor, weight in zip(tensors[1:], weights[1:]):
                delta.add_(tensor, alpha=weight)
            x = start.read(key)
            delta.sub_(x)
            state = previous.read(key) if previous is not None else {}
            new = self.server_step(server_round, x, delta, state)
            if writer is not None:
                for name in names:
                    writer.write(f"{name}/{key}", state[name])
            return new

        try:
            if names:  # the buffers of every float key, in the order aggregate_by_key calls the rule
                state_file(out_dir).parent.mkdir(parents=True, exist_ok=True)
                fsync_dir(state_file(out_dir).parent.parent)  # the new folder's entry survives a power cut
                writer = SafetensorsStreamWriter(
                    state_file(out_dir), [(f"{n}/{key}", shape) for key, shape in entries for n in names], metadata,
                    sha256=True)
            report = aggregate_by_key(sources, out_dir, rule, name=self.rule_name, reference=reference,
                                      model_files=self.model_files, metadata=header,
                                      late_metadata=LateMetadata({STATE_SHA256: 64}, close_state) if names else None)
        except BaseException as exc:
            if writer is not None:
                writer.abort()
                if not out_dir.exists():  # the state is in place but its global model did not follow
                    state_file(out_dir).unlink(missing_ok=True)
            if previous is not None and isinstance(exc, CheckpointError):
                # A failed step (a non-finite value, say) read from a state rewritten meanwhile is the
                # state's doing, not the clients': that error replaces it (the failure chained to it).
                previous.check_unchanged(failure=exc)
            raise
        finally:
            if previous is not None:
                previous.close()
        log(INFO, "round %d: %s step %d of the %s (%s)", server_round, self.rule_name, step,
            "global model" if out_dir.name == "global" else out_dir.name.replace("_", " "),
            f"state {state_file(out_dir)}" if names else "no state kept")
        return report


class _PreviousState:
    """The optimiser state written with a global model, read one key at a time."""

    def __init__(self, path: Path, handle: SafetensorsFile, step: int, names: tuple[str, ...],
                 watched: FileStat) -> None:
        self.path, self._handle, self.step, self._names = path, handle, step, names
        self._watched = watched  # the file's stat when its hash was checked (see check_unchanged)

    @classmethod
    def find(cls, reference: CheckpointReader, run_root: str, rule_name: str, names: tuple[str, ...],
             entries: list[tuple[str, tuple[int, ...]]]) -> _PreviousState | None:
        """The state of ``reference``'s model, checked against ``entries``; None when it has none
        (the base model, a model outside the run, or a rule that keeps no buffers)."""
        directory = Path(reference.directory).resolve()
        try:
            inside = directory.relative_to(Path(run_root).resolve()).as_posix()
        except ValueError:
            return None
        if not names or not _GLOBAL_DIR.fullmatch(inside):
            return None
        path = state_file(directory)
        model_header = _header(directory / MODEL_FILE)
        if not path.is_file():
            written_by = model_header.get("fedagent.aggregation")
            if written_by == rule_name:
                raise ServerOptimizerStateError(
                    f"{directory} was written by {rule_name} but its optimiser state {path} is missing; "
                    "the run cannot go on with the same result (restore the file or start a new run)")
            return None  # a model written by FedAvg's mean (PPO's first critic): the buffers start at zero
        watched = _check_state_hash(path, directory, model_header.get(STATE_SHA256))
        try:
            handle = SafetensorsFile(path)
        except CheckpointError as exc:  # truncated, not safetensors, or gone
            raise ServerOptimizerStateError(f"optimiser state {path} is unreadable ({exc})") from None
        state = cls(path, handle, 0, names, watched)
        try:
            state.check_unchanged()  # replaced or moved between its hash and this opening: say so before the step
            metadata = handle.metadata()
            try:
                buffers, state.step = json.loads(metadata.get("fedagent.buffers", "[]")), int(metadata.get(
                    "fedagent.step", "0"))
            except ValueError as exc:
                raise ServerOptimizerStateError(f"optimiser state {path} has an unreadable header ({exc})") from None
            if metadata.get("fedagent.server_optimizer") != rule_name or buffers != list(names):
                raise ServerOptimizerStateError(
                    f"optimiser state {path} holds {metadata.get('fedagent.buffers')} of "
                    f"{metadata.get('fedagent.server_optimizer')!r}, this run's {rule_name} needs {list(names)}")
            wanted = {f"{n}/{key}": shape for key, shape in entries for n in names}
            stored = {key: handle.shape(key) for key in handle.keys()}
            if stored != wanted:
                odd = sorted(set(stored) ^ set(wanted)) or sorted(k for k in wanted if stored[k] != wanted[k])
                raise ServerOptimizerStateError(
                    f"optimiser state {path} does not fit the global model {directory} (first difference: {odd[0]})")
        except BaseException:
            state.close()
            raise
        return state

    def read(self, key: str) -> dict[str, torch.Tensor]:
        """Every buffer of ``key`` as a new fp32 tensor (the file is never changed). A file shortened
        since it was opened fails the read (CheckpointError), which the step's caller turns into this
        state's error (:meth:`check_unchanged`)."""
        return {name: self._handle.get_tensor(f"{name}/{key}").to(torch.float32) for name in self._names}

    def check_unchanged(self, failure: BaseException | None = None) -> None:
        """ServerOptimizerStateError when the file's stat is no longer the one its hash was checked at
        (for a model that recorded no hash: the one at opening).

        The buffers are read from the open file key by key, so a file rewritten in place after that
        check (or during it) is read with bytes the recorded hash never covered. Called right after
        opening, once every key is read (before the new global model is committed: a step built from
        them is then not committed) and after a step that failed (``failure``, named in the message:
        a file shortened while read fails its next read, :class:`.SafetensorsFile`). One ``open``
        and ``fstat`` at the path, one ``fstat`` of the file read."""
        now, held = stat_now(self.path), self._handle.held_stat()
        if now != self._watched or held != self._watched:
            now = now if held == self._watched else f"{now} ({held} through the file read)"
            failed = f" (the step had failed: {failure})" if failure is not None else ""
            raise ServerOptimizerStateError(
                f"optimiser state {self.path} changed while it was read (its stat at the hash check was "
                f"{self._watched}, now {now}); the step from it was not committed{failed}. Something else "
                "writes into this run's directory: stop it, restore the file from a copy of the run, and resume")

    def close(self) -> None:
        """Release the file."""
        self._handle.close()


def _check_state_hash(path: Path, directory: Path, recorded: str | None) -> FileStat:
    """Refuse a state file whose bytes are not those its global model's header recorded (module
    docstring); one that has no recorded hash (an older run's) is loaded with a warning. Returns the
    stat the reads are checked against (:meth:`_PreviousState.check_unchanged`): the file's when the
    hash ended, or its stat before the hash where it moved while hashed (which no later stat equals);
    without a recorded hash, its stat now."""
    digests = AuditDigests()  # as a hasher that records the file's stat around its hash
    try:
        if recorded is None:
            log(WARNING, "optimiser state %s: its global model %s records no content hash (written before "
                "fedagent-flwr recorded one); loaded unchecked", path, directory)
            return fresh_stat(path)  # no hash: the reads are checked against the file as it is opened
        actual = digests.file_digest(path).hex()
    except OSError as exc:
        raise ServerOptimizerStateError(f"optimiser state {path} is unreadable ({exc})") from None
    if actual != recorded:
        raise ServerOptimizerStateError(
            f"optimiser state {path} is not the file written with {directory}: its sha256 is {actual[:16]}..., the "
            f"global model's header recorded {recorded[:16]}... (changed, damaged or replaced since). Stepping from it "
            "would change the result: restore the file from a copy of the run, or start a new run")
    watched = digests.hashed_stat(path)
    assert watched is not None  # it was just hashed
    return watched


def _header(model_file: Path) -> dict[str, str]:
    """The safetensors metadata of ``model_file`` ({} when it has none or cannot be read)."""
    try:
        with SafetensorsFile(model_file) as handle:
            return handle.metadata()
    except CheckpointError:  # not a single-file safetensors model: not one this rule wrote
        return {}
