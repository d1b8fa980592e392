"""A federated job run end to end by ``flwr run`` on a test's SuperLink, and the check that a
round's written aggregate is the mean of its clients' checkpoints, recomputed from their files.

Shared by the simulation tests (subprocess and persistent trainers, windowed mode).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from testkit.flower_harness import SuperLink


def run_job(superlink: SuperLink, tmp_path: Path, overrides: str, supernodes: int) -> tuple[dict, Path, str]:
    """Run the job ``job`` under ``tmp_path`` with the Hydra ``overrides`` on ``supernodes`` nodes;
    return its federated summary (which must have been written), its run directory and the run's
    output (stdout, then stderr)."""
    proc = superlink.run(f"output_dir={tmp_path} run_name=job {overrides}", supernodes=supernodes)
    output = proc.stdout + proc.stderr
    summary_path = tmp_path / "job" / "federated_summary.json"
    assert summary_path.exists(), output[-4000:]
    return json.loads(summary_path.read_text()), tmp_path / "job", output


def client_state(client_dir: Path) -> dict[str, torch.Tensor]:
    """The weights a client trained in a round (``client_dir``: its round folder), from the
    world-size-1 FSDP shard its train result names."""
    result = json.loads((client_dir / "train_result.json").read_text())
    shard = Path(result["actor_dir"]) / "model_world_size_1_rank_0.pt"
    return torch.load(shard, map_location="cpu", weights_only=True)


def check_round_mean(run_dir: Path, entry: dict, weights: dict[int, float]) -> float:
    """Max abs error between the written aggregate and the mean recomputed from client files.

    ``entry`` is the round's summary entry and ``weights`` each client's weight (its episodes);
    the aggregate must hold every key the clients trained (the tied ``lm_head.weight`` aside)."""
    states = {c: client_state(run_dir / f"round_{entry['round']}" / f"client_{c}") for c in weights}
    total = sum(weights.values())
    aggregate = load_file(str(Path(entry["aggregated_actor"]) / "model.safetensors"))
    worst = 0.0
    for key, tensor in aggregate.items():
        expected = sum(states[c][key].double() * (w / total) for c, w in weights.items())
        worst = max(worst, (tensor.double() - expected).abs().max().item())
    # The tiny model ties lm_head to the embeddings: the HF output leaves the tied copy out.
    assert set(aggregate) == set(next(iter(states.values()))) - {"lm_head.weight"}
    return worst
