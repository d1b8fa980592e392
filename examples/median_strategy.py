"""An aggregation rule as a strategy: the coordinate-wise median of the clients' checkpoints.

Coordinate-wise median [Yin et al., 2018, "Byzantine-Robust Distributed Learning: Towards Optimal
Statistical Rates", arxiv.org/abs/1803.01498]: every weight of the new global model is the median
of that weight over the round's clients, so one client far off (a diverged run, a poisoned
update) cannot drag the model the way it drags a mean. With an even number of clients the median
is the mean of the two middle values. Episode counts (the FedAvg weights) are not used.

Only the tensor rule changes, so the subclass overrides ``aggregate_checkpoints`` and hands the
per-key arithmetic to ``aggregate_by_key``, which keeps FedAvgFSDP's checks, output layout (fp32
HF safetensors) and atomic write. Loaded by dotted path::

    flwr run . --run-config \
        'overrides="strategy.class_path=examples.median_strategy.CoordinateMedian strategy.name=median"'
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from fedagent_flwr.checkpoint import AggregateReport, CheckpointReader, aggregate_by_key
from fedagent_flwr.serverapp.strategy import FedAvgFSDP


def coordinate_median(key: str, tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Element-wise median over the sources (mean of the two middle values for an even count)."""
    ordered = torch.stack(tensors).sort(dim=0).values
    count = ordered.shape[0]
    middle = count // 2
    if count % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


class CoordinateMedian(FedAvgFSDP):
    """FedAvgFSDP with the coordinate-wise median as its tensor rule (actor and PPO critic alike)."""

    def aggregate_checkpoints(
        self, server_round: int, sources: Sequence[tuple[CheckpointReader, float]], out_dir: Path,
        reference: CheckpointReader | None,
    ) -> AggregateReport:
        return aggregate_by_key(sources, out_dir, coordinate_median, name="coordinate_median", reference=reference,
                                model_files=self.model_files)
