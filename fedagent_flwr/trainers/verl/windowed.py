"""Windowed mode on verl: one training row per turn, FedAgent's way (reference §1.4).

Stock verl keeps one row per prompt (times ``rollout.n``) from rollout to update. FedAgent's
windowed mode, followed here, changes three things:

* :class:`WindowedAgentLoopWorker` asks the agent loop for one trajectory per turn
  (:meth:`~fedagent_flwr.trainers.verl.agent_loop.EnvAgentLoop.run_windowed`), flattens them, and
  repeats every input column (``uid`` above all) onto each turn of its episode, so verl's GRPO
  groups the turns of all rollouts of one env instance. In validation it keeps each episode's last
  turn, one row per prompt, as verl expects there. The output is tagged with the row-count divisor.
* :class:`WindowedAgentLoopManager` is verl's manager with that worker
  (``actor_rollout_ref.rollout.agent.agent_loop_manager_class``);
  :class:`SeededWindowedAgentLoopManager` runs it with a seed per request (``trainer.request_seeds``,
  :mod:`.request_seeds`).
* Importing this module patches :class:`verl.DataProto` once, for tagged batches only:
  ``slice(0, k)`` is a no-op (verl cuts the rollout output back to the prompt count), and
  ``prompts.union(output)`` with a tagged output adopts the output (its rows are turns), padded to a
  multiple of the divisor by repeating its first rows (verl needs whole mini-batches and an even
  split over the GPUs). Untagged batches behave exactly as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import hydra
import numpy as np
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
)

from fedagent_flwr.trainers.verl.manager import WorkerManager
from fedagent_flwr.trainers.verl.request_seeds import RequestSeedMixin

#: ``meta_info`` key of a windowed rollout output; its value is the row-count divisor.
TAG = "fedagent_windowed_divisor"


def row_divisor(config: Any) -> int:
    """What the number of training rows must be a multiple of: one PPO mini-batch
    (``ppo_mini_batch_size * rollout.n`` rows) and every micro-batch times the world size
    (FedAgent's ``_compute_size_divisor``)."""
    arr = config.actor_rollout_ref
    world = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    terms = [int(arr.actor.ppo_mini_batch_size) * int(arr.rollout.n), world]
    for micro in (arr.actor.get("ppo_micro_batch_size_per_gpu"), arr.rollout.get("log_prob_micro_batch_size_per_gpu"),
                  arr.ref.get("log_prob_micro_batch_size_per_gpu")):
        if micro:
            terms.append(int(micro) * world)
    if str(config.algorithm.adv_estimator) == "gae":
        terms.append(int(config.critic.ppo_mini_batch_size) * int(arr.rollout.n))
        if config.critic.get("ppo_micro_batch_size_per_gpu"):
            terms.append(int(config.critic.ppo_micro_batch_size_per_gpu) * world)
    return math.lcm(*terms)


def expand_columns(columns: Mapping[str, np.ndarray], counts: Sequence[int]) -> dict[str, np.ndarray]:
    """Each input column with row ``i`` repeated ``counts[i]`` times (its episode's turns)."""
    return {key: np.repeat(value, counts, axis=0) for key, value in columns.items()}


def padded_rows(num_rows: int, divisor: int) -> list[int]:
    """Row indices: all rows, then the first ones again until the count is a multiple of ``divisor``."""
    if num_rows < 1:
        raise ValueError("a windowed rollout produced no rows")
    missing = -num_rows % divisor
    return list(range(num_rows)) + [k % num_rows for k in range(missing)]


class WindowedAgentLoopWorker(AgentLoopWorker):
    """verl's agent-loop worker with one output row per turn (see the module docstring)."""

    async def _run_agent_loop(self, sampling_params: dict[str, Any], trajectory: dict[str, Any], *,  # type: ignore[override]
                              agent_name: str, trace: bool = True, **kwargs: Any) -> list[Any]:
        loop = hydra.utils.instantiate(
            config=_agent_loop_registry[agent_name],
            trainer_config=DictConfigWrap(config=self.config),
            server_manager=self.llm_client,
            tokenizer=self.tokenizer,
            processor=self.processor,
            hf_model_type=self.hf_model_type,
            dataset_cls=self.dataset_cls,
            data_config=DictConfigWrap(self.config.data),
            tools=ToolListWrap(self.tools),
        )
        validate = bool(trajectory["validate"])
        outputs = await loop.run_windowed(sampling_params, validate=validate, **kwargs)
        if validate:
            outputs = outputs[-1:]  # one row per prompt: the episode's last turn carries its return
        return [await self._agent_loop_postprocess(output, validate, **kwargs) for output in outputs]

    def _postprocess(self, inputs: list[Any], input_non_tensor_batch: dict | None = None,  # type: ignore[override]
                     validate: bool = False) -> DataProto:
        counts = [len(turns) for turns in inputs]
        flat = [output for turns in inputs for output in turns]
        columns = expand_columns(input_non_tensor_batch or {}, counts)
        output = super()._postprocess(flat, input_non_tensor_batch=columns, validate=validate)
        # Always carry the row's columns (uid for GRPO's groups): with the streaming reward loop the
        # stock post-processing leaves them out and relies on a same-length union.
        for key, value in columns.items():
            output.non_tensor_batch.setdefault(key, value)
        if not validate:
            output.meta_info[TAG] = row_divisor(self.config)
        return output


class WindowedAgentLoopManager(WorkerManager):
    """verl's agent-loop manager running :class:`WindowedAgentLoopWorker` workers."""

    worker = WindowedAgentLoopWorker


class SeededWindowedAgentLoopWorker(RequestSeedMixin, WindowedAgentLoopWorker):
    """:class:`WindowedAgentLoopWorker` with a seed base per row (``trainer.request_seeds``)."""


class SeededWindowedAgentLoopManager(WorkerManager):
    """verl's agent-loop manager running :class:`SeededWindowedAgentLoopWorker` workers."""

    worker = SeededWindowedAgentLoopWorker


def tagged(data: Any) -> bool:
    """Whether ``data`` is a windowed rollout output."""
    return isinstance(data, DataProto) and TAG in (data.meta_info or {})


def _install() -> None:
    """Patch ``DataProto.slice``/``union`` for tagged batches (once per process)."""
    if getattr(DataProto, "_fedagent_windowed", False):
        return
    stock_slice, stock_union = DataProto.slice, DataProto.union

    def slice_(self: DataProto, start: Any = None, end: Any = None, step: Any = None) -> DataProto:
        if tagged(self) and start in (0, None) and step is None and end is not None:
            return self  # verl trims the rollout to the prompt count; a windowed output has more rows
        return stock_slice(self, start, end, step)

    def union(self: DataProto, other: DataProto) -> DataProto:
        if tagged(other):  # whatever the lengths: rows are turns, not the prompts' repeats
            rows = padded_rows(len(other), int(other.meta_info[TAG]))
            adopted = other.select_idxs(np.array(rows)) if len(rows) != len(other) else other
            meta = {k: v for k, v in adopted.meta_info.items() if k != TAG}
            self.batch, self.non_tensor_batch = adopted.batch, dict(adopted.non_tensor_batch)
            self.meta_info = {**meta, **(self.meta_info or {})}
            return self
        return stock_union(self, other)

    DataProto.slice = slice_  # type: ignore[method-assign]
    DataProto.union = union  # type: ignore[method-assign]
    DataProto._fedagent_windowed = True  # type: ignore[attr-defined]


_install()
