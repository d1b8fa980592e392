"""ServerApp and ClientApp plumbing that needs no simulation: strategy loading, run directory,
trainer subprocess failures and timeouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.clientapp import backend
from fedagent_flwr.clientapp.backend import TrainerFailed, run_trainer
from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.serverapp.app import build_strategy, load_strategy_class, run_directory
from fedagent_flwr.serverapp.strategy import FedProxFSDP


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("nowhere.module.Strategy", "cannot be imported"),
        ("fedagent_flwr.config.ConfigError", "is not a flwr Strategy subclass"),
        ("flwr.serverapp.strategy.FedAvg", "must subclass fedagent_flwr.serverapp.strategy.FedAvgFSDP"),
    ],
)
def test_strategy_class_errors_name_the_path(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_strategy_class(path)


def test_build_strategy_checks_kwargs_and_mu(tmp_path: Path, tiny_model_dir: Path) -> None:
    base = CheckpointRef.for_directory(tiny_model_dir)
    prox = build_strategy(load_settings(overrides="strategy=fedprox strategy.proximal_mu=0.3"), tmp_path, base)
    assert isinstance(prox, FedProxFSDP) and prox.proximal_mu == 0.3
    with pytest.raises(ConfigError, match="strategy.kwargs.num_clients"):
        build_strategy(load_settings(overrides="+strategy.kwargs.num_clients=3"), tmp_path, base)
    with pytest.raises(ConfigError, match="has no effect with FedAvgFSDP"):
        build_strategy(load_settings(overrides="strategy.proximal_mu=0.1"), tmp_path, base)
    custom = build_strategy(load_settings(overrides="+strategy.kwargs.weighted_by_key=episodes"), tmp_path, base)
    assert custom.weighted_by_key == "episodes"
    slow_nodes = build_strategy(load_settings(overrides="+strategy.kwargs.discovery_timeout=1800"), tmp_path, base)
    assert slow_nodes.nodes.discovery_timeout == 1800.0  # the node registry's, not the strategy's
    with pytest.raises(ConfigError, match=r"'strategy.kwargs.discovery_timeout' = -1.0 is invalid: expected > 0"):
        build_strategy(load_settings(overrides="+strategy.kwargs.discovery_timeout=-1"), tmp_path, base)


def test_run_directory_is_named_by_run_name_or_run_id(tmp_path: Path) -> None:
    settings = load_settings(overrides=f"output_dir={tmp_path} run_name=a")
    run_dir = run_directory(settings, 7)
    assert run_dir == (tmp_path / "a").resolve() and run_dir.is_dir()
    assert run_directory(settings, 8) == run_dir  # a re-run finds it (and resumes, see test_resume)
    assert run_directory(load_settings(overrides=f"output_dir={tmp_path}"), 8) == (tmp_path / "run-8").resolve()
    with pytest.raises(ConfigError, match="plain directory name"):
        run_directory(load_settings(overrides=f"output_dir={tmp_path} run_name=../x"), 7)


def test_trainer_failure_and_timeout_give_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(backend.BACKEND_MODULES, "sleepy", "testkit.sleepy_backend")
    job = tmp_path / "job.json"
    with pytest.raises(TrainerFailed) as info:
        run_trainer("sleepy", "fail", job, tmp_path / "fail.log", "client 3 round 2", timeout_s=60)
    message = str(info.value)
    assert message.startswith("client 3 round 2: sleepy trainer exited with code 3")
    assert "something went wrong in the trainer" in message and str(tmp_path / "fail.log") in message
    with pytest.raises(TrainerFailed, match="killed after the 2 s timeout"):
        run_trainer("sleepy", "30", job, tmp_path / "slow.log", "client 0 round 1", timeout_s=2)
    log = (tmp_path / "slow.log").read_text()
    assert "sleepy backend 30" in log and "finished sleeping" not in log  # killed, not waited for
    with pytest.raises(TrainerFailed, match="unknown trainer backend 'nope'"):
        run_trainer("nope", "train", job, tmp_path / "x.log", "client 0 round 1", timeout_s=5)


def test_an_unusable_model_path_fails_the_run_with_a_summary_naming_model_path(tmp_path: Path) -> None:
    import json

    from fedagent_flwr.serverapp.app import RunSetupError, start_run
    from fedagent_flwr.serverapp.recorder import RunRecorder

    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    settings = load_settings(overrides=f"output_dir={tmp_path} run_name=a model.path={not_a_model}")
    run_dir = run_directory(settings, 7)
    with pytest.raises(RunSetupError, match=r"^config key 'model.path' = .*empty': .* is not a Hugging Face model"):
        start_run(None, settings, run_dir, 7)  # type: ignore[arg-type]  # no client is asked anything
    summary = json.loads((run_dir / "federated_summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("config key 'model.path'")
    assert summary["config_sha256"] is None and summary["last_completed_round"] is None
    # Another failed attempt in the same directory, with another config, replaces that record ...
    other = load_settings(overrides=f"output_dir={tmp_path} run_name=a model.path=/nowhere/model num_rounds=5")
    with pytest.raises(RunSetupError, match="config key 'model.path' = '/nowhere/model'"):
        start_run(None, other, run_dir, 8)  # type: ignore[arg-type]
    assert json.loads((run_dir / "federated_summary.json").read_text())["run_id"] == 8
    # ... but never the record of a run that completed a round: a re-run with its config resumes it.
    recorder = RunRecorder(run_dir, {"run_id": 9, "base_model": "/m"})
    recorder.complete_round(0)
    with pytest.raises(RunSetupError):
        start_run(None, other, run_dir, 10)  # type: ignore[arg-type]
    kept = json.loads((run_dir / "federated_summary.json").read_text())
    assert (kept["run_id"], kept["status"], kept["last_completed_round"]) == (9, "running", 0)


def test_an_environment_it_cannot_build_fails_the_run_before_the_model_is_looked_at(tmp_path: Path) -> None:
    import json

    from fedagent_flwr.serverapp.app import RunSetupError, start_run

    settings = load_settings(overrides=f"output_dir={tmp_path} run_name=b env.val.envs.0.config.lo=20 "
                                       "model.path=/nowhere/model")
    run_dir = run_directory(settings, 3)
    with pytest.raises(RunSetupError, match=r"^config key 'env.val.envs.0.config': TinyGuess config 'hi' \(10\)"):
        start_run(None, settings, run_dir, 3)  # type: ignore[arg-type]
    summary = json.loads((run_dir / "federated_summary.json").read_text())
    assert (summary["status"], summary["error"]) == (
        "failed", "config key 'env.val.envs.0.config': TinyGuess config 'hi' (10) must be >= 'lo' (20)")


def test_the_summary_names_the_estimator_verl_runs() -> None:
    from fedagent_flwr.config import load_settings
    from fedagent_flwr.serverapp.app import adv_estimator

    assert adv_estimator(load_settings("config", "trainer=verl")) == "grpo"
    assert adv_estimator(load_settings("config", "trainer=verl algorithm=ppo")) == "gae"
    custom = load_settings("config", ["trainer=verl", "trainer.extra_overrides=['algorithm.adv_estimator=rloo']"])
    assert adv_estimator(custom) == "rloo"
    # The reference trainer has no such override: it always runs GRPO.
    assert adv_estimator(load_settings("config", "")) == "grpo"
