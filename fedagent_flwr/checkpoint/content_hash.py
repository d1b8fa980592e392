"""The content hash of a checkpoint directory: per-file sha256, in parallel or while reading.

A checkpoint reference carries a sha256 over the directory's hashed files (:func:`hashed_files`:
weight files and JSON configs at the top level). It is a two-level hash: each file's own sha256,
then one sha256 over ``name NUL size NUL file-digest`` of every file in name order, after a
version tag. Files are independent, so they are hashed on several threads
(:func:`hash_checkpoint_dir`), and a rank file can be hashed from the very bytes the aggregation
reads (:class:`FileHashStream`), so the server reads each byte from disk once instead of hashing
the checkpoint in a separate pass first.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = [
    "FileHashStream",
    "combine_file_digests",
    "file_digest",
    "hash_checkpoint_dir",
    "hashed_files",
    "is_hidden",
    "update_from_file",
]

# Changing how the digest is built changes every checkpoint's hash: bump the tag and the version
# with it (run records carry the version, so a resume can tell an old run from a damaged one).
CONTENT_HASH_VERSION = "v2"
CONTENT_HASH_TAG = f"fedagent-checkpoint-content-{CONTENT_HASH_VERSION}\n".encode()
# Files that carry the model weights, plus the small JSON configs so that a swapped config
# (another architecture) is caught as well. verl's optimizer and extra-state shards
# (optim_*.pt, extra_state_*.pt; about twice the model) are left out: they are never averaged,
# and hashing them would triple the bytes the server reads. Tokenizer files and logs likewise.
_HASHED_SUFFIXES = (".safetensors", ".json")
_HASH_BLOCK = 8 * 1024 * 1024
# hashlib releases the GIL on large updates, so threads hash files truly in parallel; more
# threads than files or cores only add contention.
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))


def is_hidden(name: str) -> bool:
    """Whether a file name is hidden (``.gitattributes``, ``.cache``): not a model file.

    Hub snapshots and git clones hold such files; they are neither hashed nor transferred.
    """
    return name.startswith(".")


def hashed_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The files covered by the content hash, in a stable order (top level only, not hidden:
    exactly what a store would transfer of them)."""
    root = Path(directory)
    return sorted(
        p
        for p in root.iterdir()
        if p.is_file() and not is_hidden(p.name)
        and (p.name.endswith(_HASHED_SUFFIXES) or (p.name.startswith("model_") and p.name.endswith(".pt")))
    )


def update_from_file(digest: Any, path: str | os.PathLike[str]) -> Any:
    """Feed a file's bytes into ``digest`` (a hashlib object) in 8 MiB blocks; return it."""
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest


def file_digest(path: str | os.PathLike[str]) -> bytes:
    """sha256 of one file (raw digest), streamed."""
    return bytes(update_from_file(hashlib.sha256(), path).digest())


def combine_file_digests(files: Sequence[tuple[str, int, bytes]]) -> str:
    """The directory hash (hex) from ``(name, size, sha256 digest)`` of every hashed file."""
    digest = hashlib.sha256(CONTENT_HASH_TAG)
    for name, size, file_hash in sorted(files):
        digest.update(name.encode() + b"\0" + str(size).encode() + b"\0" + file_hash)
    return digest.hexdigest()


def hash_checkpoint_dir(directory: str | os.PathLike[str], threads: int | None = None,
                        known: Mapping[str, tuple[int, bytes]] | None = None,
                        file_hasher: Callable[[Path], bytes] | None = None) -> str:
    """Content hash of ``directory`` (module docstring), its files hashed on ``threads`` threads.

    ``known`` maps a file name to its size and digest where the caller already holds them (a
    store's receipt, checked against the file's stat: :mod:`.receipts`); those files are not read.
    ``file_hasher`` hashes each of the others (default :func:`file_digest`; the audit's remembers
    what it hashed: :mod:`.audit_digests`).
    """
    known = known or {}
    hasher = file_hasher or file_digest
    files = hashed_files(directory)
    todo = [path for path in files if path.name not in known]
    workers = max(1, min(len(todo), threads or HASH_THREADS))
    if workers == 1:
        computed = [hasher(path) for path in todo]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-hash") as pool:
            computed = list(pool.map(hasher, todo))
    entries = {p.name: (p.stat().st_size, d) for p, d in zip(todo, computed)}
    entries.update({p.name: known[p.name] for p in files if p.name in known})
    return combine_file_digests([(name, size, digest) for name, (size, digest) in entries.items()])


class FileHashStream:
    """sha256 of one file, fed with the blocks a reader reads from it anyway.

    :meth:`feed` takes ``(offset, bytes)`` of every read. Bytes are hashed in file order: a block
    beyond the hashed prefix first has the gap before it read and hashed (zip headers, the pickle,
    a tensor the reader skips: small next to the tensors), a block inside the prefix (a storage
    two keys share) adds nothing, and :meth:`finish` hashes the tail. A reader that reads its
    tensors in storage order, as the aggregation does, so reads each byte once.
    """

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self.size = size
        self.position = 0  # bytes [0, position) are in the digest
        self.gap_bytes = 0  # bytes read only for the hash
        self._digest = hashlib.sha256()
        self._result: bytes | None = None

    def feed(self, offset: int, data: memoryview) -> None:
        """Account for ``data``, just read from the file at ``offset``."""
        end = offset + len(data)
        if self._result is not None or end <= self.position:
            return
        if offset > self.position:
            self._hash_range(self.position, offset)
        self._digest.update(data[self.position - offset:])
        self.position = end

    def finish(self) -> bytes:
        """Hash what was not read yet and return the file's sha256 (raw digest); idempotent."""
        if self._result is None:
            self._hash_range(self.position, self.size)
            self._result = self._digest.digest()
        return self._result

    def _hash_range(self, begin: int, end: int) -> None:
        while begin < end:
            block = os.pread(self._fd, min(_HASH_BLOCK, end - begin), begin)
            if not block:  # truncated under us: the digest will not match, which is the error
                break
            self._digest.update(block)
            self.gap_bytes += len(block)
            begin += len(block)
        self.position = max(self.position, begin)
