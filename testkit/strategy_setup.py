"""A FedAvgFSDP strategy set up as the ServerApp sets it up, for tests that drive its rounds by hand
(:mod:`testkit.round_harness`): its run directory and recorder, the nodes serving its clients, a real
initial checkpoint, and where each client's checkpoints go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.strategy import FedAvgFSDP
from testkit.ckpt_factory import ModelSpec, write_hf_checkpoint
from testkit.round_harness import connect


def connected_strategy(tmp_path: Path, initial: CheckpointRef, cls: type[FedAvgFSDP] = FedAvgFSDP,
                       clients: int = 6, served: int | None = None, **kwargs: Any) -> tuple[FedAvgFSDP, Path]:
    """A ``cls`` strategy starting from ``initial``, with its run directory (``tmp_path/run``, also
    returned) and recorder: all ``clients`` selected every round; node 100 + c serves client c for
    the first ``served`` (default: all). ``kwargs`` go to ``cls`` (a strategy's own settings)."""
    run_root = tmp_path / "run"
    run_root.mkdir()
    recorder = RunRecorder(run_root, {"base_model": initial.path, "env_kind": "test", "mode": "federated",
                                      "strategy": "fedavg"})
    strategy = cls(run_root=str(run_root), initial_model=initial, num_clients=clients, clients_per_round=clients,
                   **kwargs)
    connect(strategy, recorder, range(clients if served is None else served))
    return strategy, run_root


def client_slot(run_root: Path, client: int, server_round: int = 1) -> Path:
    """Where client ``client`` writes its checkpoints of ``server_round`` (the only place the server
    takes them from)."""
    return run_root / f"round_{server_round}" / f"client_{client}"


def stub_model(tmp_path: Path) -> Path:
    """A model directory with one (unreadable) weight file: enough where no weight is read."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x")
    return model


def initial_checkpoint(tmp_path: Path) -> CheckpointRef:
    """A real HF checkpoint (a small qwen2 model, seed 9) in ``tmp_path/base``, as the initial model."""
    write_hf_checkpoint(ModelSpec("global", "qwen2", seed=9), tmp_path / "base")
    return CheckpointRef.for_directory(tmp_path / "base")
