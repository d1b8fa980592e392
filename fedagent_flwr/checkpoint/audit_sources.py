"""The audit's opening of one source an aggregate's header records (``fedagent.sources``).

Shared by the weighted-mean audit (:mod:`.verify`) and the server optimisers' (:mod:`.verify_optimizer`):
the source's files must still hash to what the header recorded (one not recorded:
:func:`.audit_hashes.unhashed`), and a LoRA adapter (``peft-lora``) is opened on top of the base model
the header names for it (``base``, ``base_sha256``: the global model its round started from), whose
hash is checked the same way, so the audit reads the same virtual full model the aggregation read
(:mod:`.lora_reader`).

What the run record says of the round (:class:`RoundStart`) is checked before the base is opened,
as :mod:`.verify_optimizer` checks a server optimiser's previous global model: the base must lie
inside the run directory or be the run's base model (a header naming any other directory is not
followed), and it must be the round's starting model, the latest earlier aggregate (or the base
model before the first), with the content hash the run record committed for it (a header naming
another round's global model fails, even where the mean recomputed on it would match). A base that
is gone is :class:`InputRemoved` (the round is reported as not checked, as a server optimiser's
round whose previous global model retention removed) only where the run says it removed it
(``removed_by_run``: the run record's ``removed``, or a committed round's removal note); otherwise it
is a missing input, CheckpointError naming it (lost, deleted by hand: the audit cannot vouch for the
round).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedagent_flwr.checkpoint.audit_digests import AuditDigests
from fedagent_flwr.checkpoint.audit_hashes import unhashed
from fedagent_flwr.checkpoint.open_ref import open_checkpoint
from fedagent_flwr.checkpoint.reader import CheckpointReader
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointFormat, CheckpointRef

__all__ = ["InputRemoved", "RoundStart", "open_recorded_source", "same_path", "trusted_global_dir"]


class InputRemoved(Exception):
    """An input of the round that the run's retention removed: the round is not checked."""


def _never(path: Path) -> bool:
    return False


@dataclass(frozen=True)
class RoundStart:
    """What the run record says of the model a round started from, for its LoRA sources' base.

    ``expected``: the round's starting model as the run record has it (path, committed content hash
    or None), the latest earlier aggregate or the run's base model; None: not known (PPO's first
    critic), only the rest is checked. ``base_model``: the run record's base model, the one base
    allowed outside the run directory. ``removed_by_run(path)``: whether the run record (or a
    committed removal note) says the run removed that global model."""

    expected: tuple[str, str | None] | None = None
    base_model: str | None = None
    removed_by_run: Callable[[Path], bool] = _never


def open_recorded_source(source: dict[str, Any], header_file: Path, run_root: Path, check_hashes: bool,
                         allow_unhashed: bool, notes: list[str], digests: AuditDigests,
                         start: RoundStart | None = None) -> CheckpointReader:
    """Open the source ``source`` of the aggregate whose header is ``header_file``, its hash (and its
    base's, for a LoRA adapter) checked against the header unless ``check_hashes`` is False.
    ``start``: the run record's word on the round's starting model (module docstring), which a
    LoRA source's base must match; None (no run record): the base is opened wherever the header
    says, and one that is gone is a CheckpointError."""
    ref = _recorded(source["path"], source.get("sha256"), "its source", header_file, check_hashes, allow_unhashed,
                    notes, digests)
    base = None
    if ref.format == "peft-lora":
        if not source.get("base"):
            raise CheckpointError(f"{header_file} records no base model of its LoRA source {source['path']}")
        base_dir = Path(source["base"])
        what = f"the base model {base_dir} of the LoRA source {source['path']}"
        if start is None:
            if not base_dir.is_dir():
                raise CheckpointError(f"{what} is missing (no removal by the run accounts for it)")
        else:
            trusted_global_dir(base_dir, what, run_root, start.base_model, start.removed_by_run)
            _check_start(source, base_dir, header_file, start, check_hashes)
        base = _recorded(source["base"], source.get("base_sha256"), f"the base model of its LoRA source "
                         f"{source['path']}:", header_file, check_hashes, allow_unhashed, notes, digests,
                         "hf-safetensors")
        committed = start.expected[1] if start is not None and start.expected is not None else None
        if check_hashes and committed and base.sha256 != committed:  # also where the header records no hash
            raise CheckpointError(f"the base model {base_dir} of the LoRA source {source['path']} has content hash "
                                  f"{base.sha256[:12]}..., the run record committed {committed[:12]}... for it: it "
                                  "was replaced after its commit")
    # opening checks the hash again: from the digests just computed while the stat is unchanged
    return open_checkpoint(ref, root=run_root, receipts=digests, base=base, base_digests=digests)


def _check_start(source: dict[str, Any], base_dir: Path, header_file: Path, start: RoundStart,
                 check_hashes: bool) -> None:
    """CheckpointError unless the header's base of a LoRA source is the round's starting model with
    the hash the run record committed."""
    if start.expected is None:
        return
    path, committed = start.expected
    if not same_path(base_dir, path):
        raise CheckpointError(f"{header_file} reads its LoRA source {source['path']} on {base_dir}, but the run "
                              f"record's starting model of the round is {path}")
    recorded = source.get("base_sha256")
    if check_hashes and committed and recorded and recorded != committed:
        raise CheckpointError(f"{header_file} records content hash {str(recorded)[:12]}... for the base model "
                              f"{base_dir} of its LoRA source {source['path']}, the run record committed "
                              f"{committed[:12]}... for it")


def trusted_global_dir(path: Path, what: str, run_root: Path, base_model: str | None,
                       removed_by_run: Callable[[Path], bool]) -> Path:
    """``path``, a global model the audit is to open (``what`` names it in errors), if it may be
    opened: inside the run, or the run's base model (CheckpointError otherwise: not followed).
    One that is gone is InputRemoved only where ``removed_by_run`` says the run removed it
    (retention removes global models inside the run only, never the base model); CheckpointError
    otherwise. Shared by a LoRA source's base and a server optimiser's previous global model."""
    inside = path.resolve().is_relative_to(run_root.resolve())
    if not inside and not same_path(path, base_model):
        raise CheckpointError(f"{what} is neither inside the run {run_root} nor its base model {base_model}: "
                              "not opened")
    if not path.is_dir():
        if inside and removed_by_run(path):
            raise InputRemoved(f"{what} removed by the run (storage.keep_last_k)")
        raise CheckpointError(f"{what} is missing (no removal by the run accounts for it)")
    return path


def same_path(path: Path, other: str | None) -> bool:
    """Whether ``path`` and ``other`` (None: never) name one directory once resolved."""
    return other is not None and path.resolve() == Path(other).resolve()


def _recorded(path: str, recorded: str | None, what: str, header_file: Path, check_hashes: bool,
              allow_unhashed: bool, notes: list[str], digests: AuditDigests,
              fmt: CheckpointFormat | None = None) -> CheckpointRef:
    """The reference of ``path`` (of the format ``fmt``; None: detected), its hash compared with the
    ``recorded`` one when ``check_hashes``."""
    ref = CheckpointRef.for_directory(path, fmt=fmt, hasher=digests.directory_hash)
    if check_hashes and not recorded:
        unhashed(f"{header_file} records no content hash of {what} {path}", allow_unhashed, notes)
    elif check_hashes and ref.sha256 != recorded:
        raise CheckpointError(f"{path} changed since it was aggregated (hash differs)")
    return ref
