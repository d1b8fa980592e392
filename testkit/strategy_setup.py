"""A FedAvgFSDP strategy set up as the ServerApp sets it up, for tests that drive its rounds by hand
(:mod:`testkit.round_harness`): its run directory and recorder, the nodes serving its clients, a real
initial checkpoint, and where each client's checkpoints go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flwr.app import Message, RecordDict

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.protocol import TrainReply
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.strategy import FedAvgFSDP
from testkit.ckpt_factory import ModelSpec, Suite, write_hf_checkpoint
from testkit.client_replies import train_reply
from testkit.round_harness import connect


def connected_strategy(tmp_path: Path, initial: CheckpointRef, cls: type[FedAvgFSDP] = FedAvgFSDP,
                       clients: int = 6, served: int | None = None, **kwargs: Any) -> tuple[FedAvgFSDP, Path]:
    """A ``cls`` strategy starting from ``initial``, with its run directory (``tmp_path/run``, also
    returned) and recorder: all ``clients`` selected every round; node 100 + c serves client c for
    the first ``served`` (default: all). ``kwargs`` go to ``cls`` (a strategy's own settings)."""
    run_root = tmp_path / "run"
    run_root.mkdir()
    # base_model_sha256 as the ServerApp records it (serverapp/app.py): the audit checks the base model by it
    recorder = RunRecorder(run_root, {"base_model": initial.path, "base_model_sha256": initial.sha256,
                                      "env_kind": "test", "mode": "federated", "strategy": "fedavg"})
    strategy = cls(run_root=str(run_root), initial_model=initial, num_clients=clients, clients_per_round=clients,
                   **kwargs)
    connect(strategy, recorder, range(clients if served is None else served))
    return strategy, run_root


def client_slot(run_root: Path, client: int, server_round: int = 1) -> Path:
    """Where client ``client`` writes its checkpoints of ``server_round`` (the only place the server
    takes them from)."""
    return run_root / f"round_{server_round}" / f"client_{client}"


def suite_replies(run_root: Path, suite: Suite, names: tuple[str, ...], episodes: tuple[int, ...],
                  server_round: int) -> list[Message]:
    """Round ``server_round``'s train replies: client c returns a copy of the suite's model ``names[c]``
    in its slot (made once, so a redone round reuses it), with ``episodes[c]`` episodes."""
    replies = []
    for client, (name, count) in enumerate(zip(names, episodes)):
        slot = client_slot(run_root, client, server_round)
        source = slot / name if (slot / name).is_dir() else suite.copy(name, slot)
        replies.append(train_reply(client, CheckpointRef.for_directory(source), count))
    return replies


def suite_ppo_reply(run_root: Path, suite: Suite, client: int, server_round: int) -> Message:
    """Client ``client``'s PPO train reply of ``server_round`` (node 100 + client): an actor copied from
    the suite's ``qwen_a``/``qwen_b`` and a critic from ``qwen_b``/``qwen_c``, ``1 + client`` examples."""
    slot = client_slot(run_root, client, server_round)
    actor = CheckpointRef.for_directory(suite.copy(["qwen_a", "qwen_b"][client], slot / "a"))
    critic = CheckpointRef.for_directory(suite.copy(["qwen_b", "qwen_c"][client], slot / "c"), "critic")
    instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="train")
    content = TrainReply(client_id=client, actor=actor, critic=critic, metrics={"num-examples": 1 + client})
    return Message(content.to_record(), reply_to=instruction)


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
