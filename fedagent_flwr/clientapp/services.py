"""Per-node env services: each client serves its own partition of each environment over HTTP.

FedAgent runs one service per client, and the service decides the client's world. Here the
ClientApp starts (or reuses, or restarts) one service per env-spec entry and split under the
run directory, records it in a state file so that later messages, which in deployment run in
fresh processes, find it again, and rewrites the trainer's env spec to point at the services.
A final ``shutdown`` query from the ServerApp stops them.
"""

from __future__ import annotations

import os
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common import log

from fedagent_flwr.envs.registry import get_env_class
from fedagent_flwr.envs.service.manager import EnvServiceError, EnvServiceManager, ServiceLaunch
from fedagent_flwr.envs.spec import load_env_spec
from fedagent_flwr.hetero import needs_goal_info, partition_goals
from fedagent_flwr.hetero.env_level import variant_request
from fedagent_flwr.procs import find_ancestor
from fedagent_flwr.schema.run import RunSchema

SERVICE_ENV = "Service"


def node_owner_pid() -> int:
    """The long-lived process of this node, which the services watch and die with.

    In deployment every message runs in a fresh ``flwr-clientapp`` process under the
    ``flower-supernode``: the SuperNode is the owner. In simulation the ClientApp runs in a Ray
    actor that lives for the whole run: this process is the owner.
    """
    supernode = find_ancestor("flower-supernode")
    return supernode.pid if supernode is not None else os.getpid()


def service_interpreter(env_name: str, env_config: dict[str, Any]) -> str | None:
    """The Python an env's service runs under when it is not this one (an env with its own venv,
    such as ALFWorld, builds it here on first use); None for the caller's interpreter."""
    provider = getattr(get_env_class(env_name), "service_python", None)
    return None if provider is None else str(provider(env_config))


def services_dir(run_root: str | Path, client_id: int) -> Path:
    """Where a client's service state files and logs live."""
    return Path(run_root) / "services" / f"client_{client_id}"


def client_partition(
    env_name: str, env_config: dict[str, Any], partition: dict[str, Any], client_id: int,
    num_clients: int, base_seed: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(partition, variant) a client's service is started with; both are echoed by /health.

    Task-level strategies choose the client's goals (``goal_indices``); environment-level ones
    (catalog_split, lookalike, ...) describe how the client's world differs (the variant), and
    the service resolves them against its data.
    """
    env_cls = get_env_class(env_name)
    strategy = str(partition.get("strategy") or "none")
    description: dict[str, Any] = {**partition, "strategy": strategy, "client_id": client_id,
                                   "num_clients": num_clients}
    variant = variant_request(strategy, client_id, num_clients, partition, base_seed)
    if variant is not None:
        return description, variant
    num_goals = env_cls.num_goals(env_config)
    if num_goals is not None and strategy != "none":
        # goal_info is an optional classmethod that BaseTextEnv does not declare (cf. hetero.partition_env_spec).
        goal_info = env_cls.goal_info(env_config) if needs_goal_info(strategy) else None  # type: ignore[attr-defined]
        description["goal_indices"] = partition_goals(
            strategy, client_id, num_clients, num_goals, partition, base_seed, goal_info
        )
    return description, {}


def serve_env_spec(
    spec: dict[str, Any],
    *,
    split: str,
    run_root: str | Path,
    client_id: int,
    settings: dict[str, Any],
    partition: dict[str, Any] | None = None,
    num_clients: int = 1,
    base_seed: int = RunSchema.seed,
) -> tuple[dict[str, Any], list[EnvServiceManager]]:
    """Make sure this client's services for ``spec`` run; return the spec pointed at them.

    ``partition`` None means the unperturbed validation world (the whole goal pool).
    """
    entries = load_env_spec(spec).envs
    state_dir = services_dir(run_root, client_id)
    served, managers = [], []
    for index, entry in enumerate(entries):
        config = entry.env_config()
        part, variant = (
            client_partition(entry.name, config, partition, client_id, num_clients, base_seed)
            if partition is not None
            else ({"strategy": "none", "split": "validation"}, {})
        )
        # Loopback unless the run configures env.service.host: the trainer on this node is the
        # only intended caller, and an env service has no authentication.
        launch = ServiceLaunch(env=entry.name, config=config, pool_size=int(settings["pool_size"]), partition=part,
                               variant=variant, host=str(settings["host"]),
                               owner_pid=node_owner_pid(), interpreter=service_interpreter(entry.name, config))
        manager = EnvServiceManager.attach_or_create(
            state_dir / f"{split}_{index}.json", launch, startup_timeout_s=float(settings["startup_timeout_s"])
        )
        url = manager.ensure_running()
        managers.append(manager)
        # The service reports the registered name, also for an env named by its dotted path.
        served.append({"name": SERVICE_ENV, "n_envs": entry.n_envs, "max_turns": entry.max_turns,
                       "config": {"url": url, "env": get_env_class(entry.name).env_name,
                                  "pool_size": launch.pool_size}})
    return {"envs": served}, managers


def stop_client_services(run_root: str | Path, client_id: int) -> list[str]:
    """Stop every service recorded for this client; return the state files handled.

    A state file that cannot be read is reported (its service stopped all the same, found by its
    marker: :meth:`EnvServiceManager.discard_unreadable`) and skipped, so that one bad file never
    leaves the client's other services (and, after this, its persistent trainer) running. Hidden names are the
    temporary files of an atomic write that a killed process left behind, not state files.
    """
    stopped = []
    for state_file in sorted(services_dir(run_root, client_id).glob("*.json")):
        if state_file.name.startswith("."):
            continue
        try:
            try:
                manager = EnvServiceManager.attach(state_file)
            except EnvServiceError as exc:  # its service is stopped all the same, found by its marker
                if said := EnvServiceManager.discard_unreadable(state_file, exc):
                    log(WARNING, "client %d: %s", client_id, said)
                continue
            manager.stop()
        except (EnvServiceError, OSError) as exc:
            log(WARNING, "client %d: env service not stopped: %s", client_id, exc)
            continue
        stopped.append(state_file.name)
    return stopped
