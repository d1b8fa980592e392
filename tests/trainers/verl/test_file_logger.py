"""verl's per-step metrics through verl's own ``file`` logger, and the loggers a user adds.

verl 0.9.1 is installed in the test environment: its real ``Tracking`` writes the step file the
reader parses, its real config schema takes the ``trainer.logger`` list the overrides build, and
the logger names the settings accept are checked against the ones its ``Tracking`` supports.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedagent_flwr.clientapp.job import TrainJob
from fedagent_flwr.progress import PROGRESS_FILE, read_progress
from fedagent_flwr.schema import SettingError
from fedagent_flwr.trainers.verl import entry
from fedagent_flwr.trainers.verl.job import STEPS_FILE, VerlJobFailed, job_environment, prepare_train, progress_reporter
from fedagent_flwr.trainers.verl.overrides import build_overrides, job_paths
from fedagent_flwr.trainers.verl.runner import run_verl
from fedagent_flwr.trainers.verl.settings import VERL_LOGGERS, VerlSettings
from fedagent_flwr.trainers.verl.verl_log import FILE_LOGGER_ENV, StepFile, StepWatch, parse_record

SPEC = {"envs": [{"name": "TinyGuess", "n_envs": 2, "max_turns": 3, "config": {"lo": 1, "hi": 10}}]}
# verl's main_ppo as the subprocess path runs it, stood in (it needs a GPU): steps logged through verl's
# own file logger, then, unless told to fail after step 1, the checkpoint and the episode a real job leaves.
_MAIN_PPO = """
import json, sys
from pathlib import Path
from verl.utils.tracking import Tracking
checkpoints, episodes, how = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
tracking = Tracking(project_name="p", experiment_name="e", default_backend=["file"])
tracking.log({"critic/score/mean": 0.25, "timing_s/step": 3.5, "actor/entropy": float("nan"), "note": "x"}, step=1)
if how == "fail":
    sys.exit("RuntimeError: verl stopped after step 1")
tracking.log({"critic/score/mean": 0.5, "timing_s/step": 2.0}, step=2)
tracking.logger["file"].finish()
actor = checkpoints / "global_step_2" / "actor"
actor.mkdir(parents=True)
(actor / "model_world_size_1_rank_0.pt").write_bytes(b"")
episodes.write_text(json.dumps({"reward": 1.0, "score": 1.0, "success": True, "num_turns": 2, "truncated": False,
                                "invalid": 0}) + "\\n")
"""


def test_verls_own_file_logger_writes_what_the_reader_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.utils.tracking import Tracking

    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(FILE_LOGGER_ENV, str(path))
    tracking = Tracking(project_name="p", experiment_name="e", default_backend=["console", "file"])
    tracking.log({"actor/pg_loss": np.float64(0.0625), "timing_s/step": 3.5, "training/global_step": 1,
                  "actor/entropy": float("nan"), "note": "text", "hist": [1, 2]}, step=1)
    tracking.log({"actor/pg_loss": np.float32(-0.5), "timing_s/step": 2.25}, step=2)
    tracking.logger["file"].finish()
    reader = StepFile(path)
    reader.poll()
    assert reader.steps == {1: {"actor/pg_loss": 0.0625, "timing_s/step": 3.5, "training/global_step": 1.0},
                            2: {"actor/pg_loss": -0.5, "timing_s/step": 2.25}}


def test_the_reader_waits_for_a_whole_line_and_follows_a_file_started_anew(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    reader = StepFile(path)
    assert reader.poll() == []  # verl has not created it yet
    line, second = json.dumps({"step": 1, "data": {"a": 1.5}}) + "\n", json.dumps({"step": 2, "data": {"a": 2.5}})
    path.write_text(line + second[:10])  # step 2 cut mid-write
    assert reader.poll() == [(1, {"a": 1.5})]
    with open(path, "a") as handle:
        handle.write(second[10:] + "\nnot json\n")
    assert reader.poll() == [(2, {"a": 2.5})]
    path.write_text(json.dumps({"step": 1, "data": {"a": 9.0}}) + "\n")  # the next fit() of a session
    assert reader.poll() == [(1, {"a": 9.0})]


def test_the_runner_follows_the_step_file_while_the_job_runs(tmp_path: Path) -> None:
    """run_verl with a process that writes verl's step-file format (the GPU job itself cannot run here).
    The process writes step 2 only once the runner has reported step 1, so the time to the first step
    is step 1's, taken while the job ran."""
    step_file = tmp_path / "verl_steps.jsonl"
    step_file.write_text(json.dumps({"step": 9, "data": {"stale": 1}}) + "\n")  # an earlier attempt's
    go = tmp_path / "step-1-seen"
    # time.monotonic() is CLOCK_MONOTONIC, one clock for every process of the machine
    script = textwrap.dedent("""
        import json, os, sys, time
        print("started at", time.monotonic(), flush=True)
        with open(os.environ["VERL_FILE_LOGGER_PATH"], "wb", buffering=0) as f:
            time.sleep(0.6)
            print("step 1 written at", time.monotonic(), flush=True)
            f.write(json.dumps({"step": 1, "data": {"timing_s/step": 0.5}}).encode() + b"\\n")
            while not os.path.exists(sys.argv[1]):
                time.sleep(0.05)
            print("step 2 written at", time.monotonic(), flush=True)
            f.write(json.dumps({"step": 2, "data": {"timing_s/step": 1.0}}).encode() + b"\\n")
        print("step 2 done", flush=True)
    """)
    seen: list[int] = []

    def on_step(step: int, metrics: dict[str, float]) -> None:
        seen.append(step)
        go.touch()

    env = job_environment({"PATH": "/usr/bin:/bin"}, step_file=str(step_file))
    launched = time.monotonic()
    code, first_step, tail, steps = run_verl([sys.executable, "-c", script, str(go)], env, tmp_path,
                                             tmp_path / "verl.log", str(tmp_path / "ray-temp"), step_file, on_step)
    assert code == 0 and tail[-1] == "step 2 done"
    assert steps == {1: {"timing_s/step": 0.5}, 2: {"timing_s/step": 1.0}} and seen == [1, 2]
    clock = {line.rsplit(" at ", 1)[0]: float(line.rsplit(" at ", 1)[1]) for line in tail if " at " in line}
    # Counted from the launch (no later than the process's start) to when step 1 was seen (no earlier
    # than it was written, and before step 2 existed: step 2 waited for step 1's report).
    assert first_step is not None
    assert clock["step 1 written"] - clock["started"] <= first_step < clock["step 2 written"] - launched


def test_a_step_watch_reports_each_step_once_and_a_failing_report_never_stops_it(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    seen: list[int] = []

    def report(step: int, metrics: dict[str, float]) -> None:
        seen.append(step)
        raise OSError("disk full")

    with StepWatch(path, report, interval_s=0.05) as watch:
        path.write_text("".join(json.dumps({"step": s, "data": {}}) + "\n" for s in (1, 2)))
    assert seen == [1, 2] and watch.first_step is not None and sorted(watch.steps) == [1, 2]


def test_the_loggers_are_console_file_and_the_users_and_compose_with_verls_schema(tmp_path: Path) -> None:
    from verl.utils.tracking import Tracking

    from testkit.verl_probe import compose_verl_config

    assert set(VERL_LOGGERS) == set(Tracking.supported_backend)
    settings, _ = VerlSettings.from_mapping({"verl_logger": ["tensorboard", "console"]})
    paths = job_paths(tmp_path / "verl", "/m", "", "/tmp/fa-ray-x")
    overrides = build_overrides(algorithm="grpo", settings=settings, paths=paths, batch_size=1, local_steps=1,
                                seed=1, experiment_name="e")
    assert "trainer.logger=[console,file,tensorboard]" in overrides
    assert list(compose_verl_config(overrides).trainer.logger) == ["console", "file", "tensorboard"]
    assert VerlSettings.from_mapping({})[0].loggers == ["console", "file"]
    with pytest.raises(SettingError, match=r"trainer\.verl_logger entry 'tensorbord' is not one of verl's"):
        VerlSettings.from_mapping({"verl_logger": ["tensorbord"]})
    with pytest.raises(SettingError, match=r"'trainer\.verl_logger' must be a list of str"):
        VerlSettings.from_mapping({"verl_logger": "wandb"})


def test_each_verl_step_becomes_a_progress_record_with_that_steps_success(tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    job = TrainJob(model_path=str(tiny_model_dir), output_dir=str(tmp_path / "out"), env_spec=SPEC, round=3,
                   client_id=1, num_clients=2, data_seed=7, local_steps=2, partition={"strategy": "none"},
                   trainer={"rollout_n": 2})
    prep = prepare_train(job)
    assert prep.env[FILE_LOGGER_ENV] == str(prep.step_file) and prep.step_file.parent == prep.work
    assert "trainer.logger=[console,file]" in prep.overrides
    per_step = 2 * 2  # 2 env instances x rollout.n 2
    successes = [True, True, False, False] + [True, False, False, False]
    prep.episode_log.write_text("".join(json.dumps({"success": s}) + "\n" for s in successes))
    report = progress_reporter(job, prep, started=0.0)
    report(1, {})
    report(2, {})
    records = read_progress(tmp_path / "out" / PROGRESS_FILE)
    assert [(r.step, r.steps, r.success_rate) for r in records] == [(1, 2, 0.5), (2, 2, 1 / per_step)]
    assert records[1].line("client 1 round 3").startswith("client 1 round 3: step 2/2, success 0.25, ")


@pytest.mark.parametrize("how", ["ok", "fail"])
def test_a_subprocess_job_keeps_each_step_once_under_its_output(how: str, tiny_model_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``entry.train`` (the subprocess mode) with verl's ``main_ppo`` stood in by a process that
    logs through verl's own file logger: the round's output holds each step once, in
    ``verl/steps.jsonl`` (which collect.sh packs) as ``keep_steps`` writes it (finite numbers only,
    in step order), not also in a second file beside it; also when verl fails after its first step."""
    out = tmp_path / "out"
    job = TrainJob(model_path=str(tiny_model_dir), output_dir=str(out), env_spec=SPEC, round=1, client_id=0,
                   num_clients=1, data_seed=7, local_steps=2, partition={"strategy": "none"}, trainer={"rollout_n": 2})
    real_run_verl = entry.run_verl

    def stand_in(command: list[str], *rest: Any) -> Any:
        assert command[1:3] == ["-m", "verl.trainer.main_ppo"]
        return real_run_verl([sys.executable, "-c", _MAIN_PPO, str(out / "checkpoints"),
                              str(out / "verl" / "episodes.jsonl"), how], *rest)

    monkeypatch.setattr(entry, "run_verl", stand_in)
    step_1 = {"step": 1, "data": {"critic/score/mean": 0.25, "timing_s/step": 3.5}}
    if how == "ok":
        assert entry.train(job).metrics["verl/steps"] == 2.0
        kept = [step_1, {"step": 2, "data": {"critic/score/mean": 0.5, "timing_s/step": 2.0}}]
    else:
        with pytest.raises(VerlJobFailed, match="verl stopped after step 1"):
            entry.train(job)
        kept = [step_1]
    holding_steps = [path.relative_to(out).as_posix() for path in sorted(out.rglob("*.jsonl"))
                     if any(parse_record(line) for line in path.read_text().splitlines())]
    assert holding_steps == [f"verl/{STEPS_FILE}"]
    assert [json.loads(line) for line in (out / "verl" / STEPS_FILE).read_text().splitlines()] == kept
