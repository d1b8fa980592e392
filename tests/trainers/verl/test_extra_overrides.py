"""``trainer.extra_overrides`` win over what the verl backend writes, except for the keys it derives
from a setting or a round's plan and relies on outside verl (``DERIVED_VERL_KEYS``): those are refused
before round 0, on the server and in a job's settings, with the setting to change instead."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.schema.fields import SettingError
from fedagent_flwr.schema.trainer import DERIVED_VERL_KEYS
from fedagent_flwr.trainers.verl.overrides import build_overrides, job_paths
from fedagent_flwr.trainers.verl.settings import VerlSettings

# verl's rollout.yaml fills these from data.max_prompt_length / data.max_response_length
# (${oc.select:data.max_*_length,512}); the agent loop reads them, the backend never writes them.
INTERPOLATED = {"actor_rollout_ref.rollout.prompt_length", "actor_rollout_ref.rollout.response_length"}


def _written(**settings: object) -> set[str]:
    paths = job_paths(Path("/tmp/x/verl"), "/m", "/c", "/tmp/fa-ray-x")
    built = build_overrides(algorithm="grpo", settings=VerlSettings.from_mapping(settings)[0], paths=paths,
                            batch_size=2, local_steps=3, seed=1, experiment_name="e")
    return {item.split("=", 1)[0].lstrip("+") for item in built}


def test_every_refused_key_is_one_the_backend_writes_or_verl_fills_from_one() -> None:
    # the agent-loop manager is written in windowed mode (and with request seeds) only, the chat
    # template's arguments when model.chat_template_kwargs is set
    written = _written() | _written(rollout_mode="windowed") | _written(chat_template_kwargs={"enable_thinking": False})
    assert set(DERIVED_VERL_KEYS) - written == INTERPOLATED


@pytest.mark.parametrize(("entry", "advice"), [
    ("data.max_prompt_length=4096", "set trainer.max_prompt_length instead"),
    ("+actor_rollout_ref.rollout.response_length=64", "set trainer.max_response_length instead"),
    ("actor_rollout_ref.rollout.n=8", "set trainer.rollout_n instead"),
    ("actor_rollout_ref.rollout.agent.num_workers=3", "set trainer.agent_workers instead"),
    ("trainer.logger=[console,wandb]", "set trainer.verl_logger instead"),
    ("trainer.total_epochs=2", "set train.epochs instead"),
    ("trainer.save_freq=1", "relies on outside verl too: drop the entry"),
    ("actor_rollout_ref.model.path=/elsewhere", "the round's global model"),
    # a node above a derived key replaces it too
    ("data={max_prompt_length:64}", "sets verl's data."),
    # the chat template's arguments: whole, or one key of them (a node below the derived key)
    ("data.apply_chat_template_kwargs={enable_thinking:false}", "sets verl's data.apply_chat_template_kwargs, "
     "which the verl backend sets from model.chat_template_kwargs"),
    ("+data.apply_chat_template_kwargs.enable_thinking=false", "drop the entry and set model.chat_template_kwargs "
     "instead"),
])
def test_a_derived_key_is_refused_on_the_server_and_in_a_job(entry: str, advice: str) -> None:
    with pytest.raises(SettingError, match=re.escape(advice)):
        VerlSettings.from_mapping({"extra_overrides": [entry]})
    with pytest.raises(ConfigError, match=r"trainer\.extra_overrides.*" + re.escape(entry)):
        load_settings("config", ["trainer=verl", f"trainer.extra_overrides=['{entry}']"])


def test_keys_the_backend_sets_but_does_not_rely_on_stay_the_users() -> None:
    # docs/extending.md selects a custom estimator this way; the learning rate has its setting but
    # nothing outside verl reads it back
    for entry in ("algorithm.adv_estimator=rloo", "actor_rollout_ref.actor.optim.lr=3e-6",
                  "actor_rollout_ref.rollout.temperature=0.7"):
        settings, _ = VerlSettings.from_mapping({"extra_overrides": [entry]})
        assert settings.extra_overrides == [entry]
