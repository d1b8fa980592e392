"""A client-side rule: FedProx's proximal term, with some tensors kept at the global weights.

The trainer calls ``apply(named_parameters)`` before every optimiser step of a client's round,
after the backward pass; the rule edits the gradients in place:

* tensors whose name matches ``freeze`` (a regular expression) get a zero gradient, so they never
  leave the round's global weights (exactly so with ``trainer.weight_decay=0``, the default): the
  clients share them unchanged, as FedBABU [Oh et al., 2022, arxiv.org/abs/2106.06042] does with
  the head;
* every other tensor gets FedProx's proximal gradient ``mu * (w - w_t)`` [Li et al., 2020,
  arxiv.org/abs/1812.06127], ``w_t`` being the weights at the first call, i.e. the global model.

``apply`` returns ``||w - w_t||^2`` over the trained tensors, which the trainer logs. Selected by
config::

    trainer.client_rule=examples.client_rule.ProximalFreeze trainer.client_rule_args={mu:0.1,freeze:embed_tokens}
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any


class ProximalFreeze:
    """Zero the gradients of ``freeze``-matching tensors; add ``mu * (w - w_t)`` to the others'."""

    def __init__(self, mu: float = 0.0, freeze: str = "") -> None:
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or mu < 0:
            raise ValueError(f"mu must be a number >= 0, got {mu!r}")
        try:
            self.freeze = re.compile(freeze) if freeze else None
        except re.error as exc:
            raise ValueError(f"freeze {freeze!r} is not a regular expression: {exc}") from None
        self.mu = float(mu)
        self.anchor: dict[str, Any] | None = None

    def apply(self, named_parameters: Iterable[tuple[str, Any]]) -> float:
        import torch

        params = list(named_parameters)
        with torch.no_grad():
            if self.anchor is None:
                self.anchor = {name: p.detach().clone() for name, p in params}
            drift = 0.0
            for name, param in params:
                if param.grad is None:
                    continue
                if self.freeze is not None and self.freeze.search(name):
                    param.grad.zero_()
                    continue
                delta = param.detach() - self.anchor[name]
                if self.mu > 0:
                    param.grad.add_(delta, alpha=self.mu)
                drift += float(delta.float().pow(2).sum())
        return drift
