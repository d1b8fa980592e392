"""``AlfWorldEnv``: ALFWorld household tasks on the real engine, registered as "ALFWorld".

Episodes run inside the client's ALFWorld service, a process under the separate service venv
(:mod:`~fedagent_flwr.envs.alfworld.service_venv`) whose engine workers
(:mod:`~fedagent_flwr.envs.service.engine_workers`) hold the TextWorld games; the trainer talks to it
through the generic ``Service`` client. The class itself imports neither ``alfworld`` nor
``textworld``, so the trainer's process can size and partition the game pool
(:meth:`num_goals`, :meth:`goal_info`, :meth:`restrict_goals`) and name the interpreter that must
serve it (:meth:`service_python`).

Protocol (FedAgent's ALFWorld service and client, reference §3.3):

* system prompt: the ALFRED expert-agent instructions (reason in ``<think>``, act in ``<action>``);
* every observation: ``Your current observation is: {obs}`` and the admissible commands
  (``help`` removed), quoted and joined by ``"\\n "``; the first one carries "Your task is to: ...";
* the reply is projected with FedAgent's ``alfworld_projection`` (lowercased text inside
  ``<action>``; without the tags the last 30 characters, flagged invalid; valid also needs the
  ``<think>`` tags and no CJK); the engine gets the projected text whatever it is;
* reward ``10 * won``, ``success = won``; the episode ends when won or after ``max_turns`` (50).

Config keys: ``data_dir`` (the ``ALFWORLD_DATA`` root; default ``$ALFWORLD_DATA``), ``split``
(train | valid_seen | valid_unseen), ``shuffle_seed`` (42), ``num_games`` (cap), ``task_types``,
``goal_indices`` (a partition: indices into the pool; a seed then picks
``goal_indices[random.Random(seed).randrange(len)]``, else ``seed % pool``), ``max_turns`` (50),
``engine_workers`` (engine processes per service, default 2).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from fedagent_flwr.envs.alfworld.data import AlfWorldDataError, GameRecord, games_for_config
from fedagent_flwr.envs.base import BaseTextEnv, EnvConfigError
from fedagent_flwr.envs.registry import register_env
from fedagent_flwr.envs.projection import project_action

DEFAULT_MAX_TURNS = 50
DEFAULT_ENGINE_WORKERS = 2
WIN_REWARD = 10.0
#: ``alfworld_projection`` keeps the last 30 characters of a reply without action tags.
FALLBACK_CHARS = 30

SYSTEM_PROMPT = (
    "You are an expert agent operating in the ALFRED Embodied Environment.\n"
    "Now it's your turn to take an action.\n"
    "You should first reason step-by-step about the current situation. This reasoning "
    "process MUST be enclosed within <think> </think> tags.\n"
    "Once you've finished your reasoning, you should choose an admissible action for "
    "current step and present it within <action> </action> tags."
)


def format_observation(observation: str, commands: Sequence[str]) -> str:
    """One user turn: the observation and the quoted admissible commands (verl-agent's layout)."""
    actions = "\n ".join(f"'{c}'" for c in commands)
    return f"Your current observation is: {observation}\nYour admissible actions of the current situation are: [{actions}]."


def _int(config: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EnvConfigError(f"ALFWorld config '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _pool(config: Mapping[str, Any]) -> tuple[GameRecord, ...]:
    try:
        return games_for_config(config)
    except (AlfWorldDataError, TypeError, ValueError) as exc:
        raise EnvConfigError(f"ALFWorld: {exc}") from None


def _goal_indices(config: Mapping[str, Any], pool_size: int) -> list[int] | None:
    raw = config.get("goal_indices")
    if raw is None:
        return None
    if (isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or not raw
            or any(isinstance(g, bool) or not isinstance(g, int) for g in raw)):
        raise EnvConfigError(f"ALFWorld config 'goal_indices' must be a non-empty list of integers, got {raw!r}")
    bad = [g for g in raw if not 0 <= g < pool_size]
    if bad:
        raise EnvConfigError(f"ALFWorld goal_indices {bad[:5]} are outside the split's pool of {pool_size}")
    return list(raw)


@register_env("ALFWorld")
class AlfWorldEnv(BaseTextEnv):
    """ALFWorld episodes played by an engine worker (see the module docstring)."""

    def __init__(self, config: Mapping[str, Any] | None = None, *, workers: Any = None, slot: int = 0) -> None:
        super().__init__(config)
        self.max_turns = _int(self.config, "max_turns", DEFAULT_MAX_TURNS, 1)
        self.games = _pool(self.config)
        self.goal_indices = _goal_indices(self.config, len(self.games))
        # The engine lives in a worker process; without one (the trainer's process) the env can
        # describe its pool but not play.
        self.workers = workers
        self.slot = slot
        self.game: GameRecord | None = None
        self._turn = 0
        self._done = True

    # --- goal pool ---------------------------------------------------------------------------

    @classmethod
    def num_goals(cls, config: Mapping[str, Any]) -> int | None:
        """Pool size: ``len(goal_indices)`` if given, else the split's game count."""
        size = len(_pool(config))
        indices = _goal_indices(config, size)
        return len(indices) if indices is not None else size

    @classmethod
    def goal_records(cls, config: Mapping[str, Any]) -> list[GameRecord]:
        """The game of every pool index (after any ``goal_indices`` restriction)."""
        games = _pool(config)
        indices = _goal_indices(config, len(games))
        return [games[i] for i in indices] if indices is not None else list(games)

    @classmethod
    def goal_info(cls, config: Mapping[str, Any]) -> list[Any]:
        """Per pool goal: task type (``preference``), FedAgent's task id (``hardness`` labels),
        scene and spec (``env_disjoint``)."""
        from fedagent_flwr.hetero.common import GoalInfo

        return [GoalInfo(category=g.task_type, task_id=g.task_id, scene=g.scene, group=g.spec)
                for g in cls.goal_records(config)]

    @classmethod
    def restrict_goals(cls, config: Mapping[str, Any], goal_indices: Sequence[int]) -> dict[str, Any]:
        """Copy of ``config`` limited to the given pool indices (composes with an existing restriction)."""
        pool = cls.num_goals(config) or 0
        if not goal_indices:
            raise EnvConfigError("ALFWorld cannot be restricted to an empty goal list")
        bad = [g for g in goal_indices if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < pool]
        if bad:
            raise EnvConfigError(f"ALFWorld goal indices {bad[:5]} are outside the pool of {pool}")
        current = _goal_indices(config, len(_pool(config)))
        chosen = [current[g] for g in goal_indices] if current is not None else [int(g) for g in goal_indices]
        return {**dict(config), "goal_indices": chosen}

    # --- service -------------------------------------------------------------------------------

    @classmethod
    def service_python(cls, config: Mapping[str, Any]) -> str:
        """The interpreter that serves ALFWorld: the service venv, built first if missing."""
        from fedagent_flwr.envs.alfworld.service_venv import ensure_service_python

        return str(ensure_service_python())

    @classmethod
    def service_setup(
        cls, config: Mapping[str, Any], partition: Mapping[str, Any], variant: Mapping[str, Any]
    ) -> Any:
        """The service pool: ``engine_workers`` processes shared round-robin by the pool slots."""
        from fedagent_flwr.envs.service.app import ServiceEnvSetup
        from fedagent_flwr.envs.service.engine_workers import EngineWorkers

        if variant:
            raise EnvConfigError(f"ALFWorld has no environment variants; got {dict(variant)}")
        effective = dict(config)
        goal_indices = (partition or {}).get("goal_indices")
        if goal_indices is not None:
            effective = cls.restrict_goals(effective, list(goal_indices))
        cls(effective)  # config errors surface before any worker starts
        num_workers = _int(effective, "engine_workers", DEFAULT_ENGINE_WORKERS, 1)
        workers = EngineWorkers(num_workers, "fedagent_flwr.envs.alfworld.engine:GameSession")
        versions = workers.start()
        games = cls.goal_records(effective)
        info = {
            "num_goals": len(games),
            "split": str(effective.get("split", "train")),
            "engine_workers": num_workers,
            "textworld": versions[0],
            "task_types": sorted({g.task_type for g in games}),
        }

        def factory(slot: int) -> AlfWorldEnv:
            return cls(effective, workers=workers, slot=slot)

        return ServiceEnvSetup(factory=factory, info=info)

    # --- episode -------------------------------------------------------------------------------

    def game_for_seed(self, seed: int) -> GameRecord:
        """The game an episode with ``seed`` plays."""
        if self.goal_indices is not None:
            return self.games[self.goal_indices[random.Random(seed).randrange(len(self.goal_indices))]]
        return self.games[seed % len(self.games)]

    async def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def _engine(self) -> Any:
        if self.workers is None:
            raise RuntimeError("AlfWorldEnv plays only inside its service (no engine workers in this process)")
        return self.workers

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.game = self.game_for_seed(int(seed))
        state = await self._engine().call(self.slot, "reset", self.game.game_file)
        self._turn, self._done = 0, False
        return format_observation(state["obs"], state["admissible_commands"]), {
            "game": self.game.game_file,
            "task_id": self.game.task_id,
            "task_type": self.game.task_type,
            "admissible_commands": state["admissible_commands"],
            "raw_observation": state["obs"],
            "turns": 0,
        }

    async def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._done or self.game is None:
            raise RuntimeError("AlfWorldEnv.step called without an active episode; call reset first")
        self._turn += 1
        action, valid = project_action(action_text, FALLBACK_CHARS)
        state = await self._engine().call(self.slot, "step", action)
        won = state["won"]
        self._done = won or self._turn >= self.max_turns
        info = {
            "success": won,
            "won": won,
            "is_action_valid": int(valid),
            "action": action,
            "admissible_commands": state["admissible_commands"],
            "raw_observation": state["obs"],
            "task_id": self.game.task_id,
            "task_type": self.game.task_type,
            "turns": self._turn,
        }
        reward = WIN_REWARD if won else 0.0
        return format_observation(state["obs"], state["admissible_commands"]), reward, self._done, info
