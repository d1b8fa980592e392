"""Put on a verl job's PYTHONPATH by the fedagent-flwr verl backend (``job.job_environment``): arms,
in every process of the job (driver and Ray workers), the user hooks (plugin modules; the client
rules, FedProx's among them) when their variables are set, the critic loader fix when
FEDAGENT_CRITIC_ATTN is set, the host-wide weight-sync lock when FEDAGENT_WEIGHT_SYNC_LOCK is set,
always GRPO's zero advantage for groups that all scored alike (``flat_groups``), and, unless
FEDAGENT_VLLM_SLEEP_CHECK=strict, vLLM's worker sleep surviving its device-wide free-memory assertion
when another process on the shared GPU allocates meanwhile (``vllm_sleep``)."""

from fedagent_flwr.trainers.verl import critic_attention, flat_groups, user_hooks, vllm_sleep, weight_sync

flat_groups.install()
user_hooks.install_from_environment()
critic_attention.install_from_environment()
weight_sync.install_from_environment()
vllm_sleep.install_from_environment()
