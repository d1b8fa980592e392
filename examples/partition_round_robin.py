"""A task-level partition strategy: shuffle the goal pool once, then deal it out like cards.

Every client computes its own share, in its own process and on its own machine, so the function
must be pure: the shuffle comes from a numpy generator seeded by the run's ``base_seed`` and a
fixed tag (``shared_rng``), never from Python's salted ``hash()`` or global random state. The
result honours the floor ``min_goals_per_client``: a client whose deal is shorter also takes the
goals dealt right after its own, wrapping around the pool.

Selected by config (``examples/conf/partition/round_robin.yaml``)::

    flwr run . --run-config 'overrides="hydra.searchpath=[pkg://examples.conf] partition=round_robin"'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fedagent_flwr.hetero import GoalInfo
from fedagent_flwr.hetero.common import check_args, knob_int, shared_rng


def round_robin(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any], base_seed: int,
                goal_info: Sequence[GoalInfo] | None = None) -> list[int]:
    """Sorted goal indices of ``client_id``: positions ``client_id, client_id + N, ...`` of a
    seeded shuffle of ``range(num_goals)``, extended to ``min_goals_per_client``."""
    check_args(client_id, num_clients, num_goals)
    floor = min(knob_int(knobs, "min_goals_per_client", 1, 1), num_goals)
    order = [int(g) for g in shared_rng(base_seed, "round_robin").permutation(num_goals)]
    mine = order[client_id::num_clients]
    taken = set(mine)
    position = client_id
    while len(mine) < floor:
        # Walk the deal on from this client's first card (wrapping) and take what it lacks.
        goal = order[position % num_goals]
        if goal not in taken:
            mine.append(goal)
            taken.add(goal)
        position += 1
    return sorted(mine)
