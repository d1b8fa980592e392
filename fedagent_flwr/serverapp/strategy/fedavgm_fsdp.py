"""FedAvg with server momentum over checkpoint references (FedAvgMFSDP).

Federated Averaging with Server Momentum [Hsu et al., 2019, arxiv.org/abs/1909.06335], as
Flower's ``FedAvgM`` computes it (PyTorch's SGD convention), on checkpoints streamed key by key
(:mod:`.server_optimizer`). Per floating-point tensor, with ``x`` the current global model and
``a`` the clients' weighted mean (FedAvg's), the pseudo-gradient is ``g = x - a`` and::

    momentum = g                              in the first step
    momentum = server_momentum momentum + g   afterwards (no Nesterov)
    x = x - server_learning_rate momentum     (g itself when server_momentum = 0)

With ``server_learning_rate = 1`` and ``server_momentum = 0`` (Flower's defaults) there is no server
optimisation: the new global model is FedAvg's mean, written by FedAvgFSDP's own code, bit for bit.
The momentum buffer (only with ``server_momentum > 0``) is kept in
``round_<r>/server_optimizer/`` beside the round's global model.
"""

from __future__ import annotations

from logging import INFO
from typing import Any, ClassVar

import torch
from flwr.common import log

from .server_optimizer import ServerOptimizerFSDP, checked_number

__all__ = ["FedAvgMFSDP"]


class FedAvgMFSDP(ServerOptimizerFSDP):
    """FedAvgFSDP plus server momentum and a server learning rate.

    Parameters (as Flower's ``FedAvgM``; the others are FedAvgFSDP's)
    ----------
    server_learning_rate : float
        > 0 (default 1.0).
    server_momentum : float
        In [0, 1) (default 0.0: no momentum buffer is kept).
    """

    rule_name: ClassVar[str] = "fedavgm"

    def __init__(self, *, server_learning_rate: float = 1.0, server_momentum: float = 0.0, **kwargs: Any) -> None:
        self.server_learning_rate = checked_number("server_learning_rate", server_learning_rate, above=0.0)
        self.server_momentum = checked_number("server_momentum", server_momentum, at_least=0.0, below=1.0)
        super().__init__(**kwargs)

    def buffers(self) -> tuple[str, ...]:
        """The momentum buffer, when there is momentum."""
        return ("momentum",) if self.server_momentum > 0.0 else ()

    def plain_mean(self) -> bool:
        """Learning rate 1 and no momentum: FedAvg (Flower's "server optimization OFF")."""
        return self.server_learning_rate == 1.0 and self.server_momentum == 0.0

    def hyperparameters(self) -> dict[str, float]:
        """server_learning_rate, server_momentum."""
        return {"server_learning_rate": self.server_learning_rate, "server_momentum": self.server_momentum}

    def server_step(self, server_round: int, x: torch.Tensor, delta: torch.Tensor,
                    state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x - lr momentum, the momentum updated in ``state`` (see the module docstring)."""
        gradient = delta.neg_()  # g = x - a
        if self.server_momentum > 0.0:
            if "momentum" in state:
                gradient = state["momentum"].mul_(self.server_momentum).add_(gradient)
            state["momentum"] = gradient
        return x.sub_(gradient, alpha=self.server_learning_rate)

    def summary(self) -> None:
        """Log FedAvgFSDP's settings and the server optimiser's."""
        super().summary()
        log(INFO, "\t└── fedavgm: server_learning_rate %g, server_momentum %g%s", self.server_learning_rate,
            self.server_momentum, " (FedAvg: no server optimisation)" if self.plain_mean() else "")
