"""Experiment tracking: the run record's events as scalars for TensorBoard (``tracking`` in the config).

The run record (:mod:`.recorder`) is the one source: every event it writes to ``metrics.jsonl``
(a client's training metrics, an aggregation with its update statistics, an evaluation, a round's
wall time) is also turned into named scalars at step = round and handed to each configured sink.
``jsonl`` is the record itself and is always written (resume reads it); ``tensorboard`` writes
event files under ``<run dir>/tensorboard`` (``tensorboard --logdir <run dir>``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

TRACKERS = ("jsonl", "tensorboard")
TENSORBOARD_DIR = "tensorboard"


class Sink(Protocol):
    """Where scalars go besides ``metrics.jsonl``."""

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None for anything that is not a plain finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def scalars_of(event: dict[str, Any]) -> dict[str, float]:
    """The scalars one ``metrics.jsonl`` event stands for, by tag (``val/...``, ``client_<c>/...``,
    ``aggregate/...``, ``time/...``); events of other kinds give none."""
    kind = event.get("event")
    out: dict[str, float] = {}
    if kind == "evaluate":
        for key in ("success_rate", "reward_mean", "score_mean"):
            if (value := _number(event.get(key))) is not None:
                out[f"val/{key}"] = value
        low_high = event.get("success_ci95") or []
        if len(low_high) == 2:
            out["val/success_ci95_low"], out["val/success_ci95_high"] = float(low_high[0]), float(low_high[1])
        if (n := _number(event.get("n"))) is not None:
            out["val/episodes"] = n
    elif kind == "train":
        client = event.get("client")
        for key, raw in sorted((event.get("metrics") or {}).items()):
            if (value := _number(raw)) is not None:
                out[f"client_{client}/{key}"] = value
    elif kind == "aggregate":
        out["aggregate/clients"] = float(len(event.get("clients") or []))
        out["aggregate/rejected"] = float(len(event.get("rejected") or {}))
        for key, raw in sorted((event.get("update_stats") or {}).items()):
            if (value := _number(raw)) is not None:
                out[f"aggregate/{key}"] = value
    elif kind == "round_time":
        if (value := _number(event.get("wall_seconds"))) is not None:
            out["time/round_seconds"] = value
    return out


class TensorBoardSink:
    """Scalars as TensorBoard event files (torch's writer; flushed after every event, so a crashed
    run's curves are on disk up to its last event)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_sinks(names: Sequence[str], run_dir: Path) -> list[Sink]:
    """The sinks of ``names`` (the config's ``tracking`` list, checked by the config) for ``run_dir``."""
    sinks: list[Sink] = []
    if "tensorboard" in names:
        sinks.append(TensorBoardSink(run_dir / TENSORBOARD_DIR))
    return sinks
