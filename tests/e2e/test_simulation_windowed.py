"""End to end in windowed mode: `flwr run` on a real SuperLink (simulation), two clients training the
tiny model with the reference trainer on one sample per turn, the server averaging their real
checkpoints, and the evaluation playing windowed episodes too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit.flower_harness import SuperLink
from testkit.run_end import ran_every_round
from testkit.simulation_runs import check_round_mean, run_job

pytestmark = pytest.mark.slow


def test_windowed_two_clients_one_round(superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path) -> None:
    summary, run_dir, output = run_job(
        superlink, tmp_path,
        f"model.path={tiny_model_dir} num_rounds=1 eval.num_episodes=2 eval.before_train=false "
        "trainer.max_new_tokens=8 trainer.lr=1e-3 "
        "storage.keep_client_checkpoints=true rollout.mode=windowed rollout.history_length=2 "
        "trainer.mode=persistent",  # one trainer per node for the train and evaluate jobs
        supernodes=2,
    )
    assert ran_every_round(summary), output[-4000:]
    (entry,) = summary["rounds"]
    episodes = {}
    for c in entry["clients"]:
        client_dir = run_dir / "round_1" / f"client_{c}"
        job = json.loads((client_dir / "train_job.json").read_text())
        assert (job["trainer"]["rollout_mode"], job["trainer"]["history_length"]) == ("windowed", 2)
        result = json.loads((client_dir / "train_result.json").read_text())
        metrics = result["metrics"]
        # One GRPO sample per played turn: 2 env seeds x rollout_n 2 = 4 episodes of up to 3 turns.
        assert result["num_episodes"] == 4
        assert metrics["num_samples"] == pytest.approx(metrics["num_turns_mean"] * 4)
        assert metrics["num_samples"] > result["num_episodes"]
        episodes[c] = float(result["num_episodes"])
    assert check_round_mean(run_dir, entry, episodes) < 1e-6  # FedAvg of the windowed clients' checkpoints
    assert [p["round"] for p in summary["val_curve"]] == [1]
    for r in (1,):
        eval_dirs = sorted((run_dir / f"round_{r}" / "eval").glob("client_*"))
        assert eval_dirs, f"no evaluation in round {r}"
        for eval_dir in eval_dirs:
            eval_job = json.loads((eval_dir / "evaluate_job.json").read_text())
            assert eval_job["trainer"]["rollout_mode"] == "windowed"
            eval_result = json.loads((eval_dir / "eval_result.json").read_text())
            assert eval_result["metrics"]["samples_mean"] == eval_result["metrics"]["num_turns_mean"]
