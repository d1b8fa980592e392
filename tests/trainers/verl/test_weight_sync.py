"""The host-wide weight-sync lock of verl jobs (issue 18's stall, :mod:`.verl_backend.weight_sync`):
armed by the job's environment in a fresh process on verl's real ``CheckpointEngineManager``, two
jobs' syncs never overlap, sync and async callers get what they got before, and a lock held too
long is given up on."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

from fedagent_flwr.trainers.verl import weight_sync
from fedagent_flwr.trainers.verl.job import job_environment
from fedagent_flwr.trainers.verl.weight_sync import HostLock, serialize_update_weights

_PROBE = ("import verl.checkpoint_engine.base as m, inspect; c = m.CheckpointEngineManager; "
          "print(getattr(c, '_fedagent_weight_sync_lock', None), "
          "inspect.iscoroutinefunction(c.update_weights.__wrapped__))")


def test_a_verl_job_process_gets_verls_manager_wrapped_unless_turned_off() -> None:
    env = job_environment(dict(os.environ))
    assert env[weight_sync.ENV_LOCK] == weight_sync.DEFAULT_LOCK
    probe = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().splitlines()[-1] == f"{weight_sync.DEFAULT_LOCK} True"
    off = job_environment({**os.environ, weight_sync.ENV_LOCK: "off"})
    probe = subprocess.run([sys.executable, "-c", _PROBE], env=off, capture_output=True, text=True, timeout=600)
    assert probe.stdout.strip().splitlines()[-1] == "None True"  # verl's own method, untouched


def _fake_verl_module(events: list[tuple[str, str]]) -> SimpleNamespace:
    """A module shaped like ``verl.checkpoint_engine.base``, with verl's real ``auto_await``."""
    from verl.utils.ray_utils import auto_await

    class CheckpointEngineManager:
        def __init__(self, name: str) -> None:
            self.name = name

        @auto_await
        async def update_weights(self, global_steps: int | None = None) -> dict[str, int | None]:
            events.append(("start", self.name))
            await asyncio.sleep(0.3)
            events.append(("end", self.name))
            return {"step": global_steps}

    return SimpleNamespace(CheckpointEngineManager=CheckpointEngineManager, auto_await=auto_await)


def test_two_jobs_syncs_never_overlap_and_callers_see_no_difference(tmp_path: Path) -> None:
    events: list[tuple[str, str]] = []
    module = _fake_verl_module(events)
    assert serialize_update_weights(module, str(tmp_path / "sync.lock"), wait_s=30) is True
    assert serialize_update_weights(module, str(tmp_path / "sync.lock")) is True  # once only
    results: dict[str, object] = {}

    def job(name: str) -> None:  # as verl's fit() calls it: synchronously, no event loop
        results[name] = module.CheckpointEngineManager(name).update_weights(3)

    threads = [threading.Thread(target=job, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {"a": {"step": 3}, "b": {"step": 3}}
    assert [kind for kind, _ in events] == ["start", "end", "start", "end"]  # one after the other
    assert events[0][1] == events[1][1]

    async def awaited() -> object:  # as verl's async trainers call it
        return await module.CheckpointEngineManager("c").update_weights(global_steps=5)

    assert asyncio.run(awaited()) == {"step": 5}


def test_a_lock_held_too_long_is_reported_then_given_up_on(tmp_path: Path) -> None:
    path = str(tmp_path / "sync.lock")
    holder = HostLock(path)
    assert holder.acquire()
    lines: list[str] = []
    acquired: list[bool] = []
    waiter = threading.Thread(target=lambda: acquired.append(
        HostLock(path, wait_s=1.0, report_every_s=0.3, log=lines.append).acquire()), daemon=True)
    waiter.start()
    waiter.join(timeout=120)  # a hang guard: a lock that never gives up fails here, not at the suite's timeout
    assert acquired == [False], "the waiter did not give up on the held lock"
    # it waited (saying so) before it gave up, and says what it does instead
    assert any("waiting" in line and "another verl job's weight sync" in line for line in lines)
    assert lines[-1] == (f"[weight-sync lock] another verl job on this host held {path} for 1 s; syncing weights "
                         "without it")
    holder.release()
    other = HostLock(path, wait_s=1.0)
    assert other.acquire() is True
    other.release()


def test_another_verl_shape_is_left_alone() -> None:
    class CheckpointEngineManager:
        def update_weights(self) -> None:  # not verl 0.9.1's auto_await-wrapped coroutine
            return None

    module = SimpleNamespace(CheckpointEngineManager=CheckpointEngineManager, auto_await=lambda f: f)
    original = CheckpointEngineManager.update_weights
    assert serialize_update_weights(module, "/nonexistent/x.lock") is False
    assert CheckpointEngineManager.update_weights is original
