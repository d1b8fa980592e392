"""End to end: real Flower simulations with a server optimiser. ``strategy=fedavgm`` with momentum:
the global models and the momentum state kept beside them equal FedAvgM recomputed from the
clients' checkpoint files, every round's state is kept with the clients' checkpoints
(``storage.keep_client_checkpoints=true``), and ``checkpoint.verify`` recomputes both rounds. ``strategy=fedadam``
killed after round 2's model and state were written, before the commit: the re-run redoes round 2
from round 1's state and ends with the uninterrupted run's model and state, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fedagent_flwr.serverapp.crashpoint import CRASH_FILE_ENV
from testkit.flower_harness import REPO, SuperLink, run_to_crash_point, simulation_superlink
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
        previous, moved = dict(x), 0.0
        for key in written:
            mean = sum(states[c][key].double() * (w / sum(weights.values())) for c, w in weights.items())
            gradient = x[key] - mean
            momentum[key] = gradient if key not in momentum else MOMENTUM * momentum[key] + gradient
            x[key] = x[key] - LR * momentum[key]
            assert float((written[key].double() - x[key]).abs().max()) < 1e-5, (r, key)
            moved = max(moved, float((written[key].double() - previous[key]).abs().max()))
            x[key] = written[key].double()  # the next round steps from the model as written
        assert moved > 1e-4, (r, moved)  # the round's step: ten times the comparison's tolerance or more
        with safe_open(str(Path(entry["aggregated_actor"]) / "model.safetensors"), framework="pt") as handle:
            assert (handle.metadata() or {})["fedagent.aggregation"] == "fedavgm"
    # Round 2's state is next to its global model (not in it); round 1's stays, with the clients' checkpoints.
    state_path = run_dir / "round_2" / "server_optimizer" / "global.safetensors"
    state = load_file(str(state_path))
    assert set(state) == {f"momentum/{k}" for k in momentum}
    assert max(float((state[f"momentum/{k}"].double() - m).abs().max()) for k, m in momentum.items()) < 1e-5
    assert (run_dir / "round_1" / "server_optimizer" / "global.safetensors").is_file()
    assert "server_optimizer_state" not in summary["rounds"][0].get("removed", {})
    assert not list((run_dir / "round_2" / "global").glob("*server_optimizer*"))
    # The audit command recomputes both rounds (model and momentum) from what the run kept.
    audit = subprocess.run([sys.executable, "-m", "fedagent_flwr.checkpoint.verify", str(run_dir)],
                           capture_output=True, text=True)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert audit.stdout.count(" fedavgm step ") == 2 and audit.stdout.count(" ok") == 2, audit.stdout



def test_fedadam_killed_after_round_2_aggregated_resumes_to_the_uninterrupted_runs_bits(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path,
) -> None:
    settings = (f"model.path={tiny_model_dir} strategy=fedadam +strategy.kwargs.eta=1e-3 num_rounds=2 "
                "eval.num_episodes=1 trainer.max_new_tokens=8 trainer.lr=1e-3 trainer.mode=persistent")
    baseline = tmp_path / "uninterrupted"
    proc = superlink.run(f"output_dir={baseline} run_name=job {settings}", supernodes=2)
    assert ran_every_round(json.loads((baseline / "job" / "federated_summary.json").read_text())), \
        (proc.stdout + proc.stderr)[-4000:]

    # The ServerApp kills itself once round 2's global model and state are in place, before the commit.
    crash_file = tmp_path / "crash-point"
    crash_file.write_text("aggregated@2")
    out = tmp_path / "crashed"
    run_dir = out / "job"
    overrides = f"output_dir={out} run_name=job {settings}"
    with simulation_superlink(tmp_path, pythonpath=[REPO], env_extra={CRASH_FILE_ENV: str(crash_file)}) as link:
        run_to_crash_point(link, overrides, 2, tmp_path / "crashed.log", run_dir)
        assert not crash_file.exists(), (tmp_path / "crashed.log").read_text()[-4000:]
        assert json.loads((run_dir / "federated_summary.json").read_text())["last_completed_round"] == 1
        assert (run_dir / "round_2" / "server_optimizer" / "global.safetensors").is_file()  # uncommitted
        round_1_state = run_dir / "round_1" / "server_optimizer" / "global.safetensors"
        assert round_1_state.is_file()
        rerun = link.run(overrides, supernodes=2)
    summary = json.loads((run_dir / "federated_summary.json").read_text())
    assert ran_every_round(summary) and summary["resumed"][0]["after_round"] == 1, (rerun.stdout + rerun.stderr)[-4000:]
    # Round 2 redone from round 1's model and state gives the uninterrupted run's model and state.
    for r in (1, 2):
        mine = load_file(str(run_dir / f"round_{r}" / "global" / "model.safetensors"))
        theirs = load_file(str(baseline / "job" / f"round_{r}" / "global" / "model.safetensors"))
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), r
    state = "round_2/server_optimizer/global.safetensors"
    assert (run_dir / state).read_bytes() == (baseline / "job" / state).read_bytes()
    assert not round_1_state.exists()  # read by the redo, then removed by round 2's commit (the newest stays)
