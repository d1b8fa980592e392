"""Server strategies that exchange checkpoint references instead of arrays."""

from .fedavg_fsdp import FedAvgFSDP, NoClientsError
from .fedprox_fsdp import FedProxFSDP

__all__ = ["FedAvgFSDP", "FedProxFSDP", "NoClientsError"]
