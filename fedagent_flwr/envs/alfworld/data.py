"""ALFWorld game data: the standard ``json_2.1.1`` layout, FedAgent's game order and goal metadata.

Layout (what ``alfworld-download`` unpacks)::

    $ALFWORLD_DATA/json_2.1.1/{train,valid_seen,valid_unseen}/
        <task_type>-<object>-<movable receptacle>-<receptacle>-<scene>/trial_*/
            traj_data.json  initial_state.pddl  game.tw-pddl

A game is playable when its trial directory holds ``traj_data.json`` and a ``game.tw-pddl`` whose
JSON says ``"solvable": true`` (ALFWorld's own rule, ``AlfredTWEnv.collect_game_files``); trials of
``movable``/``Sliced`` tasks are skipped, as ALFWorld's text engine does. The official set has
3,553 train, 140 valid_seen and 134 valid_unseen such games.

Order, as FedAgent's engine fixes it: games sorted by path (the walk order of a filesystem is not
reproducible), then shuffled with ``random.Random(shuffle_seed)`` (default 42) for train and
``random.Random(42)`` for the evaluation splits; an evaluation split larger than ``num_eval_games``
(default 500, so the official 140 are all kept) is cut to ``random.Random(42).sample`` of that many.
Pool index ``i`` is position ``i`` of that list, on every machine that has the same games.

Pure Python (no ``alfworld`` import): the trainer's process reads goal metadata for partitions.
"""

from __future__ import annotations

import json
import os
import random
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: ALFWorld's task types (``alfworld.agents.environment.alfred_tw_env.TASK_TYPES``).
TASK_TYPES: dict[int, str] = {
    1: "pick_and_place_simple",
    2: "look_at_obj_in_light",
    3: "pick_clean_then_place_in_recep",
    4: "pick_heat_then_place_in_recep",
    5: "pick_cool_then_place_in_recep",
    6: "pick_two_obj_and_place",
}
SPLITS: tuple[str, ...] = ("train", "valid_seen", "valid_unseen")
#: Playable games per split in the official release (FedAgent's counts).
OFFICIAL_SPLIT_SIZES: dict[str, int] = {"train": 3553, "valid_seen": 140, "valid_unseen": 134}
DATA_VERSION_DIR = "json_2.1.1"
DATA_ENV_VAR = "ALFWORLD_DATA"
#: How missing game data is fixed; part of every "no data" message.
DOWNLOAD_HINT = "fetch the data with: python -m fedagent_flwr.envs.alfworld.download {data_dir}"
DEFAULT_SHUFFLE_SEED = 42
EVAL_SEED = 42
DEFAULT_NUM_EVAL_GAMES = 500


class AlfWorldDataError(ValueError):
    """ALFWorld game data that is missing or not in the standard layout."""


class AlfWorldDataMissing(AlfWorldDataError):
    """No data root, or one without the split's directory: the data was never fetched here."""


@dataclass(frozen=True)
class GameRecord:
    """One playable game: where it is and what it asks.

    ``task_dir`` is ``<task_type>-<object>-<mrecep>-<recep>-<scene>``, ``trial`` the ``trial_*`` name.
    ``spec`` is the task without its scene (``<task_type>-<object>-<mrecep>-<recep>``): the same
    task in other rooms shares it. ``task_id`` is FedAgent's key for hardness labels.
    """

    game_file: str  # absolute path of game.tw-pddl
    split: str
    task_type: str
    task_dir: str
    trial: str
    scene: str

    @property
    def spec(self) -> str:
        return self.task_dir.rsplit("-", 1)[0]

    @property
    def task_id(self) -> str:
        return f"alfworld_{self.task_dir}_{self.trial}_game"

    @property
    def trial_dir(self) -> Path:
        return Path(self.game_file).parent


def resolve_data_root(data_dir: str | os.PathLike[str] | None) -> Path:
    """The ``ALFWORLD_DATA`` root: ``data_dir`` if given, else ``$ALFWORLD_DATA``; must hold ``json_2.1.1``."""
    raw = str(data_dir or "").strip() or os.environ.get(DATA_ENV_VAR, "").strip()
    if not raw:
        raise AlfWorldDataMissing(
            f"no ALFWorld data directory is set: set env.data_dir (or the environment variable {DATA_ENV_VAR}) to "
            f"a directory holding {DATA_VERSION_DIR}/; {DOWNLOAD_HINT.format(data_dir='DATA_DIR')}"
        )
    root = Path(raw).expanduser().resolve()
    if not (root / DATA_VERSION_DIR).is_dir():
        raise AlfWorldDataMissing(f"ALFWorld data root {root} has no {DATA_VERSION_DIR}/ directory; "
                                f"{DOWNLOAD_HINT.format(data_dir=root)}")
    return root


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise AlfWorldDataError(f"ALFWorld split must be one of {SPLITS}, got {split!r}")


def _check_task_types(names: Iterable[Any]) -> None:
    unknown = sorted(set(names) - set(TASK_TYPES.values()))
    if unknown:
        raise AlfWorldDataError(f"unknown ALFWorld task types {unknown} (known: {sorted(TASK_TYPES.values())})")


def _split_dir(root: Path, split: str) -> Path:
    """The split's directory under the data root; :class:`AlfWorldDataMissing` if it was never fetched."""
    split_dir = root / DATA_VERSION_DIR / split
    if not split_dir.is_dir():
        raise AlfWorldDataMissing(f"ALFWorld data root {root} has no {DATA_VERSION_DIR}/{split}/ directory; "
                                  f"{DOWNLOAD_HINT.format(data_dir=root)}")
    return split_dir


def check_config_data(config: Mapping[str, Any]) -> None:
    """What :func:`games_for_config` needs, checked without reading a game: the split and task types
    are known and the data root holds the split's directory."""
    split = str(config.get("split", "train"))
    _check_split(split)
    _check_task_types(_task_type_names(config.get("task_types")))
    _split_dir(resolve_data_root(config.get("data_dir")), split)


def _task_type_names(task_types: Any) -> list[Any]:
    """Task types as names (ALFWorld's integer ids mapped); [] when unset."""
    if task_types is None:
        return []
    return [TASK_TYPES[t] if isinstance(t, int) and not isinstance(t, bool) and t in TASK_TYPES else t
            for t in task_types]


def _solvable(game_file: Path) -> bool:
    try:
        game = json.loads(game_file.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(game, dict) and game.get("solvable") is True


def _scene_of(task_dir: str) -> str:
    scene = task_dir.rsplit("-", 1)[-1]
    if not scene.isdigit():
        raise AlfWorldDataError(f"task directory {task_dir!r} does not end in a scene number")
    return scene


def _walk_split(split_dir: Path, split: str, task_types: frozenset[str]) -> list[GameRecord]:
    games = []
    for traj in split_dir.glob("*/trial_*/traj_data.json"):
        trial_dir = traj.parent
        task_dir = trial_dir.parent.name
        if "movable" in str(trial_dir) or "Sliced" in str(trial_dir):
            continue
        task_type = task_dir.split("-", 1)[0]
        if task_type not in task_types:
            continue
        game_file = trial_dir / "game.tw-pddl"
        if not game_file.is_file() or not _solvable(game_file):
            continue
        games.append(GameRecord(str(game_file), split, task_type, task_dir, trial_dir.name, _scene_of(task_dir)))
    return games


_CACHE_LOCK = threading.Lock()
_GAMES: dict[tuple[Any, ...], tuple[GameRecord, ...]] = {}


def load_games(
    data_dir: str | os.PathLike[str] | None,
    split: str,
    *,
    shuffle_seed: int = DEFAULT_SHUFFLE_SEED,
    num_games: int | None = None,
    task_types: Iterable[str] | None = None,
) -> tuple[GameRecord, ...]:
    """The split's playable games in FedAgent's order (see the module docstring); cached per process.

    ``num_games`` caps the list: train keeps the first ``num_games`` (FedAgent's ``num_train_games``),
    an evaluation split samples ``num_games`` (default 500) with ``random.Random(42)``.
    """
    _check_split(split)
    root = resolve_data_root(data_dir)
    wanted = frozenset(task_types) if task_types is not None else frozenset(TASK_TYPES.values())
    _check_task_types(wanted)
    if split != "train" and num_games is None:
        num_games = DEFAULT_NUM_EVAL_GAMES
    key = (str(root), split, int(shuffle_seed), num_games, tuple(sorted(wanted)))
    with _CACHE_LOCK:
        cached = _GAMES.get(key)
        if cached is not None:
            return cached
        split_dir = _split_dir(root, split)
        games = sorted(_walk_split(split_dir, split, wanted), key=lambda g: g.game_file)
        if not games:
            raise AlfWorldDataError(
                f"no playable ALFWorld games in {split_dir} (need trial_*/traj_data.json and a game.tw-pddl "
                f"with \"solvable\": true)"
            )
        if split == "train":
            random.Random(shuffle_seed).shuffle(games)
            if num_games is not None and num_games > 0:
                games = games[:num_games]
        else:
            random.Random(EVAL_SEED).shuffle(games)
            if num_games is not None and 0 < num_games < len(games):
                games = random.Random(EVAL_SEED).sample(games, num_games)
        result = tuple(games)
        _GAMES[key] = result
        return result


def games_for_config(config: Mapping[str, Any]) -> tuple[GameRecord, ...]:
    """The game pool an ALFWorld env config names.

    The config's ``data_dir``, ``split``, ``shuffle_seed``, ``num_games`` and ``task_types`` select it.
    """
    task_types = config.get("task_types")
    if task_types is not None:
        task_types = _task_type_names(task_types)
    num_games = config.get("num_games")
    return load_games(
        config.get("data_dir"),
        str(config.get("split", "train")),
        shuffle_seed=int(config.get("shuffle_seed", DEFAULT_SHUFFLE_SEED)),
        num_games=None if num_games is None else int(num_games),
        task_types=task_types,
    )
