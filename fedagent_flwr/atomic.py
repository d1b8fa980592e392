"""Atomic file writes: write to a temporary name in the same directory, fsync, rename.

A reader (or a crash) then sees either the old file or the complete new one, never a half.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed to ``path``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        fsync_file(tmp)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a written file to disk, so that a rename after it never exposes missing bytes."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def json_text(payload: Any) -> str:
    """``payload`` as the indented, key-sorted JSON that every JSON file of a run uses."""
    return json.dumps(payload, indent=2, sort_keys=True)


def write_json_atomic(path: str | os.PathLike[str], payload: Any) -> None:
    """Replace ``path`` with ``payload`` as indented, key-sorted JSON, atomically."""
    write_text_atomic(path, json_text(payload))
