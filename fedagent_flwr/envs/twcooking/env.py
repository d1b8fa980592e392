"""``TWCookingEnv``: TextWorld cooking games generated offline, registered as "TWCooking".

A household-style benchmark that needs no downloaded data: the game set is generated with
``tw-make tw-cooking`` (:mod:`~fedagent_flwr.envs.twcooking.games`) at the levels the config names,
and played on TextWorld's engine inside the client's service (the ALFWorld service venv, which
ships TextWorld and its Inform 7 compiler) by engine workers, with ALFWorld's episode protocol
(:class:`~fedagent_flwr.envs.game_pool.GamePoolEnv`): reward ``10 * won``; an episode also ends
when the game is lost (eating a raw or burnt ingredient).

Heterogeneity knob: the pool lists the games level by level and each goal's category is its level,
so the task-level partitions give clients different worlds: ``uniform`` hands each client its own
block of levels (per-client settings), ``preference`` (``omega``) skews each client's level mix.

Config keys: ``levels`` (names from :data:`~fedagent_flwr.envs.twcooking.games.LEVELS` or
``{name, recipe, take, go, open, cook, cut, drop}``; default easy/medium/hard), ``games_per_level``
(4), ``seed`` (1), ``split`` (train | valid: disjoint recipes), ``goal_indices``, ``max_turns`` (50),
``engine_workers`` (2).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedagent_flwr.envs.base import EnvConfigError
from fedagent_flwr.envs.game_pool import ACTION_INSTRUCTIONS, GamePoolEnv
from fedagent_flwr.envs.registry import register_env
from fedagent_flwr.envs.twcooking.games import GameSetError, ensure_game_set

DEFAULT_LEVELS = ("easy", "medium", "hard")
DEFAULT_GAMES_PER_LEVEL = 4

SYSTEM_PROMPT = "You are an expert agent playing a text-based cooking game in a house.\n" + ACTION_INSTRUCTIONS


@dataclass(frozen=True)
class CookingGame:
    """One generated game: its ``.z8`` file, level, seed and the generator's walkthrough."""

    game_file: str
    level: str
    seed: int
    split: str
    walkthrough: tuple[str, ...]

    @property
    def task_id(self) -> str:
        return f"twcooking_{self.level}_{self.split}_{self.seed}"


_POOLS: dict[str, tuple[CookingGame, ...]] = {}


@register_env("TWCooking")
class TWCookingEnv(GamePoolEnv):
    """TextWorld cooking episodes played by an engine worker (see the module docstring)."""

    SESSION = "fedagent_flwr.envs.twcooking.engine:CookingSession"
    SYSTEM_PROMPT = SYSTEM_PROMPT

    @classmethod
    def pool(cls, config: Mapping[str, Any]) -> Sequence[CookingGame]:
        """The generated games of the config's levels and split, level by level (generated once)."""
        try:
            root = ensure_game_set(list(config.get("levels") or DEFAULT_LEVELS),
                                   config.get("games_per_level", DEFAULT_GAMES_PER_LEVEL),
                                   int(config.get("seed", 1)), str(config.get("split", "train")))
        except (GameSetError, TypeError, ValueError) as exc:
            raise EnvConfigError(f"TWCooking: {exc}") from None
        key = str(root)
        if key not in _POOLS:
            manifest = json.loads((Path(root) / "games.json").read_text())
            _POOLS[key] = tuple(
                CookingGame(str(Path(root) / g["file"]), g["level"], int(g["seed"]), g["split"],
                            tuple(g["walkthrough"]))
                for g in manifest["games"])
        return _POOLS[key]

    @classmethod
    def goal_info(cls, config: Mapping[str, Any]) -> list[Any]:
        """Per pool goal: its level as the category (``preference``) and a task id."""
        from fedagent_flwr.hetero.common import GoalInfo

        return [GoalInfo(category=g.level, task_id=g.task_id) for g in cls.goal_records(config)]

    @classmethod
    def service_info(cls, games: Sequence[CookingGame]) -> dict[str, Any]:
        return {"levels": sorted({g.level for g in games})}

    def game_facts(self, game: CookingGame) -> dict[str, Any]:
        return {"level": game.level, "task_id": game.task_id}
