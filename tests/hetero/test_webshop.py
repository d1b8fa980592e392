"""WebShop task-level partitions: task_disjoint, preference, coverage, hardness (reference §4.2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from fedagent_flwr.envs.webshop.data import load_world
from fedagent_flwr.envs.webshop.env import WebShopEnv
from fedagent_flwr.envs.webshop.goal_info import goal_info_for_config, goal_info_for_world
from fedagent_flwr.hetero import (
    GoalInfo,
    PartitionError,
    load_hardness_labels,
    partition_env_spec,
    partition_goals,
    preference_partition,
    task_disjoint_partition,
)
from fedagent_flwr.hetero.common import default_r, generate_client_sizes
from fedagent_flwr.hetero.task import assign_with_overlap, coverage_assignment, hardness_assignment, hardness_partition
from testkit.partition_sizes import coverage_sizes, hardness_sizes
from testkit.webshop_data import DATA_DIR, needs_data

HARDNESS_FILE = DATA_DIR.parent / "hardness" / "qwen2.5-1.5b_webshop_trajectories.json"
needs_labels = pytest.mark.skipif(not HARDNESS_FILE.is_file(), reason=f"hardness labels not found at {HARDNESS_FILE}")


@lru_cache(maxsize=1)
def world_info() -> list[GoalInfo]:
    """Train-pool goal metadata of the real (possibly partial) catalogue, with hardness labels."""
    labels = load_hardness_labels(HARDNESS_FILE) if HARDNESS_FILE.is_file() else None
    return goal_info_for_world(load_world(DATA_DIR), labels=labels)


def synthetic_info(counts: dict[str, int], easy_every: int = 3) -> list[GoalInfo]:
    out = []
    for cat, count in counts.items():
        out += [GoalInfo(category=cat, task_id=f"{cat}_{i}", success=(i % easy_every == 0)) for i in range(count)]
    return out


def _valid(part: list[int], n: int) -> None:
    """Distinct goals of the pool (in FedAgent's order, which need not be ascending)."""
    assert len(part) == len(set(part)) and all(0 <= g < n for g in part)


# --- task_disjoint --------------------------------------------------------------------------------


def test_task_disjoint_documented_sizes_on_fedagent_pool() -> None:
    # Reference §4.2: per-client size max(floor(6410/N), min); N=100 -> 64-goal slices widened to 100.
    n = 6410
    parts = [partition_goals("task_disjoint", c, 100, n, {"min_goals_per_client": 100}) for c in range(100)]
    assert all(len(p) == 100 and p == list(range(p[0], p[0] + 100)) for p in parts)
    assert parts[0] == list(range(0, 100))  # no room on the left: all 36 extra goals on the right
    assert parts[50] == list(range(3200 - 18, 3264 + 18))  # 18 left, 18 right
    assert parts[99] == list(range(6310, 6410))  # right room 10: deficit 8 moved left (18 + 8 = 26)
    assert set(parts[0]) & set(parts[1])
    for num_clients in (2, 10, 50):  # base >= 100: disjoint slices of exactly floor(n/N), tail unused
        parts = [task_disjoint_partition(c, num_clients, n, 100) for c in range(num_clients)]
        base = n // num_clients
        assert [g for p in parts for g in p] == list(range(base * num_clients))


def test_task_disjoint_floor_and_small_pools() -> None:
    assert task_disjoint_partition(0, 3, 10, 0) == [0, 1, 2]
    assert task_disjoint_partition(2, 3, 10, 0) == [6, 7, 8]  # goal 9 is FedAgent's unused tail
    assert task_disjoint_partition(1, 3, 10, 6) == [2, 3, 4, 5, 6, 7]  # [3, 6) + 1 left, 2 right
    assert task_disjoint_partition(1, 2, 10, 50) == list(range(10))  # floor above the pool: everything
    assert task_disjoint_partition(4, 5, 3, 0) == []  # N > n and no floor: FedAgent's empty slice
    assert task_disjoint_partition(4, 5, 3, 1) == [0]  # the floor widens [0, 0) to the right
    with pytest.raises(PartitionError, match="client_id"):
        task_disjoint_partition(3, 3, 10, 0)


@needs_data
def test_task_disjoint_on_the_real_pool() -> None:
    n = len(world_info())
    for num_clients in (2, 10, 100):
        parts = [partition_goals("task_disjoint", c, num_clients, n, {}) for c in range(num_clients)]
        assert all(len(p) == max(n // num_clients, 100) for p in parts)  # default floor: FedAgent's 100


# --- preference -----------------------------------------------------------------------------------


def _max_share(part: list[int], info: list[GoalInfo]) -> float:
    counts = Counter(info[g].category for g in part)
    return max(counts.values()) / len(part)


@needs_data
def test_preference_sizes_and_omega_direction() -> None:
    info = world_info()
    n = len(info)
    knobs = {"min_goals_per_client": 100}
    low = [partition_goals("preference", c, 20, n, {**knobs, "omega": 0.01}, goal_info=info) for c in range(20)]
    high = [partition_goals("preference", c, 20, n, {**knobs, "omega": 0.99}, goal_info=info) for c in range(20)]
    for part in low + high:
        _valid(part, n)
        assert len(part) == 100  # exactly min_goals
    # omega 0.99: (nearly) every client draws from a single category.
    assert np.mean([_max_share(p, info) for p in high]) > 0.95
    # omega 0.01: q ~ pi, the category mix after keeping 20 % of fashion; no client is single-category.
    cats = Counter(g.category for g in info)
    kept = {c: (max(1, int(0.2 * k)) if c == "fashion" else k) for c, k in cats.items()}
    top = max(kept.values()) / sum(kept.values())
    assert all(len({info[g].category for g in p}) >= 3 for p in low)
    assert abs(np.mean([_max_share(p, info) for p in low]) - top) < 0.08
    # fashion is subsampled: with omega small its share is far below its raw pool share.
    raw_fashion = cats["fashion"] / n
    fashion_share = np.mean([sum(info[g].category == "fashion" for g in p) / 100 for p in low])
    assert raw_fashion > 0.6 and fashion_share < raw_fashion - 0.2
    # different clients, different preferences
    assert len({Counter(info[g].category for g in p).most_common(1)[0][0] for p in high}) >= 2


def test_preference_exhausted_categories_and_floor() -> None:
    info = synthetic_info({"a": 5, "b": 3, "c": 200})
    n = len(info)
    for c in range(10):
        for omega in (0.01, 0.5, 0.99):
            part = preference_partition(c, 10, n, info, min_goals_per_client=150, omega=omega)
            _valid(part, n)
            assert len(part) == 150
    # floor above the pool gives every goal; min_goals 0 gives none (FedAgent draws multinomial(0, q))
    assert sorted(preference_partition(0, 2, n, info, min_goals_per_client=999)) == list(range(n))
    assert preference_partition(0, 2, n, info, min_goals_per_client=0) == []
    with pytest.raises(PartitionError, match="min_goals_per_client"):
        preference_partition(0, 2, n, info, min_goals_per_client=-1)
    # N is never used: a client's goals do not depend on the number of clients
    assert preference_partition(1, 2, n, info, 50) == preference_partition(1, 9, n, info, 50)
    # a fashion-only pool: 20 % of fashion is kept, the top-up fills from the rest
    fashion = synthetic_info({"fashion": 100})
    assert len(preference_partition(1, 2, 100, fashion, min_goals_per_client=60)) == 60


def test_preference_needs_goal_info() -> None:
    with pytest.raises(PartitionError, match="needs goal metadata"):
        partition_goals("preference", 0, 2, 10, {})
    with pytest.raises(PartitionError, match="goal_info has 3 entries"):
        partition_goals("preference", 0, 2, 10, {}, goal_info=[GoalInfo("a")] * 3)
    with pytest.raises(PartitionError, match="omega"):
        partition_goals("preference", 0, 2, 3, {"omega": 1.5}, goal_info=[GoalInfo("a")] * 3)


# --- coverage -------------------------------------------------------------------------------------


def _check_assignment(parts: list[list[int]], sizes: list[int], n: int, tight: bool = True) -> None:
    """FedAgent's assignment: each client at most its size (a sample goes to min(k_m, clients with
    room) clients, a shortfall is topped up at random, possibly with goals it already has)."""
    lens = [len(p) for p in parts]
    assert all(length <= size for length, size in zip(lens, sizes))
    for p in parts:
        _valid(p, n)
    if tight:  # on real pools: (nearly) the sizes, (nearly) every goal held floor(r) or ceil(r) times
        assert sum(sizes) - sum(lens) <= max(1, sum(sizes) // 100)
        r = sum(sizes) / n
        copies = Counter(g for p in parts for g in p)
        assert sum(copies[g] in (np.floor(r), np.ceil(r)) for g in range(n)) >= 0.99 * n


@needs_data
@pytest.mark.parametrize("num_clients", [2, 10, 100])
def test_coverage_sizes_overlap_and_bounds(num_clients: int) -> None:
    n = len(world_info())
    for size_std in (1.0, 256.0):
        sizes = coverage_sizes(num_clients, n, 100, size_std)
        assert all(100 <= s <= 1000 for s in sizes)
        assert sum(sizes) == num_clients * 500  # FedAgent's round(r*n), r = N*500/n
        parts = coverage_assignment(num_clients, n, 100, size_std)
        _check_assignment(parts, sizes, n)
        if num_clients * 500 > n:  # r > 1: every goal is held by >= floor(r) clients
            assert all(len(set(parts[0]) & set(p)) > 0 for p in parts[1:])
    assert partition_goals("coverage", 1, num_clients, n, {"size_std": 1.0}) == coverage_assignment(num_clients, n)[1]


@needs_data
def test_coverage_documented_two_client_total_and_concentration() -> None:
    n = len(world_info())
    # Reference example "2 clients got 876 and 124": the pair always sums to 1000 (r = 1000/n < 1, no overlap).
    for seed in range(5):
        sizes = coverage_sizes(2, n, 100, 1.0, base_seed=seed)
        assert sum(sizes) == 1000 and min(sizes) >= 100
        parts = coverage_assignment(2, n, 100, 1.0, base_seed=seed)
        assert [len(p) for p in parts] == sizes and not set(parts[0]) & set(parts[1])
    even = coverage_sizes(100, n, 100, 256.0)
    skew = coverage_sizes(100, n, 100, 1.0)
    assert max(abs(s - 500) for s in even) < 100  # large size_std: near-uniform
    assert np.std(skew) > 3 * np.std(even) and max(skew) - min(skew) > 600


def test_coverage_floor_and_small_pools() -> None:
    sizes = coverage_sizes(8, 4000, 300, 1.0)
    assert min(sizes) >= 300 and sum(sizes) == 8 * 500
    # FedAgent's bounds do not shrink with the pool: a pool below the sizes goes to every client whole.
    assert sum(coverage_sizes(3, 50, 10, 1.0)) == 1500
    assert [sorted(p) for p in coverage_assignment(3, 50, 10, 1.0)] == [list(range(50))] * 3
    sizes = coverage_sizes(4, 700, 100, 1.0)
    parts = coverage_assignment(4, 700, 100, 1.0)
    _check_assignment(parts, sizes, 700, tight=False)
    assert all(len(p) > 100 for p in parts)
    with pytest.raises(PartitionError, match="<= 500"):  # FedAgent asserts low <= center
        coverage_assignment(2, 5000, 501, 1.0)


def test_assign_with_overlap_follows_k() -> None:
    rng = np.random.default_rng(0)
    for _ in range(30):
        num_clients, n = int(rng.integers(1, 12)), int(rng.integers(1, 40))
        sizes = [int(s) for s in rng.integers(0, n + 1, size=num_clients)]
        if sum(sizes) == 0:
            continue
        r = sum(sizes) / n
        sets, k = assign_with_overlap(n, sizes, r, np.random.default_rng(int(rng.integers(1 << 30))))
        assert set(k) <= {int(np.floor(r)), int(np.ceil(r))} and sum(k) == sum(sizes)
        _check_assignment([list(s) for s in sets], sizes, n, tight=False)
        if r <= 1:  # each goal to at most one client: the sizes come out exactly
            assert [len(s) for s in sets] == sizes


def test_sizing_helpers() -> None:
    assert default_r(3553, 3, 100, 500, 1000) == 1500 / 3553
    assert default_r(100, 3, 100, 500, 1000) == 15.0  # r > 1: goals shared by several clients
    sizes = generate_client_sizes(50, 0, 50, 100, 1.0, 2500, np.random.default_rng(1))
    assert sum(sizes) == 2500 and 0 <= min(sizes) and max(sizes) <= 100
    # a total outside [C*low, C*high] is clamped (FedAgent), equal bounds draw nothing
    assert generate_client_sizes(2, 10, 20, 30, 1.0, 100, np.random.default_rng(1)) == [30, 30]
    assert generate_client_sizes(3, 7, 7, 7, 1.0, 0, np.random.default_rng(1)) == [7, 7, 7]
    # specs/partitions.md §7: N = 3, L = 100, s = 16 -> [456, 495, 549] from default_rng(42)
    assert generate_client_sizes(3, 100, 500, 1000, 16, 1500, np.random.default_rng(42)) == [456, 495, 549]
    with pytest.raises(PartitionError, match="low <= center <= high"):
        generate_client_sizes(2, 10, 5, 30, 1.0, 40, np.random.default_rng(1))


# --- hardness -------------------------------------------------------------------------------------


@needs_labels
def test_hardness_labels_file_matches_documented_counts() -> None:
    labels = load_hardness_labels(HARDNESS_FILE)
    assert (len(labels), sum(labels.values())) == (6402, 1780)  # reference §3.5: 6,402 labels, 1,780 easy


@needs_data
@needs_labels
def test_hardness_sizes_easy_counts_and_label_sources() -> None:
    info = world_info()
    n = len(info)
    easy = {i for i, g in enumerate(info) if g.success}
    assert easy and len(easy) < n / 2
    for success_std, spread in ((256.0, False), (1.0, True)):
        counts = hardness_sizes(20, n, 100, success_std)
        assert sum(counts) == 20 * 50 and all(0 <= e <= 100 for e in counts)
        assert (max(counts) - min(counts) > 50) is spread
        parts = hardness_assignment(20, n, info, 100, success_std)
        assert partition_goals("hardness", 19, 20, n, {"success_std": success_std}, goal_info=info) == parts[19]
        for c in range(20):
            part = parts[c]
            _valid(part, n)
            assert len(part) == 100
            assert len(easy & set(part)) == counts[c]
            assert set(part[:counts[c]]) <= easy  # the quota first (set order), then unsuccessful goals
    # labels from the trajectories file (keyed by task id) give the same partition as GoalInfo.success
    bare = [GoalInfo(category=g.category, task_id=g.task_id, asin=g.asin) for g in info]
    knobs = {"success_std": 1.0, "trajectories_file": str(HARDNESS_FILE)}
    assert partition_goals("hardness", 3, 20, n, knobs, goal_info=bare) == \
        partition_goals("hardness", 3, 20, n, {"success_std": 1.0}, goal_info=info)


def test_hardness_caps_floor_and_errors() -> None:
    info = synthetic_info({"x": 30}, easy_every=10)  # 3 easy, 27 hard
    for c in range(4):
        part = hardness_partition(c, 4, 30, info, min_goals_per_client=20, success_std=1.0)
        assert len(part) == 20 and len({0, 10, 20} & set(part)) <= 3
    assert sorted(hardness_partition(0, 2, 30, info, min_goals_per_client=99)) == list(range(30))
    # unlabelled goals count as hard; with no label at all there is nothing to partition by
    with pytest.raises(PartitionError, match="success labels"):
        hardness_partition(0, 2, 3, [GoalInfo("a")] * 3)
    mixed = [GoalInfo("a", success=True), GoalInfo("a", success=None), GoalInfo("a", success=False)]
    assert len(hardness_partition(1, 2, 3, mixed, min_goals_per_client=2)) == 2
    with pytest.raises(PartitionError, match="cannot read hardness labels"):
        partition_goals("hardness", 0, 2, 3, {"trajectories_file": "/nonexistent.json"}, goal_info=mixed)


# --- determinism, dispatcher and env wiring -------------------------------------------------------

_DETERMINISM_CODE = """
import json, sys
from fedagent_flwr.envs.webshop.data import load_world
from fedagent_flwr.envs.webshop.goal_info import goal_info_for_world
from fedagent_flwr.hetero import load_hardness_labels, partition_goals
data, labels = sys.argv[1], sys.argv[2]
info = goal_info_for_world(load_world(data), labels=load_hardness_labels(labels))
n = len(info)
out = {}
for s in ("task_disjoint", "preference", "coverage", "hardness"):
    for c in (0, 7):
        out[f"{s}/{c}"] = partition_goals(s, c, 10, n, {"omega": 0.5, "size_std": 1.0, "success_std": 1.0},
                                          base_seed=42, goal_info=info)
print(json.dumps(out))
"""


@needs_data
@needs_labels
def test_same_indices_in_separate_processes() -> None:
    info = world_info()
    n = len(info)
    knobs = {"omega": 0.5, "size_std": 1.0, "success_std": 1.0}
    here = {f"{s}/{c}": partition_goals(s, c, 10, n, knobs, base_seed=42, goal_info=info)
            for s in ("task_disjoint", "preference", "coverage", "hardness") for c in (0, 7)}
    root = Path(__file__).resolve().parents[2]
    for hash_seed in ("1", "987"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", _DETERMINISM_CODE, str(DATA_DIR), str(HARDNESS_FILE)],
                             capture_output=True, text=True, check=True, env=env, cwd=root)
        assert json.loads(out.stdout) == here
    # ... and the seed matters for the random strategies
    for s in ("preference", "coverage", "hardness"):
        assert partition_goals(s, 0, 10, n, knobs, base_seed=43, goal_info=info) != here[f"{s}/0"]


def test_dispatcher_knows_the_task_strategies() -> None:
    info = synthetic_info({"a": 40, "b": 40})
    for s in ("task_disjoint", "TASK_DISJOINT", "preference", "coverage", "hardness"):
        part = partition_goals(s, 1, 4, 80, {"min_goals_per_client": 10, "env_div": 0.7}, goal_info=info)
        assert len(part) >= 10
    with pytest.raises(PartitionError, match="size_std"):
        partition_goals("coverage", 0, 2, 80, {"size_std": "wide"})
    with pytest.raises(PartitionError, match="min_goals_per_client"):
        partition_goals("task_disjoint", 0, 2, 80, {"min_goals_per_client": -1})


@needs_data
def test_goal_info_for_config_matches_the_env_pool() -> None:
    config = {"data_dir": str(DATA_DIR)}
    info = goal_info_for_config(config)
    assert len(info) == WebShopEnv.num_goals(config) == len(world_info())
    assert [(g.category, g.task_id) for g in info] == [(g.category, g.task_id) for g in world_info()]
    narrowed = goal_info_for_config({**config, "goal_indices": [5, 2]})
    assert narrowed == [info[5], info[2]]
    assert len(goal_info_for_config({**config, "split": "val"})) == WebShopEnv.num_goals({**config, "split": "val"})


@needs_data
def test_partition_env_spec_with_webshop(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"envs": [{"name": "WebShop", "n_envs": 2, "max_turns": 15, "config": {"data_dir": str(DATA_DIR)}}]}
    n = len(world_info())
    part = partition_env_spec(spec, {"strategy": "coverage", "size_std": 1.0}, 1, 4)
    # FedAgent's WebShop wrappers sort the client's goals (ALFWorld keeps FedAgent's order)
    assert part.envs[0].config["goal_indices"] == sorted(coverage_assignment(4, n, 100, 1.0)[1])
    # WebShop supplies goal metadata through its goal_info(config) classmethod...
    part = partition_env_spec(spec, {"strategy": "preference", "omega": 0.99, "min_goals_per_client": 30}, 2, 4)
    goals = part.envs[0].config["goal_indices"]
    assert goals == partition_goals("preference", 2, 4, n, {"omega": 0.99, "min_goals_per_client": 30},
                                    goal_info=world_info(), order="sorted")
    assert len(goals) == 30
    # ...an environment without one is refused for the strategies that need it.
    monkeypatch.delattr(WebShopEnv, "goal_info")
    with pytest.raises(PartitionError, match="needs goal metadata"):
        partition_env_spec(spec, {"strategy": "preference"}, 0, 4)
