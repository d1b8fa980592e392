"""The per-user cache directory and how entries are produced in it.

Downloaded and derived artefacts (converted models, the ALFWorld service environment) live
outside any checkout so that every clone, worktree and run on the machine reuses them. Each entry
is produced under a cache-wide :class:`filelock.FileLock` in a temporary directory beside its final
place and renamed into place when complete, so concurrent producers build it exactly once and a
crash never leaves a half-built entry under the final name.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock


def cache_dir() -> Path:
    """Directory for downloaded and derived artefacts.

    ``$FEDAGENT_CACHE_DIR`` if set (CI, shared machines), else ``$XDG_CACHE_HOME/fedagent-flwr``,
    else ``~/.cache/fedagent-flwr``. Created on first use.
    """
    explicit = os.environ.get("FEDAGENT_CACHE_DIR", "").strip()
    if explicit:
        root = Path(explicit).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
        base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
        root = base / "fedagent-flwr"
    root.mkdir(parents=True, exist_ok=True)
    return root


def progress(message: str) -> None:
    """Progress of slow steps goes to stderr so it never mixes with a trainer's stdout lines."""
    print(f"[fedagent-flwr] {message}", file=sys.stderr, flush=True)


@contextmanager
def cache_lock(name: str) -> Iterator[Path]:
    """Hold the cache-wide lock for entry ``name`` and yield the cache directory."""
    root = cache_dir()
    with FileLock(str(root / f".{name}.lock")):
        yield root


def fresh_tmp_dir(root: Path, name: str) -> Path:
    """A temporary directory next to the final location, so the final rename stays on one filesystem."""
    path = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    path.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by other users
    return path


class CacheEntryError(RuntimeError):
    """A cache entry that exists under its final name but is not complete."""


def build_once(name: str, build: Callable[[Path, Path], None], complete: str) -> Path:
    """The cache entry ``name``, produced by ``build(work_dir, final_dir)`` if it is missing.

    ``complete`` names the file or folder whose presence marks a finished entry. The build writes
    into a fresh temporary directory beside the final one (``final_dir`` is where it will end up,
    for builds that record their own location), which is renamed into place when ``build``
    returns; on any error it is removed. Concurrent callers wait on the entry's lock and reuse it.
    """
    final = cache_dir() / name
    if (final / complete).exists():
        return final
    with cache_lock(name) as root:
        if (final / complete).exists():  # another process finished it while we waited
            return final
        if final.exists():  # not ours to trust: a foreign or damaged directory
            raise CacheEntryError(f"{final} exists but is incomplete (no {complete}); remove it and retry")
        work = fresh_tmp_dir(root, name)
        try:
            build(work, final)
            os.replace(work, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
