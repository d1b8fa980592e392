"""Every preset under conf/recipe/ composes, passes the run's checks, and (for verl recipes) yields
overrides that verl's own config validation accepts: a recipe must not fail on the GPU node."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedagent_flwr.clientapp.backend import CLIENTAPP_TRAINER_KEYS
from fedagent_flwr.clientapp.client_rule import RULE_KEYS
from fedagent_flwr.clientapp.verl_backend.overrides import build_overrides, job_paths
from fedagent_flwr.clientapp.verl_backend.settings import VerlSettings
from fedagent_flwr.config import conf_dir, load_settings
from tests.verl_probe import compose_verl_config

RECIPES = sorted(p.stem for p in (conf_dir() / "recipe").glob("*.yaml"))
ARMS = ["", "experiment=local", "experiment=centralized", "strategy=fedprox"]


def test_there_are_recipes() -> None:
    assert "tinyguess_verl" in RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arm", ARMS)
def test_recipe_composes_for_every_arm(recipe: str, arm: str) -> None:
    settings = load_settings("config", f"recipe={recipe} {arm}")
    assert settings.num_rounds >= 1 and settings.eval_num_episodes >= 64  # learning claims need >= 64 episodes
    if arm == "experiment=centralized":
        assert settings.total_clients == 1


@pytest.mark.parametrize("recipe", [r for r in RECIPES if load_settings("config", f"recipe={r}").trainer_backend == "verl"])
def test_verl_recipe_overrides_pass_verls_validation(recipe: str, tmp_path: Path) -> None:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    settings = load_settings("config", f"recipe={recipe}")
    verl_settings, unknown = VerlSettings.from_mapping(
        {k: v for k, v in settings.trainer.items() if k not in CLIENTAPP_TRAINER_KEYS and k not in RULE_KEYS})
    assert not unknown
    batch = sum(int(e["n_envs"]) for e in settings.train_env_spec["envs"])
    paths = job_paths(tmp_path / "verl", str(tmp_path / "model"), "", "/tmp/fa-ray-test")
    overrides = build_overrides(algorithm=settings.algorithm, settings=verl_settings, paths=paths, batch_size=batch,
                                local_steps=settings.local_steps, seed=1, experiment_name="round1_client0")
    cfg = compose_verl_config(overrides)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert cfg.data.train_batch_size == batch
    assert cfg.actor_rollout_ref.rollout.n == settings.trainer["rollout_n"]
