"""FedProx over checkpoint references (FedProxFSDP).

Federated Optimization in Heterogeneous Networks [Li et al., 2020, arxiv.org/abs/1812.06127]:
identical to :class:`FedAvgFSDP` on the server; each client adds the proximal term
``mu / 2 * ||w - w_global||^2`` to its local objective, with ``mu`` sent as ``proximal-mu``
in every train instruction (the key Flower's own ``FedProx`` uses). On the client, ``proximal-mu``
> 0 puts the built-in client rule :class:`fedagent_flwr.trainers.common.fedprox.FedProx` first in
the job's rules, which both trainer backends run (verl: in every actor worker, fail-closed).
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common import log
from flwr.serverapp import Grid

from fedagent_flwr.protocol import PROXIMAL_MU

from .fedavg_fsdp import FedAvgFSDP


class FedProxFSDP(FedAvgFSDP):
    """FedAvgFSDP plus the ``proximal-mu`` instruction for the clients' proximal term.

    ``proximal_mu`` has no default here: it is the config's ``strategy.proximal_mu`` (declared in the
    schema, set by ``conf/strategy/fedprox.yaml``), which the ServerApp passes in."""

    def __init__(self, *, proximal_mu: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.proximal_mu = proximal_mu
        if proximal_mu == 0.0:
            log(WARNING, "FedProxFSDP with proximal_mu=0 behaves exactly like FedAvgFSDP")

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Add ``proximal-mu`` to the instructions, then configure as FedAvgFSDP."""
        config[PROXIMAL_MU] = self.proximal_mu
        return super().configure_train(server_round, arrays, config, grid)

    def summary(self) -> None:
        """Log FedAvgFSDP's settings and mu."""
        super().summary()
        log(INFO, "\t└── Proximal mu: %s", self.proximal_mu)
