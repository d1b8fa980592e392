"""Server strategies that exchange checkpoint references instead of arrays."""

from .fedavg_fsdp import FedAvgFSDP, TrainAggregation
from .fedprox_fsdp import FedProxFSDP
from .plan import RunPlan

__all__ = ["FedAvgFSDP", "FedProxFSDP", "RunPlan", "TrainAggregation"]
