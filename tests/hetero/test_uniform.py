"""Uniform goal partition, the strategy dispatcher and partitioned env specs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from fedagent_flwr.envs.registry import make_env
from fedagent_flwr.envs.tiny_guess import CORRECT_OBS
from fedagent_flwr.hetero import PartitionError, partition_env_spec, partition_goals, uniform_partition
from fedagent_flwr.hetero.uniform import DEFAULT_MIN_GOALS


def test_single_client_gets_everything() -> None:
    assert uniform_partition(0, 1, 7) == list(range(7))  # b = n; a pool below the floor: all of it
    assert uniform_partition(0, 1, 7, min_goals_per_client=3) == list(range(7))


@pytest.mark.parametrize(("num_clients", "num_goals"), [(2, 10), (3, 10), (4, 50), (7, 100), (10, 10)])
def test_without_floor_slices_are_fedagent_n_over_n_and_drop_the_tail(num_clients: int, num_goals: int) -> None:
    parts = [uniform_partition(c, num_clients, num_goals, 1) for c in range(num_clients)]
    base = num_goals // num_clients
    assert [g for part in parts for g in part] == list(range(base * num_clients))  # disjoint, in order
    assert {len(p) for p in parts} == {base}  # the n mod N tail belongs to no client (FedAgent)


def test_floor_widens_like_fedagent() -> None:
    # FedAgent's paper setting on ALFWorld: 100 clients over 3,553 games, 100 goals each.
    parts = [uniform_partition(c, 100, 3553, 100) for c in range(100)]
    assert all(len(p) == 100 and p == list(range(p[0], p[0] + 100)) for p in parts)
    assert parts[0][0] == 0 and parts[-1][-1] < 3553
    assert set(parts[0]) & set(parts[1])  # neighbours overlap once widened
    # An interior slice [1750, 1785) of 35 games grows by need // 2 = 32 on the left, 33 on the right.
    assert uniform_partition(50, 100, 3553, 100) == list(range(1750 - 32, 1785 + 33))
    # specs/partitions.md §4: a 260-item pool, L = 100, N = 3 -> [0, 100), [79, 179), [160, 260).
    assert [uniform_partition(c, 3, 260, 100)[::99] for c in range(3)] == [[0, 99], [79, 178], [160, 259]]
    assert uniform_partition(1, 4, 10, 4) == [1, 2, 3, 4]  # [2, 4) + 1 left, 1 right
    assert uniform_partition(1, 4, 10, 6) == [0, 1, 2, 3, 4, 5]  # 2 left, 2 right
    assert uniform_partition(3, 4, 10, 4) == [5, 6, 7, 8]  # goals 8, 9 are the tail: only widening reaches 8


def test_default_floor_is_fedagents_and_a_pool_below_it_goes_to_everyone() -> None:
    # TinyGuess's 10 secrets against FedAgent's floor of 100: every client gets the whole pool.
    assert DEFAULT_MIN_GOALS == 100
    assert uniform_partition(2, 4, 10) == list(range(10))
    assert partition_goals("uniform", 1, 2, 10, {}) == list(range(10))
    assert uniform_partition(2, 4, 10, min_goals_per_client=10) == list(range(10))
    assert uniform_partition(3, 4, 10, min_goals_per_client=99) == list(range(10))
    # The default run's floor of 1 (conf/partition/uniform.yaml) splits them.
    assert [partition_goals("uniform", c, 2, 10, {"min_goals_per_client": 1}) for c in range(2)] == [
        [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert uniform_partition(0, 3, 0) == []  # FedAgent: an empty pool gives an empty slice


def test_fixed_values_and_cross_process_stability() -> None:
    expected = {"c0": uniform_partition(0, 4, 50, 20), "c3": uniform_partition(3, 4, 50, 20)}
    assert expected == {"c0": list(range(0, 20)), "c3": list(range(30, 50))}
    code = (
        "import json; from fedagent_flwr.hetero import partition_goals as p;"
        "print(json.dumps({'c0': p('uniform', 0, 4, 50, {'min_goals_per_client': 20}),"
        " 'c3': p('uniform', 3, 4, 50, {'min_goals_per_client': 20})}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123"} | dict(__import__("os").environ))
    assert json.loads(out.stdout) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [((4, 4, 10), "client_id 4"), ((-1, 4, 10), "client_id"), ((0, 0, 10), "num_clients"),
     ((0, 4, -1), "num_goals"), ((0, 2, 10, -1), "min_goals_per_client")],
)
def test_bad_arguments(args: tuple[int, ...], message: str) -> None:
    with pytest.raises(PartitionError, match=message):
        uniform_partition(*args)


def test_dispatcher() -> None:
    assert partition_goals("none", 1, 4, 10, {}) == list(range(10))
    assert partition_goals("", 1, 4, 10) == list(range(10))  # FedAgent's spelling of "no partition"
    knobs = {"min_goals_per_client": 20, "omega": 0.5}  # knobs of other strategies are ignored
    assert partition_goals("Uniform", 1, 4, 50, knobs) == uniform_partition(1, 4, 50, 20)
    with pytest.raises(PartitionError, match="goal order"):
        partition_goals("uniform", 0, 2, 10, {}, order="random")
    with pytest.raises(PartitionError, match=r"'catalog_split'.*none, uniform"):
        partition_goals("catalog_split", 0, 2, 10, {})


def test_partition_env_spec_restricts_tinyguess_targets() -> None:
    spec = {"envs": [{"name": "TinyGuess", "n_envs": 3, "max_turns": 4, "config": {"lo": 11, "hi": 60}}]}
    assert partition_env_spec(spec, {}, 0, 4).to_dict()["envs"][0]["config"] == {"lo": 11, "hi": 60}
    assert partition_env_spec(spec, {"strategy": "none"}, 0, 4).envs[0].config == {"lo": 11, "hi": 60}
    part = partition_env_spec(spec, {"strategy": "uniform", "min_goals_per_client": 20}, 3, 4)
    entry = part.envs[0]
    assert (entry.name, entry.n_envs, entry.max_turns) == ("TinyGuess", 3, 4)
    assert entry.config["targets"] == [11 + g for g in range(30, 50)]

    async def secrets() -> set[int]:
        found = set()
        for seed in range(40):
            env = make_env(entry.name, {**entry.env_config(), "max_turns": 64})
            await env.reset(seed)
            for guess in range(11, 61):
                if (await env.step(f"<answer>{guess}</answer>"))[0] == CORRECT_OBS:
                    found.add(guess)
                    break
        return found

    assert asyncio.run(secrets()) == set(entry.config["targets"])


def test_partition_env_spec_unknown_strategy() -> None:
    spec = {"envs": [{"name": "TinyGuess", "n_envs": 1}]}
    with pytest.raises(PartitionError, match="unknown partition strategy"):
        partition_env_spec(spec, {"strategy": "dirichlet"}, 0, 2)


def test_coverage_names_a_bad_spread_before_a_bad_minimum() -> None:
    """With both knobs invalid, coverage names its spread (``dispersion_s``) first, in the per-client
    dispatcher and in the once-for-all assignment alike: the order the checks had before they shared
    one ``size_std`` reader."""
    from fedagent_flwr.hetero.task import all_clients

    knobs = {"min_goals_per_client": -1, "dispersion_s": -3.0}
    with pytest.raises(PartitionError, match="dispersion_s"):
        partition_goals("coverage", 0, 2, 10, knobs)
    with pytest.raises(PartitionError, match="dispersion_s"):
        all_clients("coverage", 2, 10, knobs, 1)
