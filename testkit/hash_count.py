"""Counting the files the content hash reads, for tests that a file is hashed once where it should be."""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.checkpoint import content_hash


def count_hashed_files(monkeypatch: pytest.MonkeyPatch,
                       key: Callable[[Path], Hashable] = lambda path: path.name) -> collections.Counter[Any]:
    """From now on (until ``monkeypatch`` undoes it), every file :func:`content_hash.file_digest` hashes
    is counted in the returned Counter under ``key(path)`` (its name by default; ``Path.resolve`` tells
    equal names in several directories apart), and still hashed from disk."""
    counts: collections.Counter[Any] = collections.Counter()
    plain = content_hash.file_digest

    def counting(path: str | os.PathLike[str]) -> bytes:
        counts[key(Path(path))] += 1
        return plain(path)

    monkeypatch.setattr(content_hash, "file_digest", counting)
    return counts
