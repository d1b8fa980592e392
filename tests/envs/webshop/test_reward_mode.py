"""The WebShop env's ``reward`` config key: FedAgent's win mapping by default, the graded score on request.

Episodes run on the real shared data: seed 11's goal (B00O30JLDK, colour 'cardinal', size 'x-large
tall') bought without choosing its options scores 0.6, and with them 1.0.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.envs.base import EnvConfigError
from fedagent_flwr.envs.webshop.env import WebShopEnv
from fedagent_flwr.envs.webshop.reward import REWARD_MODES, WIN_REWARD, service_reward
from testkit.webshop_data import DATA_DIR, needs_data

SEED = 11  # a train goal whose target has options, so skipping them scores strictly between 0 and 1


def _cfg(**extra: Any) -> dict[str, Any]:
    return {"data_dir": str(DATA_DIR), "max_turns": 15, **extra}


def _buy_target(config: dict[str, Any], choose_options: bool) -> list[tuple[float, bool, dict[str, Any]]]:
    """(reward, done, info) of every step of an episode that finds the goal's product and buys it."""

    async def episode() -> list[tuple[float, bool, dict[str, Any]]]:
        env = WebShopEnv(config)
        _, info = await env.reset(SEED)
        goal = env.world.goals[info["goal_index"]]
        title = re.sub(r"[\[\]]", " ", env.world.by_asin[goal["asin"]]["Title"])
        actions = [f"search[{title}]", f"click[{goal['asin'].lower()}]"]
        if choose_options:
            actions += [f"click[{value}]" for value in goal["goal_options"].values()]
        actions.append("click[buy now]")
        steps = []
        for action in actions:
            _, reward, done, step_info = await env.step(f"<think>.</think><action>{action}</action>")
            steps.append((reward, done, step_info))
        return steps

    return asyncio.run(episode())


@needs_data
@pytest.mark.parametrize("extra", [{}, {"reward": "success"}], ids=["default", "explicit"])
def test_success_mode_is_fedagents_mapping(extra: dict[str, Any]) -> None:
    """Default and "success": 0 for a purchase scoring 0.6, 10 for one scoring 1.0, 0 before the purchase."""
    partial = _buy_target(_cfg(**extra), choose_options=False)
    assert [r for r, _, _ in partial[:-1]] == [0.0] * (len(partial) - 1)
    reward, done, info = partial[-1]
    assert done and info["task_score"] == pytest.approx(0.6)
    assert reward == 0.0 and info["success"] is False and info["won"] is False
    reward, done, info = _buy_target(_cfg(**extra), choose_options=True)[-1]
    assert done and info["task_score"] == 1.0 and reward == WIN_REWARD and info["success"] is True


@needs_data
def test_score_mode_pays_the_graded_score_and_keeps_success() -> None:
    """"score": the purchase step pays 10 × its score (6.0 here), earlier steps 0; success stays the win."""
    partial = _buy_target(_cfg(reward="score"), choose_options=False)
    assert [r for r, _, _ in partial[:-1]] == [0.0] * (len(partial) - 1)
    reward, done, info = partial[-1]
    assert done and 0.0 < info["task_score"] < 1.0
    assert reward == WIN_REWARD * info["task_score"] and reward == pytest.approx(6.0)
    assert info["success"] is False and info["won"] is False
    full = _buy_target(_cfg(reward="score"), choose_options=True)
    assert [(r, d, i["success"], i["task_score"]) for r, d, i in full] == [
        (r, d, i["success"], i["task_score"]) for r, d, i in _buy_target(_cfg(), choose_options=True)]
    assert full[-1][0] == WIN_REWARD and full[-1][2]["success"] is True


@needs_data
def test_score_mode_reaches_service_instances() -> None:
    """The HTTP service builds its envs from the same config: its factory's envs carry the mode."""
    setup = WebShopEnv.service_setup(_cfg(reward="score"), {"goal_indices": [0, 1]}, {})
    assert setup.factory(0).reward_mode == "score"


@pytest.mark.parametrize("bad", ["graded", "", 1.0, None])
def test_bad_reward_value_names_the_key(bad: Any) -> None:
    """A value outside ("success", "score") fails before any data is loaded, naming the key and the choices."""
    with pytest.raises(EnvConfigError, match=r"'reward' must be one of \('success', 'score'\)") as caught:
        WebShopEnv._check_fields({"reward": bad})
    assert caught.value.key == "reward"


@needs_data
def test_the_run_config_sets_it_and_the_start_up_check_names_a_bad_value() -> None:
    """``+env.train.envs.0.config.reward=score`` passes the ServerApp's start-up check; a bad value is
    refused there, named by its run-config key."""
    from fedagent_flwr.serverapp.preflight import check_env_specs

    base = f"env=webshop env.data_dir={DATA_DIR}"
    assert check_env_specs(load_settings(overrides=f"{base} +env.train.envs.0.config.reward=score"),
                           data_is_local=True) == []
    bad = load_settings(overrides=f"{base} +env.train.envs.0.config.reward=graded")
    with pytest.raises(ConfigError, match=r"^config key 'env.train.envs.0.config.reward' = 'graded': "):
        check_env_specs(bad, data_is_local=True)


def test_service_reward_modes() -> None:
    """The mapping itself: score mode pays only on a finished step; success is the exact-1.0 win in both."""
    assert REWARD_MODES == ("success", "score")
    assert service_reward(0.75, True) == service_reward(0.75, True, "success")
    assert service_reward(0.75, True).reward == 0.0
    graded = service_reward(0.75, True, "score")
    assert (graded.reward, graded.task_score, graded.success) == (7.5, 0.75, False)
    assert service_reward(0.75, False, "score").reward == 0.0
    assert service_reward(1.0, True, "score") == service_reward(1.0, True, "success")
    assert service_reward(0.0, True, "score").reward == 0.0
    with pytest.raises(ValueError, match="reward mode"):
        service_reward(1.0, True, "binary")
