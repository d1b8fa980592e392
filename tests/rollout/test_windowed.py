"""Windowed mode in the trainers: the setting, the per-turn samples and their GRPO groups, the
reference trainer and the evaluator playing windowed episodes with a real tiny model."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fedagent_flwr.clientapp.job import EvalJob, EvalResult, TrainResult, load, save
from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.envs.tiny_guess import TinyGuess
from fedagent_flwr.rollout.episode import SamplingParams
from fedagent_flwr.rollout.windowed import run_windowed_episode
from fedagent_flwr.schema import SettingError
from fedagent_flwr.trainers.common.checks import InputError
from fedagent_flwr.trainers.common.evaluator import load_model
from fedagent_flwr.trainers.common.sampler import EpisodeTask, HFPolicy, play_episodes
from fedagent_flwr.trainers.reference.config import GRPOConfig
from fedagent_flwr.trainers.reference.grpo import grpo_advantages, windowed_samples
from fedagent_flwr.trainers.verl.settings import VerlSettings
from testkit.reference_trainer import run_trainer, train_job

WINDOWED = {"rollout_n": 2, "max_new_tokens": 8, "lr": 1e-2, "num_threads": 2, "rollout_mode": "windowed",
            "history_length": 2}


def test_the_setting_defaults_to_concat_travels_as_trainer_keys_and_bad_values_name_the_key() -> None:
    settings = load_settings()
    assert (settings.trainer["rollout_mode"], settings.trainer["history_length"]) == ("concat", 2)
    windowed = load_settings(overrides="rollout.mode=windowed rollout.history_length=3")
    assert (windowed.trainer["rollout_mode"], windowed.trainer["history_length"]) == ("windowed", 3)
    verl = load_settings(overrides="trainer=verl rollout.mode=windowed")
    assert VerlSettings.from_mapping({k: v for k, v in verl.trainer.items()
                                      if k in ("rollout_mode", "history_length")})[0].rollout_mode == "windowed"
    for override, culprit in (("rollout.mode=sliding", "'rollout.mode'"), ("rollout.history_length=-1",
                                                                            "'rollout.history_length'")):
        with pytest.raises(ConfigError, match=culprit):
            load_settings(overrides=override)
    for override in ("+trainer.rollout_mode=windowed", "trainer.rollout_mode=windowed"):
        with pytest.raises(ConfigError, match="'trainer.rollout_mode' is set from 'rollout.mode'"):
            load_settings(overrides=override)
    with pytest.raises(ConfigError, match="'trainer.history_length' is set from 'rollout.history_length'"):
        load_settings(overrides="trainer.history_length=3")
    # The trainers' own checks of a job file name the trainer key.
    with pytest.raises(InputError, match="trainer.rollout_mode"):
        GRPOConfig.from_mapping({"rollout_mode": "sliding"})
    with pytest.raises(SettingError, match="trainer.history_length"):
        VerlSettings.from_mapping({"history_length": -2})


def test_tinyguess_window_shows_the_last_guesses_and_their_answers(smollm2_tokenizer: Any) -> None:
    replies = iter(["<answer>10</answer>", "maybe 40", "no idea", "<answer>30</answer>"])

    async def generate(prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
        return smollm2_tokenizer.encode(next(replies), add_special_tokens=False)

    env = TinyGuess({"lo": 1, "hi": 50, "max_turns": 4})
    episode = asyncio.run(run_windowed_episode(env, 25, smollm2_tokenizer, generate, SamplingParams(16), 4, 4096,
                                               history_length=2))  # secret 26
    prompts = [m["content"] for m in episode.messages[::2]]
    system = asyncio.run(TinyGuess({"lo": 1, "hi": 50, "max_turns": 4}).system_prompt())
    first = f"{system}\n\nGuess the secret number between 1 and 50. Reply as <answer>N</answer>."
    assert prompts[0] == first
    assert prompts[1] == f"{first}\n\nYour most recent 1 of 1 guess(es):\nGuess 1: 10 -> higher\n" \
                         "Now make guess 2. Reply as <answer>N</answer>."
    assert prompts[3] == (f"{first}\n\nYour most recent 2 of 3 guess(es):\nGuess 2: 40 -> lower\n"
                          "Guess 3: invalid -> Invalid response. Reply as <answer>N</answer>.\n"
                          "Now make guess 4. Reply as <answer>N</answer>.")
    assert episode.num_turns == 4 and not episode.success and len(episode.windows) == 4


def test_per_turn_samples_keep_their_episodes_group_and_return(tiny_model_dir: Path) -> None:
    model, tokenizer = load_model(tiny_model_dir, 2)
    policy = HFPolicy(model, tokenizer, 8)
    config = {"lo": 1, "hi": 4}
    tasks = [EpisodeTask("TinyGuess", config, seed, 3, seed) for seed in (5, 6, 7) for _ in range(3)]
    episodes = play_episodes(policy, tokenizer, tasks, SamplingParams(6, 1.0), 1024,
                             torch.Generator().manual_seed(3), "windowed", 2)
    groups = [t.group for t in tasks]
    assert len({e.num_turns for e in episodes}) >= 1 and all(e.windows for e in episodes)
    # The random tiny model never wins, so give the episodes stand-in returns with a spread inside
    # every group (the rows must carry whatever their episode's return is).
    for k, episode in enumerate(episodes):
        episode.reward = float(k % 3)
    samples, rewards, row_groups = windowed_samples(episodes, groups)
    assert len(samples) == sum(e.num_turns for e in episodes) > len(episodes)
    expected_groups = [g for e, g in zip(episodes, groups) for _ in range(e.num_turns)]
    assert row_groups == expected_groups
    assert rewards == [e.reward for e in episodes for _ in range(e.num_turns)]
    assert all(all(m == 1 for m in s.response_mask) and s.response_ids for s in samples)
    advantages = grpo_advantages(rewards, row_groups)
    # Every turn of an episode carries the same advantage: its episode's return against its group.
    offset = 0
    for episode in episodes:
        mine = advantages[offset:offset + episode.num_turns]
        assert max(mine) - min(mine) < 1e-12
        offset += episode.num_turns
    assert any(abs(a) > 0 for a in advantages)
    for group in set(groups):
        values = [r for r, g in zip(rewards, row_groups) if g == group]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for a, r, g in zip(advantages, rewards, row_groups):
            if g == group:
                assert a == pytest.approx((r - mean) / (std + 1e-6))  # GRPO over the group's per-turn rows


def test_reference_trainer_trains_on_one_sample_per_turn_and_evaluates_windowed(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    proc = run_trainer("train", train_job(tmp_path, tiny_model_dir, "w", trainer=dict(WINDOWED)))
    assert proc.returncode == 0, proc.stderr
    result = load(TrainResult, tmp_path / "w" / "train_result.json")
    turns = result.metrics["num_turns_mean"] * result.num_episodes
    assert result.num_episodes == 4 and result.metrics["num_samples"] == pytest.approx(turns)
    assert result.metrics["num_samples"] > result.num_episodes  # TinyGuess with 2 turns: mostly 2 samples each
    assert f"samples {int(result.metrics['num_samples'])}" in proc.stdout
    assert "ignoring trainer keys" not in proc.stderr

    job = EvalJob(model_path=str(tiny_model_dir), output_dir=str(tmp_path / "eval"), env_spec=
                  {"envs": [{"name": "TinyGuess", "n_envs": 1, "max_turns": 3, "config": {}}]}, round=0,
                  seeds=[1, 2], trainer=dict(WINDOWED))
    save(job, tmp_path / "eval.json")
    evaluated = run_trainer("evaluate", tmp_path / "eval.json")
    assert evaluated.returncode == 0, evaluated.stderr
    eval_result = load(EvalResult, tmp_path / "eval" / "eval_result.json")
    assert eval_result.num_episodes == 2
    # The episodes were played windowed: one sample per turn (concat would give one per episode).
    assert eval_result.metrics["samples_mean"] == eval_result.metrics["num_turns_mean"] > 1
