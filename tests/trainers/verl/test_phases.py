"""The phase recorder of persistent verl sessions (``trainers/verl/phases.py``), on a CPU machine.

* several processes record into one ``phases.jsonl`` on one clock, handed over through the
  environment as the session hands it to Ray's processes; a process without it records nothing;
* each record is also one ``[phase] name=... t=... dt=...`` log line, a failing block is marked;
* :func:`timed_calls` times calls verl makes (a classmethod under verl's own ``auto_await``, an
  instance's method, a coroutine) and puts every attribute back;
* every verl 0.9.1 call the session times is where the session expects it.
The session's own phases up to verl's GPU check are checked in ``test_persistent.py``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.trainers.verl import phases
from fedagent_flwr.trainers.verl.phases import PhaseRecorder, PhasesFileError, read_phases, timed_calls

REPO = Path(__file__).resolve().parents[3]
LINE = re.compile(r"^\[phase\] name=(\S+) t=(-?\d+\.\d\d) dt=(\d+\.\d\d)( .*)?$")
_CHILD = """
import time
from fedagent_flwr.trainers.verl import phases
recorder = phases.from_environment()
with recorder.phase("child_work", rank=1) as extra:
    time.sleep(0.2)
    extra["items"] = 3
"""


def test_processes_record_into_one_file_on_the_session_clock(tmp_path: Path) -> None:
    lines: list[str] = []
    path = tmp_path / "channel" / phases.FILE_NAME
    t0 = time.time() - 5.0  # the session began 5 s ago
    recorder = PhaseRecorder(path, t0, log=lines.append)
    with recorder.phase("parent_before"):
        time.sleep(0.05)
    child = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, **recorder.environment()})
    assert child.returncode == 0, child.stderr
    in_round = recorder.bound(round=2, client=1)
    in_round.record_seconds("reload_actor", 1.5, ranks=2)

    records = read_phases(path)
    assert [r["phase"] for r in records] == ["parent_before", "child_work", "reload_actor"]
    before, work, reload = records
    assert work["pid"] != before["pid"] == reload["pid"] == os.getpid()
    assert {r["session"] for r in records} == {recorder.session}
    # one clock: the child's phase starts after the parent's ended, all about 5 s after t0
    assert 5.0 <= before["start"] < before["t"] <= work["start"] < work["t"] <= reload["t"] < 5.0 + 120
    assert work["dt"] >= 0.2 and work["rank"] == 1 and work["items"] == 3 and "round" not in work
    assert reload["round"] == 2 and reload["client"] == 1 and reload["ranks"] == 2 and reload["dt"] == 1.5
    # the child's log line went to its stdout (Ray forwards a worker's to the session's log)
    child_line = LINE.match(child.stdout.strip().splitlines()[-1])
    assert child_line and child_line.group(1) == "child_work" and "rank=1" in child_line.group(4)
    assert [LINE.match(line).group(1) for line in lines] == ["parent_before", "reload_actor"]  # type: ignore[union-attr]
    assert "round=2 client=1" in lines[-1]


def test_without_the_session_s_environment_nothing_is_recorded(tmp_path: Path) -> None:
    child = subprocess.run([sys.executable, "-c", _CHILD], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if not k.startswith("FEDAGENT_PHASES")}
                           | {"PYTHONPATH": str(REPO)})
    assert child.returncode == 0, child.stderr
    assert child.stdout == "" and list(tmp_path.iterdir()) == []


def test_a_failing_block_is_recorded_as_failed_and_an_unwritable_file_costs_one_note(tmp_path: Path) -> None:
    lines: list[str] = []
    blocker = tmp_path / "file"
    blocker.write_text("")
    recorder = PhaseRecorder(blocker / "phases.jsonl", time.time(), log=lines.append)  # its parent is a file
    with pytest.raises(ValueError, match="boom"), recorder.phase("ray_start"):
        raise ValueError("boom")
    recorder.record("again", time.time())
    assert lines[0].startswith("[phase] name=ray_start") and "failed=True" in lines[0]
    assert lines[1].startswith("[phase] note: cannot write") and len(lines) == 3  # one note only


def test_process_start_time_is_when_the_process_began() -> None:
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    after = time.time()
    try:
        started = phases.process_started_at(child.pid)
    finally:
        child.kill()
        child.wait()
    # between the calls that bracket its start, give or take the boot time's whole second
    assert started is not None and before - 1.0 <= started <= after + 1.0
    assert phases.process_started_at(2**22 + 12345) is None  # no such process


def test_timed_calls_times_verl_style_calls_and_puts_everything_back() -> None:
    from verl.utils.ray_utils import auto_await  # what verl's Manager.create classmethods are wrapped in

    lines: list[str] = []
    recorder = PhaseRecorder(None, time.time(), log=lines.append)

    class Manager:
        @classmethod
        @auto_await
        async def create(cls, value: int) -> Any:
            await asyncio.sleep(0.01)
            return cls, value

        def generate(self, batch: int) -> int:
            return batch * 2

        async def update(self) -> str:
            return "synced"

    class Windowed(Manager):  # verl's windowed manager inherits create
        pass

    raw_create = vars(Manager)["create"]
    shared = phases.CallLog()
    with timed_calls(Manager, "create", recorder, "agent_loop_workers_create", "first_create", shared) as log:
        assert Windowed.create(7) == (Windowed, 7)  # still a classmethod of the class it is called on
        assert Manager.create(8) == (Manager, 8)
    assert log is shared and shared.calls == 2 and shared.last_started is not None
    assert vars(Manager)["create"] is raw_create and "create" not in vars(Windowed)
    with timed_calls(Manager, "create", recorder, "agent_loop_workers_create", "first_create", shared):
        Manager.create(9)  # the shared log's first call was earlier: no second "first"
    assert [LINE.match(line).group(1) for line in lines] == [  # type: ignore[union-attr]
        "first_create", "agent_loop_workers_create", "agent_loop_workers_create"]
    assert ["call=1" in lines[0], "call=2" in lines[1], "call=1" in lines[2]] == [True, True, True]

    manager = Manager()
    lines.clear()
    with timed_calls(manager, "generate", recorder, "generation"), timed_calls(manager, "update", recorder, "sync"):
        assert manager.generate(3) == 6
        assert asyncio.run(manager.update()) == "synced"  # a coroutine is timed until awaited
    assert "generate" not in vars(manager) and "update" not in vars(manager) and manager.generate(2) == 4
    assert [LINE.match(line).group(1) for line in lines] == ["generation", "sync"]  # type: ignore[union-attr]

    def broken(self: Any) -> None:
        raise RuntimeError("no GPU")

    Manager.broken = broken  # type: ignore[attr-defined]
    lines.clear()
    with timed_calls(Manager, "broken", recorder, "ray_resource_pool"), pytest.raises(RuntimeError):
        manager.broken()  # type: ignore[attr-defined]
    assert "failed=True" in lines[0] and vars(Manager)["broken"] is broken


def test_a_damaged_phases_file_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / phases.FILE_NAME
    path.write_text(json.dumps({"phase": "ray_start", "dt": 1.0}) + "\n" + '{"phase": "cut')
    with pytest.raises(PhasesFileError, match=rf"{re.escape(str(path))}:2: not JSON"):
        read_phases(path)
    path.write_text(json.dumps({"name": "ray_start"}) + "\n")
    with pytest.raises(PhasesFileError, match=":1: not a phase record"):
        read_phases(path)


def test_the_verl_calls_the_session_times_are_where_it_expects_them() -> None:
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.experimental.reward_loop import RewardLoopManager
    from verl.single_controller.ray import RayWorkerGroup, ResourcePoolManager
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.rollout.llm_server import LLMServerManager

    init_workers = inspect.getsource(RayPPOTrainer.init_workers)
    for call in ("self.resource_pool_manager.create_resource_pool()", "self.ray_worker_group_cls(",
                 "RewardLoopManager(", "LLMServerManager.create(", "AgentLoopManager.create(",
                 "self.checkpoint_manager.sleep_replicas()", "self.reward_loop_manager.reward_loop_workers"):
        assert call in init_workers, call
    fit = inspect.getsource(RayPPOTrainer.fit)
    for call in ("self.checkpoint_manager.update_weights(", "self.async_rollout_manager.generate_sequences(",
                 "self._update_actor(batch)", "self._update_critic(batch)", "self._save_checkpoint()"):
        assert call in fit, call
    init_model = inspect.getsource(ActorRolloutRefWorker.init_model)
    assert "self.ref = self.ref_worker_cls(" in init_model and "self.actor = self.actor_worker_cls(" in init_model
    for owner, name in ((LLMServerManager, "create"), (AgentLoopManager, "create")):
        assert isinstance(inspect.getattr_static(owner, name), classmethod), (owner, name)
    assert "self.agent_loop_workers.append(" in inspect.getsource(AgentLoopManager._init_agent_loop_workers)
    assert "self.reward_loop_workers" in inspect.getsource(RewardLoopManager)
    assert callable(ResourcePoolManager.create_resource_pool) and callable(RayWorkerGroup.__init__)
    assert inspect.iscoroutinefunction(CheckpointEngineManager.sleep_replicas.__wrapped__)


def test_our_worker_classes_time_their_first_engine_build_only(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch
    from verl.workers.engine_workers import TrainingWorker

    from fedagent_flwr.trainers.verl import persistent_workers as workers

    # verl builds the actor and reference engines from these classes; init_model and the critic's
    # reset stay bound by verl's worker groups as the methods they override.
    hybrid = workers.ReloadableActorRolloutRefWorker
    assert issubclass(hybrid.actor_worker_cls, TrainingWorker) and issubclass(hybrid.ref_worker_cls, TrainingWorker)
    assert getattr(hybrid.init_model, MAGIC_ATTR)["dispatch_mode"] == Dispatch.ONE_TO_ALL
    assert getattr(workers.ReloadableTrainingWorker.reset, MAGIC_ATTR)["dispatch_mode"] == Dispatch.ONE_TO_ALL

    path = tmp_path / phases.FILE_NAME
    monkeypatch.setenv(phases.ENV_FILE, str(path))
    monkeypatch.setenv(phases.ENV_T0, repr(time.time()))
    phases.from_environment.cache_clear()  # as in a fresh worker process
    try:
        worker = SimpleNamespace(rank=3)
        builds: list[int] = []
        for _ in range(3):  # init_model's build, then two rounds' reloads
            workers._timed_first_reset(worker, "actor_init", lambda: builds.append(1))
    finally:
        phases.from_environment.cache_clear()
    assert len(builds) == 3
    assert [(r["phase"], r["rank"]) for r in read_phases(path)] == [("actor_init", 3)]
