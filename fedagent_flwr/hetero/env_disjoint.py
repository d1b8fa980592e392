"""``env_disjoint``: FedAgent's ALFWorld environment-disjoint partition (specs/partitions.md §9).

Games are grouped by *spec* (the task without its room, ``<task>-<object>-<mrecep>-<recep>``).
Specs are visited in ascending string order; a spec's games are sorted by ``(scene, trial)`` as
strings (scene ``"2" < "30" < "5"``). For a spec of ``m`` games in at least two scenes, every
client takes the same number ``k = min(m, max(1, ceil(m / N * (1 + env_div))))`` of **games** (not
rooms): the ``k`` with the lowest ``e = (1 - env_div) * u + env_div * v``, in ascending ``e``, where
``u = RandomState(spec_seed).random(m)`` is shared by all clients and ``v =
RandomState(client_seed).random(m)`` is the client's own:

* ``H`` = the first 4 bytes of SHA-256 of the spec (big-endian) ``& 0x7fffffff``;
* ``spec_seed = (S + H) & 0x7fffffff``; ``client_seed = (S + 1000 c + (H & 0xffff)) & 0x7fffffff``.

``env_div = 0``: every client takes the same games; ``env_div = 1``: independent selections. A
spec seen in one scene follows ``fallback``: ``"skip"`` (FedAgent's default: nobody gets it),
``"shared"`` (every client gets all its games) or ``"trial-only"`` (a single game is shared, two or
more go through the top-k). Scenes listed as held out (``holdout_scenes``, or FedAgent's
``holdout_alfworld_v1.json`` via ``holdout_file``) are dropped first; FedAgent's service passes none.
``min_goals_per_client`` is ignored, as in FedAgent.

``unit="scene"`` is this project's earlier design, kept as an explicitly named alternative: the
same formulas over a spec's *scenes* (``m`` = number of scenes, the top-k picks rooms), and a
client gets every game of its rooms, so a (spec, room) is all in or all out.

Everything is a pure function of integers (never Python's salted ``hash()``); ``S = 42`` gives
FedAgent's partition.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedagent_flwr.hetero.common import DEFAULT_SEED, GoalInfo, check_args, check_goal_info, knob
from fedagent_flwr.hetero.uniform import PartitionError
from fedagent_flwr.schema.run import FALLBACKS, UNITS, Partition

DEFAULT_ENV_DIV: float = Partition.env_div  # type: ignore[assignment]  # the schema field's default (FedAgent's)


def spec_digest(spec: str) -> int:
    """``H``: the first 4 bytes of SHA-256 of the spec (UTF-8), big-endian, ``& 0x7fffffff``."""
    return int.from_bytes(hashlib.sha256(spec.encode("utf-8")).digest()[:4], "big") & 0x7FFFFFFF


def spec_seeds(spec: str, client_id: int, base_seed: int = DEFAULT_SEED) -> tuple[int, int]:
    """``(spec_seed, client_seed)`` of a spec for one client."""
    digest = spec_digest(spec)
    spec_seed = (int(base_seed) + (digest & 0x7FFFFFFF)) & 0x7FFFFFFF
    client_seed = (int(base_seed) + 1000 * int(client_id) + (digest & 0xFFFF)) & 0x7FFFFFFF
    return spec_seed, client_seed


def selection_scores(spec: str, count: int, client_id: int, env_div: float, base_seed: int = DEFAULT_SEED,
                     rng: np.random.RandomState | None = None) -> np.ndarray:
    """``e = (1 - env_div) * u + env_div * v`` over a spec's ``count`` sorted items, for one client.

    ``u = RandomState(spec_seed).random(count)``, ``v = RandomState(client_seed).random(count)``;
    ``rng``, if given, is re-seeded instead (the same MT19937 stream, without building a new one).
    """
    spec_seed, client_seed = spec_seeds(spec, client_id, base_seed)
    rng = np.random.RandomState(0) if rng is None else rng
    rng.seed(spec_seed)
    u = rng.random(count)
    rng.seed(client_seed)
    v = rng.random(count)
    return (1.0 - env_div) * u + env_div * v


def per_client_count(count: int, num_clients: int, env_div: float) -> int:
    """``k = min(m, max(1, ceil(m / N * (1 + env_div))))`` in double precision."""
    return min(count, max(1, int(np.ceil((count / num_clients) * (1 + env_div)))))


def _trial(info: GoalInfo) -> str:
    """The trial directory: ``info.trial``, else read from ALFWorld's task id
    ``alfworld_<spec>-<scene>_<trial>_game``, else the task id itself."""
    if info.trial is not None:
        return str(info.trial)
    task_id = str(info.task_id or "")
    prefix = f"alfworld_{info.group}-{info.scene}_"
    if task_id.startswith(prefix) and task_id.endswith("_game"):
        return task_id[len(prefix):-len("_game")]
    return task_id


def env_disjoint_partition(
    client_id: int,
    num_clients: int,
    goal_info: Sequence[GoalInfo],
    env_div: float = DEFAULT_ENV_DIV,
    base_seed: int = DEFAULT_SEED,
    holdout_scenes: Collection[str] = (),
    fallback: str = "skip",
    unit: str = "game",
) -> list[int]:
    """The pool indices of ``client_id``'s games, spec by spec, in FedAgent's order (module doc).

    Goals without a scene or spec are dropped (FedAgent drops paths it cannot parse). A client left
    with no game at all is an error that says why.
    """
    num_goals = len(goal_info)
    check_args(client_id, num_clients, max(num_goals, 1))
    goal_info = check_goal_info("env_disjoint", goal_info, num_goals)
    if fallback not in FALLBACKS:
        raise PartitionError(f"env_disjoint fallback must be one of {FALLBACKS}, got {fallback!r}")
    if unit not in UNITS:
        raise PartitionError(f"env_disjoint unit must be one of {UNITS}, got {unit!r}")
    if not 0.0 <= env_div <= 1.0:
        raise PartitionError(f"env_div must be in [0, 1], got {env_div!r}")
    held_out = {str(s) for s in holdout_scenes}
    by_spec: dict[str, list[tuple[str, str, int]]] = {}
    for index, info in enumerate(goal_info):
        if info.scene is None or info.group is None or str(info.scene) in held_out:
            continue
        by_spec.setdefault(str(info.group), []).append((str(info.scene), _trial(info), index))
    chosen: list[int] = []
    rng = np.random.RandomState(0)  # re-seeded per spec
    for spec in sorted(by_spec):
        games = sorted(by_spec[spec])
        scenes = sorted({scene for scene, _, _ in games})
        if unit == "scene":
            if len(scenes) <= 1 and fallback != "trial-only":
                if fallback == "shared":
                    chosen += [index for _, _, index in games]
                continue
            k = per_client_count(len(scenes), num_clients, env_div)
            order = np.argsort(selection_scores(spec, len(scenes), client_id, env_div, base_seed, rng))[:k]
            for position in order:
                chosen += [index for scene, _, index in games if scene == scenes[int(position)]]
            continue
        if len(scenes) <= 1:
            if fallback == "skip":
                continue
            if fallback == "shared" or len(games) == 1:
                chosen += [index for _, _, index in games]
                continue
        k = per_client_count(len(games), num_clients, env_div)
        order = np.argsort(selection_scores(spec, len(games), client_id, env_div, base_seed, rng))[:k]
        chosen += [games[int(position)][2] for position in order]
    if not chosen:
        raise PartitionError(
            f"env_disjoint leaves client {client_id} of {num_clients} without games: every task has at most one "
            f"scene outside the held-out ones (fallback {fallback!r}); use fallback 'shared' or another strategy"
        )
    return chosen


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
    """Dispatcher adapter: knobs ``env_div``, ``fallback``, ``unit``, ``holdout_scenes`` / ``holdout_file``."""
    holdout: list[str] = [str(s) for s in knobs.get("holdout_scenes") or ()]
    if knobs.get("holdout_file"):
        holdout += read_holdout_scenes(knobs["holdout_file"])
    return env_disjoint_partition(client_id, num_clients, check_goal_info("env_disjoint", goal_info, num_goals),
                                  knob(knobs, "env_div"), base_seed, holdout, knob(knobs, "fallback"),
                                  knob(knobs, "unit"))
