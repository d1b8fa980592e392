"""Put on a verl job's PYTHONPATH by the fedagent-flwr entry module: arms, in every process of the
job (driver and Ray workers), the user hooks (plugin modules, client rule) when their variables are
set, the FedProx hook when FEDAGENT_FEDPROX_MU is set, the critic loader fix when
FEDAGENT_CRITIC_ATTN is set, and the host-wide weight-sync lock when FEDAGENT_WEIGHT_SYNC_LOCK is set."""

from fedagent_flwr.trainers.verl import critic_attention, fedprox, user_hooks, weight_sync

# User hooks first: a client rule's step wrapper then runs after FedProx's, as in the reference trainer.
user_hooks.install_from_environment()
fedprox.install_from_environment()
critic_attention.install_from_environment()
weight_sync.install_from_environment()
