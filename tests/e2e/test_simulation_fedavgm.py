"""End to end: a real Flower simulation with a server optimiser (``strategy=fedavgm`` with momentum):
the global models and the momentum state kept beside them equal FedAvgM recomputed from the
clients' checkpoint files, and once round 2 commits only its state is left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from testkit.flower_harness import SuperLink
from testkit.run_end import ran_every_round
from testkit.simulation_runs import client_state, run_job

pytestmark = pytest.mark.slow

LR, MOMENTUM = 0.5, 0.9


def test_fedavgm_two_rounds_keeps_its_momentum_beside_the_global_model(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path,
) -> None:
    summary, run_dir, output = run_job(
        superlink, tmp_path,
        f"model.path={tiny_model_dir} strategy=fedavgm +strategy.kwargs.server_learning_rate={LR} "
        f"+strategy.kwargs.server_momentum={MOMENTUM} num_rounds=2 eval.num_episodes=2 trainer.max_new_tokens=8 "
        "trainer.lr=1e-3 storage.keep_client_checkpoints=true trainer.mode=persistent",
        supernodes=2,
    )
    assert ran_every_round(summary), output[-4000:]
    assert summary["strategy"] == "fedavgm"
    x = {k: v.double() for k, v in load_file(str(Path(tiny_model_dir) / "model.safetensors")).items()}
    momentum: dict[str, torch.Tensor] = {}
    for entry in summary["rounds"]:
        r = entry["round"]
        assert entry["client_actor_ids"] == [0, 1] and not entry["rejected"]
        weights = {c: float(json.loads((run_dir / f"round_{r}" / f"client_{c}" / "train_result.json").read_text())
                            ["num_episodes"]) for c in (0, 1)}
        states = {c: client_state(run_dir / f"round_{r}" / f"client_{c}") for c in (0, 1)}
        written = load_file(str(Path(entry["aggregated_actor"]) / "model.safetensors"))
        for key in written:
            mean = sum(states[c][key].double() * (w / sum(weights.values())) for c, w in weights.items())
            gradient = x[key] - mean
            momentum[key] = gradient if key not in momentum else MOMENTUM * momentum[key] + gradient
            x[key] = x[key] - LR * momentum[key]
            assert float((written[key].double() - x[key]).abs().max()) < 1e-5, (r, key)
            x[key] = written[key].double()  # the next round steps from the model as written
        with safe_open(str(Path(entry["aggregated_actor"]) / "model.safetensors"), framework="pt") as handle:
            assert (handle.metadata() or {})["fedagent.aggregation"] == "fedavgm"
    # Round 2's state is next to its global model (not in it); round 1's went when round 2 committed.
    state_path = run_dir / "round_2" / "server_optimizer" / "global.safetensors"
    state = load_file(str(state_path))
    assert set(state) == {f"momentum/{k}" for k in momentum}
    assert max(float((state[f"momentum/{k}"].double() - m).abs().max()) for k, m in momentum.items()) < 1e-5
    assert not (run_dir / "round_1" / "server_optimizer" / "global.safetensors").exists()
    assert summary["rounds"][0]["removed"]["server_optimizer_state"] > 0
    assert not list((run_dir / "round_2" / "global").glob("*server_optimizer*"))
