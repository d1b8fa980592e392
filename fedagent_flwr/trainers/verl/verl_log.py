"""Reading verl's console log: per-step metric lines and the moments a client-round spends.

verl's console logger prints one line per training step, e.g.
``(TaskRunner pid=1) step:1 - actor/pg_loss:np.float64(0.159) - timing_s/gen:26.0 - ...``. These
lines are the only place the trainer's own metrics (losses, grad norms, per-phase timings) appear,
so the entry module parses them into the ``TrainResult`` and the benchmark reports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

_STEP = re.compile(r"\bstep:(\d+) - (.*)$")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan")


def parse_value(text: str) -> float | None:
    """The number in ``0.5``, ``np.float64(0.5)``, ``tensor(0.5)`` ...; None if there is none."""
    inner = text.strip()
    match = re.fullmatch(r"[\w.]+\((.*)\)", inner)
    if match:
        inner = match.group(1).split(",")[0].strip()
    if not _NUMBER.fullmatch(inner):
        return None
    value = float(inner)
    return value if math.isfinite(value) else None


def parse_step_line(line: str) -> tuple[int, dict[str, float]] | None:
    """``(step, metrics)`` of one console metric line, or None for any other line."""
    match = _STEP.search(line)
    if not match:
        return None
    metrics: dict[str, float] = {}
    for item in match.group(2).split(" - "):
        key, sep, raw = item.partition(":")
        if not sep:
            continue
        value = parse_value(raw)
        if value is not None:
            metrics[key.strip()] = value
    return int(match.group(1)), metrics


def step_metrics(lines: Iterable[str]) -> dict[int, dict[str, float]]:
    """Every step's metrics found in ``lines`` (a later line for the same step wins)."""
    steps: dict[int, dict[str, float]] = {}
    for line in lines:
        parsed = parse_step_line(line)
        if parsed is not None:
            steps[parsed[0]] = parsed[1]
    return steps


def numeric_metrics(data: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of one metrics dict as verl's trainer logs it (floats, NumPy or torch
    scalars); everything else (lists, strings, NaN) is left out."""
    metrics: dict[str, float] = {}
    for key, value in data.items():
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of more than one element
            continue
        if math.isfinite(number):
            metrics[str(key)] = number
    return metrics
