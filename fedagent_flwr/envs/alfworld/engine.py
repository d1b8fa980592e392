"""One ALFWorld game session on the real engine (TextWorld's PDDL backend with ALFWorld's wrappers).

Runs only where ``alfworld`` and ``textworld`` are installed: in the service venv
(:mod:`fedagent_flwr.envs.alfworld.service_venv`), inside an engine worker process
(:mod:`fedagent_flwr.envs.service.engine_workers`). A session loads the game file named at reset with
``textworld.start`` and the wrappers ALFWorld's ``AlfredTWEnv`` uses (``AlfredDemangler`` for
readable object names, ``AlfredInfos`` for the game file), and asks TextWorld for ``won`` and the
admissible commands. ``help`` is removed from the admissible list, as FedAgent's service does.

TextWorld's PDDL parser is not thread-safe (FedAgent's "pop from empty list" crash), so a session
must only ever be used by one thread at a time; the worker processes guarantee that.
"""

from __future__ import annotations

from typing import Any

from fedagent_flwr.envs.textworld_session import TextWorldSession

HIDDEN_COMMANDS = frozenset({"help"})


def admissible(state: Any) -> list[str]:
    """The state's admissible commands without the ones FedAgent hides (``help``)."""
    return [c for c in (state.get("admissible_commands") or []) if c not in HIDDEN_COMMANDS]


class GameSession(TextWorldSession):
    """A reusable ALFWorld player: ``reset(game_file)`` starts an episode, ``step(command)`` plays one command."""

    @staticmethod
    def warm_up() -> str:
        """Import the engine (seconds) before the first episode; the TextWorld version."""
        import alfworld.agents.environment.alfred_tw_env  # noqa: F401
        import textworld

        return textworld.__version__

    def _start(self, game_file: str) -> Any:
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        return textworld.start(game_file, infos, wrappers=[AlfredDemangler(), AlfredInfos])

    def reset(self, game_file: str) -> dict[str, Any]:
        """Load ``game_file`` (a ``game.tw-pddl``) and start it; the initial observation and commands."""
        state = self._load(game_file)
        return {"obs": str(state["feedback"]), "admissible_commands": admissible(state), "won": bool(state["won"])}

    def step(self, command: str) -> dict[str, Any]:
        """Apply one text command (anything: the engine answers "Nothing happens." to non-commands)."""
        state, done = self._play(command)
        return {
            "obs": str(state["feedback"]),
            "admissible_commands": admissible(state),
            "won": bool(state["won"]),
            "engine_done": bool(done),
        }
