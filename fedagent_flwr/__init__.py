"""fedagent-flwr: federated reinforcement learning for LLM agents as a Flower app.

Rooms: ``serverapp`` (strategies, aggregation driver, run record), ``clientapp`` (ClientApp,
trainer backends), ``checkpoint`` (references, readers, streamed averaging), ``envs``
(environments and specs), ``hetero`` (partitions), ``rollout`` (the episode runner), ``models``
(default and test models), ``config`` (Hydra composition and checks), ``seeding``.
"""

__version__ = "0.1.0"
