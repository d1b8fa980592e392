"""Goal metadata for the content-aware partitions (``preference``, ``hardness``) of a WebShop pool.

``goal_info_for_world(world)[i]`` describes train goal ``i`` = ``world.goals[world.val_size + i]``,
i.e. pool index ``i`` of :class:`~fedagent_flwr.envs.webshop.env.WebShopEnv`'s train split - the
index space that :func:`fedagent_flwr.hetero.partition_goals` works in. FedAgent computes these
partitions over the real seed-42-shuffled goal list (its fix "B3"), which is what ``world.goals`` is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fedagent_flwr.envs.webshop.data import WebShopWorld, goal_task_id
from fedagent_flwr.hetero.common import GoalInfo


def goal_info_for_world(
    world: WebShopWorld,
    split: str = "train",
    labels: Mapping[str, bool] | None = None,
    goal_indices: Sequence[int] | None = None,
) -> list[GoalInfo]:
    """One :class:`GoalInfo` (category, hardness task id, ASIN, optional success label) per pool goal.

    ``split`` picks the pool (``train`` = ``goals[val_size:]``, ``val`` = ``goals[:val_size]``);
    ``goal_indices`` (pool-relative, as in the env config) narrows it further, in that order.
    ``labels`` (``task_id -> success``, e.g. from :func:`fedagent_flwr.hetero.load_hardness_labels`)
    fills ``success``; goals without a label keep ``None`` (= hard).
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    pool = world.train_goals if split == "train" else world.val_goals
    if goal_indices is not None:
        pool = [pool[i] for i in goal_indices]
    out = []
    for goal in pool:
        task_id = goal_task_id(goal)
        out.append(GoalInfo(
            category=goal.get("category"),
            task_id=task_id,
            success=None if labels is None else labels.get(task_id),
            asin=goal.get("asin"),
        ))
    return out


def goal_info_for_config(config: Mapping[str, Any]) -> list[GoalInfo]:
    """Goal metadata of the pool a WebShop env config describes (``split``, ``goal_indices``, data knobs).

    Matches ``WebShopEnv.num_goals(config)`` entry for entry, so it can back a ``goal_info``
    classmethod on the env class (what :func:`fedagent_flwr.hetero.partition_env_spec` looks for).
    """
    from fedagent_flwr.envs.webshop.env import _goal_indices, _split, _split_bounds, shared_world

    world, _ = shared_world(config)
    _, size = _split_bounds(config)
    return goal_info_for_world(world, _split(config), goal_indices=_goal_indices(config, size))
