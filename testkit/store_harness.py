"""Helpers for tests of the checkpoint stores: a client with an instruction's tokens, filesystem
snapshots (to show nothing was written outside the run root), and a bounded wait."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.checkpoint import content_hash
from fedagent_flwr.checkpoint.http_client import HttpClientStore
from fedagent_flwr.checkpoint.http_server import HttpServerStore

RUN = "11"  # the Flower run id the test stores serve
SHARD = "model_world_size_1_rank_0.pt"


def tree(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` (outside ``skip``) with its size and mtime: a before/after snapshot."""
    found = {}
    for path in root.rglob("*"):
        if any(path == s or s in path.parents for s in skip):
            continue
        stat = path.lstat()
        found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


def node(store: HttpServerStore, work: Path, server_round: int = 1, client: int = 0, **kwargs: Any) -> HttpClientStore:
    """A client of ``store`` working in ``work``, with the tokens an instruction for (round, client) carries."""
    return HttpClientStore(store.url, RUN, store.read_token(), work,
                           upload_token=store.upload_token(server_round, client), **kwargs)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition``; a hang guard, not a timing bound (the server answers in milliseconds)."""
    deadline = time.monotonic() + 60
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


class HashCounter:
    """Counts the bytes fed to every sha256 that :mod:`fedagent_flwr.checkpoint.content_hash`
    creates (the aggregation's hashing while reading, a directory hashed at opening or at the
    check, the combining step): real hashlib digests, only counted. Install with :meth:`install`."""

    def __init__(self) -> None:
        self.bytes = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> HashCounter:
        import types

        monkeypatch.setattr(content_hash, "hashlib", types.SimpleNamespace(sha256=self.sha256))
        return self

    def sha256(self, data: bytes = b"") -> Any:
        counter = self
        real = hashlib.sha256(data)
        counter.bytes += len(data)

        class Counted:
            def update(self, block: Any) -> None:
                counter.bytes += memoryview(block).nbytes
                real.update(block)

            def digest(self) -> bytes:
                return real.digest()

            def hexdigest(self) -> str:
                return real.hexdigest()

        return Counted()
