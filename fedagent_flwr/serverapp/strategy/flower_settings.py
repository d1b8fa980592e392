"""Flower settings of ``FedAvg`` that :class:`~.fedavg_fsdp.FedAvgFSDP` cannot honour, refused at
construction with a message that names the setting and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedagent_flwr.protocol import CONFIG
from fedagent_flwr.seeding import select_clients

if TYPE_CHECKING:
    from fedagent_flwr.serverapp.strategy.fedavg_fsdp import FedAvgFSDP


def check_flower_settings(strategy: FedAvgFSDP) -> None:
    """Raise ``ValueError`` for a Flower setting ``strategy`` cannot honour, naming it and the fix."""
    name = type(strategy).__name__
    if strategy.fraction_train != 1.0:
        raise ValueError(
            f"{name} does not sample by fraction_train (got {strategy.fraction_train}): it trains "
            "clients.per_round of clients.total clients, chosen with FedAgent's seeded rule; set "
            "clients.per_round instead"
        )
    # The built-in rule's count, not an override's: a subclass may not be fully built yet.
    per_round = len(select_clients(1, strategy.num_clients, strategy.clients_per_round, strategy.base_seed,
                                   strategy.local_client_id))
    if not 1 <= strategy.min_train_nodes <= per_round:
        raise ValueError(f"min_train_nodes = {strategy.min_train_nodes} must be between 1 and the {per_round} "
                         "client(s) trained per round (clients.per_round)")
    # Flower sets min_evaluate_nodes to 0 itself when fraction_evaluate is 0 (no evaluation).
    evaluates = ("min_evaluate_nodes",) if strategy.fraction_evaluate > 0 else ()
    for setting in ("min_available_nodes", *evaluates):
        if not 1 <= getattr(strategy, setting) <= strategy.num_clients:
            raise ValueError(f"{setting} = {getattr(strategy, setting)} must be between 1 and the "
                             f"{strategy.num_clients} client(s) of the run (clients.total)")
    if not 0.0 <= strategy.fraction_evaluate <= 1.0:
        raise ValueError(f"fraction_evaluate = {strategy.fraction_evaluate} must be between 0 and 1")
    if strategy.configrecord_key != CONFIG or strategy.arrayrecord_key != "arrays":
        raise ValueError(f"{name} does not rename message records (configrecord_key, arrayrecord_key): "
                         f"the ClientApp reads the '{CONFIG}' record and no ArrayRecord travels")
