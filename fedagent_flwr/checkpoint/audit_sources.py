"""The audit's opening of one source an aggregate's header records (``fedagent.sources``).

Shared by the weighted-mean audit (:mod:`.verify`) and the server optimisers' (:mod:`.verify_optimizer`):
the source's files must still hash to what the header recorded (one not recorded:
:func:`.audit_hashes.unhashed`), and a LoRA adapter (``peft-lora``) is opened on top of the base model
the header names for it (``base``, ``base_sha256``: the global model its round started from), whose
hash is checked the same way, so the audit reads the same virtual full model the aggregation read
(:mod:`.lora_reader`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedagent_flwr.checkpoint.audit_digests import AuditDigests
from fedagent_flwr.checkpoint.audit_hashes import unhashed
from fedagent_flwr.checkpoint.open_ref import open_checkpoint
from fedagent_flwr.checkpoint.reader import CheckpointReader
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef

__all__ = ["open_recorded_source"]


def open_recorded_source(source: dict[str, Any], header_file: Path, run_root: Path, check_hashes: bool,
                         allow_unhashed: bool, notes: list[str], digests: AuditDigests) -> CheckpointReader:
    """Open the source ``source`` of the aggregate whose header is ``header_file``, its hash (and its
    base's, for a LoRA adapter) checked against the header unless ``check_hashes`` is False."""
    ref = _recorded(source["path"], source.get("sha256"), "its source", header_file, check_hashes, allow_unhashed,
                    notes, digests)
    base = None
    if ref.format == "peft-lora":
        if not source.get("base"):
            raise CheckpointError(f"{header_file} records no base model of its LoRA source {source['path']}")
        if not Path(source["base"]).is_dir():
            raise CheckpointError(f"the base model {source['base']} of the LoRA source {source['path']} is gone "
                                  "(storage.keep_last_k removes old global models)")
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
