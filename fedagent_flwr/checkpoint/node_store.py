"""The client half shared by the stores that keep files on a node (http, s3): where the run's
files and the global-model cache live, and one way to fetch a global model into that cache.

A node-side store's ``fetch`` checks the reference, fills the content-addressed cache through
:func:`.node_cache.fill_cache` with the store's own download, remembers the model for this
message (eviction never takes it), logs what moved and bounds the cache (node config
``cache-keep``); only the download itself differs between the stores.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from fedagent_flwr.checkpoint.manifest import check_sha256
from fedagent_flwr.checkpoint.node_cache import evict_and_report, fill_cache
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef
from fedagent_flwr.checkpoint.store import ClientStore, store_ref_parts
from fedagent_flwr.checkpoint.upload_staging import CheckedFiles


@dataclass
class TransferReport:
    """Bytes moved by the last ``fetch`` or ``put`` (what a resumed transfer saved shows here)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    files_skipped: int = 0  # already complete on the other side (or in the cache)
    cache_hit: bool = False
    started: float = 0.0  # time.monotonic() at the start

    def describe(self, what: str) -> str:
        """One log line: what moved, its size, time and rate (a 28 GB transfer must not look like a hang)."""
        seconds = max(time.monotonic() - self.started, 1e-9)
        moved = self.bytes_sent + self.bytes_received
        if self.cache_hit:
            return f"[store] {what}: from this node's cache"
        skipped = f", {self.files_skipped} file(s) already there" if self.files_skipped else ""
        return (f"[store] {what}: {moved / 1e6:.1f} MB in {seconds:.1f} s "
                f"({moved / 1e6 / seconds:.1f} MB/s){skipped}")


class NodeClientStore(ClientStore):
    """A client store that keeps files on the node: the run's files in ``<work dir>/run-<run id>/``
    and the global models in the content-addressed ``<work dir>/cache/``."""

    url: str
    work_dir: Path
    run_key: str
    cache_keep: int  # 0: the node's cache keeps every model
    report: TransferReport

    def __init__(self, url: str, run_key: str, work_dir: str | Path, cache_keep: int = 0) -> None:
        self.url = url.rstrip("/")
        self.run_key = run_key
        self.work_dir = Path(work_dir)
        self.cache_keep = cache_keep
        self.report = TransferReport()
        self._fetched: set[str] = set()  # models this store (one message) handed out: never evicted by it

    @property
    def run_root(self) -> Path:
        return self.work_dir / f"run-{self.run_key}"

    @property
    def cache_dir(self) -> Path:
        return self.work_dir / "cache"

    def model_segments(self, path: str, ref: CheckpointRef) -> tuple[list[str], str]:
        """The store path segments of global model reference ``path`` (``models/...`` of this run)
        and the model's checked content hash; CheckpointError otherwise."""
        segments = store_ref_parts(path, self.url, self.run_key, "global model")
        if len(segments) < 2 or segments[0] != "models":
            raise CheckpointError(f"global model reference {ref.path!r} names no shared model of this run")
        return segments, check_sha256(ref.sha256, f"global model {ref.path}")

    def cached_fetch(self, ref: CheckpointRef, digest: str, download: Callable[[Path], CheckedFiles],
                     transfers: AbstractContextManager[object]) -> Path:
        """Model ``digest`` in the node cache, ``download`` filling a staging folder unless it is
        cached (inside ``transfers``: the store's connection or error naming) and returning the
        files it checked (:func:`.node_cache.fill_cache` combines the content hash from them);
        then the log line and the cache bound."""
        self.report = TransferReport(started=time.monotonic())
        with transfers:
            target, self.report.cache_hit = fill_cache(self.cache_dir, digest, f"global model {ref.path}", download)
        self._fetched.add(digest)
        print(self.report.describe(f"global model {digest[:12]} fetched"), flush=True)
        evict_and_report(self.cache_dir, self.cache_keep, self._fetched)
        return target
