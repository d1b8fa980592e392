"""Task-level partitions of a goal pool (specs/partitions.md §5-§8): which goals each client trains on.

Each function reproduces FedAgent's, draw for draw, with the run's base seed ``S`` where FedAgent
hard-codes 42 (``S = 42`` gives FedAgent's partition), and returns pool indices **in FedAgent's
order** (ALFWorld's environment takes games from its list by position; FedAgent's WebShop wrappers
sort, which :func:`fedagent_flwr.hetero.partition_goals` does for ``order="sorted"``).

* :func:`task_disjoint_partition` - FedAgent's catalog_split goal slice (full catalogue): the
  ``uniform`` arithmetic (§4, §10.2).
* :func:`preference_partition` - category skew (§5): ``q ~ Dir(pi (1 - omega)/omega)`` from
  ``RandomState(S + c)``, exactly ``L`` goals ``~ Multinomial(L, q)`` over categories in order of
  first appearance, one capacity redistribution, a uniform top-up.
* :func:`coverage_partition` - Beta client sizes in ``[L, 1000]`` around 500 and FedAgent's
  ``assign_with_overlap``, all from one ``default_rng(S)`` (§7); each client's goals in set order.
* :func:`hardness_partition` - as revised in FedAgent 0a41188 (§8): a Beta easy quota per client
  placed among the successful goals with ``assign_with_overlap``, then unsuccessful goals up to
  ``L``, all from one ``default_rng(S)`` whose post-assignment state every client shares.

``L`` is ``min_goals_per_client`` (FedAgent's default 100). A pool smaller than ``L`` is not an
error: preference then gives every goal, coverage and hardness what FedAgent gives.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedagent_flwr.hetero.common import (
    DEFAULT_OMEGA,
    DEFAULT_SEED,
    DEFAULT_SIZE_STD,
    DEFAULT_SUCCESS_STD,
    GoalInfo,
    assign_with_overlap,
    check_args,
    check_goal_info,
    check_int,
    check_sizes,
    default_r,
    fedagent_slice,
    first_knob,
    generate_client_sizes,
    knob,
)
from fedagent_flwr.hetero.uniform import DEFAULT_MIN_GOALS, PartitionError
from fedagent_flwr.schema.run import Partition

__all__ = [
    "assign_with_overlap", "coverage_assignment", "coverage_partition", "hardness_assignment", "hardness_partition",
    "load_hardness_labels", "preference_partition", "task_disjoint_partition",
]

# --- task_disjoint --------------------------------------------------------------------------------


def task_disjoint_partition(client_id: int, num_clients: int, num_goals: int,
                            min_goals_per_client: int = DEFAULT_MIN_GOALS) -> list[int]:
    """FedAgent's ``task_disjoint``: the catalog_split goal slice with the full catalogue.

    The ``uniform`` arithmetic (:func:`~fedagent_flwr.hetero.uniform.uniform_bounds`): disjoint
    ``n // N`` slices when ``n // N >= min_goals``, otherwise widened so that neighbours overlap.
    """
    return fedagent_slice(client_id, num_clients, num_goals, min_goals_per_client)


# --- preference -----------------------------------------------------------------------------------

#: FedAgent keeps a random ``max(1, int(0.2 f))`` of the ``f`` fashion goals (WebShop) before the draw.
FASHION_CATEGORY = "fashion"
FASHION_SAMPLE_RATIO: float = Partition.fashion_sample_ratio  # type: ignore[assignment]  # the field's default
PREFERENCE_EPS = 0.01
#: FedAgent's ``partition_dataset`` uses ``tau`` (default 0.3, the schema's) when ``omega`` is not
#: given; its runs always pass ``OMEGA`` (default 0.5, ``conf/partition/preference.yaml``).
OMEGA_CLIP = (1e-3, 1 - 1e-3)
UNKNOWN_CATEGORY = "unknown"


def _category(info: GoalInfo) -> str:
    return UNKNOWN_CATEGORY if info.category is None else str(info.category)


def preference_partition(
    client_id: int,
    num_clients: int,
    num_goals: int,
    goal_info: Sequence[GoalInfo],
    min_goals_per_client: int = DEFAULT_MIN_GOALS,
    omega: float = DEFAULT_OMEGA,
    base_seed: int = DEFAULT_SEED,
    fashion_sample_ratio: float = FASHION_SAMPLE_RATIO,
) -> list[int]:
    """Dirichlet category preference (ω, specs/partitions.md §5): ``L`` goals, in FedAgent's order.

    ``num_clients`` is only checked: a client's goals do not depend on it. Categories are grouped
    in order of first appearance (``None`` = ``"unknown"``); a ``"fashion"`` category keeps
    ``RandomState(S + c).choice(fashion, max(1, int(ratio f)), replace=False)`` (WebShop). Then, on a
    fresh ``RandomState(S + c)``: ``q = dirichlet(pi (1 - omega)/omega)`` with ``pi_k = (p_k + 0.01) /
    (1 + 0.01 C)``; ``counts = multinomial(L, q)``; counts above a category's size are cut and the
    overflow redrawn once over the other categories; each category's count drawn without
    replacement; a shortfall topped up uniformly from the unused goals.
    """
    check_args(client_id, num_clients, num_goals)
    goal_info = check_goal_info("preference", goal_info, num_goals)
    L = check_int("min_goals_per_client", min_goals_per_client, 0)
    omega = min(max(float(omega), OMEGA_CLIP[0]), OMEGA_CLIP[1])
    seed = int(base_seed) + int(client_id)

    groups: dict[str, list[int]] = {}
    for i, info in enumerate(goal_info):
        groups.setdefault(_category(info), []).append(i)
    fashion = groups.get(FASHION_CATEGORY)
    if fashion:
        keep = max(1, int(len(fashion) * fashion_sample_ratio))
        drawn = np.random.RandomState(seed).choice(np.asarray(fashion), size=keep, replace=False)
        groups[FASHION_CATEGORY] = [int(i) for i in drawn]
    cats = list(groups)
    sizes = np.array([len(groups[k]) for k in cats], dtype=np.int64)
    p = sizes / sizes.sum()
    pi = (p + PREFERENCE_EPS) / (1 + PREFERENCE_EPS * len(cats))

    rng = np.random.RandomState(seed)
    q = rng.dirichlet(pi * (1 - omega) / omega)
    q = q / q.sum()
    if not np.all(np.isfinite(q)):
        raise PartitionError(f"preference: the Dirichlet draw of client {client_id} underflowed "
                             f"(omega {omega} is too close to 1); use a smaller omega")
    counts = rng.multinomial(L, q)
    overflow, donors = 0, []
    for k, size in enumerate(sizes):
        if counts[k] > size:
            overflow += int(counts[k] - size)
            counts[k] = size
        elif counts[k] < size:
            donors.append(k)
    if overflow > 0 and donors:
        q_donors = q[donors]
        extra = rng.multinomial(overflow, q_donors / q_donors.sum())
        for j, k in enumerate(donors):
            counts[k] += min(int(extra[j]), int(sizes[k] - counts[k]))

    chosen: list[int] = []
    for k, cat in enumerate(cats):
        if counts[k] > 0:
            chosen += [int(i) for i in rng.choice(np.asarray(groups[cat]), size=int(counts[k]), replace=False)]
    if len(chosen) < L:
        used = set(chosen)
        free = [i for i in range(num_goals) if i not in used]
        take = min(L - len(chosen), len(free))
        chosen += [int(i) for i in rng.choice(np.asarray(free, dtype=np.int64), size=take, replace=False)]
    return chosen


# --- coverage -------------------------------------------------------------------------------------

COVERAGE_CENTER = 500
COVERAGE_HIGH = 1000


def _coverage_setup(num_clients: int, num_goals: int, min_goals_per_client: int, size_std: float,
                    base_seed: int) -> tuple[np.random.Generator, float, list[int]]:
    low = check_sizes(num_clients, num_goals, min_goals_per_client)
    if low > COVERAGE_CENTER:
        raise PartitionError(f"coverage needs min_goals_per_client <= {COVERAGE_CENTER} (FedAgent's centre size), "
                             f"got {low}")
    rng, r, _, sizes = _beta_sizes(num_clients, num_goals, low, COVERAGE_CENTER, COVERAGE_HIGH, size_std, base_seed)
    return rng, r, sizes


def _beta_sizes(num_clients: int, num_goals: int, low: int, center: int, high: int, std: float,
                base_seed: int) -> tuple[np.random.Generator, float, int, list[int]]:
    """The Beta client sizes both coverage and hardness start from, and the ``default_rng(S)`` drawn on."""
    rng = np.random.default_rng(int(base_seed))
    r = default_r(num_goals, num_clients, low, center, high)
    total = int(round(r * num_goals))
    return rng, r, total, generate_client_sizes(num_clients, low, center, high, std, total, rng)


def coverage_assignment(num_clients: int, num_goals: int, min_goals_per_client: int = DEFAULT_MIN_GOALS,
                        size_std: float = DEFAULT_SIZE_STD, base_seed: int = DEFAULT_SEED) -> list[list[int]]:
    """Every client's goals under ``coverage`` (what :func:`coverage_partition` returns, for all clients)."""
    check_sizes(num_clients, num_goals, min_goals_per_client)
    parts = _coverage_cached(num_clients, num_goals, min_goals_per_client, float(size_std), int(base_seed))
    return [list(part) for part in parts]


@functools.lru_cache(maxsize=8)
def _coverage_cached(num_clients: int, num_goals: int, min_goals_per_client: int, size_std: float,
                     base_seed: int) -> tuple[tuple[int, ...], ...]:
    # One global assignment serves every client of the process (the inspect command, tests).
    rng, r, sizes = _coverage_setup(num_clients, num_goals, min_goals_per_client, size_std, base_seed)
    sets, _ = assign_with_overlap(num_goals, sizes, r, rng)
    return tuple(tuple(s) for s in sets)


def coverage_partition(
    client_id: int,
    num_clients: int,
    num_goals: int,
    min_goals_per_client: int = DEFAULT_MIN_GOALS,
    size_std: float = DEFAULT_SIZE_STD,
    base_seed: int = DEFAULT_SEED,
) -> list[int]:
    """Coverage (ξ, §7): Beta-sized client pools in ``[L, 1000]`` averaging 500, each goal held by
    ``floor(r)`` or ``ceil(r)`` clients (``r = 500 N / n``); the client's goals in set order.

    Every client computes the same global assignment from ``default_rng(S)`` and reads its own
    part. ``L`` above 500 is refused (FedAgent fails an assertion).
    """
    check_args(client_id, num_clients, num_goals)
    return coverage_assignment(num_clients, num_goals, min_goals_per_client, size_std, base_seed)[client_id]


# --- hardness -------------------------------------------------------------------------------------


def load_hardness_labels(path: str | os.PathLike[str]) -> dict[str, bool]:
    """``task_id -> success`` from a FedAgent trajectories file (§8.1).

    Only ``trajectories`` is read; an entry's id is ``task_info.task_id`` (entries without one are
    skipped), its label the truthiness of ``traj_info.success`` (default False); a later entry
    overrides an earlier one. A file without a single labelled entry is refused.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        labels: dict[str, bool] = {}
        for entry in data.get("trajectories") or []:
            task_id = (entry.get("task_info") or {}).get("task_id")
            if task_id is None:
                continue
            labels[str(task_id)] = bool((entry.get("traj_info") or {}).get("success", False))
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise PartitionError(f"cannot read hardness labels from {path}: {exc}") from None
    if not labels:
        raise PartitionError(f"hardness labels file {path} has no trajectory with a task_info.task_id")
    return labels


def _hardness_setup(num_clients: int, num_goals: int, min_goals_per_client: int, success_std: float,
                    base_seed: int) -> tuple[np.random.Generator, int, list[int]]:
    L = check_sizes(num_clients, num_goals, min_goals_per_client)
    rng, _, total, quotas = _beta_sizes(num_clients, num_goals, 0, L // 2, L, success_std, base_seed)
    return rng, total, quotas


def _easy_flags(goal_info: Sequence[GoalInfo], labels: Mapping[str, bool] | None) -> list[bool]:
    if labels is not None:
        return [bool(labels.get(str(info.task_id), False)) if info.task_id is not None else False
                for info in goal_info]
    if all(info.success is None for info in goal_info):
        raise PartitionError("hardness needs success labels: pass trajectories_file or GoalInfo.success")
    return [info.success is True for info in goal_info]


def hardness_assignment(
    num_clients: int,
    num_goals: int,
    goal_info: Sequence[GoalInfo],
    min_goals_per_client: int = DEFAULT_MIN_GOALS,
    success_std: float = DEFAULT_SUCCESS_STD,
    base_seed: int = DEFAULT_SEED,
    labels: Mapping[str, bool] | None = None,
    clients: Sequence[int] | None = None,
) -> dict[int, list[int]]:
    """``{client: goals}`` under ``hardness`` (§8.3, FedAgent 0a41188) for ``clients`` (default all).

    A goal is easy iff its label is True: ``labels[goal_info[i].task_id]`` when ``labels`` is given
    (goals without an entry are unlabelled), else ``goal_info[i].success``; unlabelled goals are hard.
    """
    goal_info = check_goal_info("hardness", goal_info, num_goals)
    flags = _easy_flags(goal_info, labels)
    L = check_int("min_goals_per_client", min_goals_per_client, 0)
    rng, total, quotas = _hardness_setup(num_clients, num_goals, L, success_std, base_seed)
    easy = [i for i, e in enumerate(flags) if e]
    hard = [i for i, e in enumerate(flags) if not e]
    sets: list[set[int]] = [set() for _ in range(num_clients)]
    if easy:
        sets, _ = assign_with_overlap(len(easy), quotas, total / len(easy), rng)
    limit = max(L, num_goals // num_clients)
    out: dict[int, list[int]] = {}
    for client in range(num_clients) if clients is None else clients:
        check_args(client, num_clients, num_goals)
        own = copy.deepcopy(rng)  # every client continues from the state the global assignment left
        mine = sets[client]
        goals = [easy[j] for j in mine]
        rest_easy = [easy[j] for j in range(len(easy)) if j not in mine]
        rest_hard = hard
        need = L - len(goals)
        if need > 0 and hard:
            drawn = [int(i) for i in own.choice(np.asarray(hard), size=min(need, len(hard)), replace=False)]
            goals += drawn
            taken = set(drawn)
            rest_hard = [i for i in hard if i not in taken]
        need = L - len(goals)
        rest = rest_easy + rest_hard
        if need > 0 and rest:
            goals += [int(i) for i in own.choice(np.asarray(rest), size=min(need, len(rest)), replace=False)]
        out[client] = goals[:limit]
    return out


def hardness_partition(
    client_id: int,
    num_clients: int,
    num_goals: int,
    goal_info: Sequence[GoalInfo],
    min_goals_per_client: int = DEFAULT_MIN_GOALS,
    success_std: float = DEFAULT_SUCCESS_STD,
    base_seed: int = DEFAULT_SEED,
    labels: Mapping[str, bool] | None = None,
) -> list[int]:
    """Hardness (ξ′, §8, FedAgent 0a41188): ``L`` goals, the client's easy quota first (set order),
    then unsuccessful goals drawn from the shared post-assignment state of ``default_rng(S)``.

    See :func:`hardness_assignment` for the labels.
    """
    check_args(client_id, num_clients, num_goals)
    return hardness_assignment(num_clients, num_goals, goal_info, min_goals_per_client, success_std,
                               base_seed, labels, clients=[client_id])[client_id]


# --- dispatcher adapters --------------------------------------------------------------------------


def _min_goals(knobs: Mapping[str, Any]) -> int:
    return int(knob(knobs, "min_goals_per_client"))


def _size_std(knobs: Mapping[str, Any]) -> float:
    """Coverage's ``size_std``, FedAgent's ``dispersion_s`` taking precedence when both are set."""
    return first_knob(knobs, ("dispersion_s", "size_std"), "size_std")


def _hardness_knobs(knobs: Mapping[str, Any]) -> tuple[float, dict[str, bool] | None]:
    """``(success_std, labels)``, the labels read from ``trajectories_file`` if it is set."""
    success_std = first_knob(knobs, ("success_std", "dispersion_s"), "success_std")
    path = knobs.get("trajectories_file")
    return success_std, load_hardness_labels(path) if path else None


def task_disjoint_strategy(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any],
                           base_seed: int, goal_info: Sequence[GoalInfo] | None = None) -> list[int]:
    return task_disjoint_partition(client_id, num_clients, num_goals, _min_goals(knobs))


def preference_strategy(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any],
                        base_seed: int, goal_info: Sequence[GoalInfo] | None = None) -> list[int]:
    omega = first_knob(knobs, ("omega", "tau"), "tau")
    ratio = knob(knobs, "fashion_sample_ratio")
    return preference_partition(client_id, num_clients, num_goals, check_goal_info("preference", goal_info, num_goals),
                                _min_goals(knobs), omega, base_seed, ratio)


def coverage_strategy(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any],
                      base_seed: int, goal_info: Sequence[GoalInfo] | None = None) -> list[int]:
    size_std = _size_std(knobs)  # checked before min_goals_per_client, so a bad pair names it first, as before
    return coverage_partition(client_id, num_clients, num_goals, _min_goals(knobs), size_std, base_seed)


def hardness_strategy(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any],
                      base_seed: int, goal_info: Sequence[GoalInfo] | None = None) -> list[int]:
    success_std, labels = _hardness_knobs(knobs)
    return hardness_partition(client_id, num_clients, num_goals, check_goal_info("hardness", goal_info, num_goals),
                              _min_goals(knobs), success_std, base_seed, labels)


def all_clients(strategy: str, num_clients: int, num_goals: int, knobs: Mapping[str, Any], base_seed: int,
                goal_info: Sequence[GoalInfo] | None = None) -> list[list[int]] | None:
    """Every client's goals for the strategies whose global assignment is worth computing once
    (``coverage``, ``hardness``), as their dispatcher adapters would give them; None for the others."""
    if strategy == "coverage":
        size_std = _size_std(knobs)  # checked first, as in coverage_strategy
        return coverage_assignment(num_clients, num_goals, _min_goals(knobs), size_std, base_seed)
    if strategy == "hardness":
        success_std, labels = _hardness_knobs(knobs)
        parts = hardness_assignment(num_clients, num_goals, check_goal_info("hardness", goal_info, num_goals),
                                    _min_goals(knobs), success_std, base_seed, labels)
        return [parts[c] for c in range(num_clients)]
    return None
