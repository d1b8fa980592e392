"""ClientApp: one federated client = one partition of the environment, trained by a subprocess
(``trainer.mode: subprocess``) or by the node's long-lived trainer (``persistent``, :mod:`.persistent`).

Train: read the global model's reference and the knobs from the instruction, fetch the model
through the run's checkpoint store, write a TrainJob, run the trainer backend, put the checkpoint
into the store and reply with its reference and one MetricRecord.
Evaluate: play validation episodes of the global model on the unperturbed validation setting.
Query ``partition``: report which partition this node serves (the server maps clients to nodes).

With a shared filesystem the node works under the server's run root; with the http store it
works in its own directory (node config ``work-dir``, default ``./fedagent-work``) and shares no
path with the server.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TypeVar

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.checkpoint.store import ClientStore, open_client_store
from fedagent_flwr.clientapp import job as jobs
from fedagent_flwr.atomic import write_json_atomic
from fedagent_flwr.clientapp.backend import CLIENTAPP_TRAINER_KEYS, TrainerFailed, run_trainer
from fedagent_flwr.clientapp.persistent import PersistentTrainer, TrainerDied, channel_dir
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


def node_work_dir(context: Context) -> Path:
    """This node's own directory (node config ``work-dir``, else ``fedagent-work`` in the cwd)."""
    value = context.node_config.get("work-dir")
    if value is None:
        return Path.cwd() / "fedagent-work"
    path = Path(str(value))
    if not path.is_absolute() or any(ord(ch) < 32 for ch in str(value)):
        raise ValueError(f"node config 'work-dir' = {value!r} must be an absolute path")
    return path


def client_store(config: ConfigRecord, context: Context) -> ClientStore:
    """The checkpoint store this instruction describes, as seen from this node."""
    return open_client_store(config, context.run_id, lambda: node_work_dir(context))


@app.query("partition")
def report_partition(msg: Message, context: Context) -> Message:
    """Tell the server which client partition this node trains."""
    partition, count = node_partition(context)
    return Message(RecordDict({"config": ConfigRecord({"partition-id": partition, "num-partitions": count})}), reply_to=msg)


@app.query("shutdown")
def shutdown(msg: Message, context: Context) -> Message:
    """End of the run: stop the env services this node started for it."""
    partition, _ = node_partition(context)
    run_root = client_store(msg.content["config"], context).run_root
    stopped = stop_client_services(run_root, partition)
    trainer_stopped = PersistentTrainer("", channel_dir(run_root, partition)).stop()
    metrics = {"services-stopped": len(stopped), "trainers-stopped": int(trainer_stopped)}
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def _trainer_knobs(settings: dict[str, Any]) -> dict[str, Any]:
    """The trainer group minus what the ClientApp itself consumes (backend, timeout, mode)."""
    return {k: v for k, v in settings.items() if k not in CLIENTAPP_TRAINER_KEYS}


def _json_field(config: ConfigRecord, key: str) -> Any:
    try:
        return json.loads(str(config[key]))
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"instruction field '{key}' is missing or not JSON: {exc}") from None


def _run_job(mode: str, job: Any, out_dir: Path, label: str, trainer: dict[str, Any], result_cls: type[T],
             context: Context, run_root: Path) -> T:
    """Write the job file, have the trainer run it, read back its result file.

    ``trainer.mode: persistent`` sends the job to the node's long-lived trainer; if that process
    dies during the job, or the job makes no progress for ``trainer.stall_timeout_s`` (the trainer
    is then stopped), the job runs again in a fresh subprocess and the next job restarts it.
    """
    job_path = out_dir / f"{mode}_job.json"
    result_path = out_dir / ("train_result.json" if mode == "train" else "eval_result.json")
    # A result left by an interrupted earlier attempt at this round (a resumed run) must never
    # pass for this attempt's.
    result_path.unlink(missing_ok=True)
    jobs.save(job, job_path)
    backend, timeout_s, log_path = str(trainer["backend"]), float(trainer["timeout_s"]), out_dir / f"{mode}.log"
    stall_timeout_s = float(trainer.get("stall_timeout_s", 0.0))  # absent in configs older than the watchdog
    if trainer.get("mode", "subprocess") == "persistent":
        handle = PersistentTrainer(backend, channel_dir(run_root, node_partition(context)[0]),
                                   float(trainer.get("persistent_idle_s", 3600.0)))
        started = time.monotonic()
        try:
            handle.run(mode, job_path, log_path, label, timeout_s, stall_timeout_s)
        except TrainerDied as exc:  # a TrainerStalled too
            # The rerun gets what is left of the job's time, not a fresh timeout: the server
            # gives up on the reply at the round's deadline anyway.
            left = timeout_s - (time.monotonic() - started)
            if left < 30:
                raise TrainerFailed(f"{exc}; too little of the {timeout_s:.0f} s timeout is left to rerun it") from None
            print(f"[{label}] {exc}; running this job in a fresh subprocess instead", flush=True)
            result_path.unlink(missing_ok=True)
            run_trainer(backend, mode, job_path, out_dir / f"{mode}.fallback.log", label, left, stall_timeout_s)
        finally:
            context.state["persistent-trainer"] = ConfigRecord(handle.state())
    else:
        run_trainer(backend, mode, job_path, log_path, label, timeout_s, stall_timeout_s)
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
    store = client_store(config, context)
    start_model = store.fetch(CheckpointRef.from_config(config, "global"))
    run_root = store.run_root
    out_dir = run_root / f"round_{server_round}" / f"client_{client}"
    # PPO: the aggregated critic of the previous round (absent in round 1: the job starts its
    # critic from the model).
    critic_path = ""
    if "global-critic-path" in config:
        critic_path = str(store.fetch(CheckpointRef.from_config(config, "global-critic")))
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
        model_path=str(start_model),
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
        critic_path=critic_path,
        partition=partition,
        trainer=_trainer_knobs(trainer),
    )
    started = time.monotonic()
    result = _run_job("train", job, out_dir, f"client {client} round {server_round}", trainer, jobs.TrainResult,
                      context, run_root)
    actor = store.put(result.actor_dir, "actor", server_round, client)
    if actor.format != result.actor_format:
        raise TrainerFailed(f"client {client}: the trainer reports a {result.actor_format} checkpoint, "
                            f"{result.actor_dir} holds {actor.format}")
    reply_config: dict[str, Any] = {"client-id": client, **actor.to_config("actor")}
    if result.critic_dir:
        reply_config.update(store.put(result.critic_dir, "critic", server_round, client).to_config("critic"))
    metrics = {
        "num-examples": int(result.num_episodes),
        "reward-mean": float(result.metrics.get("reward_mean", 0.0)),
        "success-rate": float(result.metrics.get("success_rate", 0.0)),
        "train-seconds": round(time.monotonic() - started, 3),
    }
    if "zero_variance_group_share" in result.metrics:  # share of GRPO groups that gave no gradient
        metrics["zero-variance-group-share"] = float(result.metrics["zero_variance_group_share"])
    # Backend timings and losses (verl: cold start, per-phase step times) travel as metrics too.
    metrics.update({_metric_key(k): float(v) for k, v in result.metrics.items()
                    if k.startswith(("verl/", "fedprox/"))})
    return Message(RecordDict({"config": ConfigRecord(reply_config), "metrics": MetricRecord(metrics)}), reply_to=msg)


def _metric_key(name: str) -> str:
    """A backend metric name as a MetricRecord key (``verl/timing_s/gen`` -> ``verl.timing_s.gen``)."""
    return name.replace("/", ".")


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Play this node's share of the validation episodes with the global model."""
    config = msg.content["config"]
    client = int(config["client-id"])
    server_round = int(config["server-round"])
    store = client_store(config, context)
    model = store.fetch(CheckpointRef.from_config(config, "global"))
    run_root = store.run_root
    out_dir = run_root / f"round_{server_round}" / "eval" / f"client_{client}"
    trainer = _json_field(config, "trainer-json")
    env_spec = _json_field(config, "env-spec-json")
    service = _json_field(config, "service-json")
    if service["enabled"]:
        # A separate, unperturbed validation service: never the client's training world.
        env_spec, _ = serve_env_spec(env_spec, split="val", run_root=run_root, client_id=client, settings=service)
    job = jobs.EvalJob(
        model_path=str(model),
        output_dir=str(out_dir),
        env_spec=env_spec,
        round=server_round,
        seeds=[int(s) for s in config["eval-seeds"]],  # type: ignore[union-attr]
        trainer=_trainer_knobs(trainer),
    )
    result = _run_job("evaluate", job, out_dir, f"client {client} eval round {server_round}", trainer,
                      jobs.EvalResult, context, run_root)
    metrics = {
        "num-examples": int(result.num_episodes),
        "success-rate": float(result.success_rate),
        "reward-mean": float(result.reward_mean),
    }
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
