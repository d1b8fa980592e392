"""``trainer.batch_invariant`` on CPU: the setting (verl backend only), the job's environment that
carries vLLM's switch (``VLLM_BATCH_INVARIANT=1`` exactly when it is on, an inherited one dropped
when off), verl 0.9.1's own Ray runtime environment forwarding it to every worker, and a persistent
session refusing a job that flips it (vLLM reads the variable only when its engine starts). Whether
vLLM's kernels then make two runs' rollouts agree is the GPU session's to measure."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.clientapp.job import TrainJob
from fedagent_flwr.clientapp.trainer_server import SessionSettingsFixed
from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.schema import SettingError
from fedagent_flwr.trainers.reference.config import GRPOConfig
from fedagent_flwr.trainers.verl import job as verl_job
from fedagent_flwr.trainers.verl.job import BATCH_INVARIANT_ENV, job_environment, prepare_train
from fedagent_flwr.trainers.verl.persistent import VerlSession, apply_environment, session_fingerprint
from fedagent_flwr.trainers.verl.settings import VerlSettings

SPEC = {"envs": [{"name": "TinyGuess", "n_envs": 2, "max_turns": 3, "config": {"lo": 1, "hi": 10}}]}


def _job(model: Path, out: Path, **trainer: Any) -> TrainJob:
    return TrainJob(model_path=str(model), output_dir=str(out), env_spec=SPEC, round=1, client_id=0, num_clients=2,
                    data_seed=7, local_steps=1, partition={"strategy": "none"}, trainer={"rollout_n": 2, **trainer})


def test_the_setting_is_a_verl_bool_off_by_default() -> None:
    assert VerlSettings.from_mapping({})[0].batch_invariant is False
    assert load_settings(overrides="trainer=verl").trainer["batch_invariant"] is False
    on = load_settings(overrides="trainer=verl trainer.batch_invariant=true")
    assert on.trainer["batch_invariant"] is True and on.trainer_settings.batch_invariant is True  # type: ignore[attr-defined]
    with pytest.raises(SettingError, match=r"'trainer\.batch_invariant' must be bool"):
        VerlSettings.from_mapping({"batch_invariant": 1})
    # the reference backend has no vLLM: refused at start as an unknown key (as request_seeds is), and a
    # reference job file carrying it notes it as another backend's key
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer\.batch_invariant'"):
        load_settings(overrides="trainer.batch_invariant=true")
    assert "batch_invariant" in GRPOConfig.from_mapping({"batch_invariant": True})[1]


def test_the_job_environment_carries_vllms_switch_exactly_when_on() -> None:
    base = {"PATH": "/usr/bin:/bin"}
    assert BATCH_INVARIANT_ENV == "VLLM_BATCH_INVARIANT"
    assert BATCH_INVARIANT_ENV not in job_environment(base)
    assert job_environment(base, batch_invariant=True)[BATCH_INVARIANT_ENV] == "1"
    # the caller's own value never decides: dropped when off, replaced when on
    assert BATCH_INVARIANT_ENV not in job_environment({**base, BATCH_INVARIANT_ENV: "1"})
    assert job_environment({**base, BATCH_INVARIANT_ENV: "0"}, batch_invariant=True)[BATCH_INVARIANT_ENV] == "1"


def test_a_prepared_job_runs_verl_with_it_and_verl_forwards_it_to_its_workers(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")  # inherited from the node: must not turn it on by itself
    off = prepare_train(_job(tiny_model_dir, tmp_path / "out"))
    on = prepare_train(_job(tiny_model_dir, tmp_path / "out", batch_invariant=True))
    assert BATCH_INVARIANT_ENV not in off.env and on.env[BATCH_INVARIANT_ENV] == "1"
    assert {k: v for k, v in on.env.items() if k != BATCH_INVARIANT_ENV} == off.env  # nothing else differs
    assert on.overrides == off.overrides  # vLLM's switch is its environment, not a verl key
    # What a session does before ray.init (the subprocess path runs verl's main_ppo in prep.env, which
    # calls the same function): verl forwards the driver's value to every Ray worker, "0" when unset.
    before = dict(os.environ)
    try:
        for prep, value in ((on, "1"), (off, "0")):
            apply_environment(prep.env)
            assert get_ppo_ray_runtime_env()["env_vars"][BATCH_INVARIANT_ENV] == value
    finally:
        apply_environment(before)


def test_a_live_session_refuses_a_job_that_flips_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    def fingerprint(job: TrainJob) -> dict[str, Any]:
        settings, spec, _, rule = verl_job.check_train_job(job)
        return session_fingerprint(job, settings, rule, sum(e.n_envs for e in spec.envs))

    session = VerlSession(work_dir=str(tmp_path / "session"))
    session.fixed = fingerprint(_job(tiny_model_dir, tmp_path / "a"))  # as after a first job; no Ray is started
    flipped = _job(tiny_model_dir, tmp_path / "b", batch_invariant=True)
    with pytest.raises(SessionSettingsFixed, match=r"trainer\.batch_invariant: session False, job True") as refused:
        session.train(flipped)
    assert refused.value.settings == ["trainer.batch_invariant"]  # the ClientApp starts a fresh session for it
    assert not (tmp_path / "b" / "verl").exists()
