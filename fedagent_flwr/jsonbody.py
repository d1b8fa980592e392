"""Parse a JSON request body from an untrusted peer with bounded nesting and number sizes.

``json.loads`` recurses once per nesting level and raises ``RecursionError`` (not ``ValueError``)
past Python's recursion limit, and ``int()`` refuses numbers over 4300 digits with a bare
``ValueError``: both reached the HTTP services here as a 500. The services of this project (env
services, the checkpoint store) take flat bodies of a few levels and 64-bit numbers at most, so
a body nested deeper than :data:`MAX_JSON_DEPTH` or holding an integer longer than
:data:`MAX_INT_DIGITS` digits is refused with :class:`JsonBodyError`, which they answer with a
4xx that says what was wrong.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 32  # the deepest body here (a checkpoint commit) has 3 levels
MAX_INT_DIGITS = 100  # far beyond any 64-bit value, far below int()'s 4300-digit limit


class JsonBodyError(ValueError):
    """A request body that is not JSON, nests too deeply or holds an absurdly long number.

    The message is a predicate of "the body" (``"is not JSON: ..."``) for the caller to prefix.
    """


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise JsonBodyError(
            f"holds a number of {digits} digits ({text[:20]}...); no field accepts more than {MAX_INT_DIGITS}"
        )
    return int(text)


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, ``[]`` and ``{}`` are 1); iterative,
    so any depth is measured without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            deepest = max(deepest, depth)
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def loads_bounded(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(raw)``, refusing with :class:`JsonBodyError` (never RecursionError) a body
    that is not JSON, nests deeper than ``max_depth`` or holds an integer of more than
    :data:`MAX_INT_DIGITS` digits."""
    try:
        value = json.loads(raw, parse_int=_bounded_int)
    except JsonBodyError:
        raise
    except RecursionError:
        raise JsonBodyError(_too_deep(max_depth)) from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise JsonBodyError(f"is not JSON: {exc}") from None
    if json_depth(value) > max_depth:
        raise JsonBodyError(_too_deep(max_depth))
    return value


def _too_deep(max_depth: int) -> str:
    return f"nests JSON deeper than {max_depth} levels; requests here are objects of a few levels"
