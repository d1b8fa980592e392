"""``AlfWorldEnv``: ALFWorld household tasks on the real engine, registered as "ALFWorld".

Episodes run inside the client's ALFWorld service, a process under the separate service venv
(:mod:`~fedagent_flwr.envs.alfworld.service_venv`) whose engine workers
(:mod:`~fedagent_flwr.envs.service.engine_workers`) hold the TextWorld games; the trainer talks to it
through the generic ``Service`` client. The class itself imports neither ``alfworld`` nor
``textworld``, so the trainer's process can size and partition the game pool
(:meth:`num_goals`, :meth:`goal_info`, :meth:`restrict_goals`) and name the interpreter that must
serve it (:meth:`service_python`). The episode machinery is :class:`~fedagent_flwr.envs.game_pool.GamePoolEnv`.

Protocol (FedAgent's ALFWorld service and client, reference §3.3):

* system prompt: the ALFRED expert-agent instructions (reason in ``<think>``, act in ``<action>``);
* every observation: ``Your current observation is: {obs}`` and the admissible commands
  (``help`` removed), quoted and joined by ``"\\n "``; the first one carries "Your task is to: ...";
* the reply is projected with FedAgent's ``alfworld_projection`` (lowercased text inside
  ``<action>``; without the tags the last 30 characters, flagged invalid; valid also needs the
  ``<think>`` tags and no CJK); the engine gets the projected text whatever it is;
* reward ``10 * won``, ``success = won``; the episode ends when won or after ``max_turns`` (50);
* windowed mode: FedAgent's windowed templates (:mod:`~fedagent_flwr.envs.alfworld.prompts`).

Config keys: ``data_dir`` (the ``ALFWORLD_DATA`` root; default ``$ALFWORLD_DATA``), ``split``
(train | valid_seen | valid_unseen), ``shuffle_seed`` (42), ``num_games`` (cap), ``task_types``,
``goal_indices`` (a partition: indices into the pool; a seed then picks
``goal_indices[random.Random(seed).randrange(len)]``, else ``seed % pool``), ``max_turns`` (50),
``engine_workers`` (engine processes per service, default 2).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from fedagent_flwr.envs.alfworld.data import (
    AlfWorldDataError,
    AlfWorldDataMissing,
    GameRecord,
    check_config_data,
    games_for_config,
)
from fedagent_flwr.envs.base import EnvConfigError, EnvDataError
from fedagent_flwr.envs.game_pool import (
    ACTION_INSTRUCTIONS,
    FALLBACK_CHARS,
    WIN_REWARD,
    GamePoolEnv,
    format_observation,
)
from fedagent_flwr.envs.registry import register_env
from fedagent_flwr.envs.window import Window

__all__ = ["FALLBACK_CHARS", "SYSTEM_PROMPT", "WIN_REWARD", "AlfWorldEnv", "format_observation"]

DEFAULT_MAX_TURNS = 50
_T = TypeVar("_T")

SYSTEM_PROMPT = "You are an expert agent operating in the ALFRED Embodied Environment.\n" + ACTION_INSTRUCTIONS


def _env_errors(read: Callable[[Mapping[str, Any]], _T], config: Mapping[str, Any]) -> _T:
    """``read(config)`` with ALFWorld's data errors as the env errors preflight and the service report."""
    try:
        return read(config)
    except AlfWorldDataMissing as exc:  # its message names ALFWorld and the download command
        raise EnvDataError(str(exc), key="data_dir") from None
    except (AlfWorldDataError, TypeError, ValueError) as exc:
        raise EnvConfigError(f"ALFWorld: {exc}") from None


@register_env("ALFWorld")
class AlfWorldEnv(GamePoolEnv):
    """ALFWorld episodes played by an engine worker (see the module docstring)."""

    SESSION = "fedagent_flwr.envs.alfworld.engine:GameSession"
    SYSTEM_PROMPT = SYSTEM_PROMPT
    DEFAULT_MAX_TURNS = DEFAULT_MAX_TURNS

    @classmethod
    def pool(cls, config: Mapping[str, Any]) -> Sequence[GameRecord]:
        """The split's playable games in FedAgent's order (:mod:`~fedagent_flwr.envs.alfworld.data`)."""
        return _env_errors(games_for_config, config)

    @classmethod
    def check_data(cls, config: Mapping[str, Any]) -> None:
        """The data root holds the config's split (no game is read: that is each service's work)."""
        _env_errors(check_config_data, config)

    @classmethod
    def goal_info(cls, config: Mapping[str, Any]) -> list[Any]:
        """Per pool goal: task type (``preference``), FedAgent's task id (``hardness`` labels),
        scene and spec (``env_disjoint``)."""
        from fedagent_flwr.hetero.common import GoalInfo

        return [GoalInfo(category=g.task_type, task_id=g.task_id, scene=g.scene, group=g.spec)
                for g in cls.goal_records(config)]

    @classmethod
    def service_info(cls, games: Sequence[GameRecord]) -> dict[str, Any]:
        return {"task_types": sorted({g.task_type for g in games})}

    def game_facts(self, game: GameRecord) -> dict[str, Any]:
        return {"task_id": game.task_id, "task_type": game.task_type}

    @classmethod
    def render_window(cls, window: Window) -> str:
        """FedAgent's windowed ALFWorld prompt (:mod:`~fedagent_flwr.envs.alfworld.prompts`)."""
        from fedagent_flwr.envs.alfworld.prompts import render_window

        return render_window(window)
