"""ALFWorld partitions (reference/fedagent.md §4.3) on the real train pool's metadata: the 3,553
official train games named by FedAgent's hardness label file, in FedAgent's order
(:data:`testkit.alfworld_partitions.POOL`).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from fedagent_flwr.envs.alfworld.data import TASK_TYPES
from fedagent_flwr.hetero import GoalInfo, PartitionError, partition_goals
from fedagent_flwr.hetero.env_disjoint import env_disjoint_partition
from fedagent_flwr.hetero.task import coverage_assignment, load_hardness_labels
from fedagent_flwr.hetero.uniform import DEFAULT_MIN_GOALS
from testkit.alfworld_partitions import HOLDOUT, LABELS, POOL, STRATEGIES, partition
from testkit.flower_harness import REPO
from testkit.partition_sizes import hardness_sizes

pytestmark = pytest.mark.skipif(not LABELS.is_file(), reason=f"ALFWorld hardness labels not found at {LABELS}")


def test_pool_is_the_official_train_split() -> None:
    assert len(POOL) == 3553 and len({g.task_id for g in POOL}) == 3553
    assert {g.category for g in POOL} == set(TASK_TYPES.values())


def test_every_strategy_is_deterministic_across_processes() -> None:
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]);"
        "from testkit.alfworld_partitions import STRATEGIES, partition;"
        "print(json.dumps({s: [partition(s, c, 4) for c in range(4)] for s in STRATEGIES}))"
    )
    outputs = [
        subprocess.run([sys.executable, "-c", script, str(REPO)], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout
        for seed in ("1", "2")
    ]
    here = {s: [partition(s, c, 4) for c in range(4)] for s in STRATEGIES}
    assert json.loads(outputs[0]) == json.loads(outputs[1]) == here


@pytest.mark.parametrize("strategy", ["uniform", "preference", "coverage", "hardness"])
def test_floor_with_100_clients(strategy: str) -> None:
    # 3553 // 100 = 35 games per slice: every client is widened or drawn up to the floor of 100.
    for client in (0, 57, 99):
        goals = partition(strategy, client, 100)
        assert len(goals) >= DEFAULT_MIN_GOALS and len(set(goals)) == len(goals)
        assert all(0 <= g < len(POOL) for g in goals)


def test_sizes_per_strategy() -> None:
    clients = 4
    uniform = [partition("uniform", c, clients) for c in range(clients)]
    # FedAgent: 3553 // 4 = 888 each; game 3552 is the tail no client gets.
    assert [len(u) for u in uniform] == [888, 888, 888, 888] and sum(uniform, []) == list(range(3552))
    assert all(len(partition("preference", c, clients)) == 100 for c in range(clients))
    coverage = coverage_assignment(clients, len(POOL), 100, 1.0, 42)
    assert [partition("coverage", c, clients) for c in range(clients)] == coverage
    assert all(100 <= len(c) <= 1000 for c in coverage) and sum(len(c) for c in coverage) == clients * 500
    assert len(set().union(*map(set, coverage))) == clients * 500  # r = 2000/3553 < 1: no goal twice
    labels = load_hardness_labels(LABELS)
    easy_counts = hardness_sizes(clients, len(POOL), 100, 1.0, 42)
    for client in range(clients):
        goals = partition("hardness", client, clients)
        assert len(goals) == 100 == len(set(goals))
        # The easy quota first, then unsuccessful games only (FedAgent 0a41188).
        flags = [labels[POOL[g].task_id] for g in goals]
        assert flags == [True] * easy_counts[client] + [False] * (100 - easy_counts[client])


def test_preference_skews_the_task_type_mix_with_omega() -> None:
    overall = Counter(g.category for g in POOL)

    def top_share(omega: float, client: int) -> float:
        counts = Counter(POOL[g].category for g in partition("preference", client, 8, omega=omega))
        return max(counts.values()) / sum(counts.values())

    # omega -> 0: each client close to the global mix; omega -> 1: one task type dominates.
    global_top = max(overall.values()) / len(POOL)
    near_iid = [top_share(0.01, c) for c in range(8)]
    skewed = [top_share(0.99, c) for c in range(8)]
    assert all(share < global_top + 0.2 for share in near_iid)
    assert all(share > 0.9 for share in skewed)
    assert len({Counter(POOL[g].category for g in partition("preference", c, 8, omega=0.99)).most_common(1)[0][0]
                for c in range(8)}) > 1  # different clients prefer different task types


def test_env_disjoint_takes_games_per_spec_and_keeps_held_out_rooms_out() -> None:
    held_out = set(json.loads(HOLDOUT.read_text())["scenes"])
    specs: dict[str, list[int]] = {}
    for i, g in enumerate(POOL):
        if g.scene not in held_out:
            specs.setdefault(g.group, []).append(i)
    multi = {spec: games for spec, games in specs.items() if len({POOL[i].scene for i in games}) > 1}
    for client in range(8):
        goals = partition("env_disjoint", client, 8)
        assert len(goals) == len(set(goals)) and not {POOL[g].scene for g in goals} & held_out
        # FedAgent counts games, not rooms: k = min(m, ceil(m / N * (1 + env_div))) of every multi-room spec,
        # spec by spec in ascending order; single-room specs are skipped (fallback "skip").
        per_spec = Counter(POOL[g].group for g in goals)
        assert per_spec == {spec: min(len(games), math.ceil(len(games) / 8 * 1.7)) for spec, games in multi.items()}
        assert [POOL[g].group for g in goals] == sorted(POOL[g].group for g in goals)


def test_env_disjoint_scene_unit_keeps_rooms_whole() -> None:
    """``unit: scene``, the earlier design: the top-k picks rooms, and a (spec, room) is all in or all out."""
    held_out = set(json.loads(HOLDOUT.read_text())["scenes"])
    cells = Counter((g.group, g.scene) for g in POOL)
    for client in range(8):
        goals = partition("env_disjoint", client, 8, unit="scene")
        mine = Counter((POOL[g].group, POOL[g].scene) for g in goals)
        assert mine and not {scene for _, scene in mine} & held_out
        assert all(mine[cell] == cells[cell] for cell in mine)
        for spec, taken in Counter(spec for spec, _ in mine).items():
            scenes = {s for (g, s) in cells if g == spec and s not in held_out}
            assert taken == min(len(scenes), math.ceil(len(scenes) / 8 * 1.7))


def test_env_disjoint_divergence_knob() -> None:
    def games(client: int, env_div: float) -> set[int]:
        return set(partition("env_disjoint", client, 8, env_div=env_div))

    same = [games(c, 0.0) for c in range(4)]
    assert all(s == same[0] for s in same)  # env_div 0: every client takes the same games
    apart = [games(c, 1.0) for c in range(4)]
    overlap = [len(apart[0] & a) / len(apart[0] | a) for a in apart[1:]]
    assert max(overlap) < 0.5  # env_div 1: games drawn independently per client


def test_env_disjoint_says_why_a_client_has_nothing() -> None:
    one_room = [GoalInfo(category="pick_and_place_simple", task_id=f"t{i}", scene="1", group="x") for i in range(5)]
    with pytest.raises(PartitionError, match="without games"):
        env_disjoint_partition(0, 2, one_room)
    assert env_disjoint_partition(1, 2, one_room, fallback="shared") == list(range(5))


def test_unknown_strategy_and_missing_metadata_are_refused() -> None:
    with pytest.raises(PartitionError, match="unknown partition strategy"):
        partition_goals("category", 0, 2, 10)  # FedAgent's overlay renamed preference to this
    with pytest.raises(PartitionError, match="needs goal metadata"):
        partition_goals("env_disjoint", 0, 2, 10)


def test_alfworld_env_partitions_its_real_game_set(alfworld_data: Path) -> None:
    """The env's own goal metadata feeds all five strategies on the game set built from the trial."""
    from fedagent_flwr.envs.alfworld.env import AlfWorldEnv
    from fedagent_flwr.hetero import partition_env_spec

    config = {"data_dir": str(alfworld_data), "split": "train"}
    info = AlfWorldEnv.goal_info(config)
    assert len(info) == 6 and {g.scene for g in info} == {"14"}
    spec = {"envs": [{"name": "ALFWorld", "n_envs": 1, "max_turns": 50, "config": config}]}
    for strategy, extra in (("uniform", {}), ("preference", {"omega": 0.9}), ("coverage", {}),
                            ("hardness", {"trajectories_file": str(LABELS)}),
                            ("env_disjoint", {"fallback": "shared"})):
        parts = [partition_env_spec(spec, {"strategy": strategy, "min_goals_per_client": 2, **extra}, c, 2)
                 .envs[0].config["goal_indices"] for c in range(2)]
        assert all(parts) and all(set(p) <= set(range(6)) for p in parts), strategy
    assert AlfWorldEnv.num_goals(AlfWorldEnv.restrict_goals(config, [1, 3])) == 2
