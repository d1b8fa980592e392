"""The per-user cache directory and how entries are produced in it.

Downloaded and derived artefacts (converted models, the ALFWorld service environment) live
outside any checkout so that every clone, worktree and run on the machine reuses them. Each entry
is produced under a cache-wide :class:`filelock.FileLock` in a temporary directory beside its final
place and renamed into place when complete, so concurrent producers build it exactly once and a
crash never leaves a half-built entry under the final name.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
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
