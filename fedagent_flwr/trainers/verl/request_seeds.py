"""Seeded sampling on verl (``trainer.request_seeds``): a deterministic vLLM seed per request.

vLLM samples a request without a seed from its engine's shared generator, so which tokens a
rollout draws depends on how requests happen to be scheduled together: two runs of one config
diverge from the first step. verl's ``full_determinism`` gives every request the *same* seed,
which would make the rollouts of one GRPO group identical (every advantage zero). Here each
rollout gets its own seed instead:

* :class:`RequestSeedMixin` (in the agent-loop worker) derives a **base** for every row from what
  identifies its rollout in the step: the env ``seed`` of the row, verl's trajectory ``step``,
  ``sample_index`` (the dataset row), ``rollout_n`` (its place in the GRPO group) and ``validate``
  (:func:`seed_base`), and hands it to the agent loop as the ``request_seed_base`` column, beside
  the ``step`` and ``rollout_n`` themselves (``request_step``, ``request_rollout_n``), which
  ``trainer.request_fingerprints`` records with each request.
* :class:`~fedagent_flwr.trainers.verl.agent_loop.ServerGenerate` then sends ``seed`` =
  :func:`request_seed` (base, turn) with each turn's sampling parameters; verl's vLLM server
  builds ``vllm.SamplingParams(max_tokens=..., **sampling_params)`` from that dict.

The group-level part of the base is a SHA-256 digest (stable across processes and runs, unlike
Python's ``hash``), and the rollout and turn are added as disjoint strides, so the requests of
one GRPO group never share a seed (for ``rollout.n`` <= 32768 and turns < 65536). ``rollout_n``
restarts when a group is split over two agent-loop workers' chunks, so the setting needs every
chunk to hold whole groups (:func:`~fedagent_flwr.trainers.verl.overrides.split_group_error`,
checked at start-up).
"""

from __future__ import annotations

import hashlib
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

from fedagent_flwr.trainers.verl.manager import WorkerManager

#: the agent loop's keyword argument (a row column added by the worker) carrying a rollout's seed base
SEED_BASE_KEY = "request_seed_base"
#: the row column carrying the rollout's verl step (``trajectory["step"]``), for the request fingerprints
REQUEST_STEP_KEY = "request_step"
#: the row column carrying the rollout's place in its GRPO group (``trajectory["rollout_n"]``), likewise
REQUEST_GROUP_PLACE_KEY = "request_rollout_n"
#: vLLM's seeds are taken modulo this (a non-negative 31-bit int fits every backend's generator)
SEED_RANGE = 2**31
#: seeds reserved per rollout: one per turn
TURN_STRIDE = 2**16


def seed_base(env_seed: int, step: int, sample_index: int, rollout_n: int, validate: bool) -> int:
    """A rollout's seed base: a digest of its group (env seed, step, row, validate) plus ``rollout_n``
    turn strides, so the rollouts of one group are ``TURN_STRIDE`` apart (mod ``SEED_RANGE``)."""
    key = f"fedagent-request-seed:{int(env_seed)}:{int(step)}:{int(sample_index)}:{int(bool(validate))}"
    group = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return (group + int(rollout_n) * TURN_STRIDE) % SEED_RANGE


def request_seed(base: int, turn: int) -> int:
    """The vLLM seed of turn ``turn`` (0-based) of the rollout whose base is ``base``."""
    return (int(base) + int(turn)) % SEED_RANGE


class RequestSeedMixin:
    """An agent-loop worker that passes each row's seed base (:func:`seed_base`) to the agent loop.

    Put before the worker class (``class W(RequestSeedMixin, AgentLoopWorker)``): the stock or
    windowed ``_run_agent_loop`` then runs with the base as the ``request_seed_base`` column, and
    the trajectory's verl ``step`` and ``rollout_n`` as ``request_step`` and ``request_rollout_n``
    (so a request fingerprint says which step's weights served it: two runs share only step 1's).
    The agent loop takes its row as ``**kwargs`` and verl's post-processing reads only the columns
    it names, so the extra columns change nothing else."""

    async def _run_agent_loop(self, sampling_params: dict[str, Any], trajectory: dict[str, Any], *,
                              agent_name: str, trace: bool = True, **kwargs: Any) -> Any:
        step, place = int(trajectory["step"]), int(trajectory["rollout_n"])
        kwargs[SEED_BASE_KEY] = seed_base(int(kwargs["seed"]), step, int(trajectory["sample_index"]), place,
                                          bool(trajectory["validate"]))
        kwargs[REQUEST_STEP_KEY] = step
        kwargs[REQUEST_GROUP_PLACE_KEY] = place
        return await super()._run_agent_loop(sampling_params, trajectory,  # type: ignore[misc]
                                             agent_name=agent_name, trace=trace, **kwargs)


class SeededAgentLoopWorker(RequestSeedMixin, AgentLoopWorker):
    """verl's agent-loop worker with a seed base per row (concat mode)."""


class SeededAgentLoopManager(WorkerManager):
    """verl's agent-loop manager running :class:`SeededAgentLoopWorker` workers."""

    worker = SeededAgentLoopWorker
