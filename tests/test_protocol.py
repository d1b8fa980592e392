"""The typed protocol between the ServerApp and the ClientApps, and FedAvgFSDP's handling of
Flower's own strategy settings.

Every message survives ``to_record`` -> ``from_record`` unchanged; a peer's record with a missing or
mistyped field is refused naming the field; the instructions a strategy sends through a federation
(partitions reported by the real ClientApp query handler) read back as the instructions it built.
Flower's ``fraction_train`` and record renames are refused with one clear error; ``min_train_nodes``,
``min_evaluate_nodes``, ``min_available_nodes`` and ``fraction_evaluate`` are honoured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedagent_flwr.checkpoint import CheckpointError, CheckpointRef
from fedagent_flwr.clientapp.app import report_partition
from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.protocol import (
    EvalInstruction,
    EvalReply,
    PartitionReply,
    ProtocolError,
    ShutdownInstruction,
    ShutdownReply,
    TrainInstruction,
    TrainReply,
)
from fedagent_flwr.serverapp.app import build_strategy
from fedagent_flwr.serverapp.strategy import FedAvgFSDP, RunPlan

SHA = "ab" * 32


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # set by Flower in real runs


def _ref(path: str, kind: str = "actor") -> CheckpointRef:
    return CheckpointRef(path=path, kind=kind, format="fsdp-shards", world_size=2, sha256=SHA)  # type: ignore[arg-type]


def _train_instruction(**changes: object) -> TrainInstruction:
    instruction = TrainInstruction(
        server_round=3, client_id=1, num_clients=4, data_seed=342, base_seed=42, algorithm="ppo", local_steps=2,
        trainer={"backend": "reference", "rollout_n": 2}, env_spec={"envs": [{"name": "TinyGuess", "n_envs": 2}]},
        partition={"strategy": "uniform"}, service={"enabled": False}, global_model=_ref("/run/round_2/global"),
        global_critic=_ref("/run/round_2/global_critic", "critic"), proximal_mu=0.01,
        store={"store-kind": "shared-fs", "run-root": "/run"}, extra={"user-knob": 7},
    )
    return dataclasses.replace(instruction, **changes)  # type: ignore[arg-type]


def test_every_message_survives_its_record() -> None:
    messages = [
        _train_instruction(),
        _train_instruction(global_critic=None, proximal_mu=0.0, extra={}),
        EvalInstruction(server_round=0, client_id=2, trainer={"backend": "reference"}, env_spec={"envs": []},
                        service={"enabled": True, "pool_size": 4}, eval_seeds=[5, 9, 13],
                        global_model=_ref("/base"), store={"store-kind": "shared-fs", "run-root": "/run"}),
        TrainReply(client_id=1, actor=_ref("/run/round_3/client_1/actor"),
                   critic=_ref("/run/round_3/client_1/critic", "critic"),
                   metrics={"num-examples": 8, "reward-mean": 0.5, "verl.timing_s.gen": 1.25}),
        TrainReply(client_id=0, actor=_ref("/run/round_3/client_0/actor"), metrics={"num-examples": 8}),
        EvalReply(num_examples=6, success_rate=0.5, reward_mean=0.25),
        EvalReply(num_examples=6, success_rate=0.5, reward_mean=0.25, score_mean=0.625),
        PartitionReply(partition_id=3, num_partitions=4),
        ShutdownInstruction(store={"store-kind": "http", "store-url": "http://127.0.0.1:1", "store-run": "7"}),
        ShutdownReply(services_stopped=2, trainers_stopped=1),
    ]
    for message in messages:
        assert type(message).from_record(message.to_record()) == message, type(message).__name__


def test_a_malformed_record_is_refused_naming_the_field() -> None:
    good = _train_instruction().to_record()

    def edited(**values: object) -> RecordDict:
        config = dict(good["config"])
        config.update(values)
        for key in [k for k, v in values.items() if v is None]:
            del config[key]
        return RecordDict({"config": ConfigRecord(config)})

    cases = [
        (edited(**{"client-id": None}), "instruction field 'client-id' is missing"),
        (edited(**{"data-seed": "342"}), "instruction field 'data-seed' must be int, got str"),
        (edited(**{"local-steps": True}), "instruction field 'local-steps' must be int, got bool"),
        (edited(**{"trainer-json": "{not json"}), "instruction field 'trainer-json' is not JSON"),
        (RecordDict({"metrics": MetricRecord({"x": 1.0})}), "train instruction has no 'config' record"),
    ]
    for record, message in cases:
        with pytest.raises(ProtocolError, match=message):
            TrainInstruction.from_record(record)
    with pytest.raises(CheckpointError, match="checkpoint reference is missing 'global-sha256'"):
        TrainInstruction.from_record(edited(**{"global-sha256": None}))
    reply = TrainReply(client_id=1, actor=_ref("/a"), metrics={"num-examples": 4}).to_record()
    reply["metrics2"] = MetricRecord({"num-examples": 4})
    with pytest.raises(ProtocolError, match="expected exactly one MetricRecord, got 2"):
        TrainReply.from_record(reply)
    swapped = TrainReply(client_id=1, actor=_ref("/a", "critic"), metrics={"num-examples": 4}).to_record()
    with pytest.raises(CheckpointError, match="reference says kind 'critic', expected 'actor'"):
        TrainReply.from_record(swapped)


class _Federation:
    """Nodes 100 + p serving partitions p (of ``num_partitions``), answering the partition query with
    the ClientApp's own handler; every other message is collected, not answered."""

    def __init__(self, partitions: Iterable[int], num_partitions: int) -> None:
        self.partitions, self.num_partitions = list(partitions), num_partitions

    def get_node_ids(self) -> list[int]:
        return [100 + p for p in self.partitions]

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None) -> list[Message]:
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            context = Context(run_id=1, node_id=node, run_config={}, state=RecordDict(),
                              node_config={"partition-id": node - 100, "num-partitions": self.num_partitions})
            replies.append(report_partition(message, context))
        return replies


def _strategy(tmp_path: Path, tiny_model_dir: Path, clients: int = 4, **kwargs: object) -> FedAvgFSDP:
    plan = RunPlan(algorithm="grpo", local_steps=2, trainer={"backend": "reference", "rollout_n": 2},
                   train_env_spec={"envs": [{"name": "TinyGuess", "n_envs": 2, "max_turns": 3, "config": {}}]},
                   val_env_spec={"envs": [{"name": "TinyGuess", "n_envs": 4, "max_turns": 3, "config": {}}]})
    return FedAvgFSDP(run_root=str(tmp_path / "run"), initial_model=CheckpointRef.for_directory(tiny_model_dir),
                      num_clients=clients, clients_per_round=clients, plan=plan, eval_seeds=list(range(8)),
                      **kwargs)  # type: ignore[arg-type]


def test_the_instructions_a_strategy_sends_read_back_as_it_built_them(tmp_path: Path, tiny_model_dir: Path) -> None:
    strategy = _strategy(tmp_path, tiny_model_dir)
    messages = list(strategy.configure_train(2, None, ConfigRecord({"user-knob": 3}), _Federation(range(4), 4)))  # type: ignore[arg-type]
    assert [m.metadata.dst_node_id for m in messages] == [100, 101, 102, 103]
    for client, message in enumerate(messages):
        read = TrainInstruction.from_record(message.content)
        assert read == strategy.train_instruction(2, client, ConfigRecord({"user-knob": 3}))
        assert (read.client_id, read.data_seed, read.extra) == (client, 42 + 200 + client, {"user-knob": 3})
        assert read.store == {"store-kind": "shared-fs", "run-root": strategy.run_root}
    evaluations = list(strategy.configure_evaluate(2, None, ConfigRecord(), _Federation(range(4), 4)))  # type: ignore[arg-type]
    seeds = [EvalInstruction.from_record(m.content).eval_seeds for m in evaluations]
    assert seeds == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_flowers_sampling_and_record_settings_are_refused_by_name(tmp_path: Path, tiny_model_dir: Path) -> None:
    cases = [
        ({"fraction_train": 0.5}, "does not sample by fraction_train .* set clients.per_round instead"),
        ({"min_train_nodes": 5}, "min_train_nodes = 5 must be between 1 and the 4 client"),
        ({"min_evaluate_nodes": 0}, "min_evaluate_nodes = 0 must be between 1 and the 4 client"),
        ({"min_available_nodes": 9}, "min_available_nodes = 9 must be between 1 and the 4 client"),
        ({"fraction_evaluate": 1.5}, "fraction_evaluate = 1.5 must be between 0 and 1"),
        ({"configrecord_key": "cfg"}, "does not rename message records"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            _strategy(tmp_path, tiny_model_dir, **kwargs)
    base = CheckpointRef.for_directory(tiny_model_dir)
    with pytest.raises(ConfigError, match="rejected its arguments: FedAvgFSDP does not sample by fraction_train"):
        build_strategy(load_settings(overrides="+strategy.kwargs.fraction_train=0.5"), tmp_path, base)


def test_flowers_minimum_node_counts_and_evaluation_fraction_are_honoured(tmp_path: Path, tiny_model_dir: Path) -> None:
    half = _Federation([0, 1], 4)  # partitions 2 and 3 have no SuperNode
    strategy = _strategy(tmp_path, tiny_model_dir, min_train_nodes=3)
    assert list(strategy.configure_train(1, None, ConfigRecord(), half)) == []  # type: ignore[arg-type]
    strategy = _strategy(tmp_path, tiny_model_dir, min_train_nodes=2)
    assert len(list(strategy.configure_train(1, None, ConfigRecord(), half))) == 2  # type: ignore[arg-type]
    strategy = _strategy(tmp_path, tiny_model_dir, min_available_nodes=3)
    assert list(strategy.configure_train(1, None, ConfigRecord(), half)) == []  # type: ignore[arg-type]
    assert list(strategy.configure_evaluate(1, None, ConfigRecord(), half)) == []  # type: ignore[arg-type]
    strategy = _strategy(tmp_path, tiny_model_dir, min_evaluate_nodes=3)
    assert list(strategy.configure_evaluate(1, None, ConfigRecord(), half)) == []  # type: ignore[arg-type]

    everyone = _Federation(range(4), 4)
    strategy = _strategy(tmp_path, tiny_model_dir, fraction_evaluate=0.5)
    evaluations = list(strategy.configure_evaluate(1, None, ConfigRecord(), everyone))  # type: ignore[arg-type]
    assert [m.metadata.dst_node_id for m in evaluations] == [100, 101]
    assert sorted(s for m in evaluations for s in EvalInstruction.from_record(m.content).eval_seeds) == list(range(8))
    strategy = _strategy(tmp_path, tiny_model_dir, fraction_evaluate=0.0)
    assert list(strategy.configure_evaluate(1, None, ConfigRecord(), everyone)) == []  # type: ignore[arg-type]
