"""Put on a verl job's PYTHONPATH by the fedagent-flwr entry module: arms the FedProx hook in every
process of the job (driver and Ray workers) when FEDAGENT_FEDPROX_MU is set, and the critic loader fix when FEDAGENT_CRITIC_ATTN is set."""

from fedagent_flwr.clientapp.verl_backend import critic_attention, fedprox

fedprox.install_from_environment()
critic_attention.install_from_environment()
