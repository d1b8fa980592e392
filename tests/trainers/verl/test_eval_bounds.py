"""The verl backend's validation (the Hugging Face evaluator) plays its episodes under the token bounds
its agent loop trains under: a windowed prompt over ``trainer.max_prompt_length`` ends the episode, a
concat response stops at ``trainer.max_response_length``, and a first prompt over the prompt budget
plays no turn, where the evaluator used to allow the two budgets' sum for all of it.

Both sides run for real on CPU: verl 0.9.1's agent loop (:class:`EnvAgentLoop` over a Hugging Face
``server_manager``) and the evaluator, with the tiny random model on the SmolLM2 tokenizer. The tiny
model never answers TinyGuess validly, so every window and every observation is the same whatever it
samples, and the two sides' prompts can be compared token for token."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from fedagent_flwr.clientapp.job import EvalJob
from fedagent_flwr.envs.registry import make_env
from fedagent_flwr.envs.spec import load_env_spec
from fedagent_flwr.rollout.episode import Episode, SamplingParams
from fedagent_flwr.rollout.windowed import run_windowed_episode
from fedagent_flwr.trainers.common.checks import InputError
from fedagent_flwr.trainers.verl import job as verl_job
from fedagent_flwr.trainers.verl.dataset import EnvEpisodeDataset
from testkit.verl_agent_loop import HFServer, loop_config

SPEC = {"envs": [{"name": "TinyGuess", "n_envs": 1, "max_turns": 5, "config": {}}]}
SEEDS = [1, 2]
MAX_NEW_TOKENS = 8


def _loop(model_dir: Path, tokenizer: Any, prompt_length: int, response_length: int) -> Any:
    """verl's agent loop at these budgets (as ``data.max_prompt_length`` / ``max_response_length``)."""
    from transformers import AutoModelForCausalLM
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from fedagent_flwr.trainers.verl.agent_loop import EnvAgentLoop

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cfg = loop_config(prompt_length=prompt_length, response_length=response_length)
    return EnvAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=HFServer(model), tokenizer=tokenizer,
                        processor=None, dataset_cls=EnvEpisodeDataset, data_config=DictConfigWrap(cfg.data),
                        max_new_tokens=MAX_NEW_TOKENS, history_length=2)


def _tokenizer(model_dir: Path) -> Any:
    """The tokenizer saved with the model (the SmolLM2 one), loaded from the model directory as the
    evaluator and verl load it (it splits some text otherwise than the ``smollm2_tokenizer`` fixture)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _rows() -> list[dict[str, Any]]:
    """The validation episodes as verl dataset rows: the evaluator's env config and seeds."""
    entry = load_env_spec(SPEC).envs[0]
    return [{"env_name": entry.name, "env_config": entry.env_config(), "seed": s, "max_turns": entry.max_turns}
            for s in SEEDS]


def _evaluate(tmp_path: Path, model_dir: Path, name: str, **trainer: Any) -> None:
    """The verl backend's evaluation of the tiny model on :data:`SPEC` (its episodes: ``played_batches``)."""
    job = EvalJob(model_path=str(model_dir), output_dir=str(tmp_path / name), env_spec=SPEC, round=0, seeds=SEEDS,
                  trainer={"max_new_tokens": MAX_NEW_TOKENS, "history_length": 2, **trainer})
    verl_job.evaluate(job)


def test_windowed_validation_ends_an_episode_whose_window_outgrows_the_prompt_budget(
        tmp_path: Path, tiny_model_dir: Path, played_batches: list[list[Episode]]) -> None:
    tokenizer = _tokenizer(tiny_model_dir)
    # TinyGuess's windows at history 2 have 137, 188, then 209 tokens every turn: a prompt budget of 200
    # lets 2 turns play; the budgets' sum (264, less 8 new tokens) would let all 5 play.
    prompt_length, response_length = 200, 64
    _evaluate(tmp_path, tiny_model_dir, "w", rollout_mode="windowed", max_prompt_length=prompt_length,
              max_response_length=response_length)
    [episodes] = played_batches
    loop = _loop(tiny_model_dir, tokenizer, prompt_length, response_length)
    trained = [asyncio.run(loop.run_windowed({"temperature": 0.0}, validate=True, **row)) for row in _rows()]
    assert [len(turns) for turns in trained] == [2, 2]

    async def any_reply(prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
        return tokenizer.encode("no idea", add_special_tokens=False)

    for episode, turns, row in zip(episodes, trained, _rows(), strict=True):
        assert episode.truncated and episode.num_turns == len(episode.windows) == len(turns)
        assert [w.prompt_ids for w in episode.windows] == [t.prompt_ids for t in turns]  # the same windows
        assert max(len(w.prompt_ids) for w in episode.windows) <= prompt_length
        # ... and cut where the windowed runner cuts at max_prompt_len
        cut = asyncio.run(run_windowed_episode(
            make_env(row["env_name"], row["env_config"]), row["seed"], tokenizer, any_reply,
            SamplingParams(MAX_NEW_TOKENS), row["max_turns"], prompt_length + response_length, history_length=2,
            max_prompt_len=prompt_length))
        assert cut.truncated and [w.prompt_ids for w in cut.windows] == [w.prompt_ids for w in episode.windows]


def test_concat_validation_stops_at_the_response_budget(
        tmp_path: Path, tiny_model_dir: Path, played_batches: list[list[Episode]]) -> None:
    tokenizer = _tokenizer(tiny_model_dir)
    # A TinyGuess turn adds 8 sampled tokens and 24 of glue before the next: a response budget of 64 holds
    # 2 turns (8 + 24 + 8; a third needs 72); the budgets' sum (a 120-token prompt, 320 in all) holds all 5.
    prompt_length, response_length = 256, 64
    _evaluate(tmp_path, tiny_model_dir, "c", rollout_mode="concat", max_prompt_length=prompt_length,
              max_response_length=response_length)
    [episodes] = played_batches
    loop = _loop(tiny_model_dir, tokenizer, prompt_length, response_length)
    trained = [asyncio.run(loop.run({"temperature": 0.0}, **row)) for row in _rows()]
    assert [t.num_turns for t in trained] == [2, 2]
    for episode, output in zip(episodes, trained, strict=True):
        assert episode.truncated and episode.num_turns == output.num_turns
        assert episode.prompt_ids == output.prompt_ids
        assert len(episode.response_ids) == len(output.response_ids) <= response_length
        assert episode.response_mask == output.response_mask  # the same turns and observations


def test_concat_validation_plays_no_turn_of_a_first_prompt_over_the_prompt_budget(
        tmp_path: Path, tiny_model_dir: Path, played_batches: list[list[Episode]]) -> None:
    # A first prompt (120 tokens) over the prompt budget (100; with a fitting sum, 320): verl refuses the
    # episode; validation plays none of its turns, and with no episode playing a turn, refuses the rollout.
    from fedagent_flwr.trainers.verl.agent_loop import PromptTooLongError

    tokenizer = _tokenizer(tiny_model_dir)
    with pytest.raises(PromptTooLongError, match="max_prompt_length is 100"):
        asyncio.run(_loop(tiny_model_dir, tokenizer, 100, 220).run({"temperature": 0.0}, **_rows()[0]))
    refusal = (r"the first prompt \(the shortest has \d+ tokens\) exceeds trainer.max_prompt_length \(100\); "
               r"raise trainer.max_prompt_length$")
    with pytest.raises(InputError, match=refusal):
        _evaluate(tmp_path, tiny_model_dir, "p", rollout_mode="concat", max_prompt_length=100,
                  max_response_length=220)
    [episodes] = played_batches
    assert all(e.truncated and e.num_turns == 0 and len(e.prompt_ids) == 120 for e in episodes)


def test_verl_settings_derive_the_agent_loops_bounds() -> None:
    """The evaluator's bounds for verl come from the one derivation the agent loop uses; the reference
    backend's are its one budget."""
    from fedagent_flwr.rollout.bounds import TokenBounds
    from fedagent_flwr.trainers.common.evaluator import EvalSettings, episode_bounds
    from fedagent_flwr.trainers.verl.settings import VerlSettings

    settings, _ = VerlSettings.from_mapping({"max_prompt_length": 200, "max_response_length": 64})
    assert settings.token_bounds == TokenBounds.prompt_response(200, 64) == TokenBounds(264, 200, 64)
    assert settings.max_model_len == 264
    assert episode_bounds(EvalSettings(max_model_len=264), settings.token_bounds) == settings.token_bounds
    assert episode_bounds(EvalSettings(max_model_len=300)) == TokenBounds(300)  # the reference trainer's
    with pytest.raises(ValueError, match="disagree with max_model_len 300"):
        episode_bounds(EvalSettings(max_model_len=300), settings.token_bounds)
    for bad in ({"max_model_len": 0}, {"max_model_len": 8, "max_prompt_len": 0}, {"max_model_len": True}):
        with pytest.raises(ValueError, match="must be a positive integer"):
            TokenBounds(**bad)
