"""verl's per-step metrics, read from the JSONL file of verl's own ``file`` logger.

verl 0.9.1's ``Tracking`` (``verl/utils/tracking.py``, class ``FileLogger``) writes one JSON object
per ``log`` call to the path in ``VERL_FILE_LOGGER_PATH``: ``{"step": <int>, "data": {<metric>:
<value>, ...}}`` followed by a newline, serialised by orjson with NumPy scalars as numbers and NaN /
infinity as ``null``. The trainer logs once per training step, when the step ends. The job's
environment names the file (:func:`.job.job_environment`) and the overrides turn the logger on
(:mod:`.overrides`), so the metrics come structured instead of parsed out of console lines.

:class:`StepWatch` follows that file while verl runs: it hands each new step to a callback (the
client's progress line, :mod:`fedagent_flwr.progress`) and notes when step 1 appeared (the cold start).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

# Where the job's environment points verl's file logger (read by verl's FileLogger).
FILE_LOGGER_ENV = "VERL_FILE_LOGGER_PATH"

StepCallback = Callable[[int, dict[str, float]], None]


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


def parse_record(line: str) -> tuple[int, dict[str, float]] | None:
    """``(step, numeric metrics)`` of one line of verl's file logger; None for a line that is not
    such a record (blank, cut short, or of another shape)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("data"), dict):
        return None
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return None
    return step, numeric_metrics(record["data"])


class StepFile:
    """Reads verl's step file incrementally: each :meth:`poll` returns the records completed since
    the last one. A line without its newline yet is left for the next poll (verl writes unbuffered,
    so a poll can land mid-line); a file that shrank was started anew and is read from its start."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self.steps: dict[int, dict[str, float]] = {}  # every step read so far (a later record wins)

    def poll(self) -> list[tuple[int, dict[str, float]]]:
        """The records completed since the last poll (none while the file does not exist)."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(0, 2)
                if handle.tell() < self.offset:
                    self.offset = 0
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        new = []
        for line in chunk[:end].decode("utf-8", errors="replace").splitlines():
            parsed = parse_record(line)
            if parsed is not None:
                self.steps[parsed[0]] = parsed[1]
                new.append(parsed)
        return new


class StepWatch:
    """Follows a step file in a thread while verl runs (a context manager).

    ``on_step(step, metrics)`` runs for every new record, in the watching thread; ``first_step`` is
    the ``time.monotonic()`` at which the first record was seen (None until then), at most
    ``interval_s`` after verl wrote it. Leaving the context reads the file one last time.
    """

    def __init__(self, path: Path, on_step: StepCallback | None = None, interval_s: float = 0.5) -> None:
        self.file = StepFile(path)
        self.on_step = on_step
        self.interval_s = interval_s
        self.first_step: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verl-step-watch", daemon=True)
        self._lock = threading.Lock()

    @property
    def steps(self) -> dict[int, dict[str, float]]:
        return self.file.steps

    def poll(self) -> None:
        """Read what is new and report it (callable from any thread)."""
        with self._lock:
            new = self.file.poll()
            if new and self.first_step is None:
                self.first_step = time.monotonic()
            for step, metrics in new:
                if self.on_step is not None:
                    try:
                        self.on_step(step, metrics)
                    except Exception as exc:  # noqa: BLE001 - a progress report must never stop training
                        print(f"note: reporting verl step {step} failed: {exc}", flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def __enter__(self) -> StepWatch:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()
