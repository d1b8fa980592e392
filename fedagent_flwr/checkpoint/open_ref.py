"""Check a checkpoint reference and open it for reading (the one entry point to the readers)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from fedagent_flwr.checkpoint.audit_digests import AuditDigests
from fedagent_flwr.checkpoint.fsdp_reader import FsdpShardReader, fsdp_shard_paths
from fedagent_flwr.checkpoint.lora_reader import LoraAdapterReader, adapter_files
from fedagent_flwr.checkpoint.reader import CheckpointReader
from fedagent_flwr.checkpoint.receipts import FileStat, TrustedDigests
from fedagent_flwr.checkpoint.ref import (
    CheckpointError,
    CheckpointRef,
    content_mismatch,
    hash_checkpoint_dir,
    resolve_inside,
)
from fedagent_flwr.checkpoint.safetensors_reader import SafetensorsReader, safetensors_files
from fedagent_flwr.checkpoint.shard_file import IoMode

__all__ = ["HashCheck", "content_mismatches", "open_checkpoint"]

#: When the content hash is checked: at opening (``True``), while the tensors are read (the
#: caller then calls :meth:`CheckpointReader.verify_content` before trusting them), or never.
HashCheck = bool | Literal["while-reading"]


def open_checkpoint(
    ref: CheckpointRef,
    root: str | os.PathLike[str] | None = None,
    check_hash: HashCheck = True,
    io: IoMode = "auto",
    receipts: TrustedDigests | None = None,
    base: CheckpointRef | None = None,
    base_digests: AuditDigests | None = None,
) -> CheckpointReader:
    """Check a reference and open it for reading.

    Refuses (with :class:`CheckpointError` naming the culprit) a reference outside ``root``
    (``..`` and symlinks resolved, weight files included), a missing directory, a missing or extra rank file, a world
    size that disagrees with the files, a content hash that does not match ``ref.sha256`` (when
    ``check_hash`` and the reference carries one) and files that cannot be parsed.
    ``io`` is for tests and unusual torch versions: how FSDP rank files are read.

    ``check_hash="while-reading"`` checks the hash of FSDP rank files from the bytes the reads
    fetch anyway (one pass over the files instead of two); the check completes in
    :meth:`~CheckpointReader.verify_content`, which the aggregation calls before it commits.
    Safetensors directories are hashed at opening either way (each file whole, before it is read).

    ``receipts`` (the http and s3 stores', :meth:`~.store.ServerStore.receipt_check`): a file whose
    receipt holds and whose stat is unchanged since it was verified on upload contributes the
    recorded digest instead of being hashed (:mod:`.receipts`); the reference's content hash is
    still checked over every file's digest. Without it (shared-fs) every byte is hashed. The audit
    passes the digests it computed already the same way (:class:`.audit_digests.AuditDigests`).
    A trusted file's bytes are read after its stat was checked, so its stat is checked again once
    the reads are done, in :meth:`~CheckpointReader.verify_content` (which the aggregation and the
    audit call before they use what they read): a file rewritten meanwhile is refused (CheckpointError
    naming it, "changed while it was read") rather than read changed without notice. With
    ``"while-reading"`` on FSDP rank files the reader checks its trusted files itself; otherwise
    (hash at opening: safetensors directories, ``check_hash=True``) the reader is told the trusted
    files and their stats (:meth:`~CheckpointReader.watch_unchanged`): one ``open`` and ``fstat``
    per trusted file. So is every file hashed at opening, with its stat when its hash ended (one
    that moved while it was hashed: its stat before, which no later stat equals): the reader maps or
    reads it after the check, so one rewritten in place meanwhile is refused too rather than read
    changed under a hash that held (a ``base``: :func:`open_global_model`).

    ``base``: the full model a ``peft-lora`` reference is read on top of (the round's global model,
    :mod:`.lora_reader`); required for an adapter, ignored otherwise. It is the server's own model,
    opened without a root, and unless ``check_hash`` is False its content hash must be ``base.sha256``
    (:func:`open_global_model`): the adapter means an update of that model only, and the server compares the
    hash the adapter records with ``base.sha256``, so the bytes must match it too. ``base_digests``: the
    caller's digests of the base's files, kept across its opens (the strategy keeps one per round), so
    a base opened for every client's adapter is hashed once while its files are unchanged; None:
    hashed at this opening.
    """
    if check_hash not in (True, False, "while-reading"):
        raise ValueError(f"check_hash must be True, False or 'while-reading', got {check_hash!r}")
    ref.check_fields()
    if root is not None:
        directory = resolve_inside(ref, root)
    else:
        if "://" in ref.path:
            raise CheckpointError(f"reference {ref.path!r} uses a scheme this run cannot read")
        directory = Path(ref.path)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")

    # Layout checks come before the hash so that a missing shard is reported as such rather
    # than as an opaque hash mismatch.
    if ref.format == "fsdp-shards":
        data_files = fsdp_shard_paths(directory, ref.world_size)
    elif ref.format == "peft-lora":
        data_files = adapter_files(directory)
        if base is None or base.format == "peft-lora":
            raise CheckpointError(f"{directory} is a LoRA adapter: it is read on top of the full model it was "
                                  f"trained from, and {'none was given' if base is None else 'its base is an adapter'}")
    else:
        data_files = safetensors_files(directory)
    if root is not None:
        # The directory is inside the root; its weight files must be too (a symlinked shard
        # could otherwise make the server read any file it can open).
        root_path = Path(root).resolve()
        for path in data_files:
            if root_path not in path.resolve().parents:
                raise CheckpointError(f"{path} links to {path.resolve()}, outside the run root {root_path}")

    deferred = check_hash == "while-reading" and ref.format == "fsdp-shards" and bool(ref.sha256)
    trusted = receipts.trusted(directory) if receipts is not None and check_hash and ref.sha256 else {}
    # checked at opening: each file's stat when its digest was taken, checked again after the reads
    watched: dict[str, FileStat] = {}
    if check_hash and ref.sha256 and not deferred:
        known = {name: (t.stat.size, t.digest) for name, t in trusted.items()}
        # Records each file's stat around its hash (AuditDigests.hashed_stats): the reader maps or reads the
        # files after this check, so a file rewritten in place meanwhile must not be read under a hash that held.
        hashing = AuditDigests()
        actual = hash_checkpoint_dir(directory, known=known, file_hasher=hashing.file_digest)
        if actual != ref.sha256:
            raise content_mismatch(directory, actual, ref.sha256)
        watched = {**hashing.hashed_stats(directory), **{name: entry.stat for name, entry in trusted.items()}}

    reader: CheckpointReader
    if ref.format == "fsdp-shards":
        reader = FsdpShardReader(ref, directory, data_files, io=io, expected_sha256=ref.sha256 if deferred else None,
                                 trusted=trusted if deferred else None)
    elif ref.format == "peft-lora":
        assert base is not None  # checked with the layout
        base_reader = open_global_model(base, bool(check_hash), base_digests, io)
        try:
            reader = LoraAdapterReader(ref, directory, base_reader, base)
        except BaseException:
            base_reader.close()
            raise
    else:
        reader = SafetensorsReader(ref, directory, data_files)
    if watched:
        reader.watch_unchanged(watched)
    return reader


def global_role(ref: CheckpointRef) -> str:
    """What a round's global ``ref`` is called in messages: "critic" (a PPO run's) or "model"."""
    return "critic" if ref.kind == "critic" else "model"


def open_global_model(base: CheckpointRef, check: bool, digests: AuditDigests | None, io: IoMode = "auto"
                      ) -> CheckpointReader:
    """Open a round's global model (the server's own: no root), the model a LoRA adapter is read on top
    of and the reference a round's checkpoints are checked and measured against; with ``check``,
    CheckpointError unless its files hash to ``base.sha256`` (when it carries one).

    The hash comes from ``digests`` (a new :class:`.audit_digests.AuditDigests` when None): a file whose
    digest it remembers and whose stat is unchanged since is not read again, any other is hashed (and
    remembered where it may be). Every file hashed or trusted is watched (:meth:`~CheckpointReader.watch_unchanged`,
    :meth:`.audit_digests.AuditDigests.hashed_stats`), one written moments ago too, so a file changed between
    this check and the end of the reads is refused by ``verify_content``.
    """
    reader = open_checkpoint(base, check_hash=False, io=io)  # its layout first: a missing file is said as such
    if not check or not base.sha256:
        return reader
    try:
        digests = digests if digests is not None else AuditDigests()
        actual = digests.directory_hash(reader.directory)
        if actual != base.sha256:
            raise CheckpointError(
                f"{reader.directory}, the round's global {global_role(base)}, has "
                f"content hash {actual[:16]}..., its reference says {base.sha256[:16]}...: its files changed on disk "
                "since the run recorded its hash, so the clients' checkpoints (trained on it as recorded) would be "
                f"aggregated against another model; restore {reader.directory} from a copy, or start the run over")
        reader.watch_unchanged(digests.hashed_stats(reader.directory))  # a model written just now too
    except BaseException:
        reader.close()
        raise
    return reader


def content_mismatches(readers: Sequence[CheckpointReader]) -> list[tuple[int, CheckpointError]]:
    """Complete every reader's deferred content-hash check; the (index, error) of each that fails.
    Whatever was built from the failing readers' values must not be used."""
    mismatches = []
    for index, reader in enumerate(readers):
        try:
            reader.verify_content()
        except CheckpointError as exc:
            mismatches.append((index, exc))
    return mismatches
