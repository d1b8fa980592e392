"""One TextWorld cooking game session (runs only in the service venv, inside an engine worker).

Games are the ``.z8`` files ``tw-make`` writes; TextWorld plays them on its Jericho/Z-machine
backend and reports admissible commands, ``won`` and ``lost`` (eating something raw, burning it).
"""

from __future__ import annotations

from typing import Any

from fedagent_flwr.envs.textworld_session import TextWorldSession


class CookingSession(TextWorldSession):
    """A reusable cooking-game player: ``reset(game_file)`` starts an episode, ``step(command)`` plays one command."""

    @staticmethod
    def warm_up() -> str:
        """Import the engine before the first episode; the TextWorld version."""
        import textworld

        return textworld.__version__

    @staticmethod
    def _state(state: Any) -> dict[str, Any]:
        return {"obs": str(state["feedback"]).strip(), "admissible_commands": list(state["admissible_commands"] or []),
                "won": bool(state["won"]), "lost": bool(state["lost"]), "score": int(state["score"] or 0)}

    def _start(self, game_file: str) -> Any:
        import textworld

        infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True, score=True)
        return textworld.start(game_file, infos)

    def reset(self, game_file: str) -> dict[str, Any]:
        """Load ``game_file`` (a ``.z8``) if it is not loaded, and start it."""
        return self._state(self._load(game_file))

    def step(self, command: str) -> dict[str, Any]:
        """Apply one text command."""
        return self._state(self._play(command)[0])
