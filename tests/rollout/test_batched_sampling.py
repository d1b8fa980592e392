"""The batched, KV-cached sampler that plays rollouts and evaluations (``HFPolicy`` driven by
``play_episodes``), on the real tiny model in both rollout modes: well-formed episodes while the
batch shrinks, the same episodes from the same seed, and the same greedy episodes whichever way
they are batched or cached, as Hugging Face's own ``generate`` plays them one by one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from fedagent_flwr.envs.registry import make_env
from fedagent_flwr.rollout.episode import Episode, SamplingParams, run_episode
from fedagent_flwr.rollout.windowed import run_windowed_episode
from fedagent_flwr.trainers.common.checks import InputError
from fedagent_flwr.trainers.common.evaluator import load_model
from fedagent_flwr.trainers.common.sampler import EpisodeTask, HFPolicy, play_episodes
from fedagent_flwr.trainers.reference.config import GRPOConfig

CONFIG = {"lo": 1, "hi": 50}
MODES = ("concat", "windowed")
# Two seeds played twice each (a GRPO group's shared first prompt) and turn budgets of 1 to 3, so
# episodes end at different turns and later batches hold fewer rows.
TASKS = [EpisodeTask("TinyGuess", CONFIG, seed, max_turns, seed)
         for seed, max_turns in ((11, 3), (11, 1), (12, 2), (12, 3), (13, 3))]
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0)
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    return load_model(tiny_model_dir, 2)


def play(tiny: tuple[Any, Any], mode: str, sampling: SamplingParams, seed: int = 5, batch_size: int = 8,
         kv_reuse: bool = True) -> tuple[list[Episode], HFPolicy]:
    model, tokenizer = tiny
    policy = HFPolicy(model, tokenizer, batch_size, kv_reuse)
    episodes = play_episodes(policy, tokenizer, TASKS, sampling, 1024, torch.Generator().manual_seed(seed), mode)
    return episodes, policy


def tokens(episodes: list[Episode]) -> list[Any]:
    """What an episode sampled, in both modes (the windows hold windowed mode's samples)."""
    return [(e.prompt_ids, e.response_ids, e.response_mask, [(w.prompt_ids, w.response_ids) for w in e.windows],
             e.num_turns, e.reward) for e in episodes]


@pytest.mark.parametrize("mode", MODES)
def test_batched_episodes_are_well_formed_as_the_batch_shrinks(tiny: tuple[Any, Any], mode: str) -> None:
    _, tokenizer = tiny
    episodes, policy = play(tiny, mode, SAMPLED)
    assert [e.seed for e in episodes] == [t.seed for t in TASKS]  # results in task order
    # Random weights never win TinyGuess in a few guesses: every episode uses its whole budget.
    assert [e.num_turns for e in episodes] == [t.max_turns for t in TASKS]
    assert policy.kv_reuse  # the model's cache is one the sampler takes apart
    for episode in episodes:
        sampled = [t.num_tokens for t in episode.turns]
        assert all(1 <= n <= SAMPLED.max_new_tokens for n in sampled)
        if mode == "concat":
            system = make_env("TinyGuess", CONFIG)
            first = [{"role": "system", "content": asyncio.run(system.system_prompt())},
                     {"role": "user", "content": asyncio.run(system.reset(episode.seed))[0]}]
            assert episode.prompt_ids == tokenizer.apply_chat_template(
                first, tokenize=True, add_generation_prompt=True, return_dict=False)
            assert len(episode.response_mask) == len(episode.response_ids)
            assert sum(episode.response_mask) == sum(sampled)  # mask 1 = exactly the sampled tokens
            assert not episode.windows
        else:
            assert [len(w.response_ids) for w in episode.windows] == sampled
            for window, message in zip(episode.windows, episode.messages[::2]):
                assert window.prompt_ids == tokenizer.apply_chat_template(
                    [message], tokenize=True, add_generation_prompt=True, return_dict=False)
                assert window.response_mask == [1] * len(window.response_ids)
            assert not episode.prompt_ids


@pytest.mark.parametrize("mode", MODES)
def test_the_same_seed_gives_the_same_episodes(tiny: tuple[Any, Any], mode: str) -> None:
    first, _ = play(tiny, mode, SAMPLED, seed=5)
    assert tokens(play(tiny, mode, SAMPLED, seed=5)[0]) == tokens(first)
    assert tokens(play(tiny, mode, SAMPLED, seed=6)[0]) != tokens(first)  # the seed does decide


@pytest.mark.parametrize("mode", MODES)
def test_batching_and_kept_caches_leave_greedy_episodes_unchanged(tiny: tuple[Any, Any], mode: str) -> None:
    """``trainer.gen_batch_size=1 trainer.prefill=full`` samples one prompt at a time, prefilling
    every turn in full (the sequential path); batching and kept caches must not change what it plays."""
    sequential, one_by_one = play(tiny, mode, GREEDY, batch_size=1, kv_reuse=False)
    for batch_size, kv_reuse in ((8, False), (8, True), (3, True)):
        episodes, policy = play(tiny, mode, GREEDY, batch_size=batch_size, kv_reuse=kv_reuse)
        assert tokens(episodes) == tokens(sequential), (batch_size, kv_reuse)
        if kv_reuse:
            # concat: later turns prefill only the last sampled token and the glue, a group's first
            # prompt once; windowed: each fresh prompt reuses the template's header and the task.
            share = 0.5 if mode == "concat" else 0.75
            assert policy.prefilled_tokens < share * one_by_one.prefilled_tokens


@pytest.mark.parametrize("mode", MODES)
def test_greedy_episodes_match_hugging_faces_generate_one_by_one(tiny: tuple[Any, Any], mode: str) -> None:
    """Left padding, position ids and the kept caches give what plain ``model.generate`` gives
    for each episode alone."""
    model, tokenizer = tiny
    batched, policy = play(tiny, mode, GREEDY)
    stop = list(policy.stop_ids)

    async def generate(prompt: list[int], sampling: SamplingParams) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=sampling.max_new_tokens,
                                 do_sample=False, pad_token_id=policy.pad_id, eos_token_id=stop)
        new = out[0, len(prompt):].tolist()
        return new[:next((k + 1 for k, t in enumerate(new) if t in stop), len(new))]

    plain = []
    for task in TASKS:
        env = make_env(task.env_name, task.config)
        if mode == "windowed":
            plain.append(asyncio.run(run_windowed_episode(env, task.seed, tokenizer, generate, GREEDY, task.max_turns,
                                                          1024, eos_token_ids=stop)))
        else:
            plain.append(asyncio.run(run_episode(env, task.seed, tokenizer, generate, GREEDY, task.max_turns, 1024,
                                                 eos_token_ids=stop)))
    assert tokens(batched) == tokens(plain)


def test_prefill_setting_is_checked_and_defaults_to_incremental() -> None:
    assert GRPOConfig.from_mapping({})[0].prefill == "incremental"
    assert GRPOConfig.from_mapping({"prefill": "full", "gen_batch_size": 1})[0].prefill == "full"
    with pytest.raises(InputError, match="trainer.prefill' = 'yes' is invalid: expected one of"):
        GRPOConfig.from_mapping({"prefill": "yes"})
    with pytest.raises(InputError, match="trainer.prefill' must be str"):
        GRPOConfig.from_mapping({"prefill": False})  # what YAML makes of an unquoted off
    with pytest.raises(ValueError, match="one key per prompt"):
        HFPolicy.sample(object.__new__(HFPolicy), [[1]], GREEDY, None, keys=[0])  # type: ignore[arg-type]


def per_task_generators(tasks: list[EpisodeTask], seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 1000 + index) for index, task in enumerate(tasks)]


@pytest.mark.parametrize("mode", MODES)
def test_an_episode_with_its_own_generator_samples_the_same_tokens_in_any_batch(
        tiny: tuple[Any, Any], mode: str) -> None:
    """With one generator per episode (what evaluation uses), an episode's sampled tokens do not
    depend on the other episodes in its batches: the validation episodes split over two clients
    play exactly as on one, so a model's score does not depend on the federation's size."""
    model, tokenizer = tiny
    generators = per_task_generators(TASKS, 5)
    whole = play_episodes(HFPolicy(model, tokenizer, 8, True), tokenizer, TASKS, SAMPLED, 1024,
                          generators, mode)
    split: list[Episode] = []
    for part in (slice(0, 2), slice(2, None)):  # two "clients", each with its own share
        split += play_episodes(HFPolicy(model, tokenizer, 8, True), tokenizer, TASKS[part], SAMPLED, 1024,
                               per_task_generators(TASKS, 5)[part], mode)
    assert tokens(split) == tokens(whole)
    # One shared generator, by contrast, gives an episode other tokens when its batch changes.
    shared = play_episodes(HFPolicy(model, tokenizer, 8, True), tokenizer, TASKS[2:], SAMPLED, 1024,
                           torch.Generator().manual_seed(5), mode)
    alone = play_episodes(HFPolicy(model, tokenizer, 8, True), tokenizer, TASKS, SAMPLED, 1024,
                          torch.Generator().manual_seed(5), mode)
    assert tokens(shared) != tokens(alone[2:])
    with pytest.raises(ValueError, match="one per task"):
        play_episodes(HFPolicy(model, tokenizer, 8, True), tokenizer, TASKS, SAMPLED, 1024, generators[:2], mode)
