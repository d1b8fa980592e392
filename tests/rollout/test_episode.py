"""The multi-turn episode runner with the real SmolLM2 tokenizer (and the tiny model)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.envs.tiny_guess import TinyGuess
from fedagent_flwr.rollout import ChatTemplateError, Episode, SamplingParams, run_episode
from fedagent_flwr.rollout.windowed import run_windowed_episode
from fedagent_flwr.trainers.common.sampler import HFPolicy
from testkit.scripted_policy import scripted_policy

SAMPLING = SamplingParams(max_new_tokens=32, temperature=1.0, top_p=1.0)


class ClosingGuess(TinyGuess):
    """TinyGuess that remembers whether the runner closed it."""

    closed = False

    async def close(self) -> None:
        self.closed = True


def mask_runs(episode: Episode) -> list[tuple[int, list[int]]]:
    """The response split into runs of equal mask value."""
    runs: list[tuple[int, list[int]]] = []
    for token, mask in zip(episode.response_ids, episode.response_mask):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(token)
        else:
            runs.append((mask, [token]))
    return runs


def test_concatenation_equals_the_rendered_conversation(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    generate, sent = scripted_policy(tok, ["<answer>25</answer>", "Then <answer>12</answer>", "<answer>7</answer>"])
    env = ClosingGuess({"lo": 1, "hi": 50, "max_turns": 6})
    episode = asyncio.run(run_episode(env, 6, tok, generate, SAMPLING, max_turns=6, max_model_len=2048))

    assert (episode.num_turns, episode.success, episode.reward, episode.truncated) == (3, True, 1.0, False)
    assert env.closed
    roles = [m["role"] for m in episode.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert [t.observation for t in episode.turns] == ["lower", "lower", "Correct!"]

    rendered = tok.apply_chat_template(episode.messages, tokenize=False)
    full = tok.encode(rendered, add_special_tokens=False)
    got = episode.prompt_ids + episode.response_ids
    # The sequence is the whole conversation up to the final EOS; the template's trailing
    # newline after it is the only thing the model never produced.
    assert full[: len(got)] == got
    assert tok.decode(full[len(got):]) == "\n"
    assert episode.prompt_ids == tok.apply_chat_template(
        episode.messages[:2], tokenize=True, add_generation_prompt=True, return_dict=False
    )

    # mask 1 = exactly what the policy produced, turn by turn; mask 0 = template glue + observation.
    runs = mask_runs(episode)
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1]
    assert [ids for m, ids in runs if m == 1] == sent
    glue = [tok.decode(ids) for m, ids in runs if m == 0]
    assert glue == ["\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"] * 2
    assert len(episode.response_mask) == len(episode.response_ids)


def test_a_turn_ended_by_another_stop_id_keeps_the_templates_whole_closing(smollm2_tokenizer: Any) -> None:
    # Two stop ids, as Qwen2.5 has (<|im_end|> and <|endoftext|>): a turn the policy ends with
    # <|endoftext|> is not closed by the template's <|im_end|>, so the glue keeps that closing,
    # while a turn ended with <|im_end|> itself gets only what follows it.
    tok = smollm2_tokenizer
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    assert endoftext != tok.eos_token_id
    replies = iter([([*tok.encode("<answer>25</answer>", add_special_tokens=False), endoftext]),
                    ([*tok.encode("<answer>12</answer>", add_special_tokens=False), tok.eos_token_id]),
                    ([*tok.encode("<answer>7</answer>", add_special_tokens=False), tok.eos_token_id])])

    async def generate(prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
        return next(replies)

    episode = asyncio.run(run_episode(TinyGuess({"lo": 1, "hi": 50, "max_turns": 6}), 6, tok, generate, SAMPLING,
                                      max_turns=6, max_model_len=2048,
                                      eos_token_ids=[endoftext, tok.eos_token_id]))
    assert [t.ended_with_eos for t in episode.turns] == [True, True, True]
    glue = [tok.decode(ids) for m, ids in mask_runs(episode) if m == 0]
    assert glue == ["<|im_end|>\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n",
                    "\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"]


def test_turns_cut_at_max_new_tokens_are_closed_by_the_template(smollm2_tokenizer: Any, tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tok = smollm2_tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    policy = HFPolicy(model, tok, batch_size=4)
    generator = torch.Generator().manual_seed(0)
    sampled: list[list[int]] = []

    async def generate(prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
        ids = policy.sample([prompt_ids], sampling, generator)[0]
        sampled.append(ids)
        return ids

    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9)
    episode = asyncio.run(run_episode(TinyGuess({"max_turns": 3}), 3, tok, generate, sampling, 3, 1024,
                                      eos_token_ids=policy.stop_ids))
    runs = mask_runs(episode)
    generated = [ids for m, ids in runs if m == 1]
    # Random weights never say EOS here, so every turn is cut at max_new_tokens.
    assert [len(ids) for ids in sampled] == [8] * episode.num_turns
    assert not any(t.ended_with_eos for t in episode.turns)
    assert sum(generated, []) == sum(sampled, [])
    for (_, ids), turn in zip([r for r in runs if r[0] == 0], episode.turns):
        assert tok.decode(ids) == (
            f"<|im_end|>\n<|im_start|>user\n{turn.observation}<|im_end|>\n<|im_start|>assistant\n"
        )
    assert sum(m == 0 for m, _ in runs) == episode.num_turns - 1


def test_no_silent_truncation(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    env = TinyGuess({"max_turns": 5})
    prompt_len = len(asyncio.run(_prompt_ids(tok)))
    budget = prompt_len + SAMPLING.max_new_tokens + 3  # room for one turn, not for the next prompt
    generate, _ = scripted_policy(tok, ["<answer>1</answer>"] * 5)
    episode = asyncio.run(run_episode(env, 40, tok, generate, SAMPLING, 5, budget))
    assert episode.truncated and episode.num_turns == 1 and not episode.success
    assert len(episode.prompt_ids) + len(episode.response_ids) <= budget
    assert set(episode.response_mask) == {1}  # the observation that did not fit was not added

    generate, _ = scripted_policy(tok, [])
    short = asyncio.run(run_episode(TinyGuess({}), 1, tok, generate, SAMPLING, 5, prompt_len + 4))
    assert short.truncated and short.num_turns == 0 and short.response_ids == []


def test_both_runners_refuse_a_generate_that_returns_more_than_max_new_tokens(smollm2_tokenizer: Any) -> None:
    async def overrun(prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
        return smollm2_tokenizer.encode("<answer>1</answer>", add_special_tokens=False) * sampling.max_new_tokens

    for runner in (run_episode, run_windowed_episode):
        env = ClosingGuess({})
        with pytest.raises(ValueError, match=r"generate returned \d+ tokens for max_new_tokens=32"):
            asyncio.run(runner(env, 1, smollm2_tokenizer, overrun, SAMPLING, 5, 4096))
        assert env.closed  # the runner closed it on the error too


async def _prompt_ids(tok: Any) -> list[int]:
    env = TinyGuess({"max_turns": 5})
    messages = [{"role": "system", "content": await env.system_prompt()},
                {"role": "user", "content": (await env.reset(0))[0]}]
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def test_template_that_rewrites_history_is_refused(smollm2_tokenizer: Any) -> None:
    tok = copy.deepcopy(smollm2_tokenizer)
    # Shows only the latest message: each render replaces the previous one instead of extending it.
    tok.chat_template = (
        "{{ messages[-1]['role'] }}: {{ messages[-1]['content'] }}{% if add_generation_prompt %} >{% endif %}"
    )
    generate, _ = scripted_policy(tok, ["<answer>3</answer>"] * 3)
    env = ClosingGuess({"max_turns": 3})
    with pytest.raises(ChatTemplateError, match="does not only extend") as error:
        asyncio.run(run_episode(env, 0, tok, generate, SAMPLING, 3, 1024))
    assert str(tok.name_or_path) in str(error.value)
    assert env.closed  # closed on error too


def test_done_on_last_allowed_turn_adds_no_observation(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    generate, sent = scripted_policy(tok, ["<answer>1</answer>", "<answer>2</answer>"])
    episode = asyncio.run(run_episode(TinyGuess({"max_turns": 6}), 30, tok, generate, SAMPLING, 2, 1024))
    assert episode.num_turns == 2 and not episode.truncated and not episode.success
    assert episode.response_ids[-len(sent[-1]):] == sent[-1] and episode.response_mask[-1] == 1
    assert episode.messages[-1]["role"] == "assistant"


class ScoredGuess(TinyGuess):
    """TinyGuess that also scores its episodes, as WebShop does (``info["task_score"]``)."""

    async def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        observation, reward, done, info = await super().step(action_text)
        return observation, reward, done, {**info, "task_score": 1.0 if info.get("success") else 0.25}


def test_episode_metrics_carry_the_env_score_only_when_every_episode_has_one(smollm2_tokenizer: Any) -> None:
    from fedagent_flwr.trainers.common.evaluator import episode_metrics

    tok = smollm2_tokenizer
    generate, _ = scripted_policy(tok, ["<answer>3</answer>", "<answer>1</answer>"] * 4)
    # secret of seed 30 in 1..10 is whatever TinyGuess draws; the score follows success either way
    scored = [asyncio.run(run_episode(ScoredGuess({"max_turns": 1}), seed, tok, generate, SAMPLING, 1, 1024))
              for seed in (30, 31)]
    expected = sum(1.0 if e.success else 0.25 for e in scored) / 2
    assert episode_metrics(scored)["score_mean"] == pytest.approx(expected)
    plain = asyncio.run(run_episode(TinyGuess({"max_turns": 1}), 30, tok, generate, SAMPLING, 1, 1024))
    assert "score_mean" not in episode_metrics([plain])
    assert "score_mean" not in episode_metrics([*scored, plain])  # a mean over some episodes would mislead


def test_prompt_and_response_bounds_of_both_runners(smollm2_tokenizer: Any) -> None:
    """verl's budgets (:mod:`fedagent_flwr.rollout.bounds`): concat plays no turn of a first prompt over
    ``max_prompt_len`` (and plays one that fits it exactly); windowed samples at most ``max_response_len``
    tokens a turn, and fits its window with that many."""
    tok = smollm2_tokenizer
    prompt_len = len(asyncio.run(_prompt_ids(tok)))
    generate, sent = scripted_policy(tok, ["<answer>1</answer>"] * 2)
    env = ClosingGuess({"max_turns": 5})
    over = asyncio.run(run_episode(env, 1, tok, generate, SAMPLING, 5, 4096, max_prompt_len=prompt_len - 1))
    assert over.truncated and over.num_turns == 0 and sent == [] and env.closed
    assert len(over.prompt_ids) == prompt_len and over.response_ids == []
    fits = asyncio.run(run_episode(TinyGuess({"max_turns": 5}), 1, tok, generate, SAMPLING, 1, 4096,
                                   max_prompt_len=prompt_len))
    assert fits.num_turns == 1 and not fits.truncated

    asked: list[int] = []

    async def reply(prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
        asked.append(sampling.max_new_tokens)
        return tok.encode("no idea", add_special_tokens=False)[:sampling.max_new_tokens]

    first = asyncio.run(run_windowed_episode(TinyGuess({}), 1, tok, reply, SAMPLING, 1, 4096))
    window = len(first.windows[0].prompt_ids)
    # room for the window and 4 new tokens, not for SAMPLING's 32: only the response cap lets the turn play
    capped = asyncio.run(run_windowed_episode(TinyGuess({}), 1, tok, reply, SAMPLING, 1, window + 4,
                                              max_response_len=4))
    assert capped.num_turns == 1 and asked == [32, 4] and len(capped.windows[0].response_ids) <= 4
    uncapped = asyncio.run(run_windowed_episode(TinyGuess({}), 1, tok, reply, SAMPLING, 1, window + 4))
    assert uncapped.truncated and uncapped.num_turns == 0
