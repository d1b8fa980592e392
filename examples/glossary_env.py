"""Glossary: a service-backed environment whose service loads a shared resource once.

The agent reads a definition and names the term (``<answer>term</answer>``); a wrong answer is
told the term's first letter. The glossary is a JSON file (``examples/data/glossary.json`` unless
``glossary_file`` says otherwise) and each entry is one goal, so task-level partitions apply.

Why a service: an environment that needs a large resource (a product catalogue and its search
index for WebShop, a game engine for ALFWorld) should load it once per client, not once per
episode and not inside the trainer. With ``env.service.enabled=true`` every client starts its own
service (``python -m fedagent_flwr.envs.service.server``) that builds a pool of instances; the
:meth:`Glossary.service_setup` hook below loads the file once and hands the same entries to every
pool slot, and reports facts for ``/health``. Selected by ``examples/conf/env/glossary_service.yaml``::

    flwr run . --run-config 'overrides="hydra.searchpath=[pkg://examples.conf] env=glossary_service"'
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedagent_flwr.envs.base import BaseTextEnv, EnvConfigError
from fedagent_flwr.envs.registry import register_env
from fedagent_flwr.envs.service.app import ServiceEnvSetup

DEFAULT_GLOSSARY = Path(__file__).resolve().parent / "data" / "glossary.json"
_ANSWER = re.compile(r"<answer>\s*([^<]+?)\s*</answer>", re.IGNORECASE)

Entry = tuple[str, str]  # (term, definition)


def load_glossary(config: Mapping[str, Any]) -> list[Entry]:
    """Every (term, definition) of the configured file, in file order (the goal indices)."""
    path = Path(str(config.get("glossary_file") or DEFAULT_GLOSSARY)).expanduser()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        entries = [(str(e["term"]).strip().lower(), str(e["definition"]).strip()) for e in raw["entries"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EnvConfigError(f"Glossary file {path} is unusable: {type(exc).__name__}: {exc}") from None
    if not entries:
        raise EnvConfigError(f"Glossary file {path} has no entries")
    return entries


def _goal_indices(config: Mapping[str, Any], size: int) -> list[int] | None:
    indices = config.get("goal_indices")
    if indices is None:
        return None
    if not isinstance(indices, list) or not indices or any(
            isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < size for g in indices):
        raise EnvConfigError(f"Glossary config 'goal_indices' must be a non-empty list of indices below {size}")
    return indices


@register_env("Glossary")
class Glossary(BaseTextEnv):
    """Name the term of a definition; episode ``seed`` picks goal ``seed % pool size``."""

    def __init__(self, config: Mapping[str, Any] | None = None, entries: Sequence[Entry] | None = None) -> None:
        super().__init__(config)
        # In a service every pool slot receives the entries loaded once by service_setup.
        everything = list(entries) if entries is not None else load_glossary(self.config)
        chosen = _goal_indices(self.config, len(everything))
        self.pool = [everything[g] for g in chosen] if chosen is not None else everything
        self.max_turns = int(self.config.get("max_turns", 2))
        self._entry: Entry | None = None
        self._turn = 0

    @classmethod
    def num_goals(cls, config: Mapping[str, Any]) -> int | None:
        size = len(load_glossary(config))
        chosen = _goal_indices(config, size)
        return len(chosen) if chosen is not None else size

    @classmethod
    def restrict_goals(cls, config: Mapping[str, Any], goal_indices: Sequence[int]) -> dict[str, Any]:
        """Restrict to ``goal_indices`` of the current pool (composes with an earlier restriction)."""
        size = len(load_glossary(config))
        current = _goal_indices(config, size) or list(range(size))
        if not goal_indices or any(not 0 <= g < len(current) for g in goal_indices):
            raise EnvConfigError(f"Glossary goal indices {list(goal_indices)[:5]} do not fit a pool of {len(current)}")
        return {**dict(config), "goal_indices": [current[g] for g in goal_indices]}

    @classmethod
    def service_setup(cls, config: Mapping[str, Any], partition: Mapping[str, Any],
                      variant: Mapping[str, Any]) -> ServiceEnvSetup:
        """The service's pool: the partition's goals, one shared copy of the glossary."""
        if variant:
            raise EnvConfigError(f"Glossary has no environment variants; got {dict(variant)}")
        effective = dict(config)
        if partition.get("goal_indices") is not None:
            effective = cls.restrict_goals(effective, list(partition["goal_indices"]))
        entries = tuple(load_glossary(effective))
        probe = cls(effective, entries)  # a bad config fails here, before the service binds a port
        info = {"num_goals": len(probe.pool), "glossary_entries": len(entries),
                "glossary_file": str(effective.get("glossary_file") or DEFAULT_GLOSSARY)}
        return ServiceEnvSetup(factory=lambda _slot: cls(effective, entries), info=info)

    async def system_prompt(self) -> str:
        return ("You are shown the definition of a term from machine learning. Reply with the term as "
                f"<answer>term</answer>. You have {self.max_turns} tries.")

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self._entry = self.pool[int(seed) % len(self.pool)]
        self._turn = 0
        term, definition = self._entry
        return f"Definition: {definition} ({len(term)} letters)", {"turns": 0}

    async def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._entry is None:
            raise RuntimeError("Glossary.step called without an active episode; call reset first")
        self._turn += 1
        term = self._entry[0]
        tagged = _ANSWER.search(action_text)
        solved = (tagged.group(1) if tagged else action_text).strip().lower() == term
        done = solved or self._turn >= self.max_turns
        observation = "Correct!" if solved else f"No. The term starts with '{term[0]}'."
        if done:
            self._entry = None
        return observation, 1.0 if solved else 0.0, done, {"success": solved, "turns": self._turn}
