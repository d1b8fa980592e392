"""The error every config check raises, and the reader of a composed run config that names the key
it failed on (:mod:`fedagent_flwr.config` and the per-client checks share them)."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending key."""


def get_key(cfg: dict[str, Any], dotted: str) -> Any:
    """The value at ``dotted`` (``a.b.c``) of a plain config tree; ConfigError naming it if absent."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"config key '{dotted}' is missing")
        node = node[part]
    return node
