"""``env_disjoint``: scene-level partition of ALFWorld games (FedAgent reference §4.3).

A client's world is the set of rooms (scenes) it trains in. Games are grouped by *spec* (the task
without its room, ``<task>-<object>-<mrecep>-<recep>``) and scene:

1. scenes listed as held out (``holdout_scenes``, or FedAgent's ``holdout_alfworld_v1.json`` via
   ``holdout_file``) are dropped first, so no client ever trains in a room reserved for
   out-of-distribution evaluation;
2. a spec left with one scene follows ``fallback``: ``"skip"`` (FedAgent's default: nobody gets it)
   or ``"shared"`` (every client gets it);
3. a spec with ``n`` scenes gives every client ``k = min(n, ceil(n / N * (1 + env_div)))`` of them:
   the ``k`` with the lowest ``e = (1 - env_div) * u + env_div * v``, where ``u`` (one uniform draw
   per scene) is shared by all clients and ``v`` is the client's own. ``env_div = 0``: every
   client trains in the same rooms; ``env_div = 1``: rooms drawn independently per client;
4. the client gets every game of its (spec, scene) pairs: a room is all in or all out.

FedAgent gives this arm no floor (``min_goals_per_client`` is unused); a client left with no game
at all is an error that says why. Draws come from numpy generators seeded with integers only
(base seed, a SHA-256 digest of the spec, the client id), never Python's salted ``hash()``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedagent_flwr.hetero.common import GoalInfo, check_args, check_goal_info, knob_float
from fedagent_flwr.hetero.uniform import PartitionError

DEFAULT_ENV_DIV = 0.7
FALLBACKS = ("skip", "shared")


def spec_digest(spec: str) -> int:
    """A 31-bit integer fixed by the spec's text (the same in every process and run)."""
    return int.from_bytes(hashlib.sha256(spec.encode()).digest()[:4], "big") & 0x7FFFFFFF


def scene_scores(spec: str, num_scenes: int, client_id: int, env_div: float, base_seed: int = 42) -> np.ndarray:
    """``e = (1 - env_div) * u + env_div * v`` for each of a spec's scenes, for one client."""
    digest = spec_digest(spec)
    u = np.random.default_rng(np.random.SeedSequence([int(base_seed), digest])).random(num_scenes)
    v = np.random.default_rng(np.random.SeedSequence([int(base_seed), digest, 1, int(client_id)])).random(num_scenes)
    return (1.0 - env_div) * u + env_div * v


def _scene_key(scene: str) -> tuple[int, str]:
    return (int(scene), scene) if scene.isdigit() else (1 << 30, scene)


def env_disjoint_partition(
    client_id: int,
    num_clients: int,
    goal_info: Sequence[GoalInfo],
    env_div: float = DEFAULT_ENV_DIV,
    base_seed: int = 42,
    holdout_scenes: Collection[str] = (),
    fallback: str = "skip",
) -> list[int]:
    """The pool indices of ``client_id``'s games (see the module docstring)."""
    num_goals = len(goal_info)
    check_args(client_id, num_clients, max(num_goals, 1))
    goal_info = check_goal_info("env_disjoint", goal_info, num_goals)
    if fallback not in FALLBACKS:
        raise PartitionError(f"env_disjoint fallback must be one of {FALLBACKS}, got {fallback!r}")
    if not 0.0 <= env_div <= 1.0:
        raise PartitionError(f"env_div must be in [0, 1], got {env_div!r}")
    held_out = {str(s) for s in holdout_scenes}
    cells: dict[str, dict[str, list[int]]] = {}
    for index, info in enumerate(goal_info):
        if info.scene is None or info.group is None:
            raise PartitionError(f"env_disjoint needs each goal's scene and spec; goal {index} has {info!r}")
        if str(info.scene) in held_out:
            continue
        cells.setdefault(info.group, {}).setdefault(str(info.scene), []).append(index)
    chosen: list[int] = []
    for spec in sorted(cells):
        scenes = sorted(cells[spec], key=_scene_key)
        if len(scenes) == 1:
            if fallback == "shared":
                chosen.extend(cells[spec][scenes[0]])
            continue
        k = min(len(scenes), math.ceil(len(scenes) / num_clients * (1.0 + env_div)))
        scores = scene_scores(spec, len(scenes), client_id, env_div, base_seed)
        for position in np.argsort(scores, kind="stable")[:k]:
            chosen.extend(cells[spec][scenes[int(position)]])
    if not chosen:
        raise PartitionError(
            f"env_disjoint leaves client {client_id} of {num_clients} without games: every task has at most one "
            f"scene outside the held-out ones (fallback {fallback!r}); use fallback 'shared' or another strategy"
        )
    return sorted(chosen)


def read_holdout_scenes(path: str | Path) -> list[str]:
    """The ``scenes`` of a FedAgent holdout file (``holdout_alfworld_v1.json``)."""
    try:
        scenes = json.loads(Path(path).read_text())["scenes"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PartitionError(f"cannot read held-out scenes from {path}: {exc}") from None
    if not isinstance(scenes, list):
        raise PartitionError(f"held-out scenes in {path} must be a list, got {scenes!r}")
    return [str(s) for s in scenes]


def env_disjoint_strategy(client_id: int, num_clients: int, num_goals: int, knobs: Mapping[str, Any],
                          base_seed: int, goal_info: Sequence[GoalInfo] | None = None) -> list[int]:
    """Dispatcher adapter: knobs ``env_div``, ``fallback``, ``holdout_scenes`` / ``holdout_file``."""
    env_div = knob_float(knobs, "env_div", DEFAULT_ENV_DIV, 0.0, 1.0)
    holdout: list[str] = [str(s) for s in knobs.get("holdout_scenes") or ()]
    if knobs.get("holdout_file"):
        holdout += read_holdout_scenes(knobs["holdout_file"])
    return env_disjoint_partition(client_id, num_clients, check_goal_info("env_disjoint", goal_info, num_goals),
                                  env_div, base_seed, holdout, str(knobs.get("fallback") or "skip"))
