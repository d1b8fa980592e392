"""TensorBoard event files read back with TensorBoard's own reader, for tests of the tracking sink
(unit tests and end-to-end runs alike)."""

from __future__ import annotations

from pathlib import Path


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the TensorBoard event files under ``log_dir``, as (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
