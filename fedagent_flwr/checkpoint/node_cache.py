"""Bounding a node's cache of global models (node config ``cache-keep``).

With the http store every node keeps each global model it downloads in
``<work dir>/cache/<sha256>/``. Over a 10-round run of a 7B model that is 10 copies of 28 GB on every
node, so a node may cap the cache at its ``cache-keep`` most recently used models (0, the default,
keeps all). Eviction runs after every fetch (a listing of the cache), and it never removes:

- a model the current message fetched (a training message fetches the actor and then the PPO
  critic: with ``cache-keep=1`` the second fetch must not take the first away from its trainer);
- a model whose per-model lock another process holds (it is being downloaded or checked), or one
  used since the pass listed the cache (a cache hit marks the use under that lock);
- a model among the ``keep`` most recently used ones (last use is the directory's mtime, set at
  every fetch and cache hit).

An interrupted download (``.partial-<sha256>/``, resumed by the next fetch of that model) is
removed by the same pass once it is older than the oldest model kept, under the same two guards.

A model is removed by renaming it out of its content-addressed name first, under its lock, so a
concurrent fetch sees the whole model or none and downloads it again. Runs that share a node's work
dir share its cache and its count: a model another run is about to load can go once this node has
fetched ``keep`` newer ones, so keep at least 2 (the model being trained from and the next).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from fedagent_flwr.atomic import fsync_dir, fsync_tree
from fedagent_flwr.checkpoint.ref import CheckpointError, is_sha256
from fedagent_flwr.checkpoint.upload_staging import CheckedFiles, checked_content_hash


@dataclass
class Eviction:
    """What one eviction pass removed, and what it had to leave."""

    removed: list[str] = field(default_factory=list)  # content hashes (".partial-<hash>": a partial download)
    bytes_freed: int = 0
    busy: list[str] = field(default_factory=list)  # locked by another process: left for a later pass

    def describe(self, keep: int) -> str:
        """One log line (empty when nothing was removed or left)."""
        if not self.removed and not self.busy:
            return ""
        busy = f"; {len(self.busy)} in use elsewhere left" if self.busy else ""
        partial = sum(name.startswith(PARTIAL_PREFIX) for name in self.removed)
        partial_note = f" ({partial} of them partial downloads)" if partial else ""
        return (f"[store] node cache: removed {len(self.removed)} older global model(s){partial_note}, "
                f"{self.bytes_freed / 1e6:.1f} MB, to keep the {keep} most recently used "
                f"(node config 'cache-keep'){busy}")


#: The folder a download fills before it is checked and renamed to the model's hash.
PARTIAL_PREFIX = ".partial-"
#: A folder being removed (renamed out of its name first, so no fetch reads half of it).
EVICTING_PREFIX = ".evicting-"


def lock_path(cache_dir: Path, digest: str) -> Path:
    """The lock a fetch of model ``digest`` holds while it downloads and checks it."""
    return cache_dir / f".{digest}.lock"


def mark_used(model_dir: Path) -> None:
    """Record a use of a cached model (its directory's mtime: the eviction order)."""
    os.utime(model_dir)


def fill_cache(cache_dir: Path, digest: str, what: str,
               download: Callable[[Path], CheckedFiles]) -> tuple[Path, bool]:
    """``<cache_dir>/<digest>/``, downloading it first unless cached; returns ``(directory, cache hit)``.

    The one way a store client fills the node cache (http and s3): under the model's lock (one
    download per model per node, even with several ClientApp processes), ``download`` fills
    ``.partial-<digest>/`` with files it checked against the manifest (those an interrupted pass
    left are checked again) and returns their digests and stats
    (:func:`~.upload_staging.check_in_place`). The folder is checked against ``digest`` and only
    then renamed to its content-addressed name, so the cache holds only complete, verified models;
    a mismatch is discarded and raised naming ``what``.

    That check reads nothing again: the content hash is combined from the digests the download
    just checked, for each file whose stat is still exactly the one it was hashed under (any
    write since moves its ``ctime``); any other file in the folder (one changed since, one the
    download did not check) is hashed, and a file the manifest does not list is removed first
    (:func:`~.upload_staging.checked_content_hash`).
    """
    target = cache_dir / digest
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_path(cache_dir, digest))):
        if target.is_dir():
            mark_used(target)
            return target, True
        staging = cache_dir / f"{PARTIAL_PREFIX}{digest}"
        staging.mkdir(exist_ok=True)
        checked = download(staging)
        actual = checked_content_hash(staging, checked)
        if actual != digest:
            shutil.rmtree(staging)
            raise CheckpointError(
                f"{what}: downloaded files hash to {actual[:16]}..., the reference says {digest[:16]}...; discarded"
            )
        fsync_tree(staging)  # the cache trusts a renamed folder without checking it again
        staging.replace(target)
        mark_used(target)
        fsync_dir(cache_dir)
    return target, False


def evict_and_report(cache_dir: Path, keep: int, protected: set[str]) -> None:
    """Run :func:`evict` when ``keep`` bounds the cache and print its line, if any (after each fetch).

    Housekeeping only: the message already has its model, so a pass that fails (a folder another
    process removed under it, a permission error) is reported and never fails the message."""
    if keep <= 0:
        return
    try:
        line = evict(cache_dir, keep, protected).describe(keep)
    except OSError as exc:
        line = f"[store] node cache: eviction skipped this time ({exc})"
    if line:
        print(line, flush=True)


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _mtime(path: Path) -> int | None:
    """``path``'s mtime in ns, None if another process removed or renamed it since the listing."""
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def _digest_of(name: str) -> str:
    """The model hash a cache folder's name carries (``<hash>``, ``.partial-<hash>``, ``.evicting-...``)."""
    for prefix in (EVICTING_PREFIX, PARTIAL_PREFIX, "partial-"):
        name = name.removeprefix(prefix)
    return name


def _remove_leftovers(cache_dir: Path) -> None:
    """``.evicting-*`` folders a pass left when it died half-way; one another pass is removing
    right now is left to it (that pass holds the model's lock)."""
    for leftover in cache_dir.glob(f"{EVICTING_PREFIX}*"):
        try:
            with FileLock(str(lock_path(cache_dir, _digest_of(leftover.name))), timeout=0):
                shutil.rmtree(leftover, ignore_errors=True)
        except Timeout:
            continue


def evict(cache_dir: Path, keep: int, protected: set[str]) -> Eviction:
    """Remove cached models beyond the ``keep`` most recently used, sparing ``protected`` hashes
    (those the calling store fetched for its message) and models another process holds the lock
    of or used since the listing."""
    result = Eviction()
    if keep <= 0 or not cache_dir.is_dir():
        return result
    _remove_leftovers(cache_dir)
    dated = [(mtime, p) for p in cache_dir.iterdir()
             if is_sha256(p.name) and (mtime := _mtime(p)) is not None and p.is_dir()]
    dated.sort(key=lambda item: item[0], reverse=True)
    doomed = dated[keep:]
    if len(dated) >= keep:  # the cache is full: partial downloads older than the oldest model kept go
        cutoff = dated[keep - 1][0]
        doomed += [(mtime, p) for p in cache_dir.glob(f"{PARTIAL_PREFIX}*")
                   if is_sha256(_digest_of(p.name)) and (mtime := _mtime(p)) is not None and mtime < cutoff]
    for listed, directory in doomed:
        digest = _digest_of(directory.name)
        if digest in protected:
            continue
        try:
            with FileLock(str(lock_path(cache_dir, digest)), timeout=0):
                # A fetch marks a use under this lock: a folder gone or used since the listing stays.
                if _mtime(directory) != listed or not directory.is_dir():
                    continue
                size = _size(directory)
                moved = cache_dir / f"{EVICTING_PREFIX}{directory.name.lstrip('.')}"
                directory.replace(moved)  # gone from its name at once: a fetch now downloads it again
                shutil.rmtree(moved, ignore_errors=True)
        except Timeout:
            result.busy.append(directory.name)
            continue
        result.removed.append(directory.name)
        result.bytes_freed += size
    return result
