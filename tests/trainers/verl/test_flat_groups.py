"""GRPO's advantage of a flat group is exactly zero in verl's own computation path (grpo and grpo_vectorized).

verl 0.9.1's float32 arithmetic gives eight episodes scored -0.6 (the WebShop run of 2026-12-02:
six invalid turns at -0.1) an advantage of -0.0560 each instead of 0; the job's ``sitecustomize``
wraps verl's function so flat groups get 0 and groups with a spread keep verl's values. Checked on
verl's real ``core_algos`` and, in a fresh process with the job's environment, through
``ray_trainer.compute_advantage``, the call the TaskRunner makes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedagent_flwr.rollout.groups import flat_group_rows
from fedagent_flwr.trainers.verl.flat_groups import patch_core_algos
from fedagent_flwr.trainers.verl.job import job_environment

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

# Group "flat": the WebShop run's eight episodes at -0.6; group "mixed": a TinyGuess-like group with
# a spread (one win, penalties); group "single": PPO-like, one episode (verl: mean 0, std 1).
SCORES = [-0.6] * 8 + [1.0, -0.1, -0.2, -0.1] + [0.7]
INDEX = np.array(["flat"] * 8 + ["mixed"] * 4 + ["single"], dtype=object)


def _rewards() -> tuple[torch.Tensor, torch.Tensor]:
    rewards = torch.zeros(len(SCORES), 5)
    rewards[:, -1] = torch.tensor(SCORES)  # the score sits on the last response token
    return rewards, torch.ones_like(rewards)


def test_verls_float32_gives_a_flat_group_a_uniform_push_and_the_wrapper_gives_zero() -> None:
    rewards, mask = _rewards()
    original = core_algos.compute_grpo_outcome_advantage
    before, _ = original(rewards.clone(), mask, INDEX)
    # the defect, as measured: every flat row -0.0560, identically (the run's actor/pg_loss 0.0560341)
    assert torch.allclose(before[:8, 0], torch.full((8,), -0.0560341477))

    class Module:  # a stand-in namespace carrying verl's real function and registry entry
        compute_grpo_outcome_advantage = original
        ADV_ESTIMATOR_REGISTRY = {"grpo": original}

    patch_core_algos(Module)
    patch_core_algos(Module)  # twice: wrapped once
    wrapped = Module.compute_grpo_outcome_advantage
    assert Module.ADV_ESTIMATOR_REGISTRY["grpo"] is wrapped and wrapped._fedagent_flat_groups is original
    after, returns = wrapped(token_level_rewards=rewards.clone(), response_mask=mask, index=INDEX)
    assert torch.equal(after[:8], torch.zeros(8, 5)) and torch.equal(returns[:8], torch.zeros(8, 5))
    assert torch.equal(after[8:], before[8:])  # a spread, or a group of one: verl's values untouched
    assert after[8:12, 0].abs().min() > 0.1


def test_verls_vectorized_grpo_has_the_same_defect_and_is_wrapped_too() -> None:
    rewards, mask = _rewards()
    original = core_algos.compute_grpo_vectorized_outcome_advantage
    before, _ = original(rewards.clone(), mask, INDEX)
    assert torch.allclose(before[:8, 0], torch.full((8,), -0.0560341477))

    class Module:  # verl's real functions and registry entries for both group-mean estimators
        compute_grpo_outcome_advantage = core_algos.compute_grpo_outcome_advantage
        compute_grpo_vectorized_outcome_advantage = original
        ADV_ESTIMATOR_REGISTRY = {"grpo": core_algos.compute_grpo_outcome_advantage, "grpo_vectorized": original}

    patch_core_algos(Module)
    wrapped = Module.compute_grpo_vectorized_outcome_advantage
    assert Module.ADV_ESTIMATOR_REGISTRY["grpo_vectorized"] is wrapped and wrapped._fedagent_flat_groups is original
    assert Module.ADV_ESTIMATOR_REGISTRY["grpo"] is Module.compute_grpo_outcome_advantage is not None
    assert Module.compute_grpo_outcome_advantage._fedagent_flat_groups is core_algos.compute_grpo_outcome_advantage
    after, returns = wrapped(rewards.clone(), mask, INDEX)
    assert torch.equal(after[:8], torch.zeros(8, 5)) and torch.equal(returns[:8], torch.zeros(8, 5))
    assert torch.equal(after[8:], before[8:])


def test_flat_rows_need_two_members_that_agree_within_float32_precision() -> None:
    scores = torch.tensor([-0.6, -0.6000001, 0.5, 0.5001, 1.0]).tolist()
    assert flat_group_rows(scores, ["a", "a", "b", "b", "c"]) == [0, 1]


_PROBE = r"""
import json, numpy as np, torch
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.core_algos import AdvantageEstimator
scores = %s
rewards = torch.zeros(len(scores), 5); rewards[:, -1] = torch.tensor(scores)
data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": torch.ones_like(rewards)},
                           non_tensors={"uid": np.array(%s, dtype=object)})
outs = [compute_advantage(data, adv_estimator=e).batch["advantages"][:, 0].tolist()
        for e in (AdvantageEstimator.GRPO, AdvantageEstimator.GRPO_VECTORIZED)]
print(json.dumps(outs))
"""


def test_the_jobs_environment_arms_the_wrapper_on_the_trainers_call_path() -> None:
    probe = _PROBE % (json.dumps(SCORES), json.dumps(INDEX.tolist()))
    env = job_environment(dict(os.environ))
    armed = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert armed.returncode == 0, armed.stderr[-2000:]
    for advantages in json.loads(armed.stdout.strip().splitlines()[-1]):  # grpo, grpo_vectorized
        assert advantages[:8] == [0.0] * 8 and min(abs(a) for a in advantages[8:12]) > 0.1
    # without the job's sitecustomize the same call shows verl's own -0.056 per flat row
    bare = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    plain = subprocess.run([sys.executable, "-c", probe], env=bare, capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr[-2000:]
    for advantages in json.loads(plain.stdout.strip().splitlines()[-1]):
        assert advantages[0] == pytest.approx(-0.0560341, abs=1e-6)
