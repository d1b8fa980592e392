"""Shared pieces of the task-level partitions: goal metadata, seeding, slices and Beta sizing.

Everything here is deterministic: random draws come from numpy generators seeded with a
:class:`numpy.random.SeedSequence` built from integers only (base seed, a fixed per-strategy tag and,
for per-client draws, the client id) - never from Python's salted ``hash()`` or process state.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedagent_flwr.hetero.uniform import PartitionError

#: FedAgent's ``DEFAULTS`` (``fed/run_fed.py``) for the task-level knobs, used when a knob is absent.
DEFAULT_MIN_GOALS = 100
DEFAULT_OMEGA = 0.5
DEFAULT_SIZE_STD = 1.0
DEFAULT_SUCCESS_STD = 1.0


@dataclass(frozen=True)
class GoalInfo:
    """What a content-aware partition needs to know about one goal of the pool.

    ``goal_info[i]`` describes pool index ``i`` (the same indices :func:`partition_goals` returns).
    ``category`` drives ``preference``; ``success`` (True = easy, False = hard, None = unlabelled,
    which counts as hard) drives ``hardness``; ``task_id`` lets ``hardness`` look labels up in a
    trajectories file instead. ``scene`` and ``group`` (the task without its scene, e.g. ALFWorld's
    ``<task>-<object>-<mrecep>-<recep>``) drive ``env_disjoint``.
    """

    category: str | None = None
    task_id: str | None = None
    success: bool | None = None
    asin: str | None = None
    scene: str | None = None
    group: str | None = None


def check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise PartitionError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_args(client_id: int, num_clients: int, num_goals: int) -> None:
    check_int("num_clients", num_clients, 1)
    check_int("num_goals", num_goals, 1)
    check_int("client_id", client_id, 0)
    if client_id >= num_clients:
        raise PartitionError(f"client_id {client_id} is out of range for {num_clients} clients")


def knob_int(knobs: Mapping[str, Any], key: str, default: int, minimum: int = 0) -> int:
    value = knobs.get(key)
    return default if value is None else check_int(key, value, minimum)


def knob_float(knobs: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = knobs.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        raise PartitionError(f"{key} must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise PartitionError(f"{key} must be a number, got {value!r}") from None
    if not (lo <= out <= hi):
        raise PartitionError(f"{key} must be in [{lo}, {hi}], got {value!r}")
    return out


def check_goal_info(strategy: str, goal_info: Sequence[GoalInfo] | None, num_goals: int) -> Sequence[GoalInfo]:
    if goal_info is None:
        raise PartitionError(
            f"partition strategy {strategy!r} needs goal metadata (goal_info, one GoalInfo per pool goal)"
        )
    if len(goal_info) != num_goals:
        raise PartitionError(f"goal_info has {len(goal_info)} entries for a pool of {num_goals} goals")
    return goal_info


def _tag(strategy: str) -> int:
    # crc32 is a fixed function of the bytes (unlike hash()), so the tag is the same everywhere.
    return zlib.crc32(strategy.encode("ascii"))


def shared_rng(base_seed: int, strategy: str) -> np.random.Generator:
    """Generator every client builds identically (draws that must agree across clients)."""
    return np.random.default_rng(np.random.SeedSequence([int(base_seed), _tag(strategy)]))


def client_rng(base_seed: int, strategy: str, client_id: int) -> np.random.Generator:
    """Generator private to one client."""
    return np.random.default_rng(np.random.SeedSequence([int(base_seed), _tag(strategy), 1, int(client_id)]))


def fedagent_slice(client_id: int, num_clients: int, num_goals: int, min_goals: int) -> list[int]:
    """FedAgent's catalog_split / task_disjoint goal slice (webshop spec §8, V1 step 2).

    ``base = n // N``; client ``c`` gets ``[c*base, c*base + base)`` (the ``n mod N`` tail goals are
    used by no client unless a widened slice reaches them). A slice shorter than ``min_goals`` is
    widened by ``need = min - base``: ``need // 2`` on the left as far as the pool allows, the rest
    on the right, a right deficit moved back to the left; when the pool is too small, all goals.
    At least one goal is always returned (``base`` is 0 when ``N > n``).
    """
    check_args(client_id, num_clients, num_goals)
    check_int("min_goals_per_client", min_goals, 0)
    base = num_goals // num_clients
    start, end = client_id * base, client_id * base + base
    size = min(max(base, min_goals, 1), num_goals)
    need = size - base
    if need > 0:
        left = min(need // 2, start)
        right = min(need - left, num_goals - end)
        left += min(need - left - right, start - left)
        start, end = start - left, end + right
    return list(range(start, end))


def round_to_total(values: np.ndarray, total: int, low: int, high: int) -> list[int]:
    """Integers in ``[low, high]`` close to ``values`` that sum to exactly ``total``.

    Floors first, then hands the remaining units to the largest fractional parts (ties to the lower
    index), skipping entries at ``high``; an excess is taken back from the smallest fractional parts.
    """
    base = np.clip(np.floor(values), low, high).astype(np.int64)
    frac = values - np.floor(values)
    diff = int(total - base.sum())
    order = np.lexsort((np.arange(len(values)), -frac))  # largest fraction first
    while diff > 0:
        moved = False
        for i in order:
            if diff == 0:
                break
            if base[i] < high:
                base[i] += 1
                diff -= 1
                moved = True
        if not moved:
            raise PartitionError(f"cannot reach a total of {total} with {len(values)} sizes <= {high}")
    while diff < 0:
        moved = False
        for i in order[::-1]:
            if diff == 0:
                break
            if base[i] > low:
                base[i] -= 1
                diff += 1
                moved = True
        if not moved:
            raise PartitionError(f"cannot reach a total of {total} with {len(values)} sizes >= {low}")
    return [int(v) for v in base]


def generate_client_sizes(
    num_clients: int,
    low: int,
    center: int,
    high: int,
    concentration: float,
    total: int,
    rng: np.random.Generator,
) -> list[int]:
    """Per-client sizes: Beta draws around ``center`` in ``[low, high]``, summing to ``total``.

    ``x_c ~ Beta(mu*s, (1 - mu)*s)`` with ``mu = (center - low)/(high - low)`` (kept inside
    ``[1e-6, 1 - 1e-6]``) and ``s = max(concentration, 2e-3)``; raw sizes ``low + x_c (high - low)``
    are scaled by the factor ``lam`` that makes ``sum(clip(lam * raw, low, high)) = total`` (found by
    bisection), then rounded to integers with exactly that total (:func:`round_to_total`). A large
    ``s`` gives near-equal sizes, ``s = 1`` very unequal ones.
    """
    if not num_clients * low <= total <= num_clients * high:
        raise PartitionError(f"total {total} is outside [{num_clients * low}, {num_clients * high}]")
    if high <= low:
        return [low] * num_clients
    mu = min(max((center - low) / (high - low), 1e-6), 1 - 1e-6)
    s = max(float(concentration), 2e-3)
    x = rng.beta(mu * s, (1 - mu) * s, size=num_clients)
    raw = np.maximum(low + x * (high - low), 1e-9)

    def fitted(lam: float) -> np.ndarray:
        return np.clip(lam * raw, low, high)

    lo_lam, hi_lam = 0.0, 1.0
    while fitted(hi_lam).sum() < total and hi_lam < 1e30:
        hi_lam *= 2.0
    for _ in range(200):
        mid = (lo_lam + hi_lam) / 2
        if fitted(mid).sum() < total:
            lo_lam = mid
        else:
            hi_lam = mid
    return round_to_total(fitted(hi_lam), total, low, high)
