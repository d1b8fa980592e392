"""ClientApp: one federated client = one partition of the environment, trained by a subprocess.

Train: read the global model's reference and the knobs from the instruction, write a TrainJob,
run the trainer backend, reply with the checkpoint's reference and one MetricRecord.
Evaluate: play validation episodes of the global model on the unperturbed validation setting.
Query ``partition``: report which partition this node serves (the server maps clients to nodes).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TypeVar

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedagent_flwr.checkpoint import CheckpointError, CheckpointRef
from fedagent_flwr.clientapp import job as jobs
from fedagent_flwr.atomic import write_json_atomic
from fedagent_flwr.clientapp.backend import TrainerFailed, run_trainer
from fedagent_flwr.clientapp.services import serve_env_spec, stop_client_services

app = ClientApp()
T = TypeVar("T")


def node_partition(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) of this node from its node config."""
    config = context.node_config
    if "partition-id" not in config or "num-partitions" not in config:
        raise ValueError(
            "this SuperNode has no partition: start it with "
            "--node-config 'partition-id=<i> num-partitions=<N>'"
        )
    return int(config["partition-id"]), int(config["num-partitions"])


@app.query("partition")
def report_partition(msg: Message, context: Context) -> Message:
    """Tell the server which client partition this node trains."""
    partition, count = node_partition(context)
    return Message(RecordDict({"config": ConfigRecord({"partition-id": partition, "num-partitions": count})}), reply_to=msg)


@app.query("shutdown")
def shutdown(msg: Message, context: Context) -> Message:
    """End of the run: stop the env services this node started for it."""
    partition, _ = node_partition(context)
    stopped = stop_client_services(str(msg.content["config"]["run-root"]), partition)
    return Message(RecordDict({"metrics": MetricRecord({"services-stopped": len(stopped)})}), reply_to=msg)


def _global_model(config: ConfigRecord, prefix: str = "global") -> CheckpointRef:
    ref = CheckpointRef.from_config(config, prefix)
    if not Path(ref.path).is_dir():
        raise CheckpointError(f"global model {ref.path} is not a directory on this node")
    return ref


def _trainer_knobs(settings: dict[str, Any]) -> dict[str, Any]:
    """The trainer group minus what the ClientApp itself consumes (backend, timeout)."""
    return {k: v for k, v in settings.items() if k not in ("backend", "timeout_s")}


def _json_field(config: ConfigRecord, key: str) -> Any:
    try:
        return json.loads(str(config[key]))
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"instruction field '{key}' is missing or not JSON: {exc}") from None


def _run_job(mode: str, job: Any, out_dir: Path, label: str, trainer: dict[str, Any], result_cls: type[T]) -> T:
    """Write the job file, run the backend subprocess on it, read back its result file."""
    job_path = out_dir / f"{mode}_job.json"
    result_path = out_dir / ("train_result.json" if mode == "train" else "eval_result.json")
    # A result left by an interrupted earlier attempt at this round (a resumed run) must never
    # pass for this attempt's.
    result_path.unlink(missing_ok=True)
    jobs.save(job, job_path)
    run_trainer(str(trainer["backend"]), mode, job_path, out_dir / f"{mode}.log", label,
                float(trainer["timeout_s"]))
    try:
        return jobs.load(result_cls, result_path)
    except jobs.JobFileError as exc:
        raise TrainerFailed(f"{label}: the {mode} run finished without a usable result: {exc}") from None


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train this client's partition for one round and reply with checkpoint references."""
    config = msg.content["config"]
    client = int(config["client-id"])
    server_round = int(config["server-round"])
    partition, _ = node_partition(context)
    if partition != client:
        raise ValueError(f"instruction for client {client} reached the node of partition {partition}")
    start_model = _global_model(config)
    run_root = str(config["run-root"])
    out_dir = Path(run_root) / f"round_{server_round}" / f"client_{client}"
    trainer = _json_field(config, "trainer-json")
    env_spec, partition = _json_field(config, "env-spec-json"), _json_field(config, "partition-json")
    service = _json_field(config, "service-json")
    if service["enabled"]:
        # This client's own partitioned services: the service applies the partition, the
        # trainer talks to it over HTTP.
        env_spec, managers = serve_env_spec(
            env_spec, split="train", run_root=run_root, client_id=client, settings=service,
            partition=partition, num_clients=int(config["num-clients"]), base_seed=int(config["base-seed"]),
        )
        write_json_atomic(out_dir / "service_health.json", [m.health() for m in managers])
        partition = {"strategy": "none"}
    job = jobs.TrainJob(
        model_path=start_model.path,
        output_dir=str(out_dir),
        env_spec=env_spec,
        round=server_round,
        client_id=client,
        num_clients=int(config["num-clients"]),
        data_seed=int(config["data-seed"]),
        base_seed=int(config["base-seed"]),
        algorithm=str(config["algorithm"]),
        local_steps=int(config["local-steps"]),
        proximal_mu=float(config.get("proximal-mu", 0.0)),  # only FedProx-style strategies send it
        partition=partition,
        trainer=_trainer_knobs(trainer),
    )
    started = time.monotonic()
    result = _run_job("train", job, out_dir, f"client {client} round {server_round}", trainer, jobs.TrainResult)
    actor = CheckpointRef.for_directory(result.actor_dir, "actor", result.actor_format)  # type: ignore[arg-type]
    reply_config: dict[str, Any] = {"client-id": client, **actor.to_config("actor")}
    metrics = {
        "num-examples": int(result.num_episodes),
        "reward-mean": float(result.metrics.get("reward_mean", 0.0)),
        "success-rate": float(result.metrics.get("success_rate", 0.0)),
        "train-seconds": round(time.monotonic() - started, 3),
    }
    return Message(RecordDict({"config": ConfigRecord(reply_config), "metrics": MetricRecord(metrics)}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Play this node's share of the validation episodes with the global model."""
    config = msg.content["config"]
    client = int(config["client-id"])
    server_round = int(config["server-round"])
    model = _global_model(config)
    run_root = str(config["run-root"])
    out_dir = Path(run_root) / f"round_{server_round}" / "eval" / f"client_{client}"
    trainer = _json_field(config, "trainer-json")
    env_spec = _json_field(config, "env-spec-json")
    service = _json_field(config, "service-json")
    if service["enabled"]:
        # A separate, unperturbed validation service: never the client's training world.
        env_spec, _ = serve_env_spec(env_spec, split="val", run_root=run_root, client_id=client, settings=service)
    job = jobs.EvalJob(
        model_path=model.path,
        output_dir=str(out_dir),
        env_spec=env_spec,
        round=server_round,
        seeds=[int(s) for s in config["eval-seeds"]],  # type: ignore[union-attr]
        trainer=_trainer_knobs(trainer),
    )
    result = _run_job("evaluate", job, out_dir, f"client {client} eval round {server_round}", trainer,
                      jobs.EvalResult)
    metrics = {
        "num-examples": int(result.num_episodes),
        "success-rate": float(result.success_rate),
        "reward-mean": float(result.reward_mean),
    }
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
