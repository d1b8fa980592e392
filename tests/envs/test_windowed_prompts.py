"""Windowed mode's prompts on the real environments: every turn is one user message laid out exactly
as FedAgent's windowed templates (``fedagent/envs/legacy_prompts.py``, verl-agent 0.3.1's wording),
on real WebShop pages (shared data) and real ALFWorld observations (the engine behind its service).

The expected texts are written out here from FedAgent's templates, independently of the package's
constants, and compared character for character, and the sample's prompt tokens are the chat
template of exactly that one message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.envs.alfworld.data import load_games
from fedagent_flwr.envs.service.client import ServiceTextEnv
from fedagent_flwr.envs.service.manager import EnvServiceManager
from fedagent_flwr.envs.webshop.env import WebShopEnv
from fedagent_flwr.rollout.episode import Episode, SamplingParams
from fedagent_flwr.rollout.windowed import run_windowed_episode
from testkit.alfworld_service import TRIAL_TASK, seed_of, service_launch, walkthrough
from testkit.webshop_data import DATA_DIR, needs_data

# --- FedAgent's templates, spelled out (U+2011 in "e‑commerce" and the trailing spaces are upstream's)

WS_NO_HIS = (
    "\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce environment. \n"
    "Your task is to: {task}.\n"
    "Your current observation is: {obs}.\n"
    "Your admissible actions of the current situation are: \n[\n{actions}\n].\n\n"
    "Now it's your turn to take one action for the current step.\n"
    "You should first reason step-by-step about the current situation, then think carefully which admissible "
    "action best advances the shopping goal. This reasoning process MUST be enclosed within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and present it "
    "within <action> </action> tags.\n"
)
WS_HIS = (
    "\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce environment.\n"
    "Your task is to: {task}.\n"
    "Prior to this step, you have already taken {steps} step(s). Below are the most recent {shown} observations "
    "and the corresponding actions you took: {history}\n"
    "You are now at step {now} and your current observation is: {obs}.\n"
    "Your admissible actions of the current situation are: \n[\n{actions}\n].\n\n"
    "Now it's your turn to take one action for the current step.\n"
    "You should first reason step-by-step about the current situation, then think carefully which admissible "
    "action best advances the shopping goal. This reasoning process MUST be enclosed within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and present it "
    "within <action> </action> tags.\n"
)
ALF_TAIL = (
    "Your admissible actions of the current situation are: [{actions}].\n\n"
    "Now it's your turn to take an action.\n"
    "You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed "
    "within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and present it "
    "within <action> </action> tags.\n"
)
ALF_NO_HIS = ("\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
              "Your current observation is: {obs}\n" + ALF_TAIL)
ALF_HIS = ("\nYou are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {task}\n"
           "Prior to this step, you have already taken {steps} step(s). Below are the most recent {shown} "
           "observaitons and the corresponding actions you took: {history}\n"
           "You are now at step {now} and your current observation is: {obs}\n" + ALF_TAIL)


def _history(pairs: Sequence[tuple[int, str, str]]) -> str:
    return "\n".join(f"[Observation {n}: '{obs}', Action {n}: '{act}']" for n, obs, act in pairs)


def _scripted(tokenizer: Any, replies: Sequence[str]) -> Any:
    """A ``generate`` that answers turn k with ``replies[k]`` (tokenised, then the EOS)."""
    queue = list(replies)

    async def generate(prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
        ids = tokenizer.encode(queue.pop(0), add_special_tokens=False) + [tokenizer.eos_token_id]
        assert len(ids) <= sampling.max_new_tokens
        return ids

    return generate


def _check_tokens(episode: Episode, tokenizer: Any, expected: Sequence[str]) -> None:
    """Each turn's sample: the chat template of exactly its one user message, then the reply (mask 1)."""
    assert len(episode.windows) == len(expected) == episode.num_turns
    for k, (sample, text) in enumerate(zip(episode.windows, expected)):
        assert episode.messages[2 * k] == {"role": "user", "content": text}
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        assert sample.prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
        assert sample.response_mask == [1] * len(sample.response_ids)
        assert sample.response_ids[-1] == tokenizer.eos_token_id


def _ws_actions(available: dict[str, Any]) -> str:
    lines = (["search[<your query>]"] if available["has_search_bar"] else []) + [
        f"click[{c}]" for c in available["clickables"]]
    return "\n".join(f"'{a}'," for a in lines)


@needs_data
def test_webshop_turns_follow_fedagents_windowed_template(smollm2_tokenizer: Any) -> None:
    env = WebShopEnv({"data_dir": str(DATA_DIR), "max_turns": 15})
    replies = ["<think>look</think><action>search[pencil dress]</action>",
               "<think>first hit</think><action>click[next >]</action>",
               "no tags at all, click[back to search]",  # invalid: FedAgent's fallback keeps the last 20 chars
               "<think>again</think><action>search[mug]</action>"]
    episode = asyncio.run(run_windowed_episode(
        env, 11, smollm2_tokenizer, _scripted(smollm2_tokenizer, replies), SamplingParams(64), 4, 8192,
        history_length=2))
    raw0 = env.world.goals[env.goal_index]["instruction_text"]  # the task, as the reset page shows it
    first_obs = asyncio.run(WebShopEnv({"data_dir": str(DATA_DIR)}).reset(11))[1]["raw_observation"]
    assert first_obs.startswith("WebShop [SEP] Instruction: [SEP] ") and raw0 in first_obs
    observations = [first_obs] + [t.info["raw_observation"] for t in episode.turns]
    pages = [{"has_search_bar": True, "clickables": ["search"]}] + [t.info["available_actions"] for t in episode.turns]
    actions = ["search[pencil dress]", "click[next >]", replies[2][-20:].lower(), "search[mug]"]
    assert [t.info["action"] for t in episode.turns] == actions
    expected = [WS_NO_HIS.format(task=raw0, obs=first_obs, actions=_ws_actions(pages[0]))]
    for now in (2, 3, 4):
        shown = [(n, observations[n - 1], actions[n - 1]) for n in range(max(1, now - 2), now)]
        expected.append(WS_HIS.format(task=raw0, steps=now - 1, shown=len(shown), history=_history(shown),
                                      now=now, obs=observations[now - 1], actions=_ws_actions(pages[now - 1])))
    assert "most recent 1 observations" in expected[1]  # FedAgent prints how many pairs it shows
    assert episode.messages[0]["content"] == expected[0]
    assert [m["content"] for m in episode.messages[::2]] == expected
    _check_tokens(episode, smollm2_tokenizer, expected)
    assert [w.invalid for w in episode.windows] == [False, False, True, False]
    assert (episode.reward, episode.success, episode.truncated) == (0.0, False, False)


@needs_data
def test_webshop_history_length_zero_and_the_13000_character_fallback(smollm2_tokenizer: Any) -> None:
    env = WebShopEnv({"data_dir": str(DATA_DIR), "max_turns": 15})
    episode = asyncio.run(run_windowed_episode(
        env, 3, smollm2_tokenizer, _scripted(smollm2_tokenizer, ["<think>.</think><action>search[a]</action>"] * 2),
        SamplingParams(64), 2, 8192, history_length=0))
    second = episode.messages[2]["content"]
    assert second.startswith("\nYou are an expert autonomous agent operating in the WebShop "
                             "e\u2011commerce environment. \n")
    assert "Prior to this step" not in second  # no history: the no-history template every turn
    # A history that makes the prompt longer than 13,000 characters falls back to no history.
    long_env = WebShopEnv({"data_dir": str(DATA_DIR), "max_turns": 15})
    long_query = "<think>.</think><action>search[" + "dress " * 2500 + "]</action>"
    long_episode = asyncio.run(run_windowed_episode(
        long_env, 3, smollm2_tokenizer, _scripted(smollm2_tokenizer, [long_query, long_query]),
        SamplingParams(4096), 2, 65536, history_length=2))
    assert "Prior to this step" not in long_episode.messages[2]["content"]


# --- ALFWorld on the real engine, through its service --------------------------------------------


@pytest.fixture(scope="module")
def alfworld_service(tmp_path_factory: pytest.TempPathFactory, alfworld_python: Path,
                     alfworld_data: Path) -> Iterator[str]:
    state = tmp_path_factory.mktemp("alfworld-windowed") / "svc.json"
    with EnvServiceManager(service_launch(alfworld_python, alfworld_data, pool=2, engine_workers=1), state,
                           startup_timeout_s=180) as manager:
        yield manager.ensure_running()


def test_alfworld_turns_follow_fedagents_windowed_template(alfworld_service: str, alfworld_data: Path,
                                                           smollm2_tokenizer: Any) -> None:
    seed = seed_of(alfworld_data, TRIAL_TASK)
    env = ServiceTextEnv({"url": alfworld_service, "env": "ALFWorld"})
    game = next(g for g in load_games(alfworld_data, "train") if g.task_dir == TRIAL_TASK)
    commands = walkthrough(str(game.game_file))[:3]
    replies = [f"<think>step</think><action>{c}</action>" for c in commands] + ["I give up"]
    episode = asyncio.run(run_windowed_episode(
        env, seed, smollm2_tokenizer, _scripted(smollm2_tokenizer, replies), SamplingParams(64), 4, 16384,
        history_length=2))
    assert episode.num_turns == 4
    # The reset observation and commands as the service returned them (the first turn's info).
    reset_env = ServiceTextEnv({"url": alfworld_service, "env": "ALFWorld"})

    async def first_info() -> dict[str, Any]:
        try:
            return (await reset_env.reset(seed))[1]
        finally:
            await reset_env.close()

    start = asyncio.run(first_info())
    observations = [start["raw_observation"]] + [t.info["raw_observation"] for t in episode.turns]
    command_lists = [start["admissible_commands"]] + [t.info["admissible_commands"] for t in episode.turns]
    actions = [*commands, "i give up"]  # no tags: the whole (short) lowercased reply
    assert [t.info["action"] for t in episode.turns] == actions
    task = observations[0].split("Your task is to: ", 1)[1].strip()
    assert task and "Your task is to" in observations[0]

    def listed(cmds: Sequence[str]) -> str:
        return "\n ".join(f"'{c}'" for c in cmds)

    expected = [ALF_NO_HIS.format(obs=observations[0], actions=listed(command_lists[0]))]
    for now in (2, 3, 4):
        shown = [(n, observations[n - 1], actions[n - 1]) for n in range(max(1, now - 2), now)]
        expected.append(ALF_HIS.format(task=task, steps=now - 1, shown=len(shown), history=_history(shown), now=now,
                                       obs=observations[now - 1], actions=listed(command_lists[now - 1])))
    assert "Your task is to" not in expected[0].split("Your current observation is:")[0]  # no task line at first
    assert [m["content"] for m in episode.messages[::2]] == expected
    _check_tokens(episode, smollm2_tokenizer, expected)
    assert [w.invalid for w in episode.windows] == [False, False, False, True]
    json.dumps(episode.messages)  # the transcript is plain JSON (it goes into logs)
