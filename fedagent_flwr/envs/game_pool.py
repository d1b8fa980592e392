"""``GamePoolEnv``: a text game environment over a fixed pool of game files, played by engine workers.

The shape ALFWorld and the TextWorld cooking family share: a pool of games (what partitions split),
a seed that picks one (``goal_indices[random.Random(seed).randrange(len)]`` under a partition, else
``seed % pool``), an engine that lives in worker processes of the env's service, running under the
service venv (:mod:`fedagent_flwr.envs.alfworld.service_venv`), and FedAgent's episode protocol:

* the reply is projected (lowercased text inside ``<action>``; without the tags the last 30
  characters, flagged invalid; valid also needs the ``<think>`` tags and no CJK) and the engine
  gets the projected text whatever it is;
* every observation is ``Your current observation is: {obs}`` plus the admissible commands, quoted
  and joined by ``"\\n "`` (verl-agent's ALFWorld layout);
* reward ``10 * won``, ``success = won``; the episode ends when won, lost or after ``max_turns``.

A subclass names its pool (:meth:`pool`), its engine session class (``SESSION``, "module:Class"
with ``reset(game_file)``/``step(command)`` returning ``obs``, ``admissible_commands``, ``won`` and
optionally ``lost``), its system prompt and per-game facts (:meth:`game_facts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from fedagent_flwr.envs.base import (
    BaseTextEnv,
    EnvConfigError,
    config_int,
    configured_goal_indices,
    pool_index_for_seed,
    restricted_goal_config,
)
from fedagent_flwr.envs.projection import project_action

WIN_REWARD = 10.0
#: FedAgent's ``alfworld_projection`` keeps the last 30 characters of a reply without action tags.
FALLBACK_CHARS = 30
DEFAULT_ENGINE_WORKERS = 2
#: The system prompt's instructions after its first line (the game's setting), shared by the game pools.
ACTION_INSTRUCTIONS = (
    "Now it's your turn to take an action.\n"
    "You should first reason step-by-step about the current situation. This reasoning "
    "process MUST be enclosed within <think> </think> tags.\n"
    "Once you've finished your reasoning, you should choose an admissible action for "
    "current step and present it within <action> </action> tags."
)


def format_observation(observation: str, commands: Sequence[str]) -> str:
    """One user turn: the observation and the quoted admissible commands (verl-agent's layout)."""
    actions = "\n ".join(f"'{c}'" for c in commands)
    return (f"Your current observation is: {observation}\n"
            f"Your admissible actions of the current situation are: [{actions}].")


class GamePoolEnv(BaseTextEnv):
    """Episodes over a pool of game files (see the module docstring)."""

    SESSION: ClassVar[str] = ""
    SYSTEM_PROMPT: ClassVar[str] = ""
    DEFAULT_MAX_TURNS: ClassVar[int] = 50

    def __init__(self, config: Mapping[str, Any] | None = None, *, workers: Any = None, slot: int = 0) -> None:
        super().__init__(config)
        self.max_turns = config_int(self.config, "max_turns", self.DEFAULT_MAX_TURNS, 1, self.env_name)
        self.games = self.pool(self.config)
        self.goal_indices = configured_goal_indices(self.env_name, self.config, len(self.games))
        # The engine lives in a worker process of the service; without one (the trainer's process)
        # the env can describe its pool but not play.
        self.workers = workers
        self.slot = slot
        self.game: Any = None
        self._turn = 0
        self._done = True

    # --- what a subclass provides ----------------------------------------------------------------

    @classmethod
    def pool(cls, config: Mapping[str, Any]) -> Sequence[Any]:
        """The game records of the config's split; each has ``game_file``."""
        raise NotImplementedError

    def game_facts(self, game: Any) -> dict[str, Any]:
        """Facts about the episode's game added to every info dict (task type, level, ...)."""
        return {}

    @classmethod
    def check_data(cls, config: Mapping[str, Any]) -> None:
        """Check, without reading or generating games, that the config's games can be found."""

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> None:
        """The turn budget, the engine workers and :meth:`check_data`: the pool itself is listed (or
        generated) by each client's service."""
        config_int(config, "max_turns", cls.DEFAULT_MAX_TURNS, 1, cls.env_name)
        config_int(config, "engine_workers", DEFAULT_ENGINE_WORKERS, 1, cls.env_name)
        cls.check_data(config)

    # --- goal pool -------------------------------------------------------------------------------

    @classmethod
    def goal_records(cls, config: Mapping[str, Any]) -> list[Any]:
        """The game of every pool index (after any ``goal_indices`` restriction)."""
        games = cls.pool(config)
        indices = configured_goal_indices(cls.env_name, config, len(games))
        return [games[i] for i in indices] if indices is not None else list(games)

    @classmethod
    def num_goals(cls, config: Mapping[str, Any]) -> int | None:
        """Pool size: ``len(goal_indices)`` if given, else the split's game count."""
        return len(cls.goal_records(config))

    @classmethod
    def restrict_goals(cls, config: Mapping[str, Any], goal_indices: Sequence[int]) -> dict[str, Any]:
        """Copy of ``config`` limited to the given pool indices (composes with an existing restriction)."""
        pool = cls.num_goals(config) or 0
        current = configured_goal_indices(cls.env_name, config, len(cls.pool(config)))
        return restricted_goal_config(cls.env_name, config, goal_indices, pool, current)

    # --- service ---------------------------------------------------------------------------------

    @classmethod
    def service_python(cls, config: Mapping[str, Any]) -> str:
        """The interpreter that serves this env: the service venv, built first if missing."""
        from fedagent_flwr.envs.alfworld.service_venv import ensure_service_python

        return str(ensure_service_python())

    @classmethod
    def service_info(cls, games: Sequence[Any]) -> dict[str, Any]:
        """Env facts for ``/health`` beyond the pool size and workers."""
        return {}

    @classmethod
    def service_setup(
        cls, config: Mapping[str, Any], partition: Mapping[str, Any], variant: Mapping[str, Any]
    ) -> Any:
        """The service pool: ``engine_workers`` processes shared round-robin by the pool slots."""
        from fedagent_flwr.envs.service.app import ServiceEnvSetup
        from fedagent_flwr.envs.service.engine_workers import EngineWorkers

        if variant:
            raise EnvConfigError(f"{cls.env_name} has no environment variants; got {dict(variant)}")
        effective = dict(config)
        goal_indices = (partition or {}).get("goal_indices")
        if goal_indices is not None:
            effective = cls.restrict_goals(effective, list(goal_indices))
        cls(effective)  # config errors surface before any worker starts
        num_workers = config_int(effective, "engine_workers", DEFAULT_ENGINE_WORKERS, 1, cls.env_name)
        workers = EngineWorkers(num_workers, cls.SESSION)
        versions = workers.start()
        games = cls.goal_records(effective)
        info = {"num_goals": len(games), "split": str(effective.get("split", "train")),
                "engine_workers": num_workers, "textworld": versions[0], **cls.service_info(games)}

        def factory(slot: int) -> GamePoolEnv:
            return cls(effective, workers=workers, slot=slot)

        return ServiceEnvSetup(factory=factory, info=info)

    # --- episode ---------------------------------------------------------------------------------

    def game_for_seed(self, seed: int) -> Any:
        """The game an episode with ``seed`` plays."""
        return self.games[pool_index_for_seed(seed, self.goal_indices, len(self.games))]

    async def system_prompt(self) -> str:
        return self.SYSTEM_PROMPT

    def _engine(self) -> Any:
        if self.workers is None:
            raise RuntimeError(
                f"{type(self).__name__} plays only inside its service (no engine workers in this process)"
            )
        return self.workers

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.game = self.game_for_seed(int(seed))
        state = await self._engine().call(self.slot, "reset", str(self.game.game_file))
        self._turn, self._done = 0, False
        return format_observation(state["obs"], state["admissible_commands"]), {
            "game": str(self.game.game_file),
            **self.game_facts(self.game),
            "admissible_commands": state["admissible_commands"],
            "raw_observation": state["obs"],
            "turns": 0,
        }

    async def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._done or self.game is None:
            raise RuntimeError(f"{type(self).__name__}.step called without an active episode; call reset first")
        self._turn += 1
        action, valid = project_action(action_text, FALLBACK_CHARS)
        state = await self._engine().call(self.slot, "step", action)
        won = bool(state["won"])
        self._done = won or bool(state.get("lost")) or self._turn >= self.max_turns
        info = {
            "success": won,
            "won": won,
            "is_action_valid": int(valid),
            "action": action,
            "admissible_commands": state["admissible_commands"],
            "raw_observation": state["obs"],
            **self.game_facts(self.game),
            "turns": self._turn,
        }
        if "lost" in state:
            info["lost"] = bool(state["lost"])
        reward = WIN_REWARD if won else 0.0
        return format_observation(state["obs"], state["admissible_commands"]), reward, self._done, info
