"""Heterogeneity: which goals (or environment variant) each federated client sees.

Partition strategies are pure, deterministic functions of (client id, client count, pool size,
knobs, base seed) - never of process state or Python's salted ``hash()`` - so every process of a
run, on any machine, computes the same partition. :func:`partition_goals` dispatches on the
strategy name; :func:`partition_env_spec` applies a partition to every entry of an env spec whose
environment exposes a goal pool. Validation always uses the full, unpartitioned spec.

The built-in strategies are FedAgent's (``sunblaze-ucb/FedAgent`` a6fdf2c, hardness as revised in
0a41188; specs/partitions.md): the same numpy draws, with the run's base seed where FedAgent
hard-codes 42, FedAgent's floor of 100 when ``min_goals_per_client`` is absent, and the client's
goals **in FedAgent's order** (an environment takes its goals by position). FedAgent's WebShop
wrappers return them sorted: :func:`goal_order` says which order an environment gets.
``python -m fedagent_flwr.hetero.inspect`` prints a partition.

A strategy of another package is named by the dotted path of its function (same signature as the
built-in ones, see :data:`GoalPartitioner`; ``fn.needs_goal_info = True`` asks for goal metadata).
Its result is checked (sorted, distinct, in range, at least the ``min_goals_per_client`` floor),
so a faulty strategy fails with its name instead of training clients on a broken partition.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedagent_flwr.envs.registry import get_env_class
from fedagent_flwr.envs.spec import EnvSpec, EnvSpecEntry, load_env_spec
from fedagent_flwr.hetero.common import DEFAULT_SEED, GoalInfo, knob
from fedagent_flwr.hetero.env_disjoint import env_disjoint_partition, env_disjoint_strategy
from fedagent_flwr.hetero.task import (
    coverage_partition,
    coverage_strategy,
    hardness_partition,
    hardness_strategy,
    load_hardness_labels,
    preference_partition,
    preference_strategy,
    task_disjoint_partition,
    task_disjoint_strategy,
)
from fedagent_flwr.hetero.uniform import PartitionError, uniform_partition
from fedagent_flwr.plugins import PluginError, is_dotted_path, load_object

__all__ = [
    "GOAL_INFO_STRATEGIES",
    "GoalInfo",
    "PartitionError",
    "STRATEGIES",
    "check_strategy",
    "goal_order",
    "needs_goal_info",
    "coverage_partition",
    "env_disjoint_partition",
    "hardness_partition",
    "load_hardness_labels",
    "preference_partition",
    "task_disjoint_partition",
    "partition_env_spec",
    "partition_goals",
    "uniform_partition",
]

# strategy name -> fn(client_id, num_clients, num_goals, knobs, base_seed, goal_info) -> goal indices
GoalPartitioner = Callable[[int, int, int, Mapping[str, Any], int, "Sequence[GoalInfo] | None"], list[int]]


def _none(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any], base_seed: int,
          goal_info: Sequence[GoalInfo] | None = None) -> list[int]:
    # FedAgent's "" strategy: every client samples the whole pool.
    return list(range(num_goals))


def _uniform(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any], base_seed: int,
             goal_info: Sequence[GoalInfo] | None = None) -> list[int]:
    return uniform_partition(client_id, num_clients, num_goals,
                             knob(knobs, "min_goals_per_client"))


STRATEGIES: dict[str, GoalPartitioner] = {
    "none": _none,
    "uniform": _uniform,
    "task_disjoint": task_disjoint_strategy,
    "preference": preference_strategy,
    "coverage": coverage_strategy,
    "hardness": hardness_strategy,
    "env_disjoint": env_disjoint_strategy,
}
#: Strategies that read goal metadata (``goal_info``: one :class:`GoalInfo` per pool goal).
GOAL_INFO_STRATEGIES = frozenset({"preference", "hardness", "env_disjoint"})
# FedAgent spells "no partition" as an empty string.
_ALIASES = {"": "none", "iid": "none"}
#: Goal orders: FedAgent's (the order its partition function produces) or ascending.
GOAL_ORDERS = ("fedagent", "sorted")
#: Environments whose FedAgent partition wrappers return the goals sorted (``webshop_*_for_client``).
SORTED_GOAL_ENVS = frozenset({"WebShop"})


def goal_order(env: str | type | None) -> str:
    """The goal order FedAgent gives an environment: ``"sorted"`` for WebShop, else ``"fedagent"``.

    ``env`` is an environment name or class; a class may declare ``partition_goal_order``.
    """
    declared = getattr(env, "partition_goal_order", None) if isinstance(env, type) else None
    if declared is not None:
        if declared not in GOAL_ORDERS:
            raise PartitionError(f"partition_goal_order must be one of {GOAL_ORDERS}, got {declared!r}")
        return str(declared)
    name = getattr(env, "env_name", None) if isinstance(env, type) else env
    return "sorted" if name in SORTED_GOAL_ENVS else "fedagent"


def _strategy_key(strategy: str | None) -> str:
    if is_dotted_path(strategy):
        return str(strategy).strip()
    key = (strategy or "").strip().lower()
    key = _ALIASES.get(key, key)
    if key not in STRATEGIES:
        raise PartitionError(
            f"unknown partition strategy {strategy!r} (known: {', '.join(STRATEGIES)}, or the dotted "
            "path of a function such as mypkg.partitions.my_split)"
        )
    return key


def _partitioner(key: str) -> GoalPartitioner:
    """The function of a strategy key (a built-in name, or a dotted path that is imported)."""
    if key in STRATEGIES:
        return STRATEGIES[key]
    try:
        function = load_object(key, "partition strategy")
    except PluginError as exc:
        raise PartitionError(str(exc)) from None
    if not callable(function):
        raise PartitionError(f"partition strategy {key!r} is not a function")
    return function  # type: ignore[no-any-return]


def needs_goal_info(strategy: str | None) -> bool:
    """Whether ``strategy`` reads goal metadata (``goal_info``) from the environment."""
    key = _strategy_key(strategy)
    return key in GOAL_INFO_STRATEGIES or bool(getattr(_partitioner(key), "needs_goal_info", False))


def check_strategy(strategy: str | None) -> None:
    """Raise :class:`PartitionError` unless ``strategy`` is a task-level strategy this process can
    run (a dotted path is imported)."""
    _partitioner(_strategy_key(strategy))


def _checked_goals(key: str, goals: Any, num_goals: int, knobs: Mapping[str, Any]) -> list[int]:
    """A user strategy's goal list, checked against the contract every built-in one keeps."""
    floor = min(int(knobs.get("min_goals_per_client") or 1), num_goals)
    if not isinstance(goals, (list, tuple)) or any(isinstance(g, bool) or not isinstance(g, int) for g in goals):
        raise PartitionError(f"partition strategy {key!r} must return a list of int goal indices, got {goals!r:.200}")
    if list(goals) != sorted(set(goals)):
        raise PartitionError(f"partition strategy {key!r} must return sorted, distinct goal indices")
    if goals and not 0 <= goals[0] <= goals[-1] < num_goals:
        raise PartitionError(f"partition strategy {key!r} returned goal indices outside the pool of {num_goals}")
    if len(goals) < floor:
        raise PartitionError(
            f"partition strategy {key!r} gave {len(goals)} goals, fewer than the floor of {floor} "
            "(min_goals_per_client, capped at the pool size)"
        )
    return list(goals)


def partition_goals(
    strategy: str,
    client_id: int,
    num_clients: int,
    num_goals: int,
    knobs: Mapping[str, Any] | None = None,
    base_seed: int = DEFAULT_SEED,
    goal_info: Sequence[GoalInfo] | None = None,
    order: str = "fedagent",
) -> list[int]:
    """Goal indices (distinct, in ``range(num_goals)``) of ``client_id`` under ``strategy``.

    Strategies (FedAgent's, specs/partitions.md): "none" (all goals), "uniform" and "task_disjoint"
    (the ``n // N`` slice widened to the floor), "preference" (knob ``omega``), "coverage"
    (``size_std``), "hardness" (``success_std``, ``trajectories_file``), "env_disjoint" (ALFWorld
    specs; ``env_div``, ``fallback``, ``unit``, ``holdout_file``; no floor, as in FedAgent); the
    others honour ``min_goals_per_client`` (absent: FedAgent's 100; a pool smaller than the floor
    gives what FedAgent gives, for "uniform" the whole pool). ``knobs`` keys a strategy does not use
    are ignored, so one partition config can serve several strategies. ``base_seed`` takes the
    place of FedAgent's hard-coded 42 (42 reproduces FedAgent). ``goal_info[i]`` describes pool goal
    ``i``; it is required by the strategies in :data:`GOAL_INFO_STRATEGIES` and ignored by the
    others. ``order``: "fedagent" (the order FedAgent's partition function returns, which ALFWorld's
    environment follows) or "sorted" (FedAgent's WebShop wrappers); see :func:`goal_order`.
    """
    key = _strategy_key(strategy)
    if order not in GOAL_ORDERS:
        raise PartitionError(f"goal order must be one of {GOAL_ORDERS}, got {order!r}")
    knobs = dict(knobs or {})
    goals = _partitioner(key)(client_id, num_clients, num_goals, knobs, base_seed, goal_info)
    goals = goals if key in STRATEGIES else _checked_goals(key, goals, num_goals, knobs)
    return sorted(goals) if order == "sorted" else goals


def partition_env_spec(
    spec: EnvSpec | Mapping[str, Any],
    partition: Mapping[str, Any] | None,
    client_id: int,
    num_clients: int,
    base_seed: int = DEFAULT_SEED,
) -> EnvSpec:
    """The env spec a client trains on: each goal-pool environment restricted to its goals.

    ``partition`` is the job's partition config: ``{"strategy": ..., <knobs>}`` (empty or
    missing strategy = "none"). Entries whose environment has no goal pool (``num_goals`` is
    None) are left as they are; with strategy "none" the spec is returned unchanged. Each
    environment gets its goals in :func:`goal_order`. Strategies
    that need goal metadata call the environment class's ``goal_info(config)`` classmethod (one
    :class:`GoalInfo` per pool goal) and fail with :class:`PartitionError` when it has none.
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
        goal_info = None
        if needs_goal_info(key):
            provider = getattr(env_cls, "goal_info", None)
            if provider is None:
                raise PartitionError(
                    f"partition strategy {key!r} needs goal metadata, which {entry.name} does not provide"
                )
            goal_info = provider(entry.config)
        goals = partition_goals(key, client_id, num_clients, pool, knobs, base_seed, goal_info, goal_order(env_cls))
        restricted = env_cls.restrict_goals(entry.config, goals)
        entries.append(EnvSpecEntry(entry.name, entry.n_envs, entry.max_turns, restricted))
    return EnvSpec(envs=tuple(entries))
