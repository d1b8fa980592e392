"""Runs whose weights are near 1 and change by an LLM's 1e-5 a round, on real HF checkpoints: where
fp32's spacing (1.2e-7) is large next to the change, the case the server-optimiser audit's fp32
bound is for (tests/serverapp/strategy/test_fedopt_verify_trust.py); the clients' checkpoints are
safetensors files a test can write into (test_verify_non_finite.py), then :func:`recommit_source`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.serverapp.strategy import FedAvgFSDP
from testkit.ckpt_factory import ModelSpec, write_hf_checkpoint
from testkit.client_replies import train_reply
from testkit.round_harness import train_round
from testkit.strategy_setup import client_slot

MODEL = "model.safetensors"
CHANGE = 1e-5  # an LLM's per-round change, well below tau (1e-3 by Flower's defaults)


def rewrite(model: Path, change: Any) -> None:
    """Replace every float tensor ``t`` of ``model`` by ``change(t)`` (fp32), its header kept."""
    with safe_open(str(model), framework="pt") as handle:
        metadata = handle.metadata() or {}
    tensors = {k: change(t).to(t.dtype) if t.is_floating_point() else t for k, t in load_file(str(model)).items()}
    save_file(tensors, str(model), metadata)


def near_one(tmp_path: Path, seed: int) -> CheckpointRef:
    """A real HF checkpoint whose weights are 1 + 0.1 N(0, 1): where fp32's spacing (1.2e-7) is
    large next to a 1e-5 change."""
    write_hf_checkpoint(ModelSpec("global", "qwen2", seed=9), tmp_path / "base")
    generator = torch.Generator().manual_seed(seed)
    rewrite(tmp_path / "base" / MODEL, lambda t: 1.0 + 0.1 * torch.randn(t.shape, generator=generator))
    return CheckpointRef.for_directory(tmp_path / "base")


def small_change_round(strategy: FedAvgFSDP, run_root: Path, server_round: int, seed: int) -> None:
    """Each of two clients returns the current global model plus CHANGE N(0, 1) (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    replies = []
    for client in range(2):
        copy = shutil.copytree(strategy.global_model.path, client_slot(run_root, client, server_round) / "model")
        rewrite(Path(copy) / MODEL, lambda t: t + CHANGE * torch.randn(t.shape, generator=generator))
        replies.append(train_reply(client, CheckpointRef.for_directory(copy), 4 + 8 * client))
    train_round(strategy, server_round, replies)


def recommit_source(run_root: Path, client: int) -> None:
    """Round 1's global model records client ``client``'s changed checkpoint's hash, and the run
    record that global model's: as if the client had sent the changed file (one round, so nothing
    later refers to the global model's hash), so that no hash check is what catches the change."""
    model = run_root / "round_1" / "global" / MODEL
    with safe_open(str(model), framework="pt") as handle:
        metadata = handle.metadata() or {}
    sources = json.loads(metadata["fedagent.sources"])
    sources[client]["sha256"] = CheckpointRef.for_directory(sources[client]["path"]).sha256
    metadata["fedagent.sources"] = json.dumps(sources)
    save_file(load_file(str(model)), str(model), metadata)
    summary_path = run_root / "federated_summary.json"
    summary = json.loads(summary_path.read_text())
    summary["rounds"][0]["aggregated_sha256"] = CheckpointRef.for_directory(model.parent).sha256
    summary_path.write_text(json.dumps(summary))
