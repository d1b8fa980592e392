"""Per-client trainer resources: ``trainer.per_client`` (issue 19, clients of different node sizes).

A federation often mixes node sizes: one client trains on two GPUs, another on one. The trainer
group is run-wide, so ``trainer.per_client`` gives single clients other values of the keys that
describe *where* a client trains, never *what* it trains::

    trainer.per_client={0:{n_gpus_per_node:2}}

(declared by the trainer groups' schema, :class:`~fedagent_flwr.schema.trainer.PerClientKeys`; the
earlier ``+trainer.per_client=...`` still works).

Only :data:`RESOURCE_KEYS` may differ (GPUs, memory shares, micro-batches, worker counts, time
limits); learning rates, group sizes and the like stay the same for every client, so the clients
still run one algorithm and the aggregation weights keep their meaning. A key must also exist in
the trainer group (a backend without it does not read it). The ServerApp checks all of this when
the run is composed (:func:`resolve`, called by :func:`fedagent_flwr.config.validate`), before
round 1, and each instruction then carries the client's own trainer group
(:func:`trainer_for_client`), without ``per_client``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fedagent_flwr.config_keys import ConfigError

#: The trainer key holding the per-client values.
PER_CLIENT_KEY = "per_client"

#: What may differ between clients: resources and limits of a client's trainer job.
RESOURCE_KEYS = (
    "n_gpus_per_node",  # verl: GPUs of the client's job (FSDP world size)
    "gpu_memory_utilization",
    "kv_cache_gib",
    "micro_batch_size_per_gpu",  # memory only: the mini-batch (the update) is the same
    "enforce_eager",
    "agent_workers",
    "ray_num_cpus",
    "timeout_s",
    "stall_timeout_s",
    "persistent_idle_s",
)


def _client_id(key: Any, total_clients: int) -> int:
    text = str(key)
    if isinstance(key, bool) or not text.isdigit() or int(text) >= total_clients:
        raise ConfigError(f"config key 'trainer.{PER_CLIENT_KEY}' names client {key!r}: expected a client id in "
                          f"[0, {total_clients - 1}] (clients.total={total_clients})")
    return int(text)


def resolve(trainer: Mapping[str, Any], total_clients: int,
            check: Callable[[dict[str, Any], str], None] | None = None) -> dict[str, dict[str, Any]]:
    """``trainer.per_client`` checked and keyed by the client id as a string (JSON-stable).

    Every entry must name a client id of the run and map only :data:`RESOURCE_KEYS` that the
    trainer group has; ``check(merged_trainer, "trainer.per_client.<id>")`` then checks each
    client's resulting trainer group with the run's own rules (ConfigError naming the key).
    """
    raw = trainer.get(PER_CLIENT_KEY) or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config key 'trainer.{PER_CLIENT_KEY}' must map client ids to trainer keys, e.g. "
                          f"{{0:{{n_gpus_per_node:2}}}}; got {raw!r}")
    resolved: dict[str, dict[str, Any]] = {}
    for key, values in raw.items():
        client = _client_id(key, total_clients)
        where = f"trainer.{PER_CLIENT_KEY}.{client}"
        if str(client) in resolved:
            raise ConfigError(f"config key '{where}' is given twice")
        if not isinstance(values, Mapping) or not values:
            raise ConfigError(f"config key '{where}' must map trainer keys to values, e.g. {{n_gpus_per_node:2}}; "
                              f"got {values!r}")
        for name in values:
            if name not in RESOURCE_KEYS:
                raise ConfigError(f"config key '{where}.{name}' cannot differ between clients: only resources may "
                                  f"({', '.join(RESOURCE_KEYS)})")
            if name not in trainer:
                backend = trainer.get("backend")
                raise ConfigError(f"config key '{where}.{name}': the trainer group (backend {backend!r}) has no "
                                  f"key '{name}'")
        resolved[str(client)] = dict(values)
        if check is not None:
            merged = trainer_for_client({**trainer, PER_CLIENT_KEY: resolved}, client)
            check(merged, where)  # types the numbers in place: keep the typed values
            resolved[str(client)] = {name: merged[name] for name in values}
    return resolved


def trainer_for_client(trainer: Mapping[str, Any], client: int) -> dict[str, Any]:
    """Client ``client``'s trainer group: the run's, with its ``per_client`` values applied."""
    own = dict(trainer)
    overrides = own.pop(PER_CLIENT_KEY, None) or {}
    own.update(overrides.get(str(client)) or overrides.get(client) or {})  # str keys; int when not resolved
    return own
