"""``tokenize_conversation``: a recorded conversation laid out exactly as ``run_episode`` lays out
the episode that produced it (real SmolLM2 tokenizer, TinyGuess, a scripted policy)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fedagent_flwr.envs.tiny_guess import TinyGuess
from fedagent_flwr.rollout import (
    ConversationError,
    SamplingParams,
    run_episode,
    run_windowed_episode,
    tokenize_conversation,
)
from testkit.scripted_policy import scripted_policy

SAMPLING = SamplingParams(max_new_tokens=32, temperature=1.0, top_p=1.0)


def play(tok: Any, replies: list[str], seed: int, max_turns: int = 6, max_model_len: int = 2048) -> Any:
    generate, _ = scripted_policy(tok, replies)
    env = TinyGuess({"lo": 1, "hi": 50, "max_turns": 6})
    return asyncio.run(run_episode(env, seed, tok, generate, SAMPLING, max_turns=max_turns,
                                   max_model_len=max_model_len))


@pytest.mark.parametrize(("replies", "seed", "max_turns", "max_model_len", "ends"), [
    (["<answer>25</answer>", "Then <answer>12</answer>", "<answer>7</answer>"], 6, 6, 2048, "solved"),
    (["no idea", "<think>hmm</think> 40", " <answer>3</answer>\n"], 20, 3, 2048, "max_turns"),
    (["<answer>25</answer>"] * 6, 6, 6, 200, "truncated"),
])
def test_a_played_episode_round_trips(smollm2_tokenizer: Any, replies: list[str], seed: int, max_turns: int,
                                      max_model_len: int, ends: str) -> None:
    tok = smollm2_tokenizer
    episode = play(tok, replies, seed, max_turns, max_model_len)
    assert all(turn.ended_with_eos for turn in episode.turns)
    assert {"solved": episode.success, "max_turns": episode.num_turns == max_turns and not episode.success,
            "truncated": episode.truncated}[ends]
    assert episode.num_turns > 1 and 0 in episode.response_mask  # multi-turn, with glue

    got = tokenize_conversation(tok, episode.messages)
    assert got == (episode.prompt_ids, episode.response_ids, episode.response_mask)


def test_each_window_round_trips_as_a_one_turn_conversation(smollm2_tokenizer: Any) -> None:
    """Windowed mode: the transcript is (window prompt, reply) pairs, each its own sample."""
    tok = smollm2_tokenizer
    generate, _ = scripted_policy(tok, ["<answer>25</answer>", "<answer>12</answer>", "<answer>7</answer>"])
    episode = asyncio.run(run_windowed_episode(TinyGuess({"max_turns": 6}), 6, tok, generate, SAMPLING,
                                               max_turns=6, max_model_len=2048))
    assert episode.success and len(episode.windows) == 3 == len(episode.messages) // 2
    for index, window in enumerate(episode.windows):
        pair = episode.messages[2 * index: 2 * index + 2]
        assert tokenize_conversation(tok, pair) == (window.prompt_ids, window.response_ids, window.response_mask)


def test_every_reply_ends_with_the_turn_closing_eos(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "guess"},
                {"role": "assistant", "content": "<answer>1</answer>"}, {"role": "user", "content": "higher"},
                {"role": "assistant", "content": "<answer>2</answer>"}]
    prompt, response, mask = tokenize_conversation(tok, messages)
    trained = [t for t, m in zip(response, mask) if m]
    assert trained.count(tok.eos_token_id) == 2 and trained[-1] == tok.eos_token_id
    assert tok.decode(trained, skip_special_tokens=True) == "<answer>1</answer><answer>2</answer>"
    assert tok.decode(prompt + response) == tok.apply_chat_template(messages, tokenize=False).rstrip("\n")
    # a trailing user message (never produced by run_episode) only adds glue
    longer = tokenize_conversation(tok, [*messages, {"role": "user", "content": "lower"}])
    assert longer[2][: len(mask)] == mask and set(longer[2][len(mask):]) == {0}


def test_a_reply_cut_without_eos_does_not_round_trip(smollm2_tokenizer: Any) -> None:
    """The documented exception: the runner trains no stop id for a reply cut at max_new_tokens, the
    recorded conversation cannot tell, and the warm start teaches the stop id."""
    tok = smollm2_tokenizer
    cut = tok.encode("<answer>25</answer> because", add_special_tokens=False)

    async def generate(prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
        return cut

    episode = asyncio.run(run_episode(TinyGuess({"max_turns": 6}), 6, tok, generate, SAMPLING, max_turns=1,
                                      max_model_len=2048))
    assert not episode.turns[0].ended_with_eos
    prompt, response, mask = tokenize_conversation(tok, episode.messages)
    assert prompt == episode.prompt_ids
    assert response == episode.response_ids + [tok.eos_token_id] and mask == [1] * len(response)


@pytest.mark.parametrize(("roles", "error"), [
    (["system", "user"], "no assistant message"),
    (["system", "assistant"], "must follow a user message"),
    (["system", "user", "assistant", "user", "user", "assistant"], "message 4 has role 'user'"),
    (["system", "user", "assistant", "assistant"], "message 3 has role 'assistant'"),
])
def test_layouts_the_rollout_never_produces_are_refused(smollm2_tokenizer: Any, roles: list[str],
                                                        error: str) -> None:
    with pytest.raises(ConversationError, match=error):
        tokenize_conversation(smollm2_tokenizer, [{"role": r, "content": f"{r} text"} for r in roles])
