"""The persistent trainer (``trainer.mode: persistent``) with the reference backend: one real
``reference_trainer serve`` process driven through its channel, compared with fresh subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from fedagent_flwr.clientapp import backend
from fedagent_flwr.clientapp.backend import TrainerFailed
from fedagent_flwr.clientapp.job import EvalJob, EvalResult, load, save
from fedagent_flwr.clientapp.persistent import (
    EXIT_FILE,
    PROCESS_FILE,
    STARTS_FILE,
    PersistentTrainer,
    TrainerDied,
    _LogFollower,
)
from fedagent_flwr.clientapp.trainer_server import LEFTOVERS_FILE, serve
from fedagent_flwr.procs import ProcessRef, boot_id
from testkit.reference_trainer import SPEC, TRAINER, run_trainer, train_job
from testkit.scripted_backend import scripted_job


def _state(output: Path) -> dict[str, torch.Tensor]:
    result = json.loads((output / "train_result.json").read_text())
    return torch.load(Path(result["actor_dir"]) / "model_world_size_1_rank_0.pt", weights_only=True)


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst == 0.0, f"max abs difference {worst}"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, Path]:
    """The tiny model and a second "global model" with the same architecture, other weights."""
    other = tmp_path_factory.mktemp("models") / "global"
    shutil.copytree(tiny_model_dir, other)
    weights = load_file(str(other / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    moved = {k: (v + 0.02 * torch.randn(v.shape, generator=generator)).contiguous() for k, v in weights.items()}
    save_file(moved, str(other / "model.safetensors"))
    return tiny_model_dir, other


@pytest.fixture()
def trainer(tmp_path: Path) -> PersistentTrainer:
    handle = PersistentTrainer("reference", tmp_path / "channel", idle_timeout_s=600)
    yield handle
    handle.stop(grace_s=10)


def _eval_job(tmp: Path, model: Path, name: str) -> Path:
    job = EvalJob(model_path=str(model), output_dir=str(tmp / name), env_spec=SPEC, round=3, seeds=[11, 12, 13],
                  trainer=dict(TRAINER))
    path = tmp / f"{name}.json"
    save(job, path)
    return path


def test_one_process_serves_rounds_bit_identically_to_fresh_subprocesses(
    tmp_path: Path, models: tuple[Path, Path], trainer: PersistentTrainer
) -> None:
    base, other = models
    # Two "rounds" with different starting models and seeds, then an evaluation of the second.
    jobs = [train_job(tmp_path, base, "r1"), train_job(tmp_path, other, "r2", round=2, data_seed=42 + 200 + 1)]
    for name, job in zip(("sub_r1", "sub_r2"), jobs):
        copy = tmp_path / f"{name}.json"
        raw = json.loads(job.read_text())
        copy.write_text(json.dumps({**raw, "output_dir": str(tmp_path / name)}))
        assert run_trainer("train", copy).returncode == 0
    assert run_trainer("evaluate", _eval_job(tmp_path, other, "sub_eval")).returncode == 0

    pids = set()
    for job in jobs:
        trainer.run("train", job, tmp_path / f"{job.stem}.log", f"client 1 {job.stem}", timeout_s=300)
        pids.add(trainer.alive_pid())
    trainer.run("evaluate", _eval_job(tmp_path, other, "eval"), tmp_path / "eval.log", "client 1 eval", 300)
    pids.add(trainer.alive_pid())

    assert len(pids) == 1 and None not in pids  # one process served all three jobs
    assert trainer.record()["starts"] == 1
    assert len((trainer.channel / STARTS_FILE).read_text().splitlines()) == 1
    _assert_identical(_state(tmp_path / "r1"), _state(tmp_path / "sub_r1"))
    _assert_identical(_state(tmp_path / "r2"), _state(tmp_path / "sub_r2"))
    ours, fresh = (load(EvalResult, tmp_path / "eval" / "eval_result.json"),
                   load(EvalResult, tmp_path / "sub_eval" / "eval_result.json"))
    assert (ours.success_rate, ours.reward_mean, ours.num_episodes) == (
        fresh.success_rate, fresh.reward_mean, fresh.num_episodes)
    # The second job only reloaded weights into the live model; each job's log is its own part.
    assert "1 full loads, 1 reloads" in (tmp_path / "r2.log").read_text()
    assert "step 1/1" in (tmp_path / "r1.log").read_text() and "evaluate:" not in (tmp_path / "r1.log").read_text()


def test_bad_input_is_rejected_and_the_trainer_keeps_serving(
    tmp_path: Path, models: tuple[Path, Path], trainer: PersistentTrainer
) -> None:
    base, _ = models
    bad = train_job(tmp_path, base, "bad", env_spec={"envs": [{"name": "NoSuchEnv", "n_envs": 1, "max_turns": 1}]})
    with pytest.raises(TrainerFailed, match=r"client 1 bad: reference trainer rejected the job: .*NoSuchEnv"):
        trainer.run("train", bad, tmp_path / "bad.log", "client 1 bad", timeout_s=120)
    pid = trainer.alive_pid()
    assert pid is not None
    trainer.run("train", train_job(tmp_path, base, "good"), tmp_path / "good.log", "client 1 good", timeout_s=300)
    assert trainer.alive_pid() == pid and (tmp_path / "good" / "train_result.json").exists()


def test_a_killed_trainer_is_reported_and_the_next_job_restarts_it(
    tmp_path: Path, models: tuple[Path, Path], trainer: PersistentTrainer
) -> None:
    base, _ = models
    trainer.ensure_started()
    first = trainer.alive_pid()
    assert first is not None

    def kill_when_training() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if "== request" in (trainer.channel / "server.log").read_text(errors="replace"):
                os.kill(first, signal.SIGKILL)
                return
            time.sleep(0.05)

    # A helper the session declared (as a verl session declares its Ray cluster), outside the
    # server's process group: it must not outlive the trainer.
    marker = f"fa-test-leftover-{first}"
    helper = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(600)", marker],
                              start_new_session=True)
    (trainer.channel / LEFTOVERS_FILE).write_text(json.dumps({"pid": first, "markers": [marker]}))
    killer = threading.Thread(target=kill_when_training)
    killer.start()
    with pytest.raises(TrainerDied, match=rf"persistent reference trainer \(pid {first}\) died during the train job"):
        trainer.run("train", train_job(tmp_path, base, "killed"), tmp_path / "killed.log", "client 1 killed", 300)
    killer.join()
    assert trainer.alive_pid() is None
    assert helper.wait(timeout=10) == -signal.SIGKILL  # stopped with the dead trainer

    trainer.run("train", train_job(tmp_path, base, "after"), tmp_path / "after.log", "client 1 after", timeout_s=300)
    second = trainer.alive_pid()
    assert second not in (None, first)
    starts = [json.loads(line) for line in (trainer.channel / STARTS_FILE).read_text().splitlines()]
    assert [s["pid"] for s in starts] == [first, second]
    assert starts[1]["reason"].startswith(f"restart: trainer pid {first} is gone (was killed by SIGKILL (exit code -9)")


def test_timeout_stops_the_trainer_and_stop_is_idempotent(
    tmp_path: Path, models: tuple[Path, Path], trainer: PersistentTrainer
) -> None:
    base, _ = models
    with pytest.raises(TrainerFailed, match=r"killed after the 1 s timeout \(persistent trainer pid \d+"):
        trainer.run("train", train_job(tmp_path, base, "slow"), tmp_path / "slow.log", "client 1 slow", timeout_s=1)
    assert trainer.alive_pid() is None
    trainer.ensure_started()
    pid = trainer.alive_pid()
    started = ProcessRef.of(pid)
    # Detached: not this process's child (a simulation actor would SIGKILL its children on exit).
    assert started is not None and psutil.Process(pid).ppid() != os.getpid() and os.getpgid(pid) == pid
    assert trainer.stop(grace_s=30) is True
    assert not started.alive()  # gone (init reaps it: it is nobody's child here)
    assert trainer.stop() is False
    assert not (trainer.channel / "server.json").exists()  # the server cleaned up after itself
    assert json.loads((trainer.channel / PROCESS_FILE).read_text())["pid"] == pid


def test_idle_trainer_exits_by_itself(tmp_path: Path) -> None:
    handle = PersistentTrainer("reference", tmp_path / "channel", idle_timeout_s=1.0)
    pid = handle.ensure_started()
    deadline = time.monotonic() + 60
    while handle.alive_pid() == pid and time.monotonic() < deadline:
        time.sleep(0.2)
    assert handle.alive_pid() is None
    assert "idle for 1 s, exiting" in (handle.channel / "server.log").read_text()
    # The next job's trainer says why its predecessor went, naming the setting to raise.
    handle.idle_timeout_s = 600
    try:
        handle.ensure_started()
        assert handle.record()["reason"] == (
            f"restart: trainer pid {pid} is gone (idle for 1 s, trainer.persistent_idle_s)")
    finally:
        handle.stop(grace_s=10)


def test_a_changed_idle_timeout_reaches_the_running_trainer(tmp_path: Path, scripted: PersistentTrainer) -> None:
    """trainer.persistent_idle_s changed between jobs (a resumed run's new config, say): the next
    job is served by the same trainer, without a cold start, and the new value applies from then on."""
    scripted.run("train", scripted_job(tmp_path, "a", script="ok"), tmp_path / "a.log", "c0 r1", 60)  # idle 600 s
    pid = scripted.alive_pid()
    shorter = PersistentTrainer("scripted", scripted.channel, idle_timeout_s=1.0)
    shorter.run("train", scripted_job(tmp_path, "b", script="ok"), tmp_path / "b.log", "c0 r2", 60)
    assert shorter.record()["pid"] == pid and shorter.record()["starts"] == 1  # reused
    deadline = time.monotonic() + 30  # a hang guard: it exits about 1 s after the job
    while shorter.alive_pid() == pid and time.monotonic() < deadline:
        time.sleep(0.2)
    assert shorter.alive_pid() is None, "the trainer kept its old idle timeout (600 s)"
    log = (scripted.channel / "server.log").read_text()
    assert "idle timeout now 1 s (was 600 s; trainer.persistent_idle_s)" in log and "idle for 1 s, exiting" in log


# -- channel semantics, with a scripted session (testkit/scripted_backend.py) ---------------------


@pytest.fixture()
def scripted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PersistentTrainer:
    monkeypatch.setitem(backend.BACKEND_MODULES, "scripted", "testkit.scripted_backend")
    handle = PersistentTrainer("scripted", tmp_path / "channel", idle_timeout_s=600)
    yield handle
    handle.stop(grace_s=5)


def test_requests_left_when_a_server_ends_are_answered_not_lost(tmp_path: Path) -> None:
    """A failure ends the session: the job queued behind it is answered "not_served" (the
    ClientApp then sends it to a fresh trainer) instead of waiting forever; after a stop, queued
    jobs are answered "stopped"."""
    from testkit.scripted_backend import ScriptedSession

    for first, expected in (("fail", "not_served"), ("stop", "stopped")):
        channel = tmp_path / first
        (channel / "inbox").mkdir(parents=True)
        if first == "stop":
            (channel / "inbox" / "1.json").write_text(json.dumps({"seq": 1, "mode": "stop"}))
        else:
            (channel / "inbox" / "1.json").write_text(json.dumps(
                {"seq": 1, "mode": "train", "job": str(scripted_job(tmp_path, "a", script="fail"))}))
        (channel / "inbox" / "2.json").write_text(json.dumps(
            {"seq": 2, "mode": "train", "job": str(scripted_job(tmp_path, "b", script="ok"))}))
        previous = signal.getsignal(signal.SIGTERM)
        try:
            code = serve(channel, ScriptedSession, "scripted", (ValueError,), (), idle_timeout_s=60)
        finally:
            signal.signal(signal.SIGTERM, previous)
        answers = {p.stem: json.loads(p.read_text()) for p in (channel / "outbox").glob("*.json")}
        assert code == (1 if first == "fail" else 0)
        assert answers["2"]["kind"] == expected and not answers["2"]["ok"]
        if first == "fail":
            assert answers["1"]["kind"] == "failed" and "scripted failure" in answers["1"]["error"]
        assert not list((channel / "inbox").glob("*.json"))
        assert json.loads((channel / "closing.json").read_text())["pid"] == os.getpid()


def test_a_failed_job_ends_the_trainer_and_the_next_job_gets_a_fresh_one(
    tmp_path: Path, scripted: PersistentTrainer
) -> None:
    with pytest.raises(TrainerFailed, match=r"scripted trainer failed: RuntimeError: scripted failure"):
        scripted.run("train", scripted_job(tmp_path, "a", script="fail", close_s=3), tmp_path / "a.log", "c0 r1", 60)
    first = scripted.record()["pid"]
    # Sent while the failed trainer still closes (3 s): it waits for it, then a fresh one serves it.
    scripted.run("train", scripted_job(tmp_path, "b", script="ok"), tmp_path / "b.log", "c0 r2", 60)
    assert scripted.record()["pid"] != first and scripted.record()["starts"] == 2
    assert scripted.record()["reason"] == f"restart: trainer pid {first} is gone (its train job failed)"
    assert (tmp_path / "b" / "train_result.json").exists()


def test_a_trainer_killed_from_outside_says_by_which_signal_as_a_subprocess_does(
    tmp_path: Path, scripted: PersistentTrainer
) -> None:
    """The out-of-memory killer's SIGKILL (here the session sends it to its own server) leaves no
    last words: the error says how the trainer ended, in the subprocess path's words
    (backend.exit_reason), and so does the next start's record."""
    with pytest.raises(TrainerDied) as died:
        scripted.run("train", scripted_job(tmp_path, "a", script="killed"), tmp_path / "a.log", "c0 r1", 60)
    first = scripted.record()["pid"]
    killed = backend.exit_reason(-signal.SIGKILL)
    assert "not by this ClientApp: most likely the out-of-memory killer" in killed
    assert str(died.value).startswith(f"c0 r1: the persistent scripted trainer (pid {first}) died during the "
                                      f"train job: it {killed}: "), died.value
    scripted.run("train", scripted_job(tmp_path, "b", script="ok"), tmp_path / "b.log", "c0 r2", 60)
    assert scripted.record()["reason"] == f"restart: trainer pid {first} is gone ({killed})"


def test_a_new_trainer_never_reads_an_earlier_trainers_exit_record(tmp_path: Path, scripted: PersistentTrainer) -> None:
    """exit.json names a pid only: a record left by an earlier trainer (of this run or of an earlier
    attempt in the same run folder, its supervisor's last write) would describe a new trainer that
    got the same pid and died without its own record (its supervisor killed with it), so a start
    clears it once it has read how the previous trainer ended."""
    scripted.channel.mkdir(parents=True)
    (scripted.channel / EXIT_FILE).write_text(json.dumps({"pid": 4242, "returncode": -9}))
    scripted.run("train", scripted_job(tmp_path, "a", script="ok"), tmp_path / "a.log", "c0 r1", 60)
    pid = scripted.alive_pid()
    assert pid is not None and not (scripted.channel / EXIT_FILE).exists()
    scripted.stop(grace_s=10)  # its own record, written by its supervisor once it is gone
    deadline = time.monotonic() + 10
    while not (scripted.channel / EXIT_FILE).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.loads((scripted.channel / EXIT_FILE).read_text()) == {"pid": pid, "returncode": 0}


def _busy_with_a_long_job(handle: PersistentTrainer, tmp: Path) -> tuple[threading.Thread, list[BaseException]]:
    """Send a 60 s job from a thread and wait until the trainer works on it; the thread's
    exceptions end up in the returned list."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            handle.run("train", scripted_job(tmp, "long", script="sleep:60"), tmp / "long.log", "c0", 120)
        except BaseException as exc:  # noqa: BLE001 - inspected by the caller
            errors.append(exc)

    waiter = threading.Thread(target=run)
    waiter.start()
    deadline = time.monotonic() + 60
    while "scripted train round 1: sleep" not in (handle.channel / "server.log").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return waiter, errors


def test_a_trainer_stopped_on_purpose_mid_job_is_no_crash_to_rerun(
    tmp_path: Path, scripted: PersistentTrainer
) -> None:
    """The run's end (another process's shutdown query) stops a trainer that still works on a job:
    the waiting ClientApp reports a stop, it does not rerun the job in a subprocess."""
    scripted.ensure_started()
    waiter, errors = _busy_with_a_long_job(scripted, tmp_path)
    assert PersistentTrainer("", scripted.channel).stop(grace_s=1) is True
    waiter.join(timeout=60)
    assert len(errors) == 1 and type(errors[0]) is TrainerFailed, errors
    assert "trainer was stopped" in str(errors[0])  # answered by the stopping server, or seen gone
    assert not (tmp_path / "long" / "train_result.json").exists()


_CLIENTAPP = """
import sys
from fedagent_flwr.clientapp import backend
from fedagent_flwr.clientapp.persistent import PersistentTrainer
backend.BACKEND_MODULES["scripted"] = "testkit.scripted_backend"
PersistentTrainer("scripted", sys.argv[1], idle_timeout_s=600).ensure_started()
"""

_NODE = """
import subprocess, sys, time
subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]], check=True)
print("clientapp exited", flush=True)
time.sleep(600)
"""


def test_the_trainer_outlives_its_clientapp_but_not_its_node(tmp_path: Path, scripted: PersistentTrainer) -> None:
    """As in deployment: a short-lived ClientApp process starts the trainer, under a long-lived node
    process (the SuperNode's side; a simulation's raylet). The trainer serves later jobs after
    that ClientApp has exited, and exits by itself once the node process is gone (a run that ended
    without the shutdown message), long before its idle timeout."""
    node = subprocess.Popen([sys.executable, "-c", _NODE, _CLIENTAPP, str(scripted.channel)],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert node.stdout is not None
        lines = [node.stdout.readline().strip() for _ in range(2)]
        assert lines[0].startswith("persistent trainer: started scripted trainer pid") and \
            lines[1] == "clientapp exited", lines
        record = scripted.record()
        assert record["watch"]["pid"] == node.pid and record["watch"]["name"].startswith("python")
        first = scripted.alive_pid()
        assert first == record["pid"]
        scripted.run("train", scripted_job(tmp_path, "a", script="ok"), tmp_path / "a.log", "c0 r1", 60)
        assert scripted.alive_pid() == first and (tmp_path / "a" / "train_result.json").exists()
        node.kill()
        node.wait(timeout=30)
        deadline = time.monotonic() + 30
        while scripted.alive_pid() is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert scripted.alive_pid() is None
        log = (scripted.channel / "server.log").read_text()
        assert f"(pid {node.pid}), the node process that started this trainer, is gone" in log
        assert json.loads((scripted.channel / "closing.json").read_text())["pid"] == first
    finally:
        node.kill()
        node.wait(timeout=30)


def test_a_busy_trainer_left_by_a_dead_node_is_replaced_not_reused(
    tmp_path: Path, scripted: PersistentTrainer
) -> None:
    """A trainer still finishing a job when its node died (a killed run) is stopped when the next
    run's job arrives, not handed that job: it would exit after it, and it holds the old run's
    state. (A trainer that watches nothing cannot be started: the ClientApp's parent is checked.)"""
    node = subprocess.Popen([sys.executable, "-c", _NODE, _CLIENTAPP, str(scripted.channel)],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert node.stdout is not None
        while node.stdout.readline().strip() != "clientapp exited":
            pass
        first = scripted.alive_pid()
        started = ProcessRef.of(first)
        waiter, errors = _busy_with_a_long_job(scripted, tmp_path)
        node.kill()
        node.wait(timeout=30)
        time.sleep(1.5)  # past the watchdog's period: only a busy trainer is still there
        assert scripted.alive_pid() == first
        second = scripted.ensure_started()
        assert second != first and started is not None and not started.alive()
        assert scripted.record()["reason"] == f"restart: trainer pid {first} is gone (terminated)"
        waiter.join(timeout=60)
        assert len(errors) == 1 and type(errors[0]) is TrainerFailed, errors
    finally:
        node.kill()
        node.wait(timeout=30)


def test_no_trainer_is_started_once_the_node_process_is_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ClientApp whose node process died (a dying simulation) must not start a trainer that would
    watch init instead and linger for the idle timeout."""
    from fedagent_flwr.clientapp import persistent

    dead = ProcessRef(os.getppid(), -1.0, boot_id(), "raylet")  # same pid, another process
    monkeypatch.setattr(persistent, "_PARENT_AT_IMPORT", dead)
    handle = PersistentTrainer("reference", tmp_path / "channel")
    with pytest.raises(TrainerFailed, match=r"not starting a persistent trainer: raylet \(pid \d+\), the node "
                                            r"process of this ClientApp, is gone"):
        handle.ensure_started()
    assert handle.alive_pid() is None and not (handle.channel / PROCESS_FILE).exists()


def test_log_follower_keeps_characters_split_between_reads(tmp_path: Path) -> None:
    import io

    log, sink = tmp_path / "server.log", io.StringIO()
    text = "progress █ done\nlast line without newline".encode()
    cut = text.index("█".encode()) + 1  # inside the three bytes of the character
    log.write_bytes(text[:cut])
    follower = _LogFollower(log, 0, sink, "c0")
    follower.pump()
    log.write_bytes(text)
    follower.close()
    assert sink.getvalue() == "progress █ done\nlast line without newline\n"
