"""Every preset under conf/recipe/ composes, passes the run's checks, and (for verl recipes) yields
overrides that verl's own config validation accepts: a recipe must not fail on the GPU node."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.clientapp.backend import CLIENTAPP_TRAINER_KEYS
from fedagent_flwr.config import conf_dir, load_settings
from fedagent_flwr.trainers.common.client_rule import RULE_KEYS
from fedagent_flwr.trainers.verl.overrides import build_overrides, job_paths
from fedagent_flwr.trainers.verl.settings import VerlSettings
from testkit.verl_probe import compose_verl_config
from testkit.webshop_data import DATA_DIR as WEBSHOP_DATA

RECIPES = sorted(p.stem for p in (conf_dir() / "recipe").glob("*.yaml") if p.stem != "none")  # none: no preset
ARMS = ["", "experiment=local", "experiment=centralized", "strategy=fedprox"]


def test_there_are_recipes() -> None:
    assert {"tinyguess_verl", "webshop_verl", "webshop_windowed_verl"} <= set(RECIPES)


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


def test_webshop_windowed_recipe_keeps_fedagents_windowed_layout_for_every_launched_arm(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """The windowed WebShop recipe (the warm-started RL run): FedAgent's windowed loop and lengths
    (one row per turn, 2-step history, prompt 4096 + response 512 per turn, 15 turns), as
    ``tools/gpu/arms.py launch`` composes it for each arm with a local model directory as the base
    model, and verl's own validation accepts the job it becomes, with the windowed manager and rows
    padded to whole 32-row mini-batches."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from fedagent_flwr.trainers.verl.overrides import WINDOWED_MANAGER
    from fedagent_flwr.trainers.verl.windowed import row_divisor
    from testkit.gpu_tools import gpu_tool

    extra = f"env.data_dir={WEBSHOP_DATA} model.path={tiny_model_dir}"
    runs = gpu_tool("arms").plan("webshop_windowed_verl", [1], ["federated", "local", "centralized"], extra, 39400)
    for run in runs:
        settings = load_settings("config", run["overrides"])
        assert settings.raw["rollout"] == {"mode": "windowed", "history_length": 2}, run["name"]
        trainer = settings.trainer
        assert (trainer["rollout_mode"], trainer["history_length"]) == ("windowed", 2)  # what the jobs carry
        assert (trainer["max_prompt_length"], trainer["max_response_length"], trainer["max_new_tokens"]) == \
            (4096, 512, 512), run["name"]
        assert settings.raw["model"]["path"] == str(tiny_model_dir)
        (train,) = settings.train_env_spec["envs"]
        (val,) = settings.val_env_spec["envs"]
        assert train["max_turns"] == val["max_turns"] == 15 and val["config"]["split"] == "val"
        assert settings.raw["env"]["service"]["pool_size"] >= train["n_envs"] * trainer["rollout_n"]
        assert settings.run.eval.num_episodes == 64

        verl_settings, unknown = VerlSettings.from_mapping(
            {k: v for k, v in trainer.items() if k not in CLIENTAPP_TRAINER_KEYS and k not in RULE_KEYS})
        assert not unknown and verl_settings.max_model_len == 4608
        paths = job_paths(tmp_path / run["name"], str(tiny_model_dir), "", "/tmp/fa-ray-test")
        cfg = compose_verl_config(build_overrides(
            algorithm=settings.run.algorithm, settings=verl_settings, paths=paths, batch_size=train["n_envs"],
            local_steps=settings.run.train.local_steps, seed=1, experiment_name="round1_client0"))
        validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        rollout = cfg.actor_rollout_ref.rollout
        assert (rollout.prompt_length, rollout.response_length) == (4096, 512)
        assert rollout.agent.agent_loop_manager_class == WINDOWED_MANAGER
        assert row_divisor(cfg) == 32  # 4 prompts x 8 rollouts a mini-batch; micro-batches of 4 divide it


@pytest.mark.skipif(not (WEBSHOP_DATA / "items_shuffle_1000.json").exists(),
                    reason=f"WebShop data not found at {WEBSHOP_DATA}")
def test_webshop_windowed_recipe_fits_whole_expert_episodes(tmp_path: Path, smollm2_tokenizer: Any) -> None:
    """Under the windowed recipe's own limits the expert's episodes are never cut: every window fits
    the prompt budget with room to spare and every purchase fits the turn cap (the concat recipe cut
    319 of 500 before "buy now"), so a warm start and the RL run see whole episodes."""
    from fedagent_flwr.envs.webshop.expert import EpisodeSettings, expert_env_config, write_expert_file
    from fedagent_flwr.rollout.episode import ChatRenderer

    settings = load_settings("config", f"recipe=webshop_windowed_verl env.data_dir={WEBSHOP_DATA}")
    trainer, (train,) = settings.trainer, settings.train_env_spec["envs"]
    episode = EpisodeSettings("windowed", train["max_turns"], trainer["max_new_tokens"], trainer["max_prompt_length"],
                              trainer["max_response_length"], settings.raw["rollout"]["history_length"])
    out = tmp_path / "expert.jsonl"
    summary = write_expert_file(out, expert_env_config(WEBSHOP_DATA, max_turns=train["max_turns"]),
                                smollm2_tokenizer, range(12), episode)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary.episodes == 12 and summary.truncated == 0 and summary.successes >= 9
    assert max(line["num_turns"] for line in lines) < train["max_turns"]
    renderer = ChatRenderer(smollm2_tokenizer, None)  # as the windowed runner renders a window
    windows = [len(renderer.prompt(line["messages"][:1])[1]) for line in lines]
    assert len(windows) == summary.turns and max(windows) < trainer["max_prompt_length"] - 1000
