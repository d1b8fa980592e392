"""One verl weight sync at a time per host: a mitigation of issue 18's stalled session (unverified
on a GPU; docs/gpu.md, "Stalls").

verl 0.9.1 pushes the actor's weights into vLLM (``CheckpointEngineManager.update_weights``: before
a round's first step and after every actor update) over a ZMQ socket at a fixed path,
``/tmp/rl-colocate-zmq-<Ray job id>-replica-<r>-rank-<k>.sock`` (the sender in
``vllm_rollout.ServerAdapter.__init__``, the receiver, a vLLM worker, in
``vLLMColocateWorkerExtension._get_zmq_handle``). verl put the Ray job id there to keep concurrent
jobs apart, but that only separates jobs of one Ray cluster: each verl job and persistent session
here starts a private cluster, whose driver job is always ``01000000``, so every verl job on a host
uses the same path. The sender unlinks the path and binds it afresh at every sync, and the receiver
connects to whatever is bound there when its RPC starts. Two syncs that overlap (likely with
persistent sessions, whose rounds start in lockstep) can therefore connect a vLLM worker to
another job's sender: that worker then waits for buckets that never come, its engine logs
"No available shared memory broadcast block found in 60 seconds" once a minute, and the GPU idles.

The sitecustomize of a verl job (:mod:`.engine_hooks`' import hook) wraps that method in every process
that imports ``verl.checkpoint_engine.base`` (the TaskRunner calls it) so that it holds a host-wide
``flock`` for the duration of the sync: syncs of the jobs of this host never overlap, so each
receiver finds its own sender. The lock is released when the process dies (a stopped job never
leaves it held). A job waits for it at most :data:`WAIT_S` (then syncs without it, as before),
printing a line every :data:`REPORT_EVERY_S` (so its own progress watchdog sees it is not stuck);
anything unexpected (another verl version, a lock file it cannot open) leaves verl as it is.
``FEDAGENT_WEIGHT_SYNC_LOCK=off`` in the ClientApp's environment turns it off.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import inspect
import os
import time
from collections.abc import Callable
from typing import Any

from fedagent_flwr.trainers.verl.engine_hooks import patch_when_imported

ENV_LOCK = "FEDAGENT_WEIGHT_SYNC_LOCK"
DEFAULT_LOCK = "/tmp/fa-verl-weight-sync.lock"  # the /tmp the sockets share
OFF = ("", "0", "off", "false", "no")
TARGET_MODULE = "verl.checkpoint_engine.base"
WAIT_S = 120.0
REPORT_EVERY_S = 30.0
TAG = "[weight-sync lock]"


class HostLock:
    """An exclusive ``flock`` on ``path``, waited for at most ``wait_s``."""

    def __init__(self, path: str, wait_s: float = WAIT_S, report_every_s: float = REPORT_EVERY_S,
                 log: Callable[[str], None] = lambda text: print(text, flush=True)) -> None:
        self.path, self.wait_s, self.report_every_s, self.log = path, wait_s, report_every_s, log
        self.fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock; False if it could not be opened or was not free within ``wait_s``."""
        try:
            # Read-only: flock needs no write access, so another user's lock file works as well.
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError as exc:
            self.log(f"{TAG} note: cannot open {self.path} ({exc}); syncing weights without it")
            return False
        started = time.monotonic()
        next_report = started + self.report_every_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.fd = fd
                return True
            except BlockingIOError:
                pass
            now = time.monotonic()
            if now - started >= self.wait_s:
                os.close(fd)
                self.log(f"{TAG} another verl job on this host held {self.path} for {self.wait_s:.0f} s; "
                         "syncing weights without it")
                return False
            if now >= next_report:
                next_report += self.report_every_s
                self.log(f"{TAG} waiting {now - started:.0f} s for another verl job's weight sync on this host "
                         f"({self.path})")
            time.sleep(0.1)

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)  # closing the only descriptor releases the flock


def serialize_update_weights(module: Any, lock_path: str, wait_s: float = WAIT_S) -> bool:
    """Make ``module.CheckpointEngineManager.update_weights`` hold the host lock while it runs.

    verl decorates that coroutine with ``auto_await`` (callable from sync code, awaitable from
    async code); the lock goes around the coroutine inside, and the result is decorated again, so
    both kinds of callers see what they saw before. Returns whether the method is (now) wrapped;
    a shape other than verl 0.9.1's is left alone, with a note.
    """
    manager = getattr(module, "CheckpointEngineManager", None)
    if manager is not None and getattr(manager, "_fedagent_weight_sync_lock", None):
        return True
    inner = getattr(getattr(manager, "update_weights", None), "__wrapped__", None)
    auto_await = getattr(module, "auto_await", None)
    if inner is None or auto_await is None or not inspect.iscoroutinefunction(inner):
        print(f"{TAG} note: {TARGET_MODULE} is not shaped as in verl 0.9.1 (CheckpointEngineManager."
              "update_weights wrapped by auto_await); weight syncs are not serialised", flush=True)
        return False

    @functools.wraps(inner)
    async def update_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        lock = HostLock(lock_path, wait_s)
        await asyncio.to_thread(lock.acquire)  # never block a running event loop while waiting
        try:
            return await inner(self, *args, **kwargs)
        finally:
            lock.release()

    # manager is not None here: inner was read from it (getattr(None, ...) gives None and returned above).
    manager.update_weights = auto_await(update_weights)  # type: ignore[union-attr]
    manager._fedagent_weight_sync_lock = lock_path  # type: ignore[union-attr]
    return True


def install_from_environment() -> bool:
    """Arm the patch when ``FEDAGENT_WEIGHT_SYNC_LOCK`` names a lock file (the job's sitecustomize)."""
    path = os.environ.get(ENV_LOCK, "").strip()
    if path.lower() in OFF:
        return False
    patch_when_imported(TARGET_MODULE, lambda module: serialize_update_weights(module, path))
    return True
