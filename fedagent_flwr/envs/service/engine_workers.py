"""Engine worker processes: several game engines per service, none waiting on the others.

FedAgent's ALFWorld service guarded every ``reset``/``step`` of every session with one
process-wide lock (TextWorld's PDDL parser is not thread-safe); that lock made the environment 73 %
of a 4-GPU training step. Here a service runs ``n`` worker processes instead. Each worker is a
single-process executor that owns the game sessions of the pool slots assigned to it
(slot ``i`` -> worker ``i % n``), so its engine is only ever used by one thread, while different
workers run in parallel on different cores.

A session is any class with ``reset(*args) -> dict`` and ``step(*args) -> dict`` (ALFWorld's
:class:`~fedagent_flwr.envs.alfworld.engine.GameSession`, the TextWorld family's session), named
by its ``"module:Class"`` path so that workers import it themselves.

Workers are started with ``spawn`` (the service process already runs threads and an event loop,
which ``fork`` would copy in an undefined state). A worker that dies takes its slots' episodes with
it: the calls fail with a clear error and the worker is restarted for the next reset.
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

# --- worker-process side: module state of one worker ------------------------------------------

_SESSIONS: dict[int, Any] = {}


def _session_class(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _warm_up(session: str) -> str:
    """Import the engine once at start-up so that the first episode does not pay for it; its version."""
    return str(_session_class(session).warm_up())


def _reset(slot: int, session: str, *args: Any) -> dict[str, Any]:
    if slot not in _SESSIONS:
        _SESSIONS[slot] = _session_class(session)()
    return _SESSIONS[slot].reset(*args)


def _step(slot: int, session: str, *args: Any) -> dict[str, Any]:
    if slot not in _SESSIONS:
        raise RuntimeError(f"engine slot {slot} has no episode (reset first)")
    return _SESSIONS[slot].step(*args)


# --- service side ------------------------------------------------------------------------------


class EngineWorkerError(RuntimeError):
    """An engine worker process died or could not be started."""


class EngineWorkers:
    """``num_workers`` engine processes playing ``session`` ("module:Class") sessions; :meth:`call`
    runs a session operation in a slot's worker."""

    def __init__(self, num_workers: int, session: str) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"engine_workers must be an integer >= 1, got {num_workers!r}")
        self.num_workers = num_workers
        self.session = session
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._executors: list[ProcessPoolExecutor | None] = [None] * num_workers

    def _executor(self, worker: int) -> ProcessPoolExecutor:
        with self._lock:
            executor = self._executors[worker]
            if executor is None:
                executor = ProcessPoolExecutor(max_workers=1, mp_context=self._context)
                self._executors[worker] = executor
            return executor

    def start(self) -> list[str]:
        """Start every worker and import the engine in it (blocking); the engine versions seen."""
        futures = [self._executor(w).submit(_warm_up, self.session) for w in range(self.num_workers)]
        try:
            return [f.result() for f in futures]
        except BrokenProcessPool as exc:
            raise EngineWorkerError(f"an engine worker died while starting: {exc}") from None

    def worker_of(self, slot: int) -> int:
        return slot % self.num_workers

    async def call(self, slot: int, operation: str, *args: Any) -> dict[str, Any]:
        """Run ``reset``/``step`` for ``slot`` in its worker without blocking the event loop."""
        fn = {"reset": _reset, "step": _step}[operation]
        worker = self.worker_of(slot)
        executor = self._executor(worker)
        try:
            return await asyncio.wrap_future(executor.submit(fn, slot, self.session, *args))
        except BrokenProcessPool:
            with self._lock:  # the next call starts a fresh worker; this episode is lost
                if self._executors[worker] is executor:
                    self._executors[worker] = None
            executor.shutdown(wait=False, cancel_futures=True)
            raise EngineWorkerError(
                f"engine worker {worker} (slot {slot}) died during {operation}; reset to start a new episode"
            ) from None

    def shutdown(self) -> None:
        """Stop every worker process."""
        with self._lock:
            executors, self._executors = self._executors, [None] * self.num_workers
        for executor in executors:
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
