"""ALFWorld's official train pool as partition metadata, and the partitions of it, for the
hetero tests (reference/fedagent.md §4.3).

The official games cannot be downloaded here, but FedAgent's hardness label file names all 3,553
train games (``alfworld_<task dir>_<trial>_game``), which is exactly the metadata the partitions
read: task type, scene, spec and task id. :data:`POOL` is that list in FedAgent's order (sorted by
path, then ``random.Random(42)``-shuffled, as :func:`~fedagent_flwr.envs.alfworld.data.load_games`
orders real data); it is empty where the label file is missing (the tests then skip).

A fresh interpreter imports :func:`partition` too, to check that partitions do not depend on the
process (its hash seed).
"""

from __future__ import annotations

import json
import random

from fedagent_flwr.hetero import GoalInfo, partition_goals
from testkit.flower_harness import REPO

SHARED = REPO.parent / "shared" / "data"
#: FedAgent's hardness labels of Qwen2.5-1.5B on ALFWorld: they name every official train game.
LABELS = SHARED / "hardness" / "qwen2.5-1.5b_alfworld_trajectories.json"
#: The scenes held out of training (the env-disjoint partition leaves them out).
HOLDOUT = SHARED / "holdout" / "holdout_alfworld_v1.json"

#: Every partition strategy.
STRATEGIES = ("uniform", "preference", "coverage", "hardness", "env_disjoint")


def train_pool() -> list[GoalInfo]:
    """GoalInfo of the 3,553 official train games, in FedAgent's seed-42 order."""
    ids = sorted(str(t["task_info"]["task_id"]) for t in json.loads(LABELS.read_text())["trajectories"])
    random.Random(42).shuffle(ids)
    pool = []
    for task_id in ids:
        task_dir, trial = task_id.removeprefix("alfworld_").removesuffix("_game").split("_trial_")
        pool.append(GoalInfo(category=task_dir.split("-", 1)[0], task_id=task_id,
                             scene=task_dir.rsplit("-", 1)[1], group=task_dir.rsplit("-", 1)[0]))
    return pool


POOL = train_pool() if LABELS.is_file() else []


def knobs(strategy: str) -> dict:
    """The partition settings every strategy is run with (each reads those it knows)."""
    return {"min_goals_per_client": 100, "omega": 0.5, "size_std": 1.0, "success_std": 1.0,
            "trajectories_file": str(LABELS), "env_div": 0.7, "holdout_file": str(HOLDOUT)}


def partition(strategy: str, client: int, clients: int, **extra: object) -> list[int]:
    """The :data:`POOL` indices ``strategy`` gives ``client`` of ``clients`` (seed 42), with
    ``extra`` settings over :func:`knobs`."""
    return partition_goals(strategy, client, clients, len(POOL), {**knobs(strategy), **extra}, 42, POOL)
