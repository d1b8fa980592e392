"""End to end: a real Flower simulation (reference trainer, tiny model) with E = 2 local epochs and
per-client validation: each trained client's own model on the validation episodes, recorded apart
from the training metrics in ``metrics.jsonl`` and ``federated_summary.json``; and the clients'
two step lines a round relayed to the ServerApp's log (on the shared filesystem: the server reads
each client's progress file in its slot). One run, read by both tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedagent_flwr.seeding import validation_seeds
from fedagent_flwr.serverapp.recorder import METRICS_FILE
from testkit.flower_harness import SuperLink
from testkit.run_end import ran_every_round

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(superlink: SuperLink, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, str]:
    """The job (1 round, E = 2, per-client validation), run once; its run directory and output.
    Persistent trainers: the node's one trainer serves its 4 jobs instead of 4 fresh processes
    (~4.5 s of CPU each to import torch and transformers); the http-store test relays the step lines
    of subprocess trainers."""
    out = tmp_path_factory.mktemp("client-val")
    proc = superlink.run(f"output_dir={out} run_name=job model.path={tiny_model_dir} num_rounds=1 "
                         "train.epochs=2 eval.per_client=true eval.num_episodes=3 trainer.max_new_tokens=8 "
                         "trainer.lr=1e-3 trainer.mode=persistent", supernodes=2)
    return out / "job", proc.stdout + proc.stderr


def test_each_trained_client_is_validated_and_recorded_apart(run: tuple[Path, str]) -> None:
    run_dir, output = run
    summary_path = run_dir / "federated_summary.json"
    assert summary_path.exists(), output[-4000:]
    summary = json.loads(summary_path.read_text())
    assert ran_every_round(summary), output[-4000:]
    assert summary["epochs_per_round"] == 2 and summary["client_eval"] is True

    # E = 2: each client made 2 updates (one local step per epoch) on the same instances.
    for client in (0, 1):
        client_dir = run_dir / "round_1" / f"client_{client}"
        assert json.loads((client_dir / "train_job.json").read_text())["epochs"] == 2
        steps = [line for line in (client_dir / "train.log").read_text().splitlines() if line.startswith("step ")]
        assert [line.split()[1:4] for line in steps] == [["1/2", "epoch", "1/2"], ["2/2", "epoch", "2/2"]]

    # The global model: eval.num_episodes split over the two clients, as without per-client validation.
    assert [(p["round"], p["n"]) for p in summary["val_curve"]] == [(0, 3), (1, 3)]
    # Each trained client's own model: every validation episode, one point per client and round.
    points = summary["client_val_curve"]
    assert [(p["round"], p["client"], p["n"]) for p in points] == [(1, 0, 3), (1, 1, 3)]
    for point in points:
        low, high = point["success_ci95"]
        assert 0.0 <= low <= point["success_rate"] <= high <= 1.0
        job = json.loads((run_dir / "round_1" / f"client_{point['client']}" / "client_val" / "evaluate_job.json")
                         .read_text())
        assert job["seeds"] == validation_seeds(7, 3)  # the global evaluation's episodes (eval.seed 7)
        assert job["model_path"].endswith(f"round_1/client_{point['client']}/client_val/model")
        assert not Path(job["model_path"]).exists()  # the merged copy is removed once scored
        result = json.loads((Path(job["output_dir"]) / "eval_result.json").read_text())
        assert (result["num_episodes"], result["success_rate"]) == (3, point["success_rate"])

    events = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    client_val = [e for e in events if e["event"] == "client_val"]
    assert [(e["round"], e["client"], e["n"]) for e in client_val] == [(1, 0, 3), (1, 1, 3)]
    assert all(e["client_val/success_rate"] == e["success_rate"] for e in client_val)
    train = [e for e in events if e["event"] == "train"]
    assert len(train) == 2 and not any(k.startswith("client-val-") for e in train for k in e["metrics"])
    # training episodes: E 2 x local_steps 1 x n_envs 2 x rollout_n 2
    assert [p["n"] for p in summary["client_curve"]] == [8, 8]


def test_a_simulation_relays_the_reference_trainers_step_lines_to_the_server_log(run: tuple[Path, str]) -> None:
    run_dir, output = run
    assert ran_every_round(json.loads((run_dir / "federated_summary.json").read_text())), output[-4000:]
    for client in (0, 1):
        for step in (1, 2):  # E 2 x local_steps 1: two steps, one line each
            # the relayed line (the ClientApp's own lines read "[client 0 round 1] step 1/2 episodes ...")
            assert f"client {client} round 1: step {step}/2, success " in output, output[-4000:]
