"""The share of flat GRPO groups (``zero_variance_group_share``) is measured on the groups verl's
GRPO forms: one per row ``uid``, which verl's trainer draws afresh for every row of every step.

Each test drives real verl 0.9.1 code on CPU: the job's own overrides composed into verl's config,
verl's ``AgentLoopWorker`` (or the windowed worker) built from it, batches made the way verl's
``fit()`` makes them (collated dataset rows, a fresh ``uid`` per row, ``_get_gen_batch``,
``repeat(rollout.n, interleave=True)``), our agent loop writing the episode log, and the backend's
``episode_metrics`` reading it. Only the LLM server is scripted, so the scores are known.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from fedagent_flwr.clientapp.job import TrainJob
from fedagent_flwr.envs.registry import register_env
from fedagent_flwr.envs.tiny_guess import TinyGuess, parse_guess
from fedagent_flwr.trainers.verl.dataset import EnvEpisodeDataset, write_rows
from fedagent_flwr.trainers.verl.job import PreparedTrain, episode_metrics, prepare_train
from testkit.verl_probe import compose_verl_config


@register_env("FlaggedGuess")
class FlaggedGuess(TinyGuess):
    """TinyGuess that flags a reply without a readable guess as an invalid action (as WebShop and
    ALFWorld do), so the invalid-action penalty applies."""

    async def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        obs, reward, done, info = await super().step(action_text)
        return obs, reward, done, {**info, "is_action_valid": parse_guess(action_text) is not None}


class ScriptedServer:
    """verl's ``server_manager`` contract (token in, token out): every call answers ``reply(prompt)``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.reply = lambda prompt: "<answer>0</answer>"

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **_: Any) -> Any:
        text = self.reply(self.tokenizer.decode(prompt_ids))
        return SimpleNamespace(token_ids=self.tokenizer.encode(text, add_special_tokens=False), log_probs=None)


def _prepared(model_dir: Path, out: Path, envs: list[dict[str, Any]], **fields: Any) -> PreparedTrain:
    trainer = {"rollout_n": 2, "max_prompt_length": 512, "max_response_length": 64, **fields.pop("trainer", {})}
    return prepare_train(TrainJob(model_path=str(model_dir), output_dir=str(out), env_spec={"envs": envs}, round=1,
                                  client_id=0, num_clients=1, data_seed=7, partition={"strategy": "none"},
                                  trainer=trainer, **fields))


def _worker(prep: PreparedTrain, server: ScriptedServer) -> Any:
    """verl's agent-loop worker (the windowed one in windowed mode), built from the job's own config."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from fedagent_flwr.trainers.verl.windowed import WindowedAgentLoopWorker

    cls = WindowedAgentLoopWorker if prep.settings.rollout_mode == "windowed" else AgentLoopWorker
    return cls(compose_verl_config(prep.overrides), server)


def _play_epoch(prep: PreparedTrain, worker: Any) -> None:
    """One epoch of verl's training loop up to the rollout: each step's rows collated, a fresh uid per
    row (as ``RayPPOTrainer.fit`` draws them), the generation batch repeated ``rollout.n`` times."""
    from torch.utils.data import DataLoader
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.dataset.rl_dataset import collate_fn

    trainer = object.__new__(RayPPOTrainer)
    dataset = EnvEpisodeDataset(data_files=prep.paths.rows_file)
    for batch_dict in DataLoader(dataset, batch_size=prep.batch_size, collate_fn=collate_fn):
        batch = DataProto.from_single_dict(batch_dict)
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        generation = trainer._get_gen_batch(batch).repeat(repeat_times=prep.settings.rollout_n, interleave=True)
        asyncio.run(worker.generate_sequences(generation))


def _records(prep: PreparedTrain) -> list[dict[str, Any]]:
    return [json.loads(line) for line in prep.episode_log.read_text().splitlines()]


def test_an_instance_replayed_in_a_later_epoch_is_a_group_of_its_own(tiny_model_dir: Path, smollm2_tokenizer: Any,
                                                                      tmp_path: Path) -> None:
    """Epoch 1 fails every episode, epoch 2 solves every one: each of verl's groups is flat (no
    gradient at all), though every (env, seed) saw both scores."""
    prep = _prepared(tiny_model_dir, tmp_path / "out", [{"name": "TinyGuess", "n_envs": 2, "max_turns": 1,
                                                         "config": {"lo": 7, "hi": 7}}], epochs=2)
    server = ScriptedServer(smollm2_tokenizer)
    worker = _worker(prep, server)
    for answer in (0, 7):
        server.reply = lambda prompt, answer=answer: f"<answer>{answer}</answer>"
        _play_epoch(prep, worker)
    records = _records(prep)
    assert [r["score"] for r in records] == [0.0] * 4 + [1.0] * 4
    assert len({(r["env"], r["seed"]) for r in records}) == 2 and len({r["uid"] for r in records}) == 4
    _, metrics = episode_metrics(prep.episode_log)
    assert metrics["success_rate"] == 0.5
    assert metrics["zero_variance_group_share"] == 1.0


def test_two_entries_playing_one_seed_are_two_groups(tiny_model_dir: Path, smollm2_tokenizer: Any,
                                                     tmp_path: Path) -> None:
    """Two spec entries of one env whose rows share a seed (an entry past its block of seeds plays
    the next entry's, ``train_env_seed``), here with different secrets: both groups are flat."""
    entries = [{"name": "TinyGuess", "n_envs": 1, "max_turns": 1, "config": {"lo": lo, "hi": lo}} for lo in (7, 3)]
    prep = _prepared(tiny_model_dir, tmp_path / "out", entries)
    rows = json.loads(Path(prep.paths.rows_file).read_text())["rows"]
    rows[1]["seed"] = rows[0]["seed"]  # the overlap plan_rows makes past SEEDS_PER_ENTRY rows per entry
    write_rows(rows, Path(prep.paths.rows_file))
    server = ScriptedServer(smollm2_tokenizer)
    server.reply = lambda prompt: "<answer>7</answer>"
    _play_epoch(prep, _worker(prep, server))
    records = _records(prep)
    assert sorted(r["score"] for r in records) == [0.0, 0.0, 1.0, 1.0]
    assert len({(r["env"], r["seed"]) for r in records}) == 1
    assert episode_metrics(prep.episode_log)[1]["zero_variance_group_share"] == 1.0


def test_windowed_groups_are_scored_by_their_turn_rows(tiny_model_dir: Path, smollm2_tokenizer: Any,
                                                       tmp_path: Path) -> None:
    """Windowed mode trains one row per turn, each scored with its own invalid-action penalty: every
    episode here loses (-0.1 in all), but its invalid first turn scores -0.1 and its valid second
    turn 0.0, so verl's GRPO sees a spread in every group and the share is 0, not 1."""
    prep = _prepared(tiny_model_dir, tmp_path / "out", [{"name": "FlaggedGuess", "n_envs": 2, "max_turns": 2,
                                                         "config": {"lo": 7, "hi": 7}}],
                     trainer={"rollout_mode": "windowed", "invalid_action_penalty": 0.1,
                              "max_prompt_length": 1024})
    server = ScriptedServer(smollm2_tokenizer)
    server.reply = lambda prompt: "<answer>0</answer>" if "guess 2" in prompt else "no idea"
    _play_epoch(prep, _worker(prep, server))
    records = _records(prep)
    assert [r["score"] for r in records] == pytest.approx([-0.1] * 4)  # the episodes alike...
    assert [r["turn_scores"] for r in records] == [pytest.approx([-0.1, 0.0])] * 4  # ...their turn rows not
    assert episode_metrics(prep.episode_log)[1]["zero_variance_group_share"] == 0.0


def test_records_without_a_uid_report_no_share(tmp_path: Path) -> None:
    """Episodes logged outside verl's trainer have no GRPO group id: no share rather than a guess."""
    log = tmp_path / "episodes.jsonl"
    log.write_text("".join(json.dumps({"env": "TinyGuess", "seed": 5, "reward": r, "score": r, "success": r > 0,
                                       "num_turns": 1, "truncated": False, "invalid": 0}) + "\n" for r in (0.0, 1.0)))
    count, metrics = episode_metrics(log)
    assert count == 2 and "zero_variance_group_share" not in metrics
