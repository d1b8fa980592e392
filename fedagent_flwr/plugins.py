"""User code named in the run config by a dotted path: environments, partitions, client rules.

A value such as ``mypkg.envs.Countdown`` names an object by the module that defines it, so every
process of a run can find it by importing that module itself: the ServerApp (config checks), the
ClientApp, the trainer subprocess, an env service and verl's Ray workers each start fresh, and a
registration done in one of them never reaches the others. The only requirement is that the
module is importable in each of those processes (installed, or on ``PYTHONPATH``).

Built-in names never contain a dot, so a dotted value is always user code.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


class PluginError(ValueError):
    """A dotted path that is malformed, cannot be imported, or names nothing."""


def is_dotted_path(value: object) -> bool:
    """Whether ``value`` looks like ``package.module.name`` (identifiers joined by dots)."""
    return isinstance(value, str) and bool(_DOTTED.match(value.strip()))


def load_object(path: str, what: str) -> Any:
    """Import the module of ``path`` and return the attribute it names.

    ``what`` says in errors what the object is for ("environment", "partition strategy", ...).
    Any failure, including an exception raised while the user's module runs, becomes one
    :class:`PluginError` that names ``path``.
    """
    text = str(path).strip()
    if not is_dotted_path(text):
        raise PluginError(f"{what} {path!r} is not a dotted path such as mypkg.module.Name")
    module_name, _, attribute = text.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise PluginError(
            f"{what} {text!r}: module {exc.name!r} is not importable in this process "
            "(install the package, or put its directory on PYTHONPATH, on every machine of the run)"
        ) from None
    except Exception as exc:  # the user's module failed while importing: say where
        raise PluginError(f"{what} {text!r}: importing {module_name} failed: {type(exc).__name__}: {exc}") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise PluginError(f"{what} {text!r}: module {module_name} has no attribute {attribute!r}") from None
