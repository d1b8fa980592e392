"""``trainer.request_seeds`` on CPU with real verl 0.9.1 code: the seeded agent-loop workers (concat and
windowed) give every request of every rollout a seed, distinct within a GRPO group and between the
turns of an episode, the same in a second run; the stock workers send none; the job names the
seeded managers; and a config whose agent-loop workers would split a group is refused at start-up.
The vLLM side (verl's server builds ``SamplingParams(**sampling_params)``) is the GPU session's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.serverapp.preflight import check_request_seed_groups
from fedagent_flwr.trainers.verl.overrides import (
    SEEDED_MANAGER,
    SEEDED_WINDOWED_MANAGER,
    WINDOWED_MANAGER,
    build_overrides,
    job_paths,
)
from fedagent_flwr.trainers.verl.request_seeds import SEED_RANGE, request_seed, seed_base
from fedagent_flwr.trainers.verl.settings import VerlSettings
from testkit.verl_agent_loop import agent_loop_worker

AGENT = "fedagent_env_seed_test"
ROW = {"env_name": "TinyGuess", "env_config": {"lo": 1, "hi": 10}, "seed": 3, "max_turns": 3,
       "raw_prompt": [{"role": "user", "content": "x"}], "index": 0}


def _request_seeds(cls: type, model: Any, tokenizer: Any, trajectories: list[dict[str, Any]]) -> list[list[Any]]:
    """Each trajectory's rollout of ``ROW`` through ``cls._run_agent_loop``: the ``seed`` of each of its
    requests (None where a request carried none)."""
    worker = agent_loop_worker(cls, model, tokenizer)
    seeds = []
    for trajectory in trajectories:
        before = len(worker.llm_client.calls)
        asyncio.run(worker._run_agent_loop({"temperature": 1.0, "top_p": 1.0}, trajectory, agent_name=AGENT,
                                           trace=False, **ROW))
        seeds.append([call.get("seed") for call in worker.llm_client.calls[before:]])
    return seeds


@pytest.mark.parametrize("mode", ["concat", "windowed"])
def test_seeded_workers_send_a_distinct_reproducible_seed_per_request(
        mode: str, tiny_model_dir: Path, smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, _agent_loop_registry

    from fedagent_flwr.trainers.verl.request_seeds import SeededAgentLoopWorker
    from fedagent_flwr.trainers.verl.windowed import SeededWindowedAgentLoopWorker, WindowedAgentLoopWorker

    monkeypatch.setitem(_agent_loop_registry, AGENT, {
        "_target_": "fedagent_flwr.trainers.verl.agent_loop.EnvAgentLoop", "max_new_tokens": 8,
        "invalid_action_penalty": 0.1, "episode_log": "", "history_length": 2})
    seeded, plain = ((SeededAgentLoopWorker, AgentLoopWorker) if mode == "concat"
                     else (SeededWindowedAgentLoopWorker, WindowedAgentLoopWorker))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    # one GRPO group (the same row and env seed at step 1: rollout_n 0 and 1), and the row at step 2
    group = [{"step": 1, "sample_index": 0, "rollout_n": n, "validate": False} for n in (0, 1)]
    later = {"step": 2, "sample_index": 0, "rollout_n": 0, "validate": False}
    first = _request_seeds(seeded, model, smollm2_tokenizer, [*group, later])

    # The random tiny model never guesses: each rollout plays several turns (concat: until its
    # 64-token response budget is spent), one request each.
    assert all(len(rollout) >= 2 for rollout in first)
    assert all(isinstance(seed, int) and 0 <= seed < SEED_RANGE for rollout in first for seed in rollout)
    every = [seed for rollout in first for seed in rollout]
    assert len(set(every)) == len(every)  # no two requests share a seed: turns, the group's rollouts, steps
    assert first[0] == [request_seed(seed_base(3, 1, 0, 0, False), t) for t in range(len(first[0]))]
    # a second run of the same rows: the same seeds, request by request
    assert _request_seeds(seeded, model, smollm2_tokenizer, [*group, later]) == first
    # the setting off (verl's own workers): no request carries a seed, as before
    assert _request_seeds(plain, model, smollm2_tokenizer, group) == [[None] * len(first[0]), [None] * len(first[1])]


def test_seed_base_is_a_stable_digest_of_the_rollout() -> None:
    base = seed_base(3, 1, 0, 0, False)
    assert base == 1985582482  # SHA-256: the same in every process and run (Python's hash() is salted)
    others = {seed_base(4, 1, 0, 0, False), seed_base(3, 2, 0, 0, False), seed_base(3, 1, 1, 0, False),
              seed_base(3, 1, 0, 0, True), seed_base(3, 1, 0, 1, False)}
    assert base not in others and len(others) == 5
    # a group's rollouts are a turn stride apart: 8 rollouts x 100 turns never meet
    seeds = {request_seed(seed_base(3, 1, 0, n, False), t) for n in range(8) for t in range(100)}
    assert len(seeds) == 800


def test_the_job_names_the_seeded_managers(tmp_path: Path) -> None:
    from verl.utils.import_utils import load_class_from_fqn

    from fedagent_flwr.trainers.verl.request_seeds import (
        RequestSeedMixin,
        SeededAgentLoopManager,
        SeededAgentLoopWorker,
    )
    from fedagent_flwr.trainers.verl.windowed import (
        SeededWindowedAgentLoopManager,
        SeededWindowedAgentLoopWorker,
        WindowedAgentLoopWorker,
    )

    def manager(**knobs: Any) -> list[str]:
        settings, _ = VerlSettings.from_mapping({"rollout_n": 2, **knobs})
        overrides = build_overrides(algorithm="grpo", settings=settings, paths=job_paths(tmp_path, "/m", "", "/tmp/x"),
                                    batch_size=4, local_steps=1, seed=1, experiment_name="e")
        return [o.split("=", 1)[1] for o in overrides if "agent_loop_manager_class" in o]

    assert VerlSettings.request_seeds is False
    assert manager() == []  # off: verl's own manager, the command unchanged
    assert manager(request_seeds=True) == [SEEDED_MANAGER]
    assert manager(rollout_mode="windowed") == [WINDOWED_MANAGER]
    assert manager(rollout_mode="windowed", request_seeds=True) == [SEEDED_WINDOWED_MANAGER]
    assert load_class_from_fqn(SEEDED_MANAGER, "AgentLoopManager") is SeededAgentLoopManager
    assert load_class_from_fqn(SEEDED_WINDOWED_MANAGER, "AgentLoopManager") is SeededWindowedAgentLoopManager
    # each manager runs its own worker class as verl's Ray workers (manager.WorkerManager)
    assert SeededAgentLoopManager.worker is SeededAgentLoopWorker
    assert SeededWindowedAgentLoopManager.worker is SeededWindowedAgentLoopWorker
    assert issubclass(SeededWindowedAgentLoopWorker, RequestSeedMixin)
    assert issubclass(SeededWindowedAgentLoopWorker, WindowedAgentLoopWorker)
    with pytest.raises(ValueError, match="trainer.use_v1"):
        VerlSettings.from_mapping({"request_seeds": True, "use_v1": True})


def test_startup_refuses_agent_workers_that_split_a_group() -> None:
    # the default run: 2 TinyGuess instances a step, 2 agent-loop workers -> one group each
    check_request_seed_groups(load_settings(overrides="trainer=verl trainer.request_seeds=true"))
    check_request_seed_groups(load_settings(overrides="trainer=verl trainer.agent_workers=3"))  # off: not checked
    with pytest.raises(ConfigError, match=r"config key 'trainer.agent_workers' = 3 with trainer.request_seeds=true "
                                          r"must divide .* = 2\)"):
        check_request_seed_groups(load_settings(overrides="trainer=verl trainer.request_seeds=true "
                                                          "trainer.agent_workers=3"))
    with pytest.raises(ConfigError, match="config key 'trainer.per_client.1.agent_workers' = 4 "):
        check_request_seed_groups(load_settings(overrides="trainer=verl trainer.request_seeds=true "
                                                          "trainer.per_client={1:{agent_workers:4}}"))


def test_the_job_refuses_agent_workers_that_split_a_group(tiny_model_dir: Path, tmp_path: Path) -> None:
    from fedagent_flwr.clientapp.job import TrainJob
    from fedagent_flwr.trainers.common.checks import InputError
    from fedagent_flwr.trainers.verl.job import check_train_job

    def job(**trainer: Any) -> TrainJob:
        return TrainJob(model_path=str(tiny_model_dir), output_dir=str(tmp_path / "out"), round=1, client_id=0,
                        env_spec={"envs": [{"name": "TinyGuess", "n_envs": 3, "max_turns": 3,
                                            "config": {"lo": 1, "hi": 10}}]},
                        num_clients=2, data_seed=142, local_steps=1, partition={"strategy": "none"},
                        trainer={"rollout_n": 2, **trainer})

    assert check_train_job(job(request_seeds=True, agent_workers=3))[0].request_seeds is True  # 3 | 3
    assert check_train_job(job(agent_workers=2))[0].request_seeds is False  # off: any worker count
    with pytest.raises(InputError, match=r"'trainer.agent_workers' = 2 with trainer.request_seeds=true .* = 3\)"):
        check_train_job(job(request_seeds=True, agent_workers=2))
