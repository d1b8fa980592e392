"""Name -> environment class registry.

Names are case-insensitive ("TinyGuess", "tinyguess"). Built-in environments are registered
lazily: the registry knows which module defines each built-in name and imports it only when the
name is asked for, so looking up TinyGuess never imports a heavy service client.

Environments of other packages are named by the dotted path of their (registered) class, e.g.
``mypkg.envs.Countdown``: every process that meets the name imports the module itself
(:mod:`fedagent_flwr.plugins`), so the trainer subprocess, env services and verl's Ray workers
find the class without any set-up of their own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from fedagent_flwr.envs.base import BaseTextEnv
from fedagent_flwr.plugins import PluginError, is_dotted_path, load_object

E = TypeVar("E", bound=type[BaseTextEnv])

# lower-cased name -> module whose import registers it. Add service-backed envs here.
_BUILTIN_MODULES: dict[str, str] = {
    "tinyguess": "fedagent_flwr.envs.tiny_guess",
    "webshop": "fedagent_flwr.envs.webshop.env",
    "alfworld": "fedagent_flwr.envs.alfworld.env",
    "twcooking": "fedagent_flwr.envs.twcooking.env",
    "service": "fedagent_flwr.envs.service.client",
}

_REGISTRY: dict[str, type[BaseTextEnv]] = {}


class UnknownEnvError(ValueError):
    """An environment name that no registered or built-in environment has."""


def register_env(name: str) -> Callable[[E], E]:
    """Class decorator: register an environment class under ``name`` (case-insensitive).

    Registering the same class twice is allowed (module reloads); a different class under a
    taken name is refused, since silently replacing an environment would change experiments.
    """
    if not name or not name.strip():
        raise ValueError("environment name must be a non-empty string")

    def decorator(cls: E) -> E:
        if not (isinstance(cls, type) and issubclass(cls, BaseTextEnv)):
            raise TypeError(f"{cls!r} registered as {name!r} is not a BaseTextEnv subclass")
        key = name.strip().lower()
        existing = _REGISTRY.get(key)
        # Same module and name = the same class re-imported (reload); anything else is a clash.
        if existing is not None and (existing.__module__, existing.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(
                f"environment name {name!r} is already taken by {existing.__module__}.{existing.__qualname__}"
            )
        cls.env_name = name.strip()
        _REGISTRY[key] = cls
        return cls

    return decorator


def known_envs() -> list[str]:
    """Display names of every environment that can be made (built-in ones are imported)."""
    for key in _BUILTIN_MODULES:
        _load_builtin(key)
    return sorted(cls.env_name for cls in _REGISTRY.values())


def _load_builtin(key: str) -> None:
    module = _BUILTIN_MODULES.get(key)
    if module is not None and key not in _REGISTRY:
        importlib.import_module(module)


def get_env_class(name: str) -> type[BaseTextEnv]:
    """The class registered under ``name``, or named by the dotted path ``name``; raises
    :class:`UnknownEnvError` listing known names."""
    if is_dotted_path(name):
        return _env_class_at(str(name).strip())
    key = str(name).strip().lower()
    _load_builtin(key)
    cls = _REGISTRY.get(key)
    if cls is None:
        raise UnknownEnvError(f"unknown environment {name!r} (known: {', '.join(known_envs())})")
    return cls


def _env_class_at(path: str) -> type[BaseTextEnv]:
    try:
        cls = load_object(path, "environment")
    except PluginError as exc:
        raise UnknownEnvError(str(exc)) from None
    if not (isinstance(cls, type) and issubclass(cls, BaseTextEnv)):
        raise UnknownEnvError(f"environment {path!r} is not a BaseTextEnv subclass")
    if not cls.env_name:
        # The registered name is what logs, metrics and /health show.
        raise UnknownEnvError(
            f"environment {path!r} is not registered: decorate the class with @register_env(\"Name\")"
        )
    return cls


def make_env(name: str, config: Mapping[str, Any] | None = None) -> BaseTextEnv:
    """Build one environment instance of ``name`` with ``config``."""
    return get_env_class(name)(config or {})
