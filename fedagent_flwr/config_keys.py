"""Typed access to a composed run config: the error every config check raises, and the readers
that name the key they failed on (:mod:`fedagent_flwr.config` and the per-client checks share them)."""

from __future__ import annotations

from collections.abc import Callable
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


def typed_key(cfg: dict[str, Any], key: str, kind: type, check: Callable[[Any], bool] | None = None,
              expect: str = "") -> Any:
    """The value at ``key``, of type ``kind`` (an int is accepted as a float) and passing ``check``;
    otherwise ConfigError naming the key (with ``expect``: what a valid value is)."""
    value = get_key(cfg, key)
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError(f"config key '{key}' must be {kind.__name__}, got {value!r}")
    if check is not None and not check(value):
        raise ConfigError(f"config key '{key}' = {value!r} is invalid: expected {expect}")
    return value
