"""End to end on a real simulation SuperLink: ``trainer.optimizer_state=keep`` with persistent
reference trainers, two clients x two rounds. Each node's trainer keeps its client's AdamW state
from round 1 into round 2, and every client's round says in the run's metrics whether it did
(``optimizer-state-kept``: nothing to keep in round 1, kept in round 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedagent_flwr.protocol import OPTIMIZER_STATE_KEPT
from testkit.flower_harness import SuperLink
from testkit.run_end import ran_every_round

pytestmark = pytest.mark.slow

RUN = ("num_rounds=2 clients.total=2 clients.per_round=2 eval.num_episodes=2 trainer.max_new_tokens=8 "
       "trainer.lr=1e-3 trainer.mode=persistent")


def test_each_client_keeps_its_optimiser_state_into_round_2_and_the_metrics_say_so(
        superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path) -> None:
    proc = superlink.run(f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} {RUN} "
                         "trainer.optimizer_state=keep")
    output = proc.stdout + proc.stderr
    run_dir = tmp_path / "job"
    summary = json.loads((run_dir / "federated_summary.json").read_text())
    assert ran_every_round(summary), output[-4000:]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kept = {(e["round"], e["client"]): e["metrics"][OPTIMIZER_STATE_KEPT] for e in events if e["event"] == "train"}
    assert kept == {(1, 0): 0.0, (1, 1): 0.0, (2, 0): 1.0, (2, 1): 1.0}, output[-4000:]
    for client in (0, 1):  # each node's one trainer said what it did
        log = (run_dir / "round_2" / f"client_{client}" / "train.log").read_text()
        assert "optimiser state: kept from the previous round" in log


def test_keep_with_subprocess_trainers_stops_the_run_before_round_0(superlink: SuperLink, tmp_path: Path,
                                                                     tiny_model_dir: Path) -> None:
    proc = superlink.run(f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} num_rounds=1 "
                         "trainer.optimizer_state=keep")
    output = proc.stdout + proc.stderr
    assert ("config key 'trainer.optimizer_state' = 'keep' needs trainer.mode=persistent" in output), output[-4000:]
    assert not (tmp_path / "job" / "round_1").exists()
