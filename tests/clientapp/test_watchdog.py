"""The progress watchdog (``trainer.stall_timeout_s``, issue 18): a trainer job that shows no
progress is stopped with the reason, in both trainer modes, instead of running into
``trainer.timeout_s``. Progress means a new output line other than a known stall warning."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from fedagent_flwr.clientapp import app, backend
from fedagent_flwr.clientapp.backend import (
    CLIENTAPP_TRAINER_KEYS,
    ProgressWatch,
    TrainerFailed,
    TrainerOutput,
    is_stall_warning,
    run_trainer,
)
from fedagent_flwr.clientapp.job import TrainJob, TrainResult, save
from fedagent_flwr.clientapp.persistent import PersistentTrainer, TrainerStalled, channel_dir
from fedagent_flwr.config import load_settings
from testkit.sleepy_backend import BAR_STEPS, STALL_WARNING


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_a_new_line_that_is_not_a_stall_warning() -> None:
    clock = _Clock()
    watch = ProgressWatch(10, clock=clock)
    watch.line("step 1 done\n")
    clock.now += 9
    watch.line(STALL_WARNING)
    watch.line("   ")
    assert watch.stalled() == ""
    clock.now += 2  # 11 s after the last progress line
    assert watch.stalled() == (
        "no progress for 10 s (trainer.stall_timeout_s): last line: 'step 1 done'; since then only 1 "
        f"stall warning(s), the last: {' '.join(STALL_WARNING.split())!r}")
    watch.line("(TaskRunner pid=1) step:2 - actor/pg_loss:0.1")
    assert watch.stalled() == "" and watch.warnings_since == 0
    clock.now += 11
    assert watch.stalled().endswith("last line: '(TaskRunner pid=1) step:2 - actor/pg_loss:0.1'")
    silent = ProgressWatch(5, clock=clock)
    clock.now += 6
    assert silent.stalled().endswith("last line: none (no output since the job started)")
    off = ProgressWatch(0, clock=clock)
    clock.now += 1e6
    assert off.stalled() == ""
    assert is_stall_warning("(AsyncvLLMServer pid=7) INFO ... Avg prompt throughput: 0.0 tokens/s, "
                            "Avg generation throughput: 0.0 tokens/s, Running: 8 reqs")
    assert not is_stall_warning("Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 0.0 tokens/s")
    assert is_stall_warning("Warning: The following resource request cannot be scheduled right now: {'GPU': 1.0}")


def test_the_key_is_validated_has_defaults_and_stays_with_the_clientapp() -> None:
    assert load_settings().trainer["stall_timeout_s"] == 900.0
    assert load_settings(overrides="trainer=verl").trainer["stall_timeout_s"] == 600.0
    assert load_settings(overrides="trainer.stall_timeout_s=0").trainer["stall_timeout_s"] == 0.0  # off
    assert "stall_timeout_s" in CLIENTAPP_TRAINER_KEYS  # not a backend hyper-parameter


# -- subprocess mode -------------------------------------------------------------------------------


@pytest.fixture()
def sleepy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(backend.BACKEND_MODULES, "sleepy", "testkit.sleepy_backend")


def test_a_subprocess_that_hangs_silently_is_stopped(tmp_path: Path, sleepy: None) -> None:
    with pytest.raises(TrainerFailed) as info:
        run_trainer("sleepy", "hang", tmp_path / "job.json", tmp_path / "hang.log", "client 3 round 2",
                    timeout_s=120, stall_timeout_s=2)
    # stopped by the watchdog, with its reason: not by the 120 s timeout ("trainer killed after ...")
    assert str(info.value) == (f"client 3 round 2: sleepy trainer stopped: no progress for 2 s "
                               f"(trainer.stall_timeout_s): last line: 'step 1 done' (log: {tmp_path / 'hang.log'})")


def test_a_subprocess_that_prints_only_stall_warnings_is_stopped(tmp_path: Path, sleepy: None) -> None:
    with pytest.raises(TrainerFailed, match=r"sleepy trainer stopped: no progress for 2 s \(trainer.stall_timeout_s\): "
                                            r"last line: 'step 1 done'; since then only \d+ stall warning\(s\), "
                                            r"the last: '.*No available shared memory broadcast block found"):
        run_trainer("sleepy", "warn", tmp_path / "job.json", tmp_path / "warn.log", "client 0 round 5",
                    timeout_s=120, stall_timeout_s=2)
    assert (tmp_path / "warn.log").read_text().count("No available shared memory broadcast block") >= 5


def test_a_slow_job_that_keeps_printing_is_left_alone(tmp_path: Path, sleepy: None) -> None:
    run_trainer("sleepy", "tick", tmp_path / "job.json", tmp_path / "tick.log", "client 0 round 1",
                timeout_s=120, stall_timeout_s=2)  # 4 s in all, a line every 0.5 s
    assert "tick 7" in (tmp_path / "tick.log").read_text()


def test_a_trainer_killed_from_outside_is_reported_as_killed_not_as_an_exit_code(tmp_path: Path, sleepy: None) -> None:
    """The out-of-memory killer's SIGKILL leaves ordinary progress as the last lines: the error
    must say the trainer was killed, and by what, rather than "exited with code -9"."""
    with pytest.raises(TrainerFailed) as info:
        run_trainer("sleepy", "killed", tmp_path / "job.json", tmp_path / "killed.log", "client 2 round 4",
                    timeout_s=120, stall_timeout_s=30)
    assert str(info.value).startswith("client 2 round 4: sleepy trainer was killed by SIGKILL (exit code -9), "
                                      "not by this ClientApp: most likely the out-of-memory killer")
    assert str(info.value).endswith(f"step 1 done (log: {tmp_path / 'killed.log'})")
    with pytest.raises(TrainerFailed, match=r"sleepy trainer exited with code 3: .*something went wrong"):
        run_trainer("sleepy", "fail", tmp_path / "job.json", tmp_path / "fail.log", "client 2 round 4", timeout_s=120)


def _bar_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("Training Progress:")]


def test_a_progress_bar_that_keeps_moving_is_progress(tmp_path: Path, sleepy: None) -> None:
    """tqdm redraws its bar after a carriage return, with no newline until the bar is full: 4.8 s of
    redraws, one every 0.4 s, pass a 2 s watchdog, and each redraw is a line of the job's log."""
    run_trainer("sleepy", "bar", tmp_path / "job.json", tmp_path / "bar.log", "client 0 round 1",
                timeout_s=120, stall_timeout_s=2)
    lines = _bar_lines(tmp_path / "bar.log")
    assert len(lines) == BAR_STEPS + 1 and lines[-1] == f"Training Progress: 100%|{'█' * 10}| {BAR_STEPS}/{BAR_STEPS}"


# -- persistent mode -------------------------------------------------------------------------------


def _scripted_job(out_dir: Path, script: str) -> tuple[TrainJob, Path]:
    job = TrainJob(model_path="unused", output_dir=str(out_dir), env_spec={}, round=5, client_id=0,
                   num_clients=1, data_seed=1, trainer={"script": script})
    out_dir.mkdir(parents=True, exist_ok=True)
    save(job, out_dir / "train_job.json")
    return job, out_dir / "train_job.json"


@pytest.fixture()
def scripted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PersistentTrainer:
    monkeypatch.setitem(backend.BACKEND_MODULES, "scripted", "testkit.scripted_backend")
    handle = PersistentTrainer("scripted", channel_dir(tmp_path / "run", 0), idle_timeout_s=600)
    yield handle
    handle.stop(grace_s=5)


@pytest.mark.parametrize("script", ["hang", "warn"])
def test_a_stalled_persistent_trainer_is_stopped_and_its_successor_says_why(
    tmp_path: Path, scripted: PersistentTrainer, script: str
) -> None:
    _, job_path = _scripted_job(tmp_path / "r5", script)
    # TrainerStalled, with the watchdog's reason: not the 120 s timeout (TrainerFailed, "trainer killed after")
    with pytest.raises(TrainerStalled) as info:
        scripted.run("train", job_path, tmp_path / "r5.log", "client 0 round 5", timeout_s=120, stall_timeout_s=3)
    first = scripted.record()["pid"]
    message = str(info.value)
    assert message.startswith(f"client 0 round 5: the persistent scripted trainer (pid {first}) was stopped: "
                              "no progress for 3 s (trainer.stall_timeout_s): last line: ")
    assert ("; since then only" in message) is (script == "warn")
    assert scripted.alive_pid() is None  # stopped, its session closed
    assert f"scripted train round 5: {script} (persistent)" in (tmp_path / "r5.log").read_text()
    scripted.ensure_started()
    assert scripted.record()["reason"] == (f"restart: trainer pid {first} is gone "
                                           "(no progress for 3 s, trainer.stall_timeout_s)")


def test_a_progress_bar_that_keeps_moving_is_progress_in_a_persistent_trainer(
    tmp_path: Path, scripted: PersistentTrainer
) -> None:
    """The same bar from a persistent trainer, read from its log file: its redraws are progress
    too (the watchdog judges both modes' output alike), and lines of the job's log."""
    out_dir = tmp_path / "r5"
    _, job_path = _scripted_job(out_dir, "bar")
    scripted.run("train", job_path, tmp_path / "r5.log", "client 0 round 5", timeout_s=120, stall_timeout_s=2)
    assert (out_dir / "train_result.json").exists()
    lines = _bar_lines(tmp_path / "r5.log")
    assert len(lines) == BAR_STEPS + 1 and lines[-1] == f"Training Progress: 100%|{'█' * 10}| {BAR_STEPS}/{BAR_STEPS}"


def test_output_lines_end_at_newlines_and_carriage_returns_wherever_the_chunks_are_cut() -> None:
    """:class:`TrainerOutput` on output cut at every byte (a pipe or a log file may hand over any
    prefix): ``\\r\\n`` is one line end, a lone ``\\r`` another, a ``\\r`` on an empty line none,
    a character split between chunks is decoded whole; each line reaches the watchdog."""
    import io

    text = "start\r\n\r 1/2 █\r 2/2 ██\nend".encode()
    for size in (1, 2, 3, 5):
        sink, clock = io.StringIO(), _Clock()
        watch = ProgressWatch(10, clock=clock)
        output = TrainerOutput(sink, "c0", watch)
        progress: list[tuple[str, float, float]] = []  # (the watchdog's last line, its time of progress, now)
        for start in range(0, len(text), size):
            clock.now += 1
            output.feed(text[start:start + size])
            if watch.last_line != (progress[-1][0] if progress else ""):
                progress.append((watch.last_line, watch.last_progress, clock.now))
        output.close()
        assert sink.getvalue() == "start\n 1/2 █\n 2/2 ██\nend\n", size
        # each redraw was progress at the chunk that ended it
        assert [line for line, _, _ in progress] == ["start", " 1/2 █", " 2/2 ██"], size
        assert all(at == now for _, at, now in progress), progress
        assert watch.last_line == "end" and list(output.recent) == ["start", " 1/2 █", " 2/2 ██", "end"]


def test_a_job_stalled_in_the_persistent_trainer_reruns_in_a_subprocess(
    tmp_path: Path, scripted: PersistentTrainer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 18: the client's persistent session stops making progress; the ClientApp stops it and
    the job succeeds in a fresh subprocess, within the job's time."""
    out_dir = tmp_path / "run" / "round_5" / "client_0"
    job, _ = _scripted_job(out_dir, "stall_in_session")
    trainer = {"backend": "scripted", "timeout_s": 120.0, "mode": "persistent", "persistent_idle_s": 600.0,
               "stall_timeout_s": 3.0}
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 1},
                      state=RecordDict(), run_config={})
    result = app._run_job("train", job, out_dir, "client 0 round 5", trainer, TrainResult, context,
                          tmp_path / "run")
    assert result.actor_dir == str(out_dir) and result.num_episodes == 1
    output = capsys.readouterr().out
    assert "no progress for 3 s (trainer.stall_timeout_s)" in output
    assert "; running this job in a fresh subprocess instead" in output
    assert "stall_in_session (persistent)" in (out_dir / "train.log").read_text()
    assert "stall_in_session (subprocess)" in (out_dir / "train.fallback.log").read_text()
    assert scripted.alive_pid() is None
