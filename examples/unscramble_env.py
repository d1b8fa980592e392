"""Unscramble: an in-process text environment, the smallest complete example of one.

The agent sees the letters of a word in a scrambled order and has ``max_turns`` replies to name
the word as ``<answer>word</answer>``; a wrong guess is told how many letters are in the right
place. The words are the goal pool, so every task-level partition applies to it.

Selected by config (``examples/conf/env/unscramble.yaml``)::

    flwr run . --run-config 'overrides="hydra.searchpath=[pkg://examples.conf] env=unscramble"'

The env spec names the class by its dotted path, ``examples.unscramble_env.Unscramble``: the
trainer subprocess (and verl's Ray workers) import this module from that name.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fedagent_flwr.envs.base import BaseTextEnv, EnvConfigError
from fedagent_flwr.envs.registry import register_env

DEFAULT_WORDS = ("planet", "garden", "silver", "window", "rocket", "forest", "bridge", "candle",
                 "marble", "pencil", "tunnel", "violin")
_ANSWER = re.compile(r"<answer>\s*([A-Za-z]+)\s*</answer>", re.IGNORECASE)
_WORD = re.compile(r"[A-Za-z]+")


def _words(config: Mapping[str, Any]) -> list[str]:
    words = config.get("words", DEFAULT_WORDS)
    if (isinstance(words, (str, bytes)) or not isinstance(words, Sequence) or not words
            or any(not isinstance(w, str) or not w.isalpha() for w in words)):
        raise EnvConfigError(f"Unscramble config 'words' must be a non-empty list of alphabetic words, got {words!r}")
    return [w.lower() for w in words]


def scramble(word: str, seed: int) -> str:
    """The letters of ``word`` in an order fixed by ``seed`` (never the word itself when avoidable)."""
    letters = list(word)
    # random.Random(int) is seeded deterministically (unlike hash() of a string), in every process.
    random.Random(seed).shuffle(letters)
    if "".join(letters) == word and len(set(word)) > 1:
        letters = letters[1:] + letters[:1]
    return "".join(letters)


@register_env("Unscramble")
class Unscramble(BaseTextEnv):
    """Name the word whose letters are shown scrambled; episode ``seed`` picks word ``seed % len(words)``."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self.words = _words(self.config)
        self.max_turns = int(self.config.get("max_turns", 3))
        if self.max_turns < 1:
            raise EnvConfigError(f"Unscramble config 'max_turns' must be >= 1, got {self.max_turns}")
        self._word: str | None = None
        self._turn = 0

    # --- the goal pool: what partitions split across clients ---

    @classmethod
    def num_goals(cls, config: Mapping[str, Any]) -> int | None:
        return len(_words(config))

    @classmethod
    def restrict_goals(cls, config: Mapping[str, Any], goal_indices: Sequence[int]) -> dict[str, Any]:
        words = _words(config)
        if not goal_indices or any(not 0 <= g < len(words) for g in goal_indices):
            raise EnvConfigError(f"Unscramble goal indices {list(goal_indices)[:5]} do not fit a pool of {len(words)}")
        return {**dict(config), "words": [words[g] for g in goal_indices]}

    # --- the episode ---

    async def system_prompt(self) -> str:
        return ("Unscramble the letters you are shown into an English word. Reply with the word as "
                f"<answer>word</answer>. You have {self.max_turns} tries.")

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self._word = self.words[int(seed) % len(self.words)]
        self._turn = 0
        return f"Letters: {scramble(self._word, int(seed))}", {"turns": 0}

    async def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._word is None:
            raise RuntimeError("Unscramble.step called without an active episode; call reset first")
        self._turn += 1
        tagged = _ANSWER.search(action_text)
        words = _WORD.findall(action_text)
        guess = (tagged.group(1) if tagged else (words[-1] if words else "")).lower()
        solved = guess == self._word
        done = solved or self._turn >= self.max_turns
        if solved:
            observation = "Correct!"
        else:
            right = sum(a == b for a, b in zip(guess, self._word))
            observation = f"Not it: {right} of {len(self._word)} letters are in the right place."
        if done:
            self._word = None
        return observation, 1.0 if solved else 0.0, done, {"success": solved, "turns": self._turn}
