"""Heterogeneity: which goals (or environment variant) each federated client sees.

Partition strategies are pure, deterministic functions of (client id, client count, pool size,
knobs, base seed) - never of process state or Python's salted ``hash()`` - so every process of a
run, on any machine, computes the same partition. :func:`partition_goals` dispatches on the
strategy name; :func:`partition_env_spec` applies a partition to every entry of an env spec whose
environment exposes a goal pool. Validation always uses the full, unpartitioned spec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fedagent_flwr.envs.registry import get_env_class
from fedagent_flwr.envs.spec import EnvSpec, EnvSpecEntry, load_env_spec
from fedagent_flwr.hetero.uniform import PartitionError, uniform_partition

__all__ = [
    "PartitionError",
    "STRATEGIES",
    "partition_env_spec",
    "partition_goals",
    "uniform_partition",
]

# strategy name -> fn(client_id, num_clients, num_goals, knobs, base_seed) -> goal indices
GoalPartitioner = Callable[[int, int, int, Mapping[str, Any], int], list[int]]


def _none(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any], base_seed: int) -> list[int]:
    # FedAgent's "" strategy: every client samples the whole pool.
    return list(range(num_goals))


def _uniform(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any], base_seed: int) -> list[int]:
    return uniform_partition(client_id, num_clients, num_goals, int(knobs.get("min_goals_per_client", 0)))


STRATEGIES: dict[str, GoalPartitioner] = {"none": _none, "uniform": _uniform}
# FedAgent spells "no partition" as an empty string.
_ALIASES = {"": "none", "iid": "none"}


def _strategy_key(strategy: str | None) -> str:
    key = (strategy or "").strip().lower()
    key = _ALIASES.get(key, key)
    if key not in STRATEGIES:
        raise PartitionError(
            f"unknown partition strategy {strategy!r} (known: {', '.join(sorted(STRATEGIES))})"
        )
    return key


def partition_goals(
    strategy: str,
    client_id: int,
    num_clients: int,
    num_goals: int,
    knobs: Mapping[str, Any] | None = None,
    base_seed: int = 42,
) -> list[int]:
    """Goal indices of ``client_id`` under ``strategy`` ("none" = all goals, "uniform" = slice).

    ``knobs`` holds the strategy's parameters (``min_goals_per_client`` for "uniform"); keys a
    strategy does not use are ignored, so one partition config can serve several strategies.
    ``base_seed`` is part of the contract for randomised strategies; "none" and "uniform" are
    pure arithmetic and do not use it.
    """
    return STRATEGIES[_strategy_key(strategy)](client_id, num_clients, num_goals, dict(knobs or {}), base_seed)


def partition_env_spec(
    spec: EnvSpec | Mapping[str, Any],
    partition: Mapping[str, Any] | None,
    client_id: int,
    num_clients: int,
    base_seed: int = 42,
) -> EnvSpec:
    """The env spec a client trains on: each goal-pool environment restricted to its goals.

    ``partition`` is the job's partition config: ``{"strategy": ..., <knobs>}`` (empty or
    missing strategy = "none"). Entries whose environment has no goal pool (``num_goals`` is
    None) are left as they are; with strategy "none" the spec is returned unchanged.
    """
    env_spec = load_env_spec(spec)
    knobs = dict(partition or {})
    key = _strategy_key(knobs.pop("strategy", "none"))
    if key == "none":
        return env_spec
    entries: list[EnvSpecEntry] = []
    for entry in env_spec.envs:
        env_cls = get_env_class(entry.name)
        pool = env_cls.num_goals(entry.config)
        if pool is None:
            entries.append(entry)
            continue
        goals = partition_goals(key, client_id, num_clients, pool, knobs, base_seed)
        restricted = env_cls.restrict_goals(entry.config, goals)
        entries.append(EnvSpecEntry(entry.name, entry.n_envs, entry.max_turns, restricted))
    return EnvSpec(envs=tuple(entries))
