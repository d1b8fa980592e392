"""Shared helpers of the FedAvgFSDP tests (test_fedavg_fsdp_*.py): the Flower task identity that
building Messages needs, train and evaluation replies as a client's node sends them, and a strategy
connected to a run recorder on a real initial checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.protocol import TrainReply
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.strategy import FedAvgFSDP
from testkit.ckpt_factory import ModelSpec, write_hf_checkpoint
from testkit.round_harness import connect


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    # Flower sets this inside real runs; building Messages in a unit test needs it too.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


def _reply(client: int, ref: CheckpointRef, episodes: float, metrics: dict | None = None) -> Message:
    """A train reply as client ``client``'s node (node 100 + client) would send it."""
    instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="train")
    values = {"num-examples": episodes, "reward-mean": 0.5, "success-rate": 0.25} if metrics is None else metrics
    return Message(TrainReply(client_id=client, actor=ref, metrics=values).to_record(), reply_to=instruction)


def _error_reply(client: int) -> Message:
    instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="train")
    return Message(Error(code=0, reason="trainer exited with code 1"), reply_to=instruction)


def _strategy(tmp_path: Path, initial: CheckpointRef, cls: type[FedAvgFSDP] = FedAvgFSDP,
              clients: int = 6, served: int | None = None) -> tuple[FedAvgFSDP, Path]:
    """All ``clients`` selected every round; node 100 + c serves client c for the first ``served``."""
    run_root = tmp_path / "run"
    run_root.mkdir()
    recorder = RunRecorder(run_root, {"base_model": initial.path, "env_kind": "test", "mode": "federated",
                                      "strategy": "fedavg"})
    strategy = cls(run_root=str(run_root), initial_model=initial, num_clients=clients, clients_per_round=clients)
    connect(strategy, recorder, range(clients if served is None else served))
    return strategy, run_root


def _slot(run_root: Path, client: int, server_round: int = 1) -> Path:
    """Where client ``client`` writes its checkpoints of ``server_round`` (the only place the server
    takes them from)."""
    return run_root / f"round_{server_round}" / f"client_{client}"


def _failed_eval(client: int, reason: str) -> Message:
    """An evaluation reply of client ``client``'s node that is an error with ``reason``."""
    instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="evaluate")
    return Message(Error(code=0, reason=reason), reply_to=instruction)


def _stub_model(tmp_path: Path) -> Path:
    """A model directory with one (unreadable) weight file: enough where no weight is read."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x")
    return model


def _initial(tmp_path: Path) -> CheckpointRef:
    write_hf_checkpoint(ModelSpec("global", "qwen2", seed=9), tmp_path / "base")
    return CheckpointRef.for_directory(tmp_path / "base")


def _evaluated(client: int, metrics: dict) -> Message:
    """An evaluation reply of client ``client``'s node (node 100 + client) carrying ``metrics``."""
    instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="evaluate")
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=instruction)
