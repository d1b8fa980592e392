"""Shared pieces of the task-level partitions: goal metadata, knob checks and FedAgent's sizing helpers.

The built-in strategies draw exactly what FedAgent draws (specs/partitions.md): numpy generators
seeded with plain integers (``default_rng(S)``, ``RandomState(S + c)``, with the run's base seed
``S`` where FedAgent hard-codes 42), the same calls in the same order. :func:`default_r`,
:func:`generate_client_sizes` and :func:`assign_with_overlap` are FedAgent's ``_beta_sizing``
helpers (§6). :func:`shared_rng` / :func:`client_rng` are seeding helpers for your own strategies
(``examples/partition_round_robin.py``); the built-in ones do not use them.
"""

from __future__ import annotations

import difflib
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedagent_flwr.hetero import uniform
from fedagent_flwr.hetero.uniform import PartitionError, uniform_bounds
from fedagent_flwr.schema.fields import SettingError, check_value
from fedagent_flwr.schema.run import Partition, RunSchema

#: FedAgent's ``DEFAULTS`` (``fed/run_fed.py``) for the task-level knobs, declared in the schema.
DEFAULT_SEED: int = RunSchema.seed  # the run's seed, S; FedAgent's partitions are S = 42's
DEFAULT_OMEGA: float = Partition.omega  # type: ignore[assignment]  # a dataclass field's default
DEFAULT_SIZE_STD: float = Partition.size_std  # type: ignore[assignment]
DEFAULT_SUCCESS_STD: float = Partition.success_std  # type: ignore[assignment]


@dataclass(frozen=True)
class GoalInfo:
    """What a content-aware partition needs to know about one goal of the pool.

    ``goal_info[i]`` describes pool index ``i`` (the same indices :func:`partition_goals` returns).
    ``category`` drives ``preference`` (None counts as ``"unknown"``, as in FedAgent); ``success``
    (True = easy, False = hard, None = unlabelled, which counts as hard) drives ``hardness``;
    ``task_id`` lets ``hardness`` look labels up in a trajectories file instead. ``scene`` and
    ``group`` (the spec: the task without its scene, e.g. ALFWorld's
    ``<task>-<object>-<mrecep>-<recep>``) drive ``env_disjoint``, which orders a spec's games by
    ``(scene, trial)``; ``trial`` (ALFWorld's ``trial_T...`` directory) is read from ALFWorld's
    ``task_id`` when not given.
    """

    category: str | None = None
    task_id: str | None = None
    success: bool | None = None
    asin: str | None = None
    scene: str | None = None
    group: str | None = None
    trial: str | None = None


INTEGERS = (int, np.integer)  # what the task-level checks take: numpy's too (sizes computed with numpy)


def check_int(name: str, value: Any, minimum: int) -> int:
    """:func:`~fedagent_flwr.hetero.uniform.check_int` taking numpy integers too."""
    return uniform.check_int(name, value, minimum, INTEGERS)


def check_args(client_id: int, num_clients: int, num_goals: int) -> None:
    check_int("num_clients", num_clients, 1)
    check_int("num_goals", num_goals, 1)
    uniform.check_client(client_id, num_clients, INTEGERS)


def check_sizes(num_clients: int, num_goals: int, min_goals_per_client: int) -> int:
    """Check a whole-federation partition's sizes (as :func:`check_args`); the floor as an int."""
    check_int("num_clients", num_clients, 1)
    check_int("num_goals", num_goals, 1)
    return check_int("min_goals_per_client", min_goals_per_client, 0)


def knob_int(knobs: Mapping[str, Any], key: str, default: int, minimum: int = 0) -> int:
    value = knobs.get(key)
    return default if value is None else check_int(key, value, minimum)


def knob(knobs: Mapping[str, Any], name: str) -> Any:
    """Partition knob ``name`` checked by its schema field (:class:`~fedagent_flwr.schema.run.Partition`:
    type, bound), or the field's default (FedAgent's) when it is absent or None."""
    if knobs.get(name) is None:
        return Partition.__dataclass_fields__[name].default
    try:
        return check_value(Partition, name, knobs[name], "partition")
    except SettingError as exc:
        raise PartitionError(str(exc)) from None


def unknown_knob(keys: Iterable[str]) -> tuple[str, str] | None:
    """None when every key is a declared knob of :class:`~fedagent_flwr.schema.run.Partition`, else
    the first unknown key and why it is refused, with the nearest known name. Only for the built-in
    strategies: they read only declared knobs, so an undeclared key is a typo whose intended value
    would silently be the default; a custom partition function reads keys of its own."""
    known = sorted(Partition.__dataclass_fields__)
    unknown = sorted(set(keys) - set(known))
    if not unknown:
        return None
    near = difflib.get_close_matches(unknown[0], known, n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return unknown[0], (f"is not a knob of the built-in partition strategies: {hint}the knobs are "
                        f"{', '.join(k for k in known if k != 'strategy')} (a partition function of "
                        "your own, given by dotted path, may read keys of its own)")


def first_knob(knobs: Mapping[str, Any], names: Sequence[str], default_of: str) -> Any:
    """The first of ``names`` that is set, else ``default_of``'s default (FedAgent's fallbacks:
    omega/tau, dispersion_s/size_std)."""
    return knob(knobs, next((n for n in names if knobs.get(n) is not None), default_of))


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
    """FedAgent's ``uniform`` / catalog_split / task_disjoint goal slice (specs/partitions.md §4, §10.2)."""
    check_args(client_id, num_clients, num_goals)
    start, end = uniform_bounds(client_id, num_clients, num_goals, check_int("min_goals_per_client", min_goals, 0))
    return list(range(start, end))


# --- FedAgent's sizing helpers (specs/partitions.md §6) ------------------------------------------


def default_r(n: int, num_clients: int, low: int, center: int, high: int) -> float:
    """``r = clip(C*center/n, C*low/n, C*high/n)`` (§6.1)."""
    return float(np.clip(num_clients * center / n, num_clients * low / n, num_clients * high / n))


def generate_client_sizes(
    num_clients: int,
    low: int,
    center: int,
    high: int,
    s: float,
    total: int,
    rng: np.random.Generator,
) -> list[int]:
    """FedAgent's Beta client sizes in ``[low, high]`` summing to ``total`` (§6.2), drawn from ``rng``.

    ``x ~ Beta(mu s', (1 - mu) s')`` with ``mu = (center - low)/(high - low)`` (kept in
    ``[1e-6, 1 - 1e-6]``) and ``s' = max(s, 0.002)``; ``y = low + x (high - low)`` rescaled to sum
    to ``total`` and clipped; floors plus the largest remainders; then the corrections of §6.2.
    A large ``s`` gives near-equal sizes, ``s = 1`` very unequal ones.
    """
    if not (num_clients > 0 and low <= center <= high):
        raise PartitionError(f"client sizes need low <= center <= high and clients > 0, got "
                             f"low={low}, center={center}, high={high}, clients={num_clients}")
    C = num_clients
    if total < C * low:
        total = C * low
    elif total > C * high:
        total = C * high
    mu = (center - low) / (high - low) if high > low else 0.5
    mu = min(max(mu, 1e-6), 1 - 1e-6)
    s_eff = max(s, 0.002)
    alpha, beta = mu * s_eff, (1 - mu) * s_eff
    x = rng.beta(alpha, beta, size=C) if high > low else np.full(C, 0.5)
    y = low + x * (high - low)
    y_sum = y.sum()
    if y_sum > 0:  # FedAgent divides by the sum unguarded; all-zero draws would give NaN there
        y = y * (total / y_sum)
    y = np.clip(y, low, high)
    sizes = np.floor(y).astype(np.int64)
    remainder = y - sizes
    target = round(total)
    need = target - int(sizes.sum())
    order = np.argsort(-remainder)
    if need > 0:
        sizes[order[:need]] += 1
    elif need < 0:
        sizes[order[need:]] -= 1
    sizes = np.clip(sizes, low, high)
    diff = target - int(sizes.sum())
    if diff > 0:
        for i in range(C):
            if diff == 0:
                break
            if sizes[i] < high:
                sizes[i] += 1
                diff -= 1
    elif diff < 0:
        for i in range(C):
            if diff == 0:
                break
            if sizes[i] > low:
                sizes[i] -= 1
                diff += 1
    diff = target - int(sizes.sum())
    for i in range(abs(diff)):
        eligible = np.flatnonzero(sizes < high) if diff > 0 else np.flatnonzero(sizes > low)
        if len(eligible) == 0:
            break
        sizes[eligible[i % len(eligible)]] += 1 if diff > 0 else -1
    return [int(v) for v in np.clip(sizes, low, high)]


def assign_with_overlap(num_samples: int, sizes: Sequence[int], r: float,
                        rng: np.random.Generator) -> tuple[list[set[int]], list[int]]:
    """FedAgent's assignment of ``num_samples`` samples to clients of the given ``sizes`` (§6.3).

    Each sample ``m`` (in order) goes to ``k_m`` in ``{floor(r), ceil(r)}`` distinct clients drawn
    without replacement with probability proportional to their remaining capacity; a random top-up
    follows if the clients' sets fall short of ``sum(sizes)``. Returns the per-client Python sets
    (iterate them for FedAgent's order, specs/partitions.md §12) and ``k``.
    """
    M = num_samples
    A = int(sum(int(v) for v in sizes))
    r_lo, r_hi = int(np.floor(r)), int(np.ceil(r))
    h = A - r_lo * M
    if not 0 <= h <= M:
        r_lo, r_hi = int(np.floor(A / M)), int(np.ceil(A / M))
        h = A - r_lo * M
    k = np.full(M, r_lo, dtype=np.int64)
    if h > 0:
        k[rng.choice(M, size=h, replace=False)] = r_hi
    rem = np.array([int(v) for v in sizes], dtype=np.int64)
    sets: list[set[int]] = [set() for _ in sizes]
    for m in range(M):
        avail = np.flatnonzero(rem > 0)
        need = min(int(k[m]), len(avail))
        if need == 0:
            continue
        weights = rem[avail] / rem[avail].sum()
        for client in rng.choice(avail, size=need, replace=False, p=weights):
            sets[int(client)].add(m)
            rem[client] -= 1
    short = A - sum(len(s) for s in sets)
    if short > 0:
        avail = np.flatnonzero(rem > 0)
        for _ in range(short):
            if len(avail) == 0:
                break
            m = int(rng.integers(0, M))
            client = int(rng.choice(avail))
            sets[client].add(m)
            rem[client] -= 1
            avail = np.flatnonzero(rem > 0)
    return sets, [int(v) for v in k]
