"""One TextWorld cooking game session (runs only in the service venv, inside an engine worker).

Games are the ``.z8`` files ``tw-make`` writes; TextWorld plays them on its Jericho/Z-machine
backend and reports admissible commands, ``won`` and ``lost`` (eating something raw, burning it).
"""

from __future__ import annotations

from typing import Any


class CookingSession:
    """A reusable player: ``reset(game_file)`` starts an episode, ``step(command)`` plays one command."""

    def __init__(self) -> None:
        self._env: Any = None
        self.game_file: str | None = None

    @staticmethod
    def warm_up() -> str:
        """Import the engine before the first episode; the TextWorld version."""
        import textworld

        return textworld.__version__

    @staticmethod
    def _state(state: Any) -> dict[str, Any]:
        return {"obs": str(state["feedback"]).strip(), "admissible_commands": list(state["admissible_commands"] or []),
                "won": bool(state["won"]), "lost": bool(state["lost"]), "score": int(state["score"] or 0)}

    def reset(self, game_file: str) -> dict[str, Any]:
        """Load ``game_file`` (a ``.z8``) if it is not loaded, and start it."""
        import textworld

        if self._env is None or self.game_file != game_file:
            self.close()
            infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True, score=True)
            self._env = textworld.start(game_file, infos)
            self.game_file = game_file
        return self._state(self._env.reset())

    def step(self, command: str) -> dict[str, Any]:
        """Apply one text command."""
        if self._env is None:
            raise RuntimeError("CookingSession.step called before reset")
        state, _score, _done = self._env.step(command)
        return self._state(state)

    def close(self) -> None:
        """Release the loaded game."""
        env, self._env = self._env, None
        self.game_file = None
        if env is not None:
            env.close()
