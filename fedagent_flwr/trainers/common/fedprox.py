"""FedProx as the built-in client rule, the one implementation both backends run.

FedProx [Li et al., 2020, arxiv.org/abs/1812.06127] adds ``mu/2 * ||w - w_t||^2`` to each client's
local objective, ``w_t`` being the round's starting (global) weights; its gradient
``mu * (w - w_t)`` is added to every trainable parameter's gradient before each optimiser step.
:class:`~fedagent_flwr.serverapp.strategy.FedProxFSDP` asks for it by sending ``proximal-mu`` in
its train instructions; the job's rule list then starts with this rule
(:func:`fedagent_flwr.trainers.common.client_rule.job_rule_specs`) and the trainers run it like any
client rule: the reference trainer in its update, the verl backend in every actor worker's FSDP
engine, where a parameter is the rank's local shard (the arithmetic is element-wise, so it needs
no communication).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: The dotted path the rule travels by (in a job's rule list and in a verl job's environment).
FEDPROX_RULE = "fedagent_flwr.trainers.common.fedprox.FedProx"


class FedProx:
    """Adds ``mu * (w - w_t)`` to the gradients; ``w_t`` is captured at the first call."""

    def __init__(self, mu: float) -> None:
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not mu > 0:
            raise ValueError(f"proximal mu must be a number > 0, got {mu!r}")
        self.mu = float(mu)
        self.anchor: dict[str, Any] | None = None
        self.steps = 0
        self.penalty = 0.0  # mu/2 * ||w - w_t||^2 at the last call: this rule's part of the loss

    def apply(self, named_parameters: Iterable[tuple[str, Any]]) -> float:
        """Add the proximal gradient in place; returns the local ``||w - w_t||^2`` (before the step)."""
        import torch

        params = [(n, p) for n, p in named_parameters if p.requires_grad]
        with torch.no_grad():
            if self.anchor is None:
                self.anchor = {n: p.detach().clone() for n, p in params}
            squared = 0.0
            for name, param in params:
                if param.grad is None:
                    continue
                delta = param.detach() - self.anchor[name]
                param.grad.add_(delta, alpha=self.mu)
                squared += float(local_shard(delta).float().pow(2).sum())
        self.steps += 1
        self.penalty = 0.5 * self.mu * squared
        return squared

    def reset(self) -> None:
        """Forget the anchor (a new round starts from new global weights)."""
        self.anchor = None
        self.steps = 0
        self.penalty = 0.0


def local_shard(tensor: Any) -> Any:
    """The rank's own shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
