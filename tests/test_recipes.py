"""Every preset under conf/recipe/ composes, passes the run's checks, and (for verl recipes) yields
overrides that verl's own config validation accepts: a recipe must not fail on the GPU node."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedagent_flwr.clientapp.backend import CLIENTAPP_TRAINER_KEYS
from fedagent_flwr.config import conf_dir, load_settings
from fedagent_flwr.trainers.common.client_rule import RULE_KEYS
from fedagent_flwr.trainers.verl.overrides import build_overrides, job_paths
from fedagent_flwr.trainers.verl.settings import VerlSettings
from testkit.verl_probe import compose_verl_config
from testkit.webshop_data import DATA_DIR as WEBSHOP_DATA

RECIPES = sorted(p.stem for p in (conf_dir() / "recipe").glob("*.yaml"))
ARMS = ["", "experiment=local", "experiment=centralized", "strategy=fedprox"]


def test_there_are_recipes() -> None:
    assert "tinyguess_verl" in RECIPES and "webshop_verl" in RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arm", ARMS)
def test_recipe_composes_for_every_arm(recipe: str, arm: str) -> None:
    settings = load_settings("config", f"recipe={recipe} {arm}")
    assert settings.run.num_rounds >= 1 and settings.run.eval.num_episodes >= 64  # learning claims need >= 64 episodes
    if arm == "experiment=centralized":
        assert settings.run.clients.total == 1


@pytest.mark.parametrize("recipe",
                         [r for r in RECIPES if load_settings("config", f"recipe={r}").trainer_backend == "verl"])
def test_verl_recipe_overrides_pass_verls_validation(recipe: str, tmp_path: Path) -> None:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    settings = load_settings("config", f"recipe={recipe}")
    verl_settings, unknown = VerlSettings.from_mapping(
        {k: v for k, v in settings.trainer.items() if k not in CLIENTAPP_TRAINER_KEYS and k not in RULE_KEYS})
    assert not unknown
    batch = sum(int(e["n_envs"]) for e in settings.train_env_spec["envs"])
    paths = job_paths(tmp_path / "verl", str(tmp_path / "model"), "", "/tmp/fa-ray-test")
    overrides = build_overrides(algorithm=settings.run.algorithm, settings=verl_settings, paths=paths, batch_size=batch,
                                local_steps=settings.run.train.local_steps, seed=1, experiment_name="round1_client0")
    cfg = compose_verl_config(overrides)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert cfg.data.train_batch_size == batch
    assert cfg.actor_rollout_ref.rollout.n == settings.trainer["rollout_n"]


@pytest.mark.skipif(not (WEBSHOP_DATA / "items_shuffle_1000.json").exists(),
                    reason=f"WebShop data not found at {WEBSHOP_DATA}")
def test_webshop_recipe_splits_the_training_goals_between_two_clients_and_bounds_episodes() -> None:
    """The WebShop recipe (issue 18): two clients on disjoint halves of the 6,410 training goals,
    computed as each client's service computes them; >= 4 rounds; a turn and a whole episode fit
    the token budgets, so episodes stay bounded on the GPU."""
    from fedagent_flwr.clientapp.services import client_partition
    from fedagent_flwr.envs.webshop.env import WebShopEnv

    settings = load_settings("config", f"recipe=webshop_verl env.data_dir={WEBSHOP_DATA}")
    assert settings.run.clients.total == 2 and settings.run.num_rounds >= 4 and settings.run.eval.num_episodes >= 64
    assert settings.partition["strategy"] == "task_disjoint"  # FedAgent's task-level arm for WebShop
    (train,) = settings.train_env_spec["envs"]
    (val,) = settings.val_env_spec["envs"]
    assert train["name"] == val["name"] == "WebShop" and val["config"]["split"] == "val"
    goals = {c: client_partition("WebShop", dict(train["config"]), dict(settings.partition), c, 2,
                                 settings.run.seed)[0]["goal_indices"] for c in (0, 1)}
    pool = WebShopEnv.num_goals(train["config"])
    assert pool == 6410 and not set(goals[0]) & set(goals[1])
    assert sorted(goals[0] + goals[1]) == list(range(pool))  # N = 2 halves the pool exactly
    trainer = settings.trainer
    assert trainer["max_new_tokens"] * train["max_turns"] < trainer["max_response_length"]
    assert settings.raw["env"]["service"]["pool_size"] >= train["n_envs"] * trainer["rollout_n"]
