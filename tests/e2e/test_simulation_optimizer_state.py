"""End to end on a real simulation SuperLink: optimiser state across rounds, on both sides, in one
run of two clients x two rounds with persistent reference trainers.

- The server's: ``strategy=fedavgm`` with momentum. The global models and the momentum state kept
  beside them equal FedAvgM recomputed from the clients' checkpoint files, every round's state is
  kept with the clients' checkpoints (``storage.keep_client_checkpoints=true``), and
  ``checkpoint.verify`` recomputes both rounds.
- The clients': ``trainer.optimizer_state=keep``. Each node's trainer keeps its client's AdamW state
  from round 1 into round 2, and every client's round says in the run's metrics whether it did
  (``optimizer-state-kept``: nothing to keep in round 1, kept in round 2).

The two are independent (the server steps from the clients' checkpoints however they were trained;
a trainer keeps its AdamW state whatever the global model it reloads), so one run serves both
tests. That keep is refused with subprocess trainers is a config check (``load_settings``), tested
in tests/trainers/verl/test_optimizer_state.py (both backends); that a config refusal stops a run
before round 0 is tests/e2e/test_simulation.py's ``test_bad_config_stops_the_run_at_start``.

FedAdam killed after round 2's model and state were written, before the commit, and resumed to the
uninterrupted run's model and state bit for bit, is tests/e2e/test_resume_crash.py's (every crash
case there runs FedAdam); that a commit removes the states before the newest
(``storage.keep_client_checkpoints=false``) and that a re-run steps from the state kept is
tests/serverapp/test_retention.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fedagent_flwr.protocol import OPTIMIZER_STATE_KEPT
from testkit.audit import audit_run
from testkit.flower_harness import SuperLink
from testkit.run_end import ran_every_round
from testkit.simulation_runs import client_state, run_job

pytestmark = pytest.mark.slow

LR, MOMENTUM = 0.5, 0.9


@pytest.fixture(scope="module")
def run(superlink: SuperLink, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[dict, Path, str]:
    """The one run both tests read: its summary, run directory and output."""
    summary, run_dir, output = run_job(
        superlink, tmp_path_factory.mktemp("optimizer-state"),
        f"model.path={tiny_model_dir} strategy=fedavgm +strategy.kwargs.server_learning_rate={LR} "
        f"+strategy.kwargs.server_momentum={MOMENTUM} num_rounds=2 clients.total=2 clients.per_round=2 "
        "eval.num_episodes=2 trainer.max_new_tokens=8 trainer.lr=1e-3 storage.keep_client_checkpoints=true "
        "trainer.mode=persistent trainer.optimizer_state=keep",
        supernodes=2,
    )
    assert ran_every_round(summary), output[-4000:]
    return summary, run_dir, output


def test_fedavgm_two_rounds_keeps_its_momentum_beside_the_global_model(
    run: tuple[dict, Path, str], tiny_model_dir: Path,
) -> None:
    summary, run_dir, output = run
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
    # The audit recomputes both rounds (model and momentum) from what the run kept. In the test
    # process (testkit.audit: no second interpreter importing torch); test_simulation.py runs the
    # command itself, as a user would.
    audit = audit_run(run_dir)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert audit.stdout.count(" fedavgm step ") == 2 and audit.stdout.count(" ok") == 2, audit.stdout


def test_each_client_keeps_its_optimiser_state_into_round_2_and_the_metrics_say_so(
    run: tuple[dict, Path, str],
) -> None:
    _, run_dir, output = run
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kept = {(e["round"], e["client"]): e["metrics"][OPTIMIZER_STATE_KEPT] for e in events if e["event"] == "train"}
    assert kept == {(1, 0): 0.0, (1, 1): 0.0, (2, 0): 1.0, (2, 1): 1.0}, output[-4000:]
    for client in (0, 1):  # each node's one trainer said what it did
        log = (run_dir / "round_2" / f"client_{client}" / "train.log").read_text()
        assert "optimiser state: kept from the previous round" in log
