"""A run that could not learn says so: the figures are the clients' replies of the WebShop run of
2026-12-02 on one H200 (docs/gpu.md §7, fourth attempt), where every group of every client scored
alike in all four rounds, and of the windowed TinyGuess run beside it, which had a signal."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from fedagent_flwr.intervals import wilson_interval
from fedagent_flwr.protocol import NUM_EXAMPLES, REWARD_MEAN, SUCCESS_RATE, ZERO_VARIANCE_GROUP_SHARE
from fedagent_flwr.serverapp.learning import describe, final_vs_base, learning_record
from fedagent_flwr.serverapp.recorder import SUMMARY_FILE, RunRecorder

# WebShop: 128 training episodes per client round, all scored alike; reward 0, success 0.
FLAT = {ZERO_VARIANCE_GROUP_SHARE: 1.0, NUM_EXAMPLES: 128, SUCCESS_RATE: 0.0, REWARD_MEAN: 0.0}
# Windowed TinyGuess, round 1: client 0 had 1 flat group in 16, client 1 6 in 16.
SIGNAL = {0: {ZERO_VARIANCE_GROUP_SHARE: 0.0625, NUM_EXAMPLES: 256, SUCCESS_RATE: 0.238},
          1: {ZERO_VARIANCE_GROUP_SHARE: 0.375, NUM_EXAMPLES: 256, SUCCESS_RATE: 0.066}}


def _run(run_dir: Path, rounds: list[dict[int, dict[str, float]]], val: list[tuple[int, int]],
         adv_estimator: str = "grpo") -> RunRecorder:
    """A recorder fed ``rounds`` (each client's train reply) and validation points (successes, n);
    the first validation point is the base model's."""
    recorder = RunRecorder(run_dir, {"run_id": 7, "base_model": "/m", "adv_estimator": adv_estimator})
    for server_round, (successes, n) in enumerate(val):
        if server_round > 0:
            clients = rounds[server_round - 1]
            recorder.record_round(server_round=server_round, clients=sorted(clients), started_from="/m",
                                  client_actors={c: f"/c{c}" for c in clients}, aggregated=f"/g{server_round}",
                                  rejected={}, client_metrics=clients)
        recorder.record_eval(server_round=server_round, model="base" if server_round == 0 else "aggregated",
                             metrics={NUM_EXAMPLES: n, SUCCESS_RATE: successes / n, REWARD_MEAN: 0.0})
    return recorder


def test_a_run_none_of_whose_rounds_had_a_learning_signal_is_degraded_and_says_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="flwr"):
        recorder = _run(tmp_path / "webshop", [{0: FLAT, 1: FLAT}] * 4, [(0, 64)] * 5)
    status, reason = recorder.outcome()
    assert status == "degraded"
    assert reason.startswith("no round had a learning signal (rounds [1, 2, 3, 4]): in each, every group of every "
                             "reporting client's episodes scored alike (zero-variance-group-share 1.0)")
    # each such round is named in the log as it is recorded
    flagged = [r.getMessage() for r in caplog.records if "had no learning signal" in r.getMessage()]
    assert [m.split(" had")[0] for m in flagged] == [f"[fedagent] round {r}" for r in (1, 2, 3, 4)]
    recorder.finish(status, reason)
    summary = json.loads((tmp_path / "webshop" / SUMMARY_FILE).read_text())
    assert summary["status"] == "degraded" and summary["warning"] == reason
    assert summary["rounds"][0]["zero_variance_group_share"] == {"0": 1.0, "1": 1.0}
    learning = summary["learning"]
    assert (learning["rounds_measured"], learning["rounds_without_signal"], learning["no_signal_run"]) == (
        [1, 2, 3, 4], [1, 2, 3, 4], True)
    assert learning["final_vs_base"]["verdict"] == "overlapping"


def test_one_round_with_a_signal_is_enough_for_a_completed_run(tmp_path: Path) -> None:
    recorder = _run(tmp_path / "mixed", [{0: FLAT, 1: FLAT}, SIGNAL, {0: FLAT, 1: FLAT}], [(10, 64)] * 4)
    assert recorder.outcome() == ("completed", "")
    record = recorder.summary["learning"]
    assert (record["rounds_without_signal"], record["no_signal_run"]) == ([1, 3], False)
    # one client with a signal is a signal: its update moved the global model by its gradient
    one = _run(tmp_path / "one", [{0: FLAT, 1: SIGNAL[1]}], [(10, 64), (10, 64)])
    assert one.outcome() == ("completed", "") and one.summary["learning"]["rounds_without_signal"] == []


def test_clients_that_do_not_report_the_share_are_never_taken_for_flat(tmp_path: Path) -> None:
    # a trainer that does not report the share: nothing is known, nothing is claimed
    silent = {NUM_EXAMPLES: 64, SUCCESS_RATE: 0.0, REWARD_MEAN: 0.0}
    recorder = _run(tmp_path / "silent", [{0: silent, 1: silent}] * 2, [(0, 64)] * 3)
    assert recorder.outcome() == ("completed", "")
    assert recorder.summary["learning"]["rounds_measured"] == []
    assert "zero_variance_group_share" not in recorder.summary["rounds"][0]


def test_flat_groups_do_not_make_a_ppo_run_degraded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # PPO's advantages come from its critic (GAE), not from a group's mean: its shares are recorded
    # and reported, but they say nothing about whether it could learn, and the log says nothing of drift
    flat_beside = {0: FLAT, 1: SIGNAL[1]}
    with caplog.at_level(logging.INFO, logger="flwr"):
        recorder = _run(tmp_path / "ppo", [{0: FLAT, 1: FLAT}, {0: FLAT, 1: FLAT}, flat_beside], [(0, 64)] * 4,
                        adv_estimator="gae")
    assert recorder.outcome() == ("completed", "")
    assert recorder.summary["learning"]["rounds_without_signal"] == [1, 2]
    assert recorder.summary["learning"]["clients_without_signal"] == [{"round": 3, "clients": ["0"]}]
    assert recorder.summary["learning"]["no_signal_run"] is False
    assert not [r for r in caplog.records if "learning signal" in r.getMessage()]


def test_verls_vectorized_grpo_counts_as_grpo_for_a_run_without_signal(tmp_path: Path) -> None:
    # grpo_vectorized is GRPO's formula computed with scatter operations: flat groups, no signal
    recorder = _run(tmp_path / "vectorized", [{0: FLAT, 1: FLAT}] * 2, [(0, 64)] * 3,
                    adv_estimator="grpo_vectorized")
    assert recorder.summary["learning"]["no_signal_run"] is True
    assert recorder.outcome()[0] == "degraded"


def test_a_validation_point_without_its_interval_gets_it_from_rate_and_n() -> None:
    # a summary written before success_ci95 was recorded (a resumed run's earlier points)
    old_base = {"round": 0, "model": "base", "n": 64, "success_rate": 6 / 64}
    comparison = final_vs_base([old_base, _point(12, 29, 64)])
    assert comparison is not None and comparison["base"]["success_ci95"] == [0.0437, 0.1898]
    assert comparison["verdict"] == "above"


def test_a_degraded_run_with_empty_rounds_adds_the_missing_signal_to_its_reason(tmp_path: Path) -> None:
    recorder = _run(tmp_path / "gaps", [{0: FLAT, 1: FLAT}], [(0, 64), (0, 64)])
    recorder.record_round(server_round=2, clients=[0, 1], started_from="/g1", client_actors={}, aggregated=None,
                          rejected={0: "out of memory", 1: "out of memory"}, client_metrics={})
    status, reason = recorder.outcome()
    assert status == "degraded"
    assert reason.startswith("round(s) [2] aggregated no client checkpoint")
    assert "; and no round had a learning signal (rounds [1])" in reason


def _point(server_round: int, successes: int, n: int, model: str = "aggregated") -> dict[str, object]:
    low, high = wilson_interval(successes, n)
    return {"round": server_round, "model": model, "n": n, "success_rate": successes / n,
            "success_ci95": [round(low, 4), round(high, 4)]}


def test_the_final_model_is_judged_against_the_base_by_their_95_percent_intervals() -> None:
    base = _point(0, 6, 64, "base")  # 0.094 [0.044, 0.190]
    assert final_vs_base([base]) is None and final_vs_base([]) is None
    above = final_vs_base([base, _point(1, 10, 64), _point(12, 29, 64)])  # the last point is the final one
    assert above is not None and above["verdict"] == "above" and above["final"]["round"] == 12
    assert describe(above) == ("validation success 0.094 [0.044, 0.190] (round 0, n=64) -> 0.453 [0.337, 0.574] "
                               "(round 12, n=64): the final model's 95% interval lies above the base model's")
    assert final_vs_base([base, _point(6, 10, 64)])["verdict"] == "overlapping"  # type: ignore[index]
    high_base = _point(0, 40, 64, "base")
    assert final_vs_base([high_base, _point(3, 6, 64)])["verdict"] == "below"  # type: ignore[index]
    # a record without validation has no comparison, and still its signal figures
    assert "final_vs_base" not in learning_record([], [])


def test_a_comparison_whose_final_point_lacks_clients_says_it_is_not_on_the_same_episodes() -> None:
    """Each evaluating client plays its own slice of the validation episodes, so a final point that
    lost a client (``failed``) is on other episodes than the base: the comparison keeps that and the
    log line says so."""
    base = _point(0, 6, 64, "base")
    partial = {**_point(5, 10, 32), "failed": {"1": "client 1 eval round 5: TrainerFailed: killed"}}
    comparison = final_vs_base([base, partial])
    assert comparison is not None and comparison["final"]["failed"] == partial["failed"]
    assert "failed" not in comparison["base"]
    assert describe(comparison).endswith(
        "(not on the same episodes: clients 1 failed to evaluate; see val_curve[].failed)")


def test_a_client_without_a_signal_beside_one_with_a_signal_is_named_in_the_summary_and_the_log(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Batch 24 seed 6 (2026-12-06), federated round 4: client 0's 32 WebShop episodes bought in 24, in groups
    # that each scored alike (share 1.0); client 1's had a spread (share 0.0). Round 1 here: both clients flat;
    # round 3: both with a signal.
    flat_beside = {0: {ZERO_VARIANCE_GROUP_SHARE: 1.0, NUM_EXAMPLES: 32, SUCCESS_RATE: 0.75},
                   1: {ZERO_VARIANCE_GROUP_SHARE: 0.0, NUM_EXAMPLES: 32, SUCCESS_RATE: 0.469}}
    with caplog.at_level(logging.INFO, logger="flwr"):
        recorder = _run(tmp_path / "partly", [{0: FLAT, 1: FLAT}, flat_beside, SIGNAL], [(40, 64)] * 4)
    assert recorder.outcome() == ("completed", "")
    learning = recorder.summary["learning"]
    assert learning["rounds_without_signal"] == [1]
    assert learning["clients_without_signal"] == [{"round": 2, "clients": ["0"]}]  # not the wholly flat round 1
    named = [r.getMessage() for r in caplog.records if "had no learning signal" in r.getMessage()]
    assert named == [
        "[fedagent] round 1 had no learning signal: every group of every reporting client's episodes scored alike "
        "(zero-variance-group-share 1.0 from clients 0, 1), so the update is drift, not learning",
        "[fedagent] round 2: client(s) 0 had no learning signal (every group of their episodes scored alike), so "
        "their update is drift, averaged in beside the others' at its full weight"]
