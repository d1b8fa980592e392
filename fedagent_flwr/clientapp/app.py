"""ClientApp: one federated client = one partition of the environment, trained by a subprocess
(``trainer.mode: subprocess``) or by the node's long-lived trainer (``persistent``, :mod:`.persistent`).

Train: read the global model's reference and the knobs from the instruction, fetch the model
through the run's checkpoint store, write a TrainJob, run the trainer backend, put the checkpoint
into the store and reply with its reference and one MetricRecord.
With per-client validation on (the instruction names validation seeds), the client then plays
those validation episodes with its own trained model too and adds the outcome to its reply
(:mod:`.client_val`).
Evaluate: play validation episodes of the global model on the unperturbed validation setting.
Query ``partition``: report which partition this node serves (the server maps clients to nodes).

With a shared filesystem the node works under the server's run root; with the http store it
works in its own directory (node config ``work-dir``, default ``./fedagent-work``) and shares no
path with the server.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from fedagent_flwr.atomic import write_json_atomic
from fedagent_flwr.checkpoint import CheckpointError
from fedagent_flwr.checkpoint.model_files import model_files_dir
from fedagent_flwr.checkpoint.store import ClientStore, open_client_store
from fedagent_flwr.clientapp import job as jobs
from fedagent_flwr.clientapp.backend import TrainerFailed, run_trainer
from fedagent_flwr.clientapp.client_val import client_val_metrics, eval_reply, trained_model_dir
from fedagent_flwr.clientapp.persistent import PersistentTrainer, TrainerDied, channel_dir
from fedagent_flwr.clientapp.progress import forward_progress
from fedagent_flwr.clientapp.services import serve_env_spec, stop_client_services
from fedagent_flwr.progress import PROGRESS_FILE
from fedagent_flwr.protocol import (
    NUM_EXAMPLES,
    OPTIMIZER_STATE_KEPT,
    REWARD_MEAN,
    SUCCESS_RATE,
    TRAIN_SECONDS,
    TRUNCATED_RATE,
    ZERO_VARIANCE_GROUP_SHARE,
    EvalInstruction,
    PartitionReply,
    ShutdownInstruction,
    ShutdownReply,
    TrainInstruction,
    TrainReply,
)
from fedagent_flwr.schema.fields import check
from fedagent_flwr.schema.trainer import CLIENTAPP_TRAINER_KEYS, ClientAppKeys, TrainerSettings

app = ClientApp()
T = TypeVar("T")


def node_partition(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) of this node from its node config."""
    config = context.node_config
    usage = "start it with --node-config 'partition-id=<i> num-partitions=<N>', 0 <= i < N"
    if "partition-id" not in config or "num-partitions" not in config:
        raise ValueError(f"this SuperNode has no partition: {usage}")
    partition, count = (_node_whole_number(config, key, usage) for key in ("partition-id", "num-partitions"))
    if not 0 <= partition < count:
        raise ValueError(f"node config 'partition-id' = {partition} is out of range for "
                         f"'num-partitions' = {count}: {usage}")
    return partition, count


def _node_whole_number(config: Mapping[str, Any], key: str, usage: str) -> int:
    """Node config ``key`` as a whole number >= 0, refused naming the key otherwise."""
    value = config[key]
    # Whole numbers only: int() would take 1.5 or true for partition 1 and serve the wrong one.
    text = str(value).strip()
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not (text.isascii() and text.isdecimal()):
        raise ValueError(f"node config {key!r} = {value!r} is not a whole number >= 0: {usage}")
    return int(value)


def node_cache_keep(context: Context) -> int:
    """How many global models this node's http-store cache keeps (node config ``cache-keep``;
    absent or 0: all of them)."""
    if "cache-keep" not in context.node_config:
        return 0
    return _node_whole_number(context.node_config, "cache-keep",
                              "set it to the number of most recently used global models to keep "
                              "(2 or more advised; 0 keeps all)")


def node_work_dir(context: Context) -> Path:
    """This node's own directory (node config ``work-dir``, else ``fedagent-work`` in the cwd)."""
    value = context.node_config.get("work-dir")
    if value is None:
        return Path.cwd() / "fedagent-work"
    path = Path(str(value))
    if not path.is_absolute() or any(ord(ch) < 32 for ch in str(value)):
        raise ValueError(f"node config 'work-dir' = {value!r} must be an absolute path")
    return path


def client_store(fields: Mapping[str, Any], context: Context) -> ClientStore:
    """The checkpoint store an instruction's store ``fields`` describe, as seen from this node."""
    return open_client_store(fields, context.run_id, lambda: node_work_dir(context), node_cache_keep(context))


@app.query("partition")
def report_partition(msg: Message, context: Context) -> Message:
    """Tell the server which client partition this node trains (a bad node config is refused here,
    before round 0, naming its key)."""
    partition, count = node_partition(context)
    node_cache_keep(context)
    return Message(PartitionReply(partition, count).to_record(), reply_to=msg)


@app.query("shutdown")
def shutdown(msg: Message, context: Context) -> Message:
    """End of the run: stop the env services this node started for it."""
    partition, _ = node_partition(context)
    run_root = client_store(ShutdownInstruction.from_record(msg.content).store, context).run_root
    stopped = stop_client_services(run_root, partition)
    trainer_stopped = PersistentTrainer("", channel_dir(run_root, partition)).stop()
    return Message(ShutdownReply(len(stopped), int(trainer_stopped)).to_record(), reply_to=msg)


def _trainer_knobs(settings: TrainerSettings) -> dict[str, Any]:
    """The trainer group minus what the ClientApp itself consumes (backend, timeout, mode)."""
    return {k: v for k, v in asdict(settings).items() if k not in CLIENTAPP_TRAINER_KEYS}


def _run_job(mode: str, job: Any, out_dir: Path, label: str, trainer: ClientAppKeys | Mapping[str, Any],
             result_cls: type[T], context: Context, run_root: Path) -> T:
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
    if not isinstance(trainer, ClientAppKeys):  # the ClientApp's own keys of a trainer group, checked
        trainer = check(ClientAppKeys, trainer, "trainer", known_only=True)[0]
    backend, timeout_s, log_path = trainer.backend, trainer.timeout_s, out_dir / f"{mode}.log"
    stall_timeout_s = trainer.stall_timeout_s
    if trainer.mode == "persistent":
        handle = PersistentTrainer(backend, channel_dir(run_root, node_partition(context)[0]),
                                   trainer.persistent_idle_s)
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
    instruction = TrainInstruction.from_record(msg.content)
    client, server_round = instruction.client_id, instruction.server_round
    partition, _ = node_partition(context)
    if partition != client:
        raise ValueError(f"instruction for client {client} reached the node of partition {partition}")
    store = client_store(instruction.store, context)
    start_model = store.fetch(instruction.global_model)
    run_root = store.run_root
    out_dir = run_root / f"round_{server_round}" / f"client_{client}"
    # PPO: the aggregated critic of the previous round (absent in round 1: the job starts its
    # critic from the model).
    critic_path = str(store.fetch(instruction.global_critic)) if instruction.global_critic is not None else ""
    trainer, env_spec, partition_knobs = instruction.trainer, instruction.env_spec, instruction.partition
    if instruction.service["enabled"]:
        # This client's own partitioned services: the service applies the partition, the
        # trainer talks to it over HTTP.
        env_spec, managers = serve_env_spec(
            env_spec, split="train", run_root=run_root, client_id=client, settings=instruction.service,
            partition=partition_knobs, num_clients=instruction.num_clients, base_seed=instruction.base_seed,
        )
        write_json_atomic(out_dir / "service_health.json", [m.health() for m in managers])
        partition_knobs = {"strategy": "none"}
    job = jobs.TrainJob(
        model_path=str(start_model),
        output_dir=str(out_dir),
        env_spec=env_spec,
        round=server_round,
        client_id=client,
        num_clients=instruction.num_clients,
        data_seed=instruction.data_seed,
        base_seed=instruction.base_seed,
        algorithm=instruction.algorithm,
        local_steps=instruction.local_steps,
        epochs=instruction.epochs,
        proximal_mu=instruction.proximal_mu,  # only FedProx-style strategies send it
        critic_path=critic_path,
        partition=partition_knobs,
        trainer=_trainer_knobs(trainer),
    )
    started = time.monotonic()
    progress = out_dir / PROGRESS_FILE
    progress.unlink(missing_ok=True)  # an earlier attempt's steps (a resumed run) are not this job's
    with forward_progress(store, progress, server_round, client):  # http: the server relays it from its copy
        result = _run_job("train", job, out_dir, f"client {client} round {server_round}", trainer,
                          jobs.TrainResult, context, run_root)
    actor = store.put(result.actor_dir, "actor", server_round, client)
    if actor.format != result.actor_format:
        raise TrainerFailed(f"client {client}: the trainer reports a {result.actor_format} checkpoint, "
                            f"{result.actor_dir} holds {actor.format}")
    critic = store.put(result.critic_dir, "critic", server_round, client) if result.critic_dir else None
    metrics = train_metrics(result, round(time.monotonic() - started, 3))
    if instruction.client_eval_seeds:
        metrics.update(validate_trained(instruction, result, start_model, out_dir, context, run_root))
    reply = TrainReply(client_id=client, actor=actor, critic=critic, metrics=metrics)
    return Message(reply.to_record(), reply_to=msg)


def validate_trained(instruction: TrainInstruction, result: jobs.TrainResult, start_model: Path, out_dir: Path,
                     context: Context, run_root: Path) -> dict[str, float | int]:
    """Per-client validation: this client's trained model on the instruction's validation episodes,
    as the reply's ``client-val-*`` metrics. A failure only warns (as FedAgent's): the client's
    update is good either way, and its reply then carries no per-client validation."""
    client, server_round = instruction.client_id, instruction.server_round
    label = f"client {client} round {server_round} per-client validation"
    val_dir = out_dir / "client_val"
    model_dir = val_dir / "model"
    try:
        model = trained_model_dir(result, model_files_dir(start_model) or start_model, model_dir, start_model)
        job = validation_job(instruction.val_env_spec, instruction.service, instruction.trainer, run_root, client,
                             model, val_dir, server_round, instruction.client_eval_seeds)
        val = _run_job("evaluate", job, val_dir, label, instruction.trainer, jobs.EvalResult, context, run_root)
        return client_val_metrics(val)
    except (TrainerFailed, CheckpointError, OSError, ValueError, KeyError, TypeError) as exc:
        print(f"[{label}] warning: not recorded: {' '.join(str(exc).split())[:500]}", flush=True)
        return {}
    finally:
        # A full copy of the model (and a killed merge's staging folder); the checkpoint stays.
        for leftover in [model_dir, *val_dir.glob(".model.staging-*")]:
            shutil.rmtree(leftover, ignore_errors=True)


def train_metrics(result: jobs.TrainResult, seconds: float) -> dict[str, float | int]:
    """The reply's metrics: episodes played (the FedAvg weight), reward, success, time, and the
    backend's own timings and losses."""
    metrics: dict[str, float | int] = {
        NUM_EXAMPLES: int(result.num_episodes),
        REWARD_MEAN: float(result.metrics.get("reward_mean", 0.0)),
        SUCCESS_RATE: float(result.metrics.get("success_rate", 0.0)),
        TRAIN_SECONDS: seconds,
    }
    if "zero_variance_group_share" in result.metrics:  # share of GRPO groups that gave no gradient
        metrics[ZERO_VARIANCE_GROUP_SHARE] = float(result.metrics["zero_variance_group_share"])
    if "truncated_rate" in result.metrics:  # episodes that ran out of the context budget (the server warns)
        metrics[TRUNCATED_RATE] = float(result.metrics["truncated_rate"])
    if "optimizer_state_kept" in result.metrics:  # trainer.optimizer_state: was this round's state kept?
        metrics[OPTIMIZER_STATE_KEPT] = float(result.metrics["optimizer_state_kept"])
    # Backend timings and losses (verl: cold start, per-phase step times) travel as metrics too.
    metrics.update({_metric_key(k): float(v) for k, v in result.metrics.items()
                    if k.startswith(("verl/", "fedprox/"))})
    return metrics


def _metric_key(name: str) -> str:
    """A backend metric name as a MetricRecord key (``verl/timing_s/gen`` -> ``verl.timing_s.gen``)."""
    return name.replace("/", ".")


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Play this node's share of the validation episodes with the global model."""
    instruction = EvalInstruction.from_record(msg.content)
    client, server_round = instruction.client_id, instruction.server_round
    store = client_store(instruction.store, context)
    model = store.fetch(instruction.global_model)
    run_root = store.run_root
    out_dir = run_root / f"round_{server_round}" / "eval" / f"client_{client}"
    job = validation_job(instruction.env_spec, instruction.service, instruction.trainer, run_root, client, model,
                         out_dir, server_round, instruction.eval_seeds)
    result = _run_job("evaluate", job, out_dir, f"client {client} eval round {server_round}", instruction.trainer,
                      jobs.EvalResult, context, run_root)
    return Message(eval_reply(result).to_record(), reply_to=msg)


def validation_job(env_spec: dict[str, Any], service: dict[str, Any], trainer: TrainerSettings, run_root: Path,
                   client: int, model: Path, out_dir: Path, server_round: int, seeds: list[int]) -> jobs.EvalJob:
    """The EvalJob of validation episodes ``seeds`` of ``model`` (the global model, or with per-client
    validation a client's own), on this node's validation service when the env is served."""
    if service["enabled"]:
        # A separate, unperturbed validation service: never the client's training world.
        env_spec, _ = serve_env_spec(env_spec, split="val", run_root=run_root, client_id=client, settings=service)
    return jobs.EvalJob(
        model_path=str(model),
        output_dir=str(out_dir),
        env_spec=env_spec,
        round=server_round,
        seeds=list(seeds),
        trainer=_trainer_knobs(trainer),
    )
