"""The messages between the ServerApp and the ClientApps, as typed dataclasses.

Every message key (``client-id``, ``trainer-json``, ``data-seed``, ...) is spelled here and only
here: the strategies build instructions and read replies through these classes, the ClientApp
reads instructions and builds replies through them. Each class turns into the ``RecordDict`` that
Flower carries (:meth:`to_record`) and back (:meth:`from_record`); reading a peer's record checks
every field's type and names the first one that is missing or malformed (:class:`ProtocolError`,
or :class:`~fedagent_flwr.checkpoint.CheckpointError` for a checkpoint reference).

Checkpoints travel as :class:`~fedagent_flwr.checkpoint.CheckpointRef` s flattened under a prefix
(``global-*``, ``global-critic-*`` in instructions; ``actor-*``, ``critic-*`` in train replies).
The checkpoint store's own fields (``store-*``, ``run-root``) are the store's business
(:mod:`fedagent_flwr.checkpoint.store`): an instruction carries them as one opaque mapping.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef
from fedagent_flwr.checkpoint.store import (
    CA_FIELD,
    KIND_FIELD,
    READ_TOKEN_FIELD,
    RUN_FIELD,
    RUN_ROOT_FIELD,
    UPLOAD_TOKEN_FIELD,
    URL_FIELD,
)
from fedagent_flwr.schema.fields import SettingError
from fedagent_flwr.schema.run import Strategy, Train
from fedagent_flwr.schema.trainer import TrainerSettings, trainer_settings

__all__ = [
    "CLIENT_VAL_PREFIX",
    "CONFIG",
    "METRICS",
    "NUM_EXAMPLES",
    "PROXIMAL_MU",
    "QUERY_PARTITION",
    "QUERY_SHUTDOWN",
    "REWARD_MEAN",
    "SUCCESS_RATE",
    "TRAIN_SECONDS",
    "ZERO_VARIANCE_GROUP_SHARE",
    "EvalInstruction",
    "EvalReply",
    "PartitionQuery",
    "PartitionReply",
    "ProtocolError",
    "ShutdownInstruction",
    "ShutdownReply",
    "TrainInstruction",
    "TrainReply",
    "to_json",
]

# Record names inside a message's RecordDict.
CONFIG = "config"
METRICS = "metrics"
# Message types of the two queries (train and evaluate use Flower's MessageType).
QUERY_PARTITION = "query.partition"
QUERY_SHUTDOWN = "query.shutdown"
# Flower's own names: the episodes a reply stands for (FedAvg's default weighting key) and the
# FedProx coefficient (the key Flower's FedProx sends).
NUM_EXAMPLES = "num-examples"
PROXIMAL_MU = "proximal-mu"

SERVER_ROUND = "server-round"
CLIENT_ID = "client-id"
NUM_CLIENTS = "num-clients"
DATA_SEED = "data-seed"
BASE_SEED = "base-seed"
ALGORITHM = "algorithm"
LOCAL_STEPS = "local-steps"
EPOCHS = "epochs"
# per-client validation: seeds and spec of the validation episodes a client plays with its trained model
CLIENT_EVAL_SEEDS = "client-eval-seeds"
VAL_ENV_SPEC_JSON = "val-env-spec-json"
TRAINER_JSON = "trainer-json"
ENV_SPEC_JSON = "env-spec-json"
PARTITION_JSON = "partition-json"
SERVICE_JSON = "service-json"
EVAL_SEEDS = "eval-seeds"
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
SERVICES_STOPPED = "services-stopped"
TRAINERS_STOPPED = "trainers-stopped"
# Metric names of replies.
REWARD_MEAN = "reward-mean"
SUCCESS_RATE = "success-rate"
# the mean of the env's own episode score (WebShop's task_score in [0, 1]) where it reports one
SCORE_MEAN = "score-mean"
# A train reply's per-client validation metrics: an EvalReply's keys behind this prefix.
CLIENT_VAL_PREFIX = "client-val-"
TRAIN_SECONDS = "train-seconds"
ZERO_VARIANCE_GROUP_SHARE = "zero-variance-group-share"
# Checkpoint reference prefixes.
GLOBAL = "global"
GLOBAL_CRITIC = "global-critic"
ACTOR = "actor"
CRITIC = "critic"
STORE_FIELDS = (KIND_FIELD, RUN_ROOT_FIELD, URL_FIELD, RUN_FIELD, READ_TOKEN_FIELD, UPLOAD_TOKEN_FIELD, CA_FIELD)


class ProtocolError(ValueError):
    """A message field that is missing or of the wrong type; the message names the field."""


def to_json(value: Any) -> str:
    """Structured settings (env specs, trainer knobs) travel as canonical JSON strings."""
    return json.dumps(value, sort_keys=True)


def _field(record: Mapping[str, Any], key: str, kind: type, what: str = "instruction") -> Any:
    """``record[key]`` as ``kind`` (an int is accepted where a float belongs, never a bool)."""
    if key not in record:
        raise ProtocolError(f"{what} field '{key}' is missing")
    value = record[key]
    accepted: tuple[type, ...] = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) or not isinstance(value, accepted):
        raise ProtocolError(f"{what} field '{key}' must be {kind.__name__}, got {type(value).__name__} "
                            f"{str(value)[:80]!r}")
    return kind(value)


def _json_field(record: Mapping[str, Any], key: str) -> Any:
    """A JSON-string field, decoded."""
    text = _field(record, key, str)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"instruction field '{key}' is not JSON: {exc}") from None


def _seed_list(record: Mapping[str, Any], key: str) -> list[int]:
    """A list-of-int field (episode seeds)."""
    seeds = record.get(key)
    if not isinstance(seeds, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ProtocolError(f"instruction field '{key}' must be a list of int, got {str(seeds)[:80]!r}")
    return [int(s) for s in seeds]


def _trainer_field(record: Mapping[str, Any]) -> TrainerSettings:
    """The trainer group, checked by the schema's one validator (as the server checked it)."""
    try:
        return trainer_settings(_json_field(record, TRAINER_JSON))
    except SettingError as exc:
        raise ProtocolError(f"instruction field '{TRAINER_JSON}': {exc}") from None


def _config(content: RecordDict, what: str) -> ConfigRecord:
    if CONFIG not in content.config_records:
        raise ProtocolError(f"{what} has no '{CONFIG}' record")
    return content.config_records[CONFIG]


def _global_models(record: Mapping[str, Any]) -> tuple[CheckpointRef, CheckpointRef | None]:
    model = CheckpointRef.from_config(record, GLOBAL)
    critic = CheckpointRef.from_config(record, GLOBAL_CRITIC) if f"{GLOBAL_CRITIC}-path" in record else None
    return model, critic


def _with_models(values: dict[str, Any], model: CheckpointRef, critic: CheckpointRef | None) -> dict[str, Any]:
    values.update(model.to_config(GLOBAL))
    if critic is not None:
        values.update(critic.to_config(GLOBAL_CRITIC))
    return values


@dataclass(frozen=True)
class TrainInstruction:
    """What the server asks one client to train in one round.

    ``global_model`` (and, for PPO after round 1, ``global_critic``) are references as the
    checkpoint store shares them; ``store`` holds the store's own fields (how to reach it, the
    client's upload grant). ``extra`` carries values of Flower's train config that the protocol does
    not know, unchanged. ``epochs`` is E, the passes over the round's instances (absent from an
    older server's instruction: 1). A non-empty ``client_eval_seeds`` asks the client to validate
    its trained model on those seeds of ``val_env_spec`` (per-client validation).
    """

    server_round: int
    client_id: int
    num_clients: int
    data_seed: int
    base_seed: int
    algorithm: str
    local_steps: int
    trainer: TrainerSettings  # a mapping given here is checked by the schema's validator
    env_spec: dict[str, Any]
    partition: dict[str, Any]
    service: dict[str, Any]
    global_model: CheckpointRef
    global_critic: CheckpointRef | None = None
    proximal_mu: float = Strategy.proximal_mu
    store: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    epochs: int = Train.epochs
    client_eval_seeds: list[int] = field(default_factory=list)
    val_env_spec: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "trainer", trainer_settings(self.trainer))

    def to_record(self) -> RecordDict:
        values: dict[str, Any] = {
            **self.extra,
            **self.store,
            SERVER_ROUND: self.server_round,
            CLIENT_ID: self.client_id,
            NUM_CLIENTS: self.num_clients,
            DATA_SEED: self.data_seed,
            BASE_SEED: self.base_seed,
            ALGORITHM: self.algorithm,
            LOCAL_STEPS: self.local_steps,
            EPOCHS: self.epochs,
            TRAINER_JSON: to_json(asdict(self.trainer)),
            ENV_SPEC_JSON: to_json(self.env_spec),
            PARTITION_JSON: to_json(self.partition),
            SERVICE_JSON: to_json(self.service),
        }
        if self.client_eval_seeds:  # only when per-client validation is on
            values[CLIENT_EVAL_SEEDS] = [int(seed) for seed in self.client_eval_seeds]
            values[VAL_ENV_SPEC_JSON] = to_json(self.val_env_spec)
        if self.proximal_mu:  # only FedProx-style strategies send it, as Flower's FedProx does
            values[PROXIMAL_MU] = self.proximal_mu
        return RecordDict({CONFIG: ConfigRecord(_with_models(values, self.global_model, self.global_critic))})

    @classmethod
    def from_record(cls, content: RecordDict) -> TrainInstruction:
        record = _config(content, "train instruction")
        model, critic = _global_models(record)
        return cls(
            server_round=_field(record, SERVER_ROUND, int),
            client_id=_field(record, CLIENT_ID, int),
            num_clients=_field(record, NUM_CLIENTS, int),
            data_seed=_field(record, DATA_SEED, int),
            base_seed=_field(record, BASE_SEED, int),
            algorithm=_field(record, ALGORITHM, str),
            local_steps=_field(record, LOCAL_STEPS, int),
            trainer=_trainer_field(record),
            env_spec=_json_field(record, ENV_SPEC_JSON),
            partition=_json_field(record, PARTITION_JSON),
            service=_json_field(record, SERVICE_JSON),
            global_model=model,
            global_critic=critic,
            proximal_mu=_field(record, PROXIMAL_MU, float) if PROXIMAL_MU in record else Strategy.proximal_mu,
            store=_store_fields(record),
            extra=_unknown(record, _TRAIN_KEYS),
            epochs=_field(record, EPOCHS, int) if EPOCHS in record else Train.epochs,
            client_eval_seeds=_seed_list(record, CLIENT_EVAL_SEEDS) if CLIENT_EVAL_SEEDS in record else [],
            val_env_spec=_json_field(record, VAL_ENV_SPEC_JSON) if CLIENT_EVAL_SEEDS in record else {},
        )


@dataclass(frozen=True)
class EvalInstruction:
    """What the server asks one client to evaluate: the global model on ``eval_seeds``."""

    server_round: int
    client_id: int
    trainer: TrainerSettings  # a mapping given here is checked by the schema's validator
    env_spec: dict[str, Any]
    service: dict[str, Any]
    eval_seeds: list[int]
    global_model: CheckpointRef
    global_critic: CheckpointRef | None = None
    store: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "trainer", trainer_settings(self.trainer))

    def to_record(self) -> RecordDict:
        values: dict[str, Any] = {
            **self.extra,
            **self.store,
            SERVER_ROUND: self.server_round,
            CLIENT_ID: self.client_id,
            TRAINER_JSON: to_json(asdict(self.trainer)),
            ENV_SPEC_JSON: to_json(self.env_spec),
            SERVICE_JSON: to_json(self.service),
            EVAL_SEEDS: [int(seed) for seed in self.eval_seeds],
        }
        return RecordDict({CONFIG: ConfigRecord(_with_models(values, self.global_model, self.global_critic))})

    @classmethod
    def from_record(cls, content: RecordDict) -> EvalInstruction:
        record = _config(content, "evaluate instruction")
        model, critic = _global_models(record)
        seeds = _seed_list(record, EVAL_SEEDS)
        return cls(
            server_round=_field(record, SERVER_ROUND, int),
            client_id=_field(record, CLIENT_ID, int),
            trainer=_trainer_field(record),
            env_spec=_json_field(record, ENV_SPEC_JSON),
            service=_json_field(record, SERVICE_JSON),
            eval_seeds=seeds,
            global_model=model,
            global_critic=critic,
            store=_store_fields(record),
            extra=_unknown(record, _EVAL_KEYS),
        )


@dataclass(frozen=True)
class TrainReply:
    """A client's answer to a :class:`TrainInstruction`: references to the checkpoints it wrote
    (the actor; the critic too under PPO) and its metrics (``num-examples``: the episodes played,
    the FedAvg weight; ``reward-mean``, ``success-rate``, ``train-seconds``, backend timings)."""

    client_id: int
    actor: CheckpointRef
    metrics: dict[str, float | int]
    critic: CheckpointRef | None = None

    def to_record(self) -> RecordDict:
        values: dict[str, Any] = {CLIENT_ID: self.client_id, **self.actor.to_config(ACTOR)}
        if self.critic is not None:
            values.update(self.critic.to_config(CRITIC))
        return RecordDict({CONFIG: ConfigRecord(values), METRICS: MetricRecord(dict(self.metrics))})

    @classmethod
    def from_record(cls, content: RecordDict) -> TrainReply:
        """Read a client's reply. A missing or mistyped ``client-id`` or metric record raises
        :class:`ProtocolError`; a malformed checkpoint reference raises ``CheckpointError`` naming
        its field."""
        record = _config(content, "reply")
        client = _field(record, CLIENT_ID, int, "reply")
        metrics = single_metrics(content)
        actor = CheckpointRef.from_config(record, ACTOR)
        critic = CheckpointRef.from_config(record, CRITIC) if f"{CRITIC}-path" in record else None
        for ref, kind in ((actor, ACTOR), (critic, CRITIC)):
            if ref is not None and ref.kind != kind:
                raise CheckpointError(f"reference says kind '{ref.kind}', expected '{kind}'")
        return cls(client_id=client, actor=actor, metrics=dict(metrics), critic=critic)  # type: ignore[arg-type]


@dataclass(frozen=True)
class EvalReply:
    """A client's answer to an :class:`EvalInstruction`: the episodes played and their outcome."""

    num_examples: int
    success_rate: float
    reward_mean: float
    score_mean: float | None = None  # only for envs that score episodes (WebShop's task_score)

    def to_record(self) -> RecordDict:
        return RecordDict({METRICS: MetricRecord(self.metrics())})  # type: ignore[arg-type]

    @classmethod
    def from_record(cls, content: RecordDict) -> EvalReply:
        return cls.from_metrics(single_metrics(content))

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any], prefix: str = "") -> EvalReply:
        """Read the metrics :meth:`metrics` wrote (behind ``prefix``: a train reply's
        per-client validation, :data:`CLIENT_VAL_PREFIX`)."""
        unprefixed = {key[len(prefix):]: value for key, value in metrics.items() if key.startswith(prefix)}
        return cls(num_examples=_field(unprefixed, NUM_EXAMPLES, int, "reply"),
                   success_rate=_field(unprefixed, SUCCESS_RATE, float, "reply"),
                   reward_mean=_field(unprefixed, REWARD_MEAN, float, "reply"),
                   score_mean=_field(unprefixed, SCORE_MEAN, float, "reply") if SCORE_MEAN in unprefixed else None)

    def metrics(self, prefix: str = "") -> dict[str, int | float]:
        """The reply's metric values, each key behind ``prefix``."""
        values: dict[str, int | float] = {
            NUM_EXAMPLES: self.num_examples, SUCCESS_RATE: self.success_rate, REWARD_MEAN: self.reward_mean
        }
        if self.score_mean is not None:
            values[SCORE_MEAN] = self.score_mean
        return {prefix + key: value for key, value in values.items()}


@dataclass(frozen=True)
class PartitionQuery:
    """The server asking a node which client partition it serves."""

    message_type = QUERY_PARTITION

    def to_record(self) -> RecordDict:
        return RecordDict({CONFIG: ConfigRecord({})})


@dataclass(frozen=True)
class PartitionReply:
    """The partition a node serves, from its node config."""

    partition_id: int
    num_partitions: int

    def to_record(self) -> RecordDict:
        return RecordDict({CONFIG: ConfigRecord({PARTITION_ID: self.partition_id,
                                                 NUM_PARTITIONS: self.num_partitions})})

    @classmethod
    def from_record(cls, content: RecordDict) -> PartitionReply:
        record = _config(content, "partition reply")
        return cls(partition_id=_field(record, PARTITION_ID, int, "reply"),
                   num_partitions=_field(record, NUM_PARTITIONS, int, "reply"))


@dataclass(frozen=True)
class ShutdownInstruction:
    """The run is over: stop what the node started for it. ``store`` tells the node where the
    run's files are (its env services and trainer channels live there)."""

    message_type = QUERY_SHUTDOWN
    store: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> RecordDict:
        return RecordDict({CONFIG: ConfigRecord(dict(self.store))})

    @classmethod
    def from_record(cls, content: RecordDict) -> ShutdownInstruction:
        return cls(store=_store_fields(_config(content, "shutdown instruction")))


@dataclass(frozen=True)
class ShutdownReply:
    """What a node stopped at the end of the run."""

    services_stopped: int
    trainers_stopped: int

    def to_record(self) -> RecordDict:
        return RecordDict({METRICS: MetricRecord({SERVICES_STOPPED: self.services_stopped,
                                                  TRAINERS_STOPPED: self.trainers_stopped})})

    @classmethod
    def from_record(cls, content: RecordDict) -> ShutdownReply:
        metrics = single_metrics(content)
        return cls(services_stopped=_field(metrics, SERVICES_STOPPED, int, "reply"),
                   trainers_stopped=int(metrics.get(TRAINERS_STOPPED, 0)))  # type: ignore[arg-type]  # a count


def single_metrics(content: RecordDict) -> MetricRecord:
    """The one MetricRecord of a reply (Flower's strategies expect exactly one)."""
    records = list(content.metric_records.values())
    if len(records) != 1:
        raise ProtocolError(f"expected exactly one MetricRecord, got {len(records)}")
    return records[0]


def _store_fields(record: Mapping[str, Any]) -> dict[str, Any]:
    return {key: record[key] for key in STORE_FIELDS if key in record}


def _ref_keys(prefix: str) -> set[str]:
    return set(CheckpointRef(path="x").to_config(prefix))


_TRAIN_KEYS = frozenset({
    SERVER_ROUND, CLIENT_ID, NUM_CLIENTS, DATA_SEED, BASE_SEED, ALGORITHM, LOCAL_STEPS, EPOCHS, TRAINER_JSON,
    ENV_SPEC_JSON, PARTITION_JSON, SERVICE_JSON, PROXIMAL_MU, CLIENT_EVAL_SEEDS, VAL_ENV_SPEC_JSON,
    *STORE_FIELDS, *_ref_keys(GLOBAL),
    *_ref_keys(GLOBAL_CRITIC),
})
_EVAL_KEYS = frozenset({
    SERVER_ROUND, CLIENT_ID, TRAINER_JSON, ENV_SPEC_JSON, SERVICE_JSON, EVAL_SEEDS, *STORE_FIELDS,
    *_ref_keys(GLOBAL), *_ref_keys(GLOBAL_CRITIC),
})


def _unknown(record: Mapping[str, Any], known: frozenset[str]) -> dict[str, Any]:
    return {key: value for key, value in record.items() if key not in known}


def protocol_keys() -> frozenset[str]:
    """Every key an instruction of this protocol may carry (a strategy's extra values must avoid them)."""
    return _TRAIN_KEYS | _EVAL_KEYS
