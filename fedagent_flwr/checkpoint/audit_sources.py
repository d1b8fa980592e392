"""The audit's opening of one source an aggregate's header records (``fedagent.sources``).

Shared by the weighted-mean audit (:mod:`.verify`) and the server optimisers' (:mod:`.verify_optimizer`):
the source's files must still hash to what the header recorded (one not recorded:
:func:`.audit_hashes.unhashed`), and a LoRA adapter (``peft-lora``) is opened on top of the base model
the header names for it (``base``, ``base_sha256``: the global model its round started from), whose
hash is checked the same way, so the audit reads the same virtual full model the aggregation read
(:mod:`.lora_reader`).

A base that is gone is :class:`InputRemoved` (the round is reported as not checked, as a server
optimiser's round whose previous global model retention removed) only where the run says it removed
it (``removed_by_run``: the run record's ``removed``, or a committed round's removal note); otherwise
it is a missing input, CheckpointError naming it (lost, deleted by hand: the audit cannot vouch for
the round).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedagent_flwr.checkpoint.audit_digests import AuditDigests
from fedagent_flwr.checkpoint.audit_hashes import unhashed
from fedagent_flwr.checkpoint.open_ref import open_checkpoint
from fedagent_flwr.checkpoint.reader import CheckpointReader
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef

__all__ = ["InputRemoved", "open_recorded_source"]


class InputRemoved(Exception):
    """An input of the round that the run's retention removed: the round is not checked."""


def _never(path: Path) -> bool:
    return False


def open_recorded_source(source: dict[str, Any], header_file: Path, run_root: Path, check_hashes: bool,
                         allow_unhashed: bool, notes: list[str], digests: AuditDigests,
                         removed_by_run: Callable[[Path], bool] = _never) -> CheckpointReader:
    """Open the source ``source`` of the aggregate whose header is ``header_file``, its hash (and its
    base's, for a LoRA adapter) checked against the header unless ``check_hashes`` is False.
    ``removed_by_run(path)``: whether the run record (or a committed removal note) says the run
    removed that global model; a LoRA base that is gone is then InputRemoved, else CheckpointError."""
    ref = _recorded(source["path"], source.get("sha256"), "its source", header_file, check_hashes, allow_unhashed,
                    notes, digests)
    base = None
    if ref.format == "peft-lora":
        if not source.get("base"):
            raise CheckpointError(f"{header_file} records no base model of its LoRA source {source['path']}")
        base_dir = Path(source["base"])
        if not base_dir.is_dir():
            # retention removes only global models inside the run (never the run's base model)
            if base_dir.resolve().is_relative_to(run_root.resolve()) and removed_by_run(base_dir):
                raise InputRemoved(f"the base model {base_dir} of its LoRA source {source['path']} removed by the "
                                   "run (storage.keep_last_k)")
            raise CheckpointError(f"the base model {base_dir} of the LoRA source {source['path']} is missing (no "
                                  "removal by the run accounts for it)")
        base = _recorded(source["base"], source.get("base_sha256"), f"the base model of its LoRA source "
                         f"{source['path']}:", header_file, check_hashes, allow_unhashed, notes, digests)
    # opening checks the hash again: from the digests just computed while the stat is unchanged
    return open_checkpoint(ref, root=run_root, receipts=digests, base=base)


def _recorded(path: str, recorded: str | None, what: str, header_file: Path, check_hashes: bool,
              allow_unhashed: bool, notes: list[str], digests: AuditDigests) -> CheckpointRef:
    """The reference of ``path``, its hash compared with the ``recorded`` one when ``check_hashes``."""
    ref = CheckpointRef.for_directory(path, hasher=digests.directory_hash)
    if check_hashes and not recorded:
        unhashed(f"{header_file} records no content hash of {what} {path}", allow_unhashed, notes)
    elif check_hashes and ref.sha256 != recorded:
        raise CheckpointError(f"{path} changed since it was aggregated (hash differs)")
    return ref
