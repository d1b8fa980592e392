"""Declaring a setting once (type, default, bound) and the one validator that checks it.

A schema field is a dataclass field whose metadata carries its bound (:func:`setting`); Hydra reads
the same dataclasses as the structured schema of the YAML files (types, unknown keys) and
:func:`check` enforces the bounds. The server checks a composed config with it, and a trainer
started from a job file checks its ``trainer`` mapping with it: the same words for the same mistake.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from omegaconf import MISSING


class SettingError(ValueError):
    """A setting with a wrong type or value; the message names the config key."""


@dataclass(frozen=True)
class Bound:
    """What one setting accepts besides its type: a numeric range, a set of choices or a pattern."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] = ()
    pattern: str = ""
    note: str = ""  # why, or what a special value means (appended to the expectation)

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` (already of the field's type) lies inside the bound."""
        if self.choices and value not in self.choices:
            return False
        if self.pattern and not re.fullmatch(self.pattern, value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def expectation(self) -> str:
        """The bound in words, for the error message."""
        low = f"[{self.ge:g}" if self.ge is not None else (f"({self.gt:g}" if self.gt is not None else "")
        high = f"{self.le:g}]" if self.le is not None else (f"{self.lt:g})" if self.lt is not None else "")
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = (">= " if low[0] == "[" else "> ") + low[1:]
        elif high:
            text = ("<= " if high[-1] == "]" else "< ") + high[:-1]
        elif self.choices:
            text = f"one of {list(self.choices)}"
        else:
            text = f"a match of {self.pattern!r}" if self.pattern else "a valid value"
        return f"{text} ({self.note})" if self.note else text


def setting(default: Any = MISSING, *, factory: Any = None, keys: type | None = None, **bound: Any) -> Any:
    """A schema field: its default (or ``factory`` for a list/dict) and its :class:`Bound`.

    For a list the bound applies to every entry. Used as ``rollout_n: int = setting(2, ge=1)``.
    ``keys``: the field is an open mapping (typed ``Any`` for Hydra, so a user's own keys pass)
    whose known keys follow the dataclass ``keys`` (``partition``: a custom strategy's knobs).
    """
    metadata: dict[str, Any] = {"bound": Bound(**bound), "keys": keys}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def renamed(schema: type, name: str) -> Any:
    """``schema``'s field ``name`` under another name: the same default and bound, declared once there."""
    declared = schema.__dataclass_fields__[name]  # type: ignore[attr-defined]  # a schema dataclass
    return dataclasses.field(default=declared.default, metadata=declared.metadata)


T = TypeVar("T")


def check(cls: type[T], raw: Mapping[str, Any] | None, prefix: str = "",
          known_only: bool = False) -> tuple[T, list[str]]:
    """``raw`` checked against the schema ``cls``: an instance and the keys it does not declare.

    Missing keys take the field's default; a key without a default that is missing, a value of
    the wrong type or outside its bound raises :class:`SettingError` naming ``prefix.key``.
    Undeclared keys are an error unless ``known_only`` (a trainer reads its own part of the
    ``trainer`` group and leaves the ClientApp's keys). After the fields, a schema's own
    ``check_together`` method (if any) checks settings that constrain each other.
    """
    if raw is not None and not isinstance(raw, Mapping):
        raise SettingError(f"config key '{prefix}' must be a mapping, got {raw!r}")
    raw = raw or {}
    hints = get_type_hints(cls)
    declared = dataclasses.fields(cls)  # type: ignore[arg-type]  # cls is a dataclass by contract
    values: dict[str, Any] = {}
    for f in declared:
        key = f"{prefix}.{f.name}" if prefix else f.name
        if f.name not in raw:
            if f.default is MISSING or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING):
                raise SettingError(f"config key '{key}' is missing")
            continue
        if f.metadata.get("keys") is not None:
            values[f.name] = check(f.metadata["keys"], raw[f.name], key, known_only=True)[0]
        else:
            values[f.name] = _typed(key, raw[f.name], hints[f.name], f.metadata.get("bound"))
    unknown = sorted(str(k) for k in raw if k not in {f.name for f in declared})
    if unknown and not known_only:
        raise SettingError(f"unknown config key '{prefix + '.' if prefix else ''}{unknown[0]}'")
    instance = cls(**values)
    if hasattr(instance, "check_together"):
        instance.check_together(prefix)
    return instance, unknown


def check_value(cls: type, name: str, value: Any, prefix: str) -> Any:
    """``value`` checked as the field ``name`` of the schema ``cls`` (type, bound), named ``prefix.name``."""
    return _typed(f"{prefix}.{name}", value, get_type_hints(cls)[name],
                  cls.__dataclass_fields__[name].metadata.get("bound"))  # type: ignore[attr-defined]


def _typed(key: str, value: Any, hint: Any, bound: Bound | None, entry: str = "") -> Any:
    """``value`` as the annotation ``hint`` says (ints widen to floats), inside ``bound``;
    ``entry`` names the list entry it is (" entry 2") in the messages."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return check(hint, value, key)[0]  # type: ignore[arg-type]  # hint is a dataclass type
    if origin is list:
        if not isinstance(value, (list, tuple)):
            item = getattr(args[0], "__name__", "value") if args else "value"
            raise SettingError(f"config key '{key}' must be a list of {item}, got {value!r}")
        return [_typed(key, item, args[0] if args else Any, bound, f" entry {i}") for i, item in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise SettingError(f"config key '{key}' must be a mapping, got {value!r}")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, hint) or (hint in (int, float) and isinstance(value, bool)) or (
            hint is float and not math.isfinite(value)):
        raise SettingError(f"config key '{key}'{entry} must be {hint.__name__}, got {value!r}")
    if bound is not None and not bound.accepts(value):
        raise SettingError(f"config key '{key}'{entry} = {value!r} is invalid: expected {bound.expectation()}")
    return value
