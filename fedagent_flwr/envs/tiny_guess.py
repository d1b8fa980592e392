"""TinyGuess: guess a secret integer, told "higher" or "lower" after each guess.

An in-process smoke environment that follows FedAgent's rules exactly:

* the secret lies in ``[lo, hi]`` (defaults 1 and 50) and is ``lo + seed % (hi - lo + 1)``;
* a reply is read as the integer inside ``<answer>N</answer>`` (case-insensitive, first tag),
  else the last integer anywhere in the reply, else it is invalid; an integer of more than
  ``MAX_GUESS_DIGITS`` digits (leading zeros aside) is invalid too, since ``int()`` refuses it
  (like any unparseable reply it uses up the turn: a normal env outcome, not an error);
* observations: ``"Invalid response. Reply as <answer>N</answer>."``, ``"Correct!"`` (reward 1.0),
  ``"higher"`` (the secret is larger), ``"lower"`` (reward 0 for all but a correct guess);
* the episode ends when solved or after ``max_turns`` guesses (default 6);
* ``info = {"success": bool, "turns": int}``; there is no ``is_action_valid``, so FedAgent's
  invalid-action penalty never applies to TinyGuess;
* windowed mode (:meth:`TinyGuess.render_window`): the rules, then the last ``history_length``
  guesses with the answer each got, and which guess comes next.

Partitioning: an optional ``targets`` list in the config is the pool of secrets (goal ``g`` is
``targets[g]``) and the secret becomes ``targets[seed % len(targets)]``. Without ``targets`` the
pool is ``lo..hi`` (goal ``g`` is ``lo + g``) and the rule above is FedAgent's formula.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from fedagent_flwr.envs.base import BaseTextEnv, EnvConfigError, config_int_list
from fedagent_flwr.envs.registry import register_env
from fedagent_flwr.envs.window import Window

INVALID_OBS = "Invalid response. Reply as <answer>N</answer>."
CORRECT_OBS = "Correct!"
HIGHER_OBS = "higher"
LOWER_OBS = "lower"

DEFAULT_LO = 1
DEFAULT_HI = 50
DEFAULT_MAX_TURNS = 6

# CPython's default limit for int(str) (sys.get_int_max_str_digits): every guess FedAgent's int()
# reads, this reads the same; a longer one, on which FedAgent's int() raises, is invalid here.
MAX_GUESS_DIGITS = 4300

_ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>", re.IGNORECASE)
_INTEGER_RE = re.compile(r"-?\d+")


def parse_guess(text: str) -> int | None:
    """The guessed integer in a reply, or None if the reply holds none that can be read.

    An absurdly long number (more than ``MAX_GUESS_DIGITS`` significant digits) counts as no
    guess: the episode answers "Invalid response" instead of failing the step.
    """
    tagged = _ANSWER_RE.search(text)
    if tagged is not None:
        return _to_int(tagged.group(1))
    numbers = _INTEGER_RE.findall(text)
    return _to_int(numbers[-1]) if numbers else None


def _to_int(digits: str) -> int | None:
    """``int(digits)``, or None past ``MAX_GUESS_DIGITS`` significant digits (or the interpreter's
    own, possibly lower, limit)."""
    sign = "-" if digits.startswith("-") else ""
    significant = digits.lstrip("-").lstrip("0") or "0"
    if len(significant) > MAX_GUESS_DIGITS:
        return None
    try:
        return int(sign + significant)
    except ValueError:  # sys.set_int_max_str_digits() set below MAX_GUESS_DIGITS
        return None


def _int_field(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise EnvConfigError(f"TinyGuess config '{key}' must be an integer, got {value!r}")
    return value


@register_env("TinyGuess")
class TinyGuess(BaseTextEnv):
    """Number guessing in ``[lo, hi]`` with higher/lower feedback."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self.lo = _int_field(self.config, "lo", DEFAULT_LO)
        self.hi = _int_field(self.config, "hi", DEFAULT_HI)
        self.max_turns = _int_field(self.config, "max_turns", DEFAULT_MAX_TURNS)
        if self.hi < self.lo:
            raise EnvConfigError(f"TinyGuess config 'hi' ({self.hi}) must be >= 'lo' ({self.lo})")
        if self.max_turns < 1:
            raise EnvConfigError(f"TinyGuess config 'max_turns' must be >= 1, got {self.max_turns}")
        self.targets = config_int_list(self.config, "targets", "TinyGuess")
        self._secret: int | None = None
        self._turn = 0
        self._done = True

    @classmethod
    def num_goals(cls, config: Mapping[str, Any]) -> int | None:
        """Pool size: ``len(targets)`` if given, else ``hi - lo + 1``."""
        targets = config_int_list(config, "targets", "TinyGuess")
        if targets is not None:
            return len(targets)
        lo = _int_field(config, "lo", DEFAULT_LO)
        hi = _int_field(config, "hi", DEFAULT_HI)
        return max(hi - lo + 1, 0)

    @classmethod
    def restrict_goals(cls, config: Mapping[str, Any], goal_indices: Sequence[int]) -> dict[str, Any]:
        """Copy of ``config`` with ``targets`` set to the secrets of the chosen goals."""
        pool_size = cls.num_goals(config) or 0
        if not goal_indices:
            raise EnvConfigError("TinyGuess cannot be restricted to an empty goal list")
        bad = [g for g in goal_indices if not 0 <= g < pool_size]
        if bad:
            raise EnvConfigError(f"TinyGuess goal indices {bad[:5]} are outside the pool of {pool_size}")
        targets = config_int_list(config, "targets", "TinyGuess")
        lo = _int_field(config, "lo", DEFAULT_LO)
        secrets = [targets[g] if targets is not None else lo + g for g in goal_indices]
        return {**dict(config), "targets": secrets}

    def secret_for_seed(self, seed: int) -> int:
        """The secret an episode with ``seed`` uses (deterministic, no RNG involved)."""
        if self.targets is not None:
            return self.targets[seed % len(self.targets)]
        return self.lo + seed % (self.hi - self.lo + 1)

    async def system_prompt(self) -> str:
        return (
            "You are playing a number guessing game. A secret integer between "
            f"{self.lo} and {self.hi} (inclusive) has been chosen. Each turn, guess it and reply "
            "with your guess in the form <answer>N</answer>. After each guess you are told "
            '"higher" if the secret is larger, "lower" if it is smaller, or "Correct!" when you '
            f"find it. You have {self.max_turns} guesses."
        )

    @classmethod
    def render_window(cls, window: Window) -> str:
        """The windowed prompt: the rules (system prompt) and the reset observation, then, after the
        first guess, the last ``history_length`` guesses as ``Guess N: <read guess> -> <answer>``."""
        head = f"{window.system}\n\n{window.initial_observation}"
        if not window.history:
            return head
        answers = [step.observation for step in window.history[1:]] + [window.observation]
        shown = window.recent
        first = len(window.history) - len(shown)
        lines = [head, ""]
        if shown:
            lines.append(f"Your most recent {len(shown)} of {len(window.history)} guess(es):")
        for k, step in enumerate(shown):
            guess = parse_guess(step.reply)
            lines.append(f"Guess {first + k + 1}: {'invalid' if guess is None else guess} -> {answers[first + k]}")
        lines.append(f"Now make guess {len(window.history) + 1}. Reply as <answer>N</answer>.")
        return "\n".join(lines)

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self._secret = self.secret_for_seed(int(seed))
        self._turn = 0
        self._done = False
        return (
            f"Guess the secret number between {self.lo} and {self.hi}. "
            "Reply as <answer>N</answer>.",
            {"turns": 0},
        )

    async def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._secret is None or self._done:
            raise RuntimeError("TinyGuess.step called without an active episode; call reset first")
        self._turn += 1
        guess = parse_guess(action_text)
        solved = False
        reward = 0.0
        if guess is None:
            obs = INVALID_OBS
        elif guess == self._secret:
            obs, reward, solved = CORRECT_OBS, 1.0, True
        elif guess < self._secret:
            obs = HIGHER_OBS
        else:
            obs = LOWER_OBS
        self._done = solved or self._turn >= self.max_turns
        return obs, reward, self._done, {"success": solved, "turns": self._turn}
