"""Windowed mode on verl, on CPU with real verl 0.9.1 code: the overrides select the windowed manager
and pass verl's validation; the agent loop returns one trajectory per turn with FedAgent's rewards;
verl's own post-processing turns them into rows that carry their episode's ``uid``; and the batch
glue (``slice``/``union`` in verl's trainer) keeps every turn row, padded to whole mini-batches.
The GPU run (vLLM, FSDP) is the lead's (issue 15's done-when)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedagent_flwr.trainers.verl.dataset import EnvEpisodeDataset
from fedagent_flwr.trainers.verl.overrides import WINDOWED_MANAGER, build_overrides, job_paths
from fedagent_flwr.trainers.verl.settings import VerlSettings
from testkit.verl_agent_loop import HFServer, loop_config
from testkit.verl_probe import compose_verl_config
from testkit.webshop_data import DATA_DIR, needs_data


def _windowed_cfg(tmp_path: Path, model: str, **extra: Any) -> Any:
    settings, _ = VerlSettings.from_mapping({"rollout_n": 2, "rollout_mode": "windowed", **extra})
    paths = job_paths(tmp_path / "verl", model, "", "/tmp/fa-ray-test")
    overrides = build_overrides(algorithm="grpo", settings=settings, paths=paths, batch_size=3, local_steps=1,
                                seed=1, experiment_name="round1_client0")
    return overrides, compose_verl_config(overrides)


def test_windowed_overrides_select_the_manager_and_pass_verls_validation(tmp_path: Path, tiny_model_dir: Path) -> None:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.import_utils import load_class_from_fqn

    from fedagent_flwr.trainers.verl.windowed import WindowedAgentLoopManager, row_divisor

    overrides, cfg = _windowed_cfg(tmp_path, str(tiny_model_dir))
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class == WINDOWED_MANAGER
    assert load_class_from_fqn(WINDOWED_MANAGER, "AgentLoopManager") is WindowedAgentLoopManager
    # mini-batch 3 prompts x n 2 = 6 rows, micro 4 x 1 GPU -> lcm 12
    assert row_divisor(cfg) == 12
    concat_settings, _ = VerlSettings.from_mapping({"rollout_n": 2})
    concat = build_overrides(algorithm="grpo", settings=concat_settings,
                             paths=job_paths(tmp_path / "c", "/m", "", "/tmp/x"), batch_size=3, local_steps=1,
                             seed=1, experiment_name="e")
    assert not any("agent_loop_manager_class" in o for o in concat)  # concat: stock verl, unchanged
    with pytest.raises(ValueError, match="trainer.use_v1"):
        VerlSettings.from_mapping({"rollout_mode": "windowed", "use_v1": True})


def _loop(model_dir: Path, tokenizer: Any, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from fedagent_flwr.trainers.verl.agent_loop import EnvAgentLoop

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cfg = loop_config(prompt_length=1024, response_length=64)
    return EnvAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=HFServer(model), tokenizer=tokenizer,
                        processor=None, dataset_cls=EnvEpisodeDataset, data_config=DictConfigWrap(cfg.data),
                        max_new_tokens=8, invalid_action_penalty=0.1, history_length=2, **kwargs), cfg


def _worker(cfg: Any, tokenizer: Any) -> Any:
    from omegaconf import OmegaConf

    from fedagent_flwr.trainers.verl.windowed import WindowedAgentLoopWorker

    worker = object.__new__(WindowedAgentLoopWorker)
    worker.rollout_config = cfg.actor_rollout_ref.rollout
    worker.tokenizer = tokenizer
    worker.processor = None
    worker.reward_loop_worker_handles = object()  # the streaming reward loop: stock drops the input columns
    worker.distillation_enabled = False
    worker.mm_processor_kwargs = {}
    worker.config = OmegaConf.create({
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2},
                              "rollout": {"n": 2, "log_prob_micro_batch_size_per_gpu": 2},
                              "ref": {"log_prob_micro_batch_size_per_gpu": 2}},
        "trainer": {"n_gpus_per_node": 1, "nnodes": 1}, "algorithm": {"adv_estimator": "grpo"}})
    return worker


def test_one_row_per_turn_carries_its_episodes_uid_and_the_trainer_glue_keeps_them(
        tiny_model_dir: Path, smollm2_tokenizer: Any) -> None:
    from verl import DataProto

    loop, cfg = _loop(tiny_model_dir, smollm2_tokenizer)
    rows = [{"env_name": "TinyGuess", "env_config": {"lo": 1, "hi": 10}, "seed": s, "max_turns": t,
             "raw_prompt": [{"role": "user", "content": "x"}], "index": k} for k, (s, t) in enumerate(((3, 3), (4, 2)))]
    outputs = [asyncio.run(loop.run_windowed({"temperature": 0.0, "top_p": 1.0}, validate=False, **row))
               for row in rows]
    assert [len(o) for o in outputs] == [3, 2]  # the random tiny model never guesses: every turn is played
    for turns in outputs:
        assert all(o.num_turns == 1 and o.response_mask == [1] * len(o.response_ids) for o in turns)
        assert all(o.reward_score == 0.0 for o in turns)  # TinyGuess: no win, no invalid-action flag
        assert len(turns[1].prompt_ids) > len(turns[0].prompt_ids)  # the window grew by one step

    worker = _worker(cfg, smollm2_tokenizer)
    processed = [[asyncio.run(worker._agent_loop_postprocess(o, validate=False, **row)) for o in turns]
                 for turns, row in zip(outputs, rows)]
    columns = {"uid": np.array(["u0", "u1"], dtype=object), "data_source": np.array(["tinyguess"] * 2, dtype=object)}
    out = worker._postprocess(processed, input_non_tensor_batch=columns, validate=False)
    assert len(out) == 5 and list(out.non_tensor_batch["uid"]) == ["u0"] * 3 + ["u1"] * 2
    assert out.batch["responses"].shape == (5, 64) and "rm_scores" in out.batch.keys()
    assert out.meta_info["fedagent_windowed_divisor"] == 4  # lcm(2 x 2, 2 x 1)

    # verl's trainer: prompts repeated to the rollout count, the output cut back to it, then united.
    prompts = DataProto.from_single_dict({"uid": np.array(["u0", "u1"], dtype=object),
                                          "reward_model": np.array([{}, {}], dtype=object)})
    kept = out.slice(0, 2)
    assert kept is out  # the windowed output keeps its turn rows
    merged = prompts.repeat(1, interleave=True).union(kept)
    assert len(merged) == 8  # 5 turn rows padded with the first rows to a multiple of 4
    assert list(merged.non_tensor_batch["uid"]) == ["u0", "u0", "u0", "u1", "u1", "u0", "u0", "u0"]
    assert "fedagent_windowed_divisor" not in merged.meta_info
    assert merged.slice(0, 2) is not merged and len(merged.slice(0, 2)) == 2  # untagged: stock behaviour
    plain = DataProto.from_single_dict({"x": torch.zeros(3, 1)})
    with pytest.raises(Exception):  # noqa: B017 -- stock union still refuses different lengths
        plain.union(DataProto.from_single_dict({"y": torch.zeros(2, 1)}))

    # Validation keeps one row per prompt: each episode's last turn.
    validated = [[asyncio.run(worker._agent_loop_postprocess(turns[-1], validate=True, **row))]
                 for turns, row in zip(outputs, rows)]
    assert len(worker._postprocess(validated, input_non_tensor_batch=columns, validate=True)) == 2


@needs_data
def test_invalid_turns_lose_the_penalty_only_when_training(tiny_model_dir: Path, smollm2_tokenizer: Any) -> None:
    loop, _ = _loop(tiny_model_dir, smollm2_tokenizer)
    row = {"env_name": "WebShop", "env_config": {"data_dir": str(DATA_DIR)}, "seed": 5, "max_turns": 2}
    train = asyncio.run(loop.run_windowed({"temperature": 0.0}, validate=False, **row))
    val = asyncio.run(loop.run_windowed({"temperature": 0.0}, validate=True, **row))
    # The random tiny model writes no <action> tags: every turn is invalid, each loses 0.1 in training.
    assert [o.reward_score for o in train] == pytest.approx([-0.1, -0.1])
    assert [o.reward_score for o in val] == [0.0, 0.0]
    assert all(o.extra_fields["reward_extra_info"]["invalid_actions"] == 2.0 for o in train)
