"""Statistics of the clients' updates, computed while a round is aggregated.

For client ``i`` the update is ``delta_i = w_i - w_start``: its checkpoint minus the round's
starting global model. The aggregator already streams every tensor of every client, so it can
measure, at the cost of one extra read of the starting model:

* ``client_update_norm[i] = ||delta_i||`` (all floating-point tensors as one vector);
* ``mean_update_norm = ||sum_i a_i delta_i||`` with ``a`` the normalised aggregation weights: how
  far the global model moved;
* ``cosine[i][j] = <delta_i, delta_j> / (||delta_i|| ||delta_j||)``: do clients pull the same way;
* ``cosine_to_mean[i]``: each client against the aggregated update;
* ``norm_ratio = ||sum a_i delta_i|| / sum a_i ||delta_i||``: 1 when every update points the same
  way, near 0 when they cancel. A federation whose clients cancel each other moves the global
  model far less than any single client would, which is one way federated training stays flat.

The pairwise products need every client's copy of one tensor at once (the Gram matrix is summed
key by key), so memory grows to ``num_clients`` times the largest tensor. Above ``max_bytes``
the accumulator switches to ``mode="norms"``: the norms are still exact (each client is compared
with the start as it streams by), the cosines are left out and the record says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

#: Default memory the pairwise statistics may use for one key's client tensors (fp32).
DEFAULT_MAX_BYTES = 2 << 30


@dataclass
class UpdateStatsAccumulator:
    """Sums, key by key, what :class:`UpdateStats` reports (see the module docstring)."""

    weights: Sequence[float]
    largest_numel: int
    max_bytes: int = DEFAULT_MAX_BYTES
    num_params: int = 0
    _gram: torch.Tensor = field(init=False)
    _mean_sq: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        n = len(self.weights)
        self._gram = torch.zeros(n, n, dtype=torch.float64)

    @property
    def mode(self) -> str:
        """``full`` (norms and cosines) or ``norms`` (the clients' tensors would not fit)."""
        return "full" if (len(self.weights) + 1) * self.largest_numel * 4 <= self.max_bytes else "norms"

    def add_key(self, start: torch.Tensor, clients: torch.Tensor) -> None:
        """Full mode: ``clients`` is an ``(n, numel)`` fp32 matrix of this key's client values.

        It is turned into the updates in place (the caller has used the values already).
        """
        clients.sub_(start.reshape(1, -1))
        self._gram += gram_float64(clients)
        self.num_params += clients.shape[1]

    def add_client_sq(self, index: int, sq_norm: float) -> None:
        """Norms mode: one client's squared update norm over one key."""
        self._gram[index, index] += sq_norm

    def count_params(self, numel: int) -> None:
        """Norms mode: one key's elements (full mode counts them in :meth:`add_key`)."""
        self.num_params += numel

    def add_mean_sq(self, sq_norm: float) -> None:
        """The aggregated update's squared norm over one key, measured directly (both modes)."""
        self._mean_sq += sq_norm

    def result(self) -> UpdateStats:
        """The statistics of every key added so far."""
        weights = torch.tensor(list(self.weights), dtype=torch.float64)
        norms = self._gram.diagonal().clamp_min(0).sqrt()
        mean_norm = math.sqrt(max(self._mean_sq, 0.0))
        if self.mode == "full":
            cosine = _cosines(self._gram, norms)
            to_mean_dot = self._gram @ weights
            to_mean = [_clip(_safe_div(float(to_mean_dot[i]), float(norms[i]) * mean_norm)) for i in range(len(norms))]
        else:
            cosine, to_mean = None, None
        weighted_norm_sum = float(weights @ norms)
        return UpdateStats(
            mode=self.mode,
            num_params=self.num_params,
            weights=[float(w) for w in weights],
            client_update_norm=[float(x) for x in norms],
            mean_update_norm=mean_norm,
            norm_ratio=_safe_div(mean_norm, weighted_norm_sum),
            cosine=cosine,
            cosine_to_mean=to_mean,
        )


@dataclass(frozen=True)
class UpdateStats:
    """What one aggregation measured about the clients' updates (module docstring)."""

    mode: str
    num_params: int
    weights: list[float]
    client_update_norm: list[float]
    mean_update_norm: float
    norm_ratio: float | None
    cosine: list[list[float | None]] | None
    cosine_to_mean: list[float | None] | None

    def mean_pairwise_cosine(self) -> float | None:
        """Mean of the off-diagonal cosines (None with fewer than two clients or in norms mode)."""
        if self.cosine is None or len(self.cosine) < 2:
            return None
        values = [c for i, row in enumerate(self.cosine) for j, c in enumerate(row) if i < j and c is not None]
        return sum(values) / len(values) if values else None

    def to_dict(self, labels: Sequence[Any] | None = None) -> dict[str, Any]:
        """JSON form; ``labels`` names the sources (client ids) in source order."""
        data: dict[str, Any] = {
            "mode": self.mode,
            "num_params": self.num_params,
            "weights": self.weights,
            "client_update_norm": self.client_update_norm,
            "mean_update_norm": self.mean_update_norm,
            "norm_ratio": self.norm_ratio,
            "cosine": self.cosine,
            "cosine_to_mean": self.cosine_to_mean,
            "mean_pairwise_cosine": self.mean_pairwise_cosine(),
        }
        if labels is not None:
            data["clients"] = list(labels)
        return data


# Elements converted to float64 at a time: large enough for fast matrix products, small enough
# that the float64 copy (clients x chunk x 8 bytes) stays a few MB.
_CHUNK = 1 << 18


def gram_float64(rows: torch.Tensor) -> torch.Tensor:
    """``rows @ rows.T`` summed in float64, chunk by chunk: an fp32 product over millions of
    elements loses about 1e-4 of relative accuracy, which is the size of the cosine differences
    worth reporting."""
    total = torch.zeros(rows.shape[0], rows.shape[0], dtype=torch.float64)
    for begin in range(0, rows.shape[1], _CHUNK):
        block = rows[:, begin:begin + _CHUNK].double()
        total += block @ block.T
    return total


def sq_norm_float64(tensor: torch.Tensor) -> float:
    """Squared L2 norm summed in float64 (see :func:`gram_float64`)."""
    return float(gram_float64(tensor.reshape(1, -1))[0, 0])


def _safe_div(numerator: float, denominator: float) -> float | None:
    # A client that did not move at all (zero update) has no direction: say so rather than 0.
    return numerator / denominator if denominator > 0 else None


def _clip(value: float | None) -> float | None:
    return None if value is None else min(1.0, max(-1.0, value))


def _cosines(gram: torch.Tensor, norms: torch.Tensor) -> list[list[float | None]]:
    n = gram.shape[0]
    # Rounding can put a cosine a hair outside [-1, 1].
    return [[_clip(_safe_div(float(gram[i, j]), float(norms[i] * norms[j]))) for j in range(n)] for i in range(n)]


def describe_update_stats(stats: UpdateStats, labels: Sequence[Any], kind: str = "actor") -> str:
    """One log line: each client's update norm, the aggregate's, their ratio and the cosines."""
    norms = ", ".join(f"{label}: {norm:.3g}" for label, norm in zip(labels, stats.client_update_norm))
    text = f"{kind} update norms {{{norms}}}, aggregated {stats.mean_update_norm:.3g}"
    if stats.norm_ratio is not None:
        text += f" (ratio {stats.norm_ratio:.3f})"
    pairwise = stats.mean_pairwise_cosine()
    if pairwise is not None:
        text += f", mean pairwise cosine {pairwise:.3f}"
    elif stats.mode == "norms":
        text += " (cosines skipped: the clients' tensors exceed the statistics' memory budget)"
    return text
