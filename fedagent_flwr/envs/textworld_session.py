"""The game session that ALFWorld's and TextWorld cooking's engine workers play (service venv only).

A subclass says how a game file is started (:meth:`TextWorldSession._start`) and what its states
report; this class keeps the loaded game between episodes of the same file and releases it.
"""

from __future__ import annotations

from typing import Any


class TextWorldSession:
    """A reusable player: ``reset(game_file)`` starts an episode, ``step(command)`` plays one command."""

    def __init__(self) -> None:
        self._env: Any = None
        self.game_file: str | None = None

    def _start(self, game_file: str) -> Any:
        """The started TextWorld env of ``game_file``."""
        raise NotImplementedError

    def _load(self, game_file: str) -> Any:
        """Start an episode of ``game_file`` (loaded only if it is not the loaded one); its first state."""
        if self._env is None or self.game_file != game_file:
            self.close()
            self._env = self._start(game_file)
            self.game_file = game_file
        return self._env.reset()

    def _play(self, command: str) -> tuple[Any, bool]:
        """Apply one command to the episode; the state and whether the engine ended the game."""
        if self._env is None:
            raise RuntimeError(f"{type(self).__name__}.step called before reset")
        state, _score, done = self._env.step(command)
        return state, done

    def close(self) -> None:
        """Release the loaded game."""
        env, self._env = self._env, None
        self.game_file = None
        if env is not None:
            env.close()
