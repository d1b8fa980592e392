"""ALFWorld over HTTP as the tests start it: the service launch on a game set (the shared trial
rebuilt with goal variants of its scene, the ``alfworld_data`` fixture), the trial's own goal, the
seed that plays it, and the walkthrough that wins a game."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedagent_flwr.envs.alfworld.data import load_games
from fedagent_flwr.envs.service.manager import ServiceLaunch

#: The shared trial's own goal (its task directory).
TRIAL_TASK = "pick_heat_then_place_in_recep-Potato-None-SinkBasin-14"


def service_launch(python: Path, data: Path, pool: int = 4, **config: Any) -> ServiceLaunch:
    """An ALFWorld service of ``pool`` slots on the train split of ``data``, run by the service
    venv's ``python``; ``config`` adds env settings (``engine_workers``, ...)."""
    return ServiceLaunch(env="ALFWorld", config={"data_dir": str(data), "split": "train", **config},
                         pool_size=pool, interpreter=str(python))


def seed_of(data: Path, task_dir: str) -> int:
    """The seed whose episode (``seed % pool``) plays ``task_dir``'s game."""
    games = load_games(data, "train")
    return next(i for i, g in enumerate(games) if g.task_dir == task_dir)


def walkthrough(game_file: str) -> list[str]:
    """The commands that win the game ``game_file`` (its folder's ``walkthrough.json``)."""
    return json.loads((Path(game_file).parent / "walkthrough.json").read_text())
