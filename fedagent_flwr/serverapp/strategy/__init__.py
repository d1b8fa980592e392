"""Server strategies that exchange checkpoint references instead of arrays."""

from .fedavg_fsdp import FedAvgFSDP, TrainAggregation
from .fedavgm_fsdp import FedAvgMFSDP
from .fedopt_fsdp import FedAdagradFSDP, FedAdamFSDP, FedOptFSDP, FedYogiFSDP
from .fedprox_fsdp import FedProxFSDP
from .plan import RunPlan
from .server_optimizer import ServerOptimizerFSDP

__all__ = [
    "FedAdagradFSDP",
    "FedAdamFSDP",
    "FedAvgFSDP",
    "FedAvgMFSDP",
    "FedOptFSDP",
    "FedProxFSDP",
    "FedYogiFSDP",
    "RunPlan",
    "ServerOptimizerFSDP",
    "TrainAggregation",
]
