"""Task-level partitions of a goal pool (FedAgent reference §4.2): which goals each client trains on.

All four return sorted, distinct indices into the pool ``range(num_goals)`` (for WebShop the train
split, ``goals[val_size:]``) and never fewer than ``min(min_goals_per_client, num_goals)`` of them.

* :func:`task_disjoint_partition` - FedAgent's catalog_split slice (full catalogue): ``n // N``
  contiguous goals per client, widened symmetrically to the floor.
* :func:`preference_partition` - category skew: ``q ~ Dir(pi (1 - omega)/omega)`` over goal categories,
  ``min_goals`` goals drawn ``~ Multinomial(min_goals, q)``.
* :func:`coverage_partition` - client pool sizes ``~ Beta`` around 500 in ``[min_goals, 1000]``,
  every goal handed to ``floor(r)`` or ``ceil(r)`` distinct clients (overlap when ``r > 1``).
* :func:`hardness_partition` - ``min_goals`` goals per client of which a Beta-distributed number are
  "easy" (success label True).

Randomness: :func:`~fedagent_flwr.hetero.common.client_rng` / ``shared_rng`` (numpy ``default_rng``
seeded from the base seed, a per-strategy tag and the client id), so results are identical in every
process and on every run with the same numpy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedagent_flwr.hetero.common import (
    DEFAULT_MIN_GOALS,
    DEFAULT_OMEGA,
    DEFAULT_SIZE_STD,
    DEFAULT_SUCCESS_STD,
    GoalInfo,
    check_args,
    check_goal_info,
    check_int,
    client_rng,
    fedagent_slice,
    generate_client_sizes,
    knob_float,
    knob_int,
    shared_rng,
)
from fedagent_flwr.hetero.uniform import PartitionError

# --- task_disjoint --------------------------------------------------------------------------------


def task_disjoint_partition(client_id: int, num_clients: int, num_goals: int, min_goals_per_client: int = 0) -> list[int]:
    """FedAgent's ``task_disjoint``: the catalog_split goal slice with the full catalogue.

    See :func:`~fedagent_flwr.hetero.common.fedagent_slice`: slices are disjoint when
    ``n // N >= min_goals``; otherwise neighbours overlap. Pure arithmetic (no RNG).
    """
    return fedagent_slice(client_id, num_clients, num_goals, min_goals_per_client)


# --- preference -----------------------------------------------------------------------------------

#: FedAgent keeps a random 20 % of the (dominant) fashion goals before the category draw.
FASHION_CATEGORY = "fashion"
FASHION_KEEP = 0.2
PREFERENCE_EPS = 0.01
OMEGA_CLIP = (1e-3, 1 - 1e-3)


def preference_partition(
    client_id: int,
    num_clients: int,
    num_goals: int,
    goal_info: Sequence[GoalInfo],
    min_goals_per_client: int = DEFAULT_MIN_GOALS,
    omega: float = DEFAULT_OMEGA,
    base_seed: int = 42,
    fashion_keep: float = FASHION_KEEP,
) -> list[int]:
    """Dirichlet category preference (ω): exactly ``m = min(min_goals_per_client, n)`` goals.

    With the client's generator:

    1. candidates: every goal, except that category ``fashion`` keeps a random
       ``max(1, round(fashion_keep * #fashion))`` of its goals (goals with no category form ``"None"``);
    2. ``pi_k = (f_k + eps) / sum_j (f_j + eps)`` with ``f_k`` the candidates' category frequencies
       and ``eps = 0.01`` (categories in sorted order);
    3. ``omega`` clipped to ``[1e-3, 1 - 1e-3]``; ``q ~ Dir(pi (1 - omega) / omega)`` (small ``omega``:
       ``q`` close to ``pi``; large ``omega``: ``q`` close to one category);
    4. ``counts ~ Multinomial(m, q)``; counts above a category's candidates are cut and the excess
       redrawn ``~ Multinomial(excess, q)`` over the categories with room left (repeated);
    5. each category's count drawn without replacement from its candidates; any shortfall (too few
       candidates overall) is topped up uniformly from the goals not yet chosen.
    """
    check_args(client_id, num_clients, num_goals)
    goal_info = check_goal_info("preference", goal_info, num_goals)
    m = min(check_int("min_goals_per_client", min_goals_per_client, 1), num_goals)
    omega = min(max(float(omega), OMEGA_CLIP[0]), OMEGA_CLIP[1])
    rng = client_rng(base_seed, "preference", client_id)

    by_cat: dict[str, list[int]] = {}
    for i, info in enumerate(goal_info):
        by_cat.setdefault(str(info.category), []).append(i)
    cats = sorted(by_cat)
    if FASHION_CATEGORY in by_cat and fashion_keep < 1.0:
        pool = by_cat[FASHION_CATEGORY]
        keep = max(1, int(round(fashion_keep * len(pool))))
        by_cat[FASHION_CATEGORY] = sorted(int(i) for i in rng.choice(pool, size=keep, replace=False))

    avail = np.array([len(by_cat[c]) for c in cats], dtype=np.int64)
    freq = avail / avail.sum()
    pi = (freq + PREFERENCE_EPS) / (freq + PREFERENCE_EPS).sum()
    q = rng.dirichlet(pi * (1 - omega) / omega)
    if not np.all(np.isfinite(q)) or q.sum() <= 0:
        q = pi
    q = q / q.sum()

    counts = rng.multinomial(m, q)
    for _ in range(1000):
        excess = int(np.maximum(counts - avail, 0).sum())
        counts = np.minimum(counts, avail)
        spare = avail - counts
        if excess == 0 or spare.sum() == 0:
            break
        weights = np.where(spare > 0, q, 0.0)
        if weights.sum() <= 0:
            weights = (spare > 0).astype(float)
        counts = counts + rng.multinomial(excess, weights / weights.sum())
    counts = np.minimum(counts, avail)

    chosen: set[int] = set()
    for cat, count in zip(cats, counts):
        if count:
            chosen.update(int(i) for i in rng.choice(by_cat[cat], size=int(count), replace=False))
    short = m - len(chosen)
    if short > 0:
        rest = [i for i in range(num_goals) if i not in chosen]
        chosen.update(int(i) for i in rng.choice(rest, size=short, replace=False))
    return sorted(chosen)


# --- coverage -------------------------------------------------------------------------------------

COVERAGE_CENTER = 500
COVERAGE_HIGH = 1000


def coverage_sizes(num_clients: int, num_goals: int, min_goals_per_client: int, size_std: float, base_seed: int = 42) -> list[int]:
    """Every client's pool size under ``coverage`` (identical on all clients).

    ``low = min(min_goals, n)``, ``high = min(max(1000, low), n)``, ``center = clip(500, low, high)``;
    total ``T = N * center`` (FedAgent's ``round(r n)`` with ``r = clip(N 500/n, N low/n, N 1000/n)``),
    sizes from :func:`~fedagent_flwr.hetero.common.generate_client_sizes` with ``s = size_std``.
    """
    check_int("num_clients", num_clients, 1)
    check_int("num_goals", num_goals, 1)
    low = min(check_int("min_goals_per_client", min_goals_per_client, 0), num_goals)
    high = min(max(COVERAGE_HIGH, low), num_goals)
    center = min(max(COVERAGE_CENTER, low), high)
    rng = shared_rng(base_seed, "coverage")
    return generate_client_sizes(num_clients, low, center, high, size_std, num_clients * center, rng)


def assign_with_overlap(sizes: Sequence[int], num_goals: int, rng: np.random.Generator) -> list[list[int]]:
    """Hand each goal to ``floor(r)`` or ``ceil(r)`` distinct clients (``r = sum(sizes) / n``).

    Client ``c`` ends with exactly ``sizes[c]`` distinct goals. A random ``T - n*floor(r)`` goals get
    the extra copy; goals are visited in a random order and each one's clients are drawn without
    replacement with probability proportional to their remaining capacity (Efraimidis-Spirakis
    keys), except that a client whose remaining capacity equals the number of goals still to visit
    must take the goal. That rule keeps the rest feasible (Gale-Ryser: with positive goal degrees
    in ``{a, a+1}`` an assignment exists iff no capacity exceeds the goals left), so it never fails.
    Goals with no copy (``r < 1``) are skipped.
    """
    n = num_goals
    cap = np.array(sizes, dtype=np.int64)
    total = int(cap.sum())
    if cap.max(initial=0) > n or total > n * len(cap):
        raise PartitionError(f"cannot give {list(sizes)} distinct goals from a pool of {n}")
    a = total // n
    degree = np.full(n, a, dtype=np.int64)
    degree[rng.permutation(n)[: total - a * n]] += 1
    parts: list[list[int]] = [[] for _ in sizes]
    order = [int(g) for g in rng.permutation(n) if degree[g] > 0]
    for step, goal in enumerate(order):
        left = len(order) - step  # goals still to visit, each needing >= 1 client
        need = int(degree[goal])
        keys = rng.random(len(cap))
        forced = np.flatnonzero(cap == left)
        free = np.flatnonzero((cap > 0) & (cap < left))
        take = need - len(forced)
        if take < 0 or take > len(free):  # unreachable while the invariant holds
            raise PartitionError("coverage assignment became infeasible")
        if take:
            score = np.log(keys[free]) / cap[free]  # larger is better; weight = remaining capacity
            picked = free[np.argsort(-score, kind="stable")[:take]]
            clients = np.concatenate([forced, picked])
        else:
            clients = forced
        for c in clients:
            parts[int(c)].append(int(goal))
        cap[clients] -= 1
    return [sorted(p) for p in parts]


def coverage_partition(
    client_id: int,
    num_clients: int,
    num_goals: int,
    min_goals_per_client: int = DEFAULT_MIN_GOALS,
    size_std: float = DEFAULT_SIZE_STD,
    base_seed: int = 42,
) -> list[int]:
    """Coverage (ξ): Beta-sized, overlapping client pools (see :func:`coverage_sizes`, :func:`assign_with_overlap`).

    Client sizes lie in ``[min(min_goals, n), min(1000, n)]`` and average 500 (when the bounds
    allow); a larger ``size_std`` gives more equal sizes. The whole assignment uses the shared
    generator, so all clients agree on it and each returns its own part.
    """
    check_args(client_id, num_clients, num_goals)
    return coverage_assignment(num_clients, num_goals, min_goals_per_client, size_std, base_seed)[client_id]


def coverage_assignment(num_clients: int, num_goals: int, min_goals_per_client: int = DEFAULT_MIN_GOALS,
                        size_std: float = DEFAULT_SIZE_STD, base_seed: int = 42) -> list[list[int]]:
    """Every client's goals under ``coverage`` (what :func:`coverage_partition` returns, for all clients)."""
    sizes = coverage_sizes(num_clients, num_goals, min_goals_per_client, size_std, base_seed)
    return assign_with_overlap(sizes, num_goals, shared_rng(base_seed, "coverage-assign"))


# --- hardness -------------------------------------------------------------------------------------


def load_hardness_labels(path: str | os.PathLike[str]) -> dict[str, bool]:
    """``task_id -> success`` from a FedAgent trajectories file (a later entry overrides an earlier one)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        trajectories = data["trajectories"]
        return {str(t["task_info"]["task_id"]): bool(t["traj_info"]["success"]) for t in trajectories}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PartitionError(f"cannot read hardness labels from {path}: {exc}") from None


def hardness_sizes(num_clients: int, num_goals: int, min_goals_per_client: int, success_std: float, base_seed: int = 42) -> list[int]:
    """Every client's number of easy goals (identical on all clients).

    ``m = min(min_goals, n)``; ``generate_client_sizes(low=0, center=m // 2, high=m,
    s=success_std, total=N * (m // 2))`` - so the mean easy count is ``m // 2``.
    """
    check_int("num_clients", num_clients, 1)
    m = min(check_int("min_goals_per_client", min_goals_per_client, 1), check_int("num_goals", num_goals, 1))
    center = m // 2
    rng = shared_rng(base_seed, "hardness")
    return generate_client_sizes(num_clients, 0, center, m, success_std, num_clients * center, rng)


def hardness_partition(
    client_id: int,
    num_clients: int,
    num_goals: int,
    goal_info: Sequence[GoalInfo],
    min_goals_per_client: int = DEFAULT_MIN_GOALS,
    success_std: float = DEFAULT_SUCCESS_STD,
    base_seed: int = 42,
    labels: Mapping[str, bool] | None = None,
) -> list[int]:
    """Hardness (ξ′): ``m = min(min_goals, n)`` goals, ``e_c`` of them easy (:func:`hardness_sizes`).

    A goal is easy iff its label is True: ``labels[goal_info[i].task_id]`` when ``labels`` is given
    (goals without an entry are unlabelled), else ``goal_info[i].success``; unlabelled goals count
    as hard. The client draws ``min(e_c, #easy)`` easy goals and ``m - that`` hard goals uniformly
    without replacement; if the hard goals run out, the rest are easy ones.
    """
    check_args(client_id, num_clients, num_goals)
    goal_info = check_goal_info("hardness", goal_info, num_goals)
    if labels is not None:
        easy_flags = [bool(labels.get(str(info.task_id), False)) if info.task_id is not None else False
                      for info in goal_info]
    else:
        if all(info.success is None for info in goal_info):
            raise PartitionError("hardness needs success labels: pass trajectories_file or GoalInfo.success")
        easy_flags = [info.success is True for info in goal_info]
    easy = [i for i, e in enumerate(easy_flags) if e]
    hard = [i for i, e in enumerate(easy_flags) if not e]
    m = min(check_int("min_goals_per_client", min_goals_per_client, 1), num_goals)
    n_easy = min(hardness_sizes(num_clients, num_goals, m, success_std, base_seed)[client_id], len(easy))
    n_hard = m - n_easy
    if n_hard > len(hard):
        n_hard = len(hard)
        n_easy = m - n_hard
    rng = client_rng(base_seed, "hardness", client_id)
    chosen = [int(i) for i in rng.choice(easy, size=n_easy, replace=False)] if n_easy else []
    chosen += [int(i) for i in rng.choice(hard, size=n_hard, replace=False)] if n_hard else []
    return sorted(chosen)


# --- dispatcher adapters --------------------------------------------------------------------------


def _min_goals(knobs: Mapping[str, Any]) -> int:
    return knob_int(knobs, "min_goals_per_client", DEFAULT_MIN_GOALS)


def task_disjoint_strategy(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any],
                           base_seed: int, goal_info: Sequence[GoalInfo] | None = None) -> list[int]:
    return task_disjoint_partition(client_id, num_clients, num_goals, _min_goals(knobs))


def preference_strategy(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any],
                        base_seed: int, goal_info: Sequence[GoalInfo] | None = None) -> list[int]:
    omega = knob_float(knobs, "omega", DEFAULT_OMEGA, 0.0, 1.0)
    return preference_partition(client_id, num_clients, num_goals, check_goal_info("preference", goal_info, num_goals),
                                _min_goals(knobs), omega, base_seed)


def coverage_strategy(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any],
                      base_seed: int, goal_info: Sequence[GoalInfo] | None = None) -> list[int]:
    size_std = knob_float(knobs, "size_std", DEFAULT_SIZE_STD, 0.0, float("inf"))
    return coverage_partition(client_id, num_clients, num_goals, _min_goals(knobs), size_std, base_seed)


def hardness_strategy(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any],
                      base_seed: int, goal_info: Sequence[GoalInfo] | None = None) -> list[int]:
    success_std = knob_float(knobs, "success_std", DEFAULT_SUCCESS_STD, 0.0, float("inf"))
    path = knobs.get("trajectories_file")
    labels = load_hardness_labels(path) if path else None
    return hardness_partition(client_id, num_clients, num_goals, check_goal_info("hardness", goal_info, num_goals),
                              _min_goals(knobs), success_std, base_seed, labels)
