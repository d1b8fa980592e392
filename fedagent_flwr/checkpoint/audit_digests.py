"""The audit's file digests, each computed once per audit and reused while its file is unchanged.

The audit (:mod:`.verify`) checks some files' content hashes more than once: a client checkpoint
when its reference is built (:meth:`.CheckpointRef.for_directory`) and again when it is opened
(:func:`.open_ref.open_checkpoint` checks the reference's hash), and with a server optimiser
(:mod:`.verify_optimizer`) a round's global model and optimiser state in their own round and
again as the next round's previous model and state. :class:`AuditDigests` hashes each file once:
a file's sha256 is remembered with its resolved path and its stat (:class:`.receipts.FileStat`:
size, ``st_mtime_ns``, ``st_ctime_ns``, ``st_ino``, ``st_dev``) and given again only while the
file's stat is exactly that; any other file is hashed again, as before. So a file changed between
two uses is still caught: every write moves its ``ctime`` (the kernel offers no call to set it,
so restoring the ``mtime`` with ``utime`` does not hide a change) and a replacement has another
inode. Every comparison the audit makes is unchanged; only the bytes behind a digest are not read
twice. A checkpoint opened with these digests (:meth:`AuditDigests.trusted` as
:func:`.open_ref.open_checkpoint`'s ``receipts``) is read after that stat check, so the reader
checks each such file's stat once more after the reads (:meth:`.CheckpointReader.verify_content`).
The aggregation keeps one per round for the global model its LoRA adapters are read on
(:func:`.open_ref.open_checkpoint`'s ``base_digests``): checked for every adapter, hashed once.

As with the store's receipts (:mod:`.receipts`, which make the same trade for the aggregation):
a digest is remembered only when the file's stat was the same before and after it was hashed
(not written meanwhile), and only when its ``ctime`` is older than :data:`RACY_NS` before the
hash began. A file written within the same timestamp tick as an earlier write keeps its stat
(git's "racily clean" files); a file that recent (the newest round of a running run, a run just
written) is hashed at every use instead. The margin covers coarse kernel clocks and filesystems
with one-second timestamps. What this does not guard against, like the receipts: a writer who can
forge ``ctime`` (root changing the clock or editing the filesystem), or bits that rot on disk
between two uses of one audit without the filesystem noticing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from fedagent_flwr.checkpoint import content_hash
from fedagent_flwr.checkpoint.receipts import FileStat, TrustedFile, changed_while_read, fresh_stat
from fedagent_flwr.checkpoint.ref import CheckpointError

__all__ = ["RACY_NS", "AuditDigests"]

#: A file whose ``ctime`` is less than this before its hash began is never remembered (module
#: docstring); the benchmark sets it beyond any file's age to measure the audit without reuse.
RACY_NS = 2_000_000_000


class AuditDigests:
    """The digests one audit computed (module docstring): :meth:`file_digest` and
    :meth:`directory_hash` stand in for :func:`.content_hash.file_digest` and
    :func:`.content_hash.hash_checkpoint_dir`, and :meth:`trusted` gives
    :func:`.open_ref.open_checkpoint` (as ``receipts``) the digests still valid in a directory."""

    def __init__(self) -> None:
        self._known: dict[Path, TrustedFile] = {}
        # every file this audit hashed, racily clean or not, with its stat when the hash ended: not a
        # digest to reuse, but a stat that, once it differs, proves the file changed since (hashed_stats)
        self._hashed: dict[Path, FileStat] = {}

    def file_digest(self, path: str | os.PathLike[str]) -> bytes:
        """sha256 of the file at ``path`` (raw digest): the remembered one while its stat is
        unchanged, else hashed (and remembered where it may be)."""
        return self._entry(Path(path))[1]

    def directory_hash(self, directory: str | os.PathLike[str]) -> str:
        """The content hash of ``directory``, as :func:`.content_hash.hash_checkpoint_dir`
        computes it, from remembered digests where they are still valid; the others are hashed on
        :data:`.content_hash.HASH_THREADS` threads."""
        known = {name: (entry.stat.size, entry.digest) for name, entry in self.trusted(directory).items()}
        return content_hash.hash_checkpoint_dir(directory, known=known, file_hasher=lambda path: self._hash(path)[1])

    def trusted(self, directory: str | os.PathLike[str]) -> dict[str, TrustedFile]:
        """The hashed files of ``directory`` whose remembered digest is still valid (stat
        unchanged), by name: what :func:`.open_ref.open_checkpoint` takes as ``receipts``."""
        found = {path.name: self._valid(path) for path in content_hash.hashed_files(directory)}
        return {name: entry for name, entry in found.items() if entry is not None}

    def hashed_stats(self, directory: str | os.PathLike[str]) -> dict[str, FileStat]:
        """The stat of each hashed file of ``directory`` when this audit last hashed it, by name (a
        trusted digest's stat is that one too; a file that moved while it was hashed: its stat before,
        so that any later check refuses it): what a reader watches
        (:meth:`~.reader.CheckpointReader.watch_unchanged`) to refuse a file changed after the check.
        Unlike :meth:`trusted`, it includes files written within :data:`RACY_NS` of their hash: their
        digest is not reused, but a stat that differs later still proves a change (an equal one proves
        nothing, for any file). Read from memory: no file is stat'ed again."""
        hashed = ((path.name, self.hashed_stat(path)) for path in content_hash.hashed_files(directory))
        return {name: stat for name, stat in hashed if stat is not None}

    def hashed_stat(self, path: str | os.PathLike[str]) -> FileStat | None:
        """The stat of the file at ``path`` when this audit last hashed it, as :meth:`hashed_stats`
        gives it for a checkpoint's files (a file that moved while it was hashed: its stat before);
        None for a file it never hashed. For a file outside a checkpoint's hashed files (a server
        optimiser's state)."""
        return self._hashed.get(Path(path).resolve())

    def check_read(self, path: str | os.PathLike[str], held: FileStat | str) -> None:
        """CheckpointError when a file this audit hashed and then read (an optimiser state, a written
        global model: files outside a checkpoint reader's watch) is no longer the file hashed: its
        stat now at ``path``, or ``held`` (through the descriptor read,
        :meth:`.SafetensorsFile.held_stat`), differs from the one its hash recorded
        (:meth:`hashed_stat`). Its values were then compared with bytes the hash never covered. A
        file this audit never hashed is not checked: nothing trusted it."""
        hashed = self.hashed_stat(path)
        changed = changed_while_read(path, hashed, held) if hashed is not None else None
        if changed is not None:
            gone = ("; it is gone from its path: removed while the audit read it (by the run's retention, if "
                    "the run is still going: audit again once it has ended)") if not os.path.lexists(path) else ""
            raise CheckpointError(changed + gone)

    def _valid(self, path: Path) -> TrustedFile | None:
        """The remembered digest of ``path`` if its stat is still the one it was hashed with."""
        key = path.resolve()
        entry = self._known.get(key)
        if entry is None:
            return None
        try:
            now = fresh_stat(key)
        except OSError:
            return None
        return entry if now == entry.stat else None

    def _entry(self, path: Path) -> tuple[int, bytes]:
        """(size, sha256) of ``path``: remembered, or hashed."""
        entry = self._valid(path)
        return (entry.stat.size, entry.digest) if entry is not None else self._hash(path)

    def _hash(self, path: Path) -> tuple[int, bytes]:
        """(size, sha256) of ``path``, hashed, and remembered where it may be (module docstring)."""
        key = path.resolve()
        began = time.time_ns()
        try:
            before: FileStat | None = fresh_stat(key)
        except OSError:
            before = None  # hashing it raises the error the caller expects
        digest = content_hash.file_digest(path)
        after = fresh_stat(key)
        if before == after and after.ctime_ns < began - RACY_NS:
            self._known[key] = TrustedFile(digest, after)
        else:
            self._known.pop(key, None)
        # The stat a later check compares with: when the hash ended; or, where the file moved while it was
        # hashed, the one before, which no later stat equals, so that check refuses it (the digest may be of
        # bytes no longer there, and the hash may still have matched the reference).
        self._hashed[key] = before if before is not None and before != after else after
        return after.size, digest

