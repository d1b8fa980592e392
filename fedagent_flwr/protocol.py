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
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Annotated, Any, ClassVar, NamedTuple, TypeVar, get_args, get_type_hints

from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef
from fedagent_flwr.checkpoint.store import (
    CA_FIELD,
    ENDPOINT_FIELD,
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
    "OPTIMIZER_STATE_KEPT",
    "PROXIMAL_MU",
    "QUERY_PARTITION",
    "QUERY_SHUTDOWN",
    "REWARD_MEAN",
    "SUCCESS_RATE",
    "TRAIN_SECONDS",
    "TRUNCATED_RATE",
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
# Instruction keys other modules name (the rest are spelled once, in the message classes' Wire).
CLIENT_ID = "client-id"
TRAINER_JSON = "trainer-json"
# Metric names of replies.
REWARD_MEAN = "reward-mean"
SUCCESS_RATE = "success-rate"
# the mean of the env's own episode score (WebShop's task_score in [0, 1]) where it reports one
SCORE_MEAN = "score-mean"
# A train reply's per-client validation metrics: an EvalReply's keys behind this prefix.
CLIENT_VAL_PREFIX = "client-val-"
TRAIN_SECONDS = "train-seconds"
# the share of a reply's episodes that ran out of the context budget before they ended (a turn
# that would not fit was not started): they count as played, with the reward they had by then
TRUNCATED_RATE = "truncated-rate"
ZERO_VARIANCE_GROUP_SHARE = "zero-variance-group-share"
# 1.0 when a client-round continued from the client's previous round's optimiser state
# (trainer.optimizer_state: keep), 0.0 when it started fresh; sent by persistent trainers, and by a
# fresh trainer process rerunning a keep job (a subprocess trainer's reset rounds do not send it)
OPTIMIZER_STATE_KEPT = "optimizer-state-kept"
STORE_FIELDS = (KIND_FIELD, RUN_ROOT_FIELD, URL_FIELD, RUN_FIELD, READ_TOKEN_FIELD, UPLOAD_TOKEN_FIELD, CA_FIELD,
                ENDPOINT_FIELD)


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


def _trainer_field(record: Mapping[str, Any], key: str) -> TrainerSettings:
    """The trainer group, checked by the schema's one validator (as the server checked it)."""
    try:
        return trainer_settings(_json_field(record, key))
    except SettingError as exc:
        raise ProtocolError(f"instruction field '{key}': {exc}") from None


def _config(content: RecordDict, what: str) -> ConfigRecord:
    if CONFIG not in content.config_records:
        raise ProtocolError(f"{what} has no '{CONFIG}' record")
    return content.config_records[CONFIG]


def single_metrics(content: RecordDict) -> MetricRecord:
    """The one MetricRecord of a reply (Flower's strategies expect exactly one)."""
    records = list(content.metric_records.values())
    if len(records) != 1:
        raise ProtocolError(f"expected exactly one MetricRecord, got {len(records)}")
    return records[0]


@dataclass(frozen=True)
class Wire:
    """How one message field travels, declared beside its type (``Annotated[int, Wire(CLIENT_ID)]``).

    ``key`` is its record key (a checkpoint reference's prefix); ``codec`` how it is written:
    ``scalar`` as is (read back checked against the field's type), ``json`` / ``trainer`` as a JSON
    string, ``seeds`` a list of int, ``ref`` a :class:`CheckpointRef` flattened under ``key``,
    ``store`` / ``extra`` / ``metrics`` a mapping spread into the record (the store's fields, the
    values the protocol does not know, a reply's whole metric record). ``record`` is the record it
    goes in (config or metrics). A field with a default is read only when its key (``when``'s key)
    is present; ``when`` names the field whose truthiness decides whether this one is sent; a ``None``
    is never sent. ``check_kind``: a reference's kind must be its prefix (a reply's actor/critic).
    """

    key: str = ""
    codec: str = "scalar"
    record: str = CONFIG
    when: str | None = None
    check_kind: bool = False


class _Wired(NamedTuple):
    name: str
    wire: Wire
    kind: type  # a scalar's type (``float`` for ``float | None``)
    optional: bool  # has a default: read only when ``presence`` is in the record
    presence: str


_WIRES: dict[type, tuple[_Wired, ...]] = {}


def _wires(cls: type) -> tuple[_Wired, ...]:
    """A message class's fields with their :class:`Wire`, the spread mappings first (so a protocol
    field always wins over an extra value of the same key); worked out once per class."""
    if cls in _WIRES:
        return _WIRES[cls]
    hints = get_type_hints(cls, include_extras=True)
    keys = {f.name: get_args(hints[f.name])[1].key for f in fields(cls)}
    wired = []
    for f in fields(cls):
        base, wire = get_args(hints[f.name])
        presence = keys[wire.when] if wire.when else f"{wire.key}-path" if wire.codec == "ref" else wire.key
        optional = f.default is not MISSING or f.default_factory is not MISSING
        wired.append(_Wired(f.name, wire, base if isinstance(base, type) else get_args(base)[0], optional, presence))
    _WIRES[cls] = tuple(sorted(wired, key=lambda w: {"extra": 0, "store": 1}.get(w.wire.codec, 2)))
    return _WIRES[cls]


def _keys(cls: type) -> frozenset[str]:
    """The config keys a message class reads itself (the rest of an instruction is its ``extra``)."""
    keys: set[str] = set()
    for w in _wires(cls):
        if w.wire.codec == "ref":
            keys |= set(CheckpointRef(path="x").to_config(w.wire.key))
        elif w.wire.codec not in ("extra", "metrics"):
            keys |= set(STORE_FIELDS) if w.wire.codec == "store" else {w.wire.key}
    return frozenset(keys)


def _encode(codec: str, key: str, value: Any) -> dict[str, Any]:
    """The record entries one field's value writes (a reference or a spread mapping writes several)."""
    if codec in ("store", "extra", "metrics"):
        return dict(value)
    if codec == "ref":
        return value.to_config(key)  # type: ignore[no-any-return]
    encoded = {"json": to_json, "trainer": lambda v: to_json(asdict(v)), "seeds": lambda v: [int(s) for s in v]}
    return {key: encoded.get(codec, lambda v: v)(value)}


def _decode(cls: type, w: _Wired, record: Mapping[str, Any], what: str) -> Any:
    """One field read back from a peer's record, checked (``what``: how the error names the message)."""
    key, codec = w.wire.key, w.wire.codec
    if codec == "ref":
        ref = CheckpointRef.from_config(record, key)
        if w.wire.check_kind and ref.kind != key:
            raise CheckpointError(f"reference says kind '{ref.kind}', expected '{key}'")
        return ref
    if codec == "extra":
        known = _keys(cls)
        return {k: v for k, v in record.items() if k not in known}
    readers: dict[str, Any] = {
        "scalar": lambda: _field(record, key, w.kind, what), "json": lambda: _json_field(record, key),
        "trainer": lambda: _trainer_field(record, key), "seeds": lambda: _seed_list(record, key),
        "store": lambda: {k: record[k] for k in STORE_FIELDS if k in record},
        "metrics": lambda: dict(record),
    }
    return readers[codec]()


_M = TypeVar("_M", bound="_Message")


class _Message:
    """One generic ``to_record`` / ``from_record`` for every message, driven by its fields' :class:`Wire`."""

    what: ClassVar[str] = "reply"  # how errors name the message ("train instruction", "reply", ...)

    def __post_init__(self) -> None:
        for w in _wires(type(self)):
            if w.wire.codec == "trainer":  # a mapping given here is checked by the schema's validator
                object.__setattr__(self, w.name, trainer_settings(getattr(self, w.name)))

    def _records(self) -> dict[str, dict[str, Any]]:
        records: dict[str, dict[str, Any]] = {}
        for w in _wires(type(self)):
            value, values = getattr(self, w.name), records.setdefault(w.wire.record, {})
            if value is not None and (w.wire.when is None or getattr(self, w.wire.when)):
                values.update(_encode(w.wire.codec, w.wire.key, value))
        return records or {CONFIG: {}}

    def to_record(self) -> RecordDict:
        """The ``RecordDict`` Flower carries: a ``config`` ConfigRecord and/or a ``metrics`` MetricRecord."""
        return RecordDict({name: ConfigRecord(values) if name == CONFIG else MetricRecord(values)
                           for name, values in self._records().items()})

    @classmethod
    def from_record(cls: type[_M], content: RecordDict) -> _M:
        """Read a peer's record, checking every field; the first missing or malformed one raises
        :class:`ProtocolError` (``CheckpointError`` for a checkpoint reference) naming it."""
        records: dict[str, Mapping[str, Any]] = {}

        def record(name: str) -> Mapping[str, Any]:  # looked up when a field first needs it
            if name not in records:
                records[name] = _config(content, cls.what) if name == CONFIG else single_metrics(content)
            return records[name]

        return cls._from_records(record)

    @classmethod
    def _from_records(cls: type[_M], record: Callable[[str], Mapping[str, Any]]) -> _M:
        values = {w.name: _decode(cls, w, record(w.wire.record), cls.what.split()[-1]) for w in _wires(cls)
                  if not (w.optional and w.wire.key and w.presence not in record(w.wire.record))}
        return cls(**values)


@dataclass(frozen=True)
class TrainInstruction(_Message):
    """What the server asks one client to train in one round.

    ``global_model`` (and, for PPO after round 1, ``global_critic``) are references as the
    checkpoint store shares them; ``store`` holds the store's own fields (how to reach it, the
    client's upload grant). ``extra`` carries values of Flower's train config that the protocol does
    not know, unchanged. ``epochs`` is E, the passes over the round's instances (absent from an
    older server's instruction: 1). A non-empty ``client_eval_seeds`` asks the client to validate
    its trained model on those seeds of ``val_env_spec`` (per-client validation). ``proximal_mu`` is
    sent only when non-zero (by FedProx-style strategies, as Flower's FedProx does).
    """

    what: ClassVar[str] = "train instruction"
    server_round: Annotated[int, Wire("server-round")]
    client_id: Annotated[int, Wire(CLIENT_ID)]
    num_clients: Annotated[int, Wire("num-clients")]
    data_seed: Annotated[int, Wire("data-seed")]
    base_seed: Annotated[int, Wire("base-seed")]
    algorithm: Annotated[str, Wire("algorithm")]
    local_steps: Annotated[int, Wire("local-steps")]
    trainer: Annotated[TrainerSettings, Wire(TRAINER_JSON, "trainer")]
    env_spec: Annotated[dict[str, Any], Wire("env-spec-json", "json")]
    partition: Annotated[dict[str, Any], Wire("partition-json", "json")]
    service: Annotated[dict[str, Any], Wire("service-json", "json")]
    global_model: Annotated[CheckpointRef, Wire("global", "ref")]
    global_critic: Annotated[CheckpointRef | None, Wire("global-critic", "ref")] = None
    proximal_mu: Annotated[float, Wire(PROXIMAL_MU, when="proximal_mu")] = Strategy.proximal_mu
    store: Annotated[dict[str, Any], Wire(codec="store")] = field(default_factory=dict)
    extra: Annotated[dict[str, Any], Wire(codec="extra")] = field(default_factory=dict)
    epochs: Annotated[int, Wire("epochs")] = Train.epochs
    client_eval_seeds: Annotated[list[int], Wire("client-eval-seeds", "seeds", when="client_eval_seeds")] = field(
        default_factory=list)
    val_env_spec: Annotated[dict[str, Any], Wire("val-env-spec-json", "json", when="client_eval_seeds")] = field(
        default_factory=dict)


@dataclass(frozen=True)
class EvalInstruction(_Message):
    """What the server asks one client to evaluate: the global model on ``eval_seeds``."""

    what: ClassVar[str] = "evaluate instruction"
    server_round: Annotated[int, Wire("server-round")]
    client_id: Annotated[int, Wire(CLIENT_ID)]
    trainer: Annotated[TrainerSettings, Wire(TRAINER_JSON, "trainer")]
    env_spec: Annotated[dict[str, Any], Wire("env-spec-json", "json")]
    service: Annotated[dict[str, Any], Wire("service-json", "json")]
    eval_seeds: Annotated[list[int], Wire("eval-seeds", "seeds")]
    global_model: Annotated[CheckpointRef, Wire("global", "ref")]
    global_critic: Annotated[CheckpointRef | None, Wire("global-critic", "ref")] = None
    store: Annotated[dict[str, Any], Wire(codec="store")] = field(default_factory=dict)
    extra: Annotated[dict[str, Any], Wire(codec="extra")] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainReply(_Message):
    """A client's answer to a :class:`TrainInstruction`: references to the checkpoints it wrote
    (the actor; the critic too under PPO) and its metrics (``num-examples``: the episodes played,
    the FedAvg weight; ``reward-mean``, ``success-rate``, ``truncated-rate``, ``train-seconds``,
    backend timings)."""

    client_id: Annotated[int, Wire(CLIENT_ID)]
    actor: Annotated[CheckpointRef, Wire("actor", "ref", check_kind=True)]
    metrics: Annotated[dict[str, float | int], Wire(codec="metrics", record=METRICS)]
    critic: Annotated[CheckpointRef | None, Wire("critic", "ref", check_kind=True)] = None


@dataclass(frozen=True)
class EvalReply(_Message):
    """A client's answer to an :class:`EvalInstruction`: the episodes played and their outcome."""

    num_examples: Annotated[int, Wire(NUM_EXAMPLES, record=METRICS)]
    success_rate: Annotated[float, Wire(SUCCESS_RATE, record=METRICS)]
    reward_mean: Annotated[float, Wire(REWARD_MEAN, record=METRICS)]
    # only for envs that score episodes (WebShop's task_score)
    score_mean: Annotated[float | None, Wire(SCORE_MEAN, record=METRICS)] = None
    # absent from an older client's reply
    truncated_rate: Annotated[float | None, Wire(TRUNCATED_RATE, record=METRICS)] = None

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any], prefix: str = "") -> EvalReply:
        """Read the metrics :meth:`metrics` wrote (behind ``prefix``: a train reply's
        per-client validation, :data:`CLIENT_VAL_PREFIX`)."""
        unprefixed = {key[len(prefix):]: value for key, value in metrics.items() if key.startswith(prefix)}
        return cls._from_records(lambda _: unprefixed)

    def metrics(self, prefix: str = "") -> dict[str, int | float]:
        """The reply's metric values, each key behind ``prefix``."""
        return {prefix + key: value for key, value in self._records()[METRICS].items()}


@dataclass(frozen=True)
class PartitionQuery(_Message):
    """The server asking a node which client partition it serves."""

    message_type = QUERY_PARTITION


@dataclass(frozen=True)
class PartitionReply(_Message):
    """The partition a node serves, from its node config."""

    what: ClassVar[str] = "partition reply"
    partition_id: Annotated[int, Wire("partition-id")]
    num_partitions: Annotated[int, Wire("num-partitions")]


@dataclass(frozen=True)
class ShutdownInstruction(_Message):
    """The run is over: stop what the node started for it. ``store`` tells the node where the
    run's files are (its env services and trainer channels live there)."""

    what: ClassVar[str] = "shutdown instruction"
    message_type = QUERY_SHUTDOWN
    store: Annotated[dict[str, Any], Wire(codec="store")] = field(default_factory=dict)


@dataclass(frozen=True)
class ShutdownReply(_Message):
    """What a node stopped at the end of the run (``trainers-stopped`` absent from an older node: 0)."""

    services_stopped: Annotated[int, Wire("services-stopped", record=METRICS)]
    trainers_stopped: Annotated[int, Wire("trainers-stopped", record=METRICS)] = 0


def protocol_keys() -> frozenset[str]:
    """Every key an instruction of this protocol may carry (a strategy's extra values must avoid them)."""
    return _keys(TrainInstruction) | _keys(EvalInstruction)
