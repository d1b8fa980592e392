"""Environment specs: which environments a client trains (or a model is validated) on.

The format is FedAgent's env-spec YAML::

    envs:
      - name: TinyGuess      # a registered environment name (case-insensitive), or the
                             # dotted path of a registered class: mypkg.envs.Countdown
        n_envs: 64           # episodes (dataset rows) per training step for this entry
        max_turns: 6         # turn budget of one episode
        config: {lo: 1, hi: 50}

:func:`load_env_spec` accepts a YAML/JSON path, a mapping or an :class:`EnvSpec` and reports the
first problem in one message that names the offending field (``envs[1].n_envs``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedagent_flwr.envs.registry import UnknownEnvError, get_env_class
from fedagent_flwr.plugins import is_dotted_path
from fedagent_flwr.schema.fields import SettingError, check
from fedagent_flwr.schema.run import EnvEntry

DEFAULT_MAX_TURNS: int = EnvEntry.max_turns  # type: ignore[assignment]  # the schema field's default


class EnvSpecError(ValueError):
    """An env spec that is missing, unreadable or has a bad field."""


@dataclass(frozen=True)
class EnvSpecEntry(EnvEntry):
    """One environment of a spec: ``n_envs`` episodes of ``name`` with ``config`` (the fields, their
    defaults and bounds are :class:`~fedagent_flwr.schema.run.EnvEntry`'s; ``name`` as registered,
    or a class's dotted path)."""

    def env_config(self) -> dict[str, Any]:
        """The config to build the environment with.

        The entry's ``max_turns`` is passed down as the environment's own turn limit unless the
        config sets one, so the runner's and the environment's budgets agree.
        """
        return {"max_turns": self.max_turns, **self.config}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EnvSpec:
    """A validated env spec: a non-empty tuple of entries."""

    envs: tuple[EnvSpecEntry, ...]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-serialisable form (what a TrainJob carries)."""
        return {"envs": [entry.to_dict() for entry in self.envs]}


def _parse_entry(raw: Any, where: str) -> EnvSpecEntry:
    if isinstance(raw, Mapping) and raw.get("config") is None:  # "config:" left empty
        raw = {**raw, "config": {}}
    try:
        entry = check(EnvSpecEntry, raw, where)[0]
        registered = get_env_class(entry.name).env_name
    except SettingError as exc:
        raise EnvSpecError(str(exc)) from None
    except UnknownEnvError as exc:
        raise EnvSpecError(f"{where}.name: {exc}") from None
    # The registered spelling, so metric names and logs do not depend on how a spec cased it; a
    # dotted path stays as written, since other processes find the class by importing it.
    name = entry.name.strip() if is_dotted_path(entry.name) else registered
    return dataclasses.replace(entry, name=name)


def _read_file(path: Path) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise EnvSpecError(f"env spec file {path} does not exist") from None
    except OSError as exc:
        raise EnvSpecError(f"env spec file {path} cannot be read: {exc.strerror}") from None
    try:
        if path.suffix == ".json":
            return json.loads(text)
        import yaml

        return yaml.safe_load(text)
    except Exception as exc:  # yaml and json raise different types; both mean "not parseable"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EnvSpecError(f"env spec file {path} cannot be parsed: {first_line}") from None


def load_env_spec(source: str | os.PathLike[str] | Mapping[str, Any] | EnvSpec) -> EnvSpec:
    """Load and validate an env spec from a YAML/JSON file, a mapping or an existing EnvSpec."""
    if isinstance(source, EnvSpec):
        return source
    label = "env spec"
    if isinstance(source, Mapping):
        raw: Any = source
    else:
        path = Path(source).expanduser()
        label = f"env spec {path}"
        raw = _read_file(path)
    if not isinstance(raw, Mapping):
        raise EnvSpecError(f"{label} must be a mapping with an 'envs' list, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"envs"})
    if unknown:
        raise EnvSpecError(f"{label} has unknown top-level field(s) {unknown} (allowed: envs)")
    envs = raw.get("envs")
    if not isinstance(envs, list) or not envs:
        raise EnvSpecError(f"{label}: 'envs' must be a non-empty list, got {envs!r}")
    try:
        entries = tuple(_parse_entry(item, f"envs[{i}]") for i, item in enumerate(envs))
    except EnvSpecError as exc:
        raise EnvSpecError(f"{label}: {exc}") from None
    return EnvSpec(envs=entries)
