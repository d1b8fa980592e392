"""FedAvgFSDP's aggregate_evaluate: scores only some clients report, malformed or impossible
evaluation replies refused as the failure of the client that sent them, and evaluating clients
that failed recorded in the log, the summary and the metrics, surviving a resume."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from flwr.app import Message, RecordDict

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.strategy import FedAvgFSDP
from testkit.client_replies import eval_reply, failed_eval_reply
from testkit.round_harness import connect, eval_round
from testkit.strategy_setup import connected_strategy, stub_model


def test_an_evaluation_where_only_some_clients_report_a_score_is_recorded_without_it(tmp_path: Path) -> None:
    """An evaluating client reports ``score-mean`` only when the env scored every one of its
    episodes (an episode cut off before its first turn has no score), so one client's reply may
    carry it and another's not: the round's evaluation is recorded, episode-weighted, without the
    score (a mean over the scoring clients' share would read low), instead of Flower's
    all-replies-alike check stopping the run."""
    from fedagent_flwr.protocol import EvalReply

    def evaluated(client: int, reply: EvalReply) -> Message:
        instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="evaluate")
        return Message(reply.to_record(), reply_to=instruction)

    model = stub_model(tmp_path)
    strategy, run_root = connected_strategy(tmp_path, CheckpointRef.for_directory(model), clients=2)
    replies = [evaluated(0, EvalReply(num_examples=2, success_rate=0.5, reward_mean=5.0, score_mean=0.75)),
               evaluated(1, EvalReply(num_examples=6, success_rate=0.0, reward_mean=0.0))]
    eval_round(strategy, 1, replies, sent=[0, 1])
    (point,) = json.loads((run_root / "federated_summary.json").read_text())["val_curve"]
    assert point["n"] == 8 and point["success_rate"] == pytest.approx(0.125)
    assert point["reward_mean"] == pytest.approx(1.25) and "score_mean" not in point
    # every client scored: the score is the episode-weighted mean
    scored = [evaluated(0, EvalReply(num_examples=2, success_rate=0.5, reward_mean=5.0, score_mean=0.75)),
              evaluated(1, EvalReply(num_examples=6, success_rate=0.0, reward_mean=0.0, score_mean=0.25))]
    eval_round(strategy, 2, scored, sent=[0, 1])
    last = json.loads((run_root / "federated_summary.json").read_text())["val_curve"][-1]
    assert last["n"] == 8 and last["score_mean"] == pytest.approx(0.375)


def test_a_malformed_evaluation_reply_is_a_failure_of_the_client_that_sent_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An evaluation reply without a usable ``num-examples`` (missing, a fraction, a list) is refused
    as a bad train reply is: by the client's and node's name, recorded as that client's failure, the
    other clients' episodes averaged. It used to stop the run with Flower's 'All MetricRecords must
    have the same keys', naming nobody, or was silently counted (4.5 episodes read as 4)."""
    from fedagent_flwr.serverapp.failures import RoundFailedError

    model = stub_model(tmp_path)
    strategy, run_root = connected_strategy(tmp_path, CheckpointRef.for_directory(model), clients=2)
    good = {"num-examples": 4, "success-rate": 0.25, "reward-mean": 2.5}
    missing = {"success-rate": 0.5, "reward-mean": 5.0}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        eval_round(strategy, 1, [eval_reply(0, good), eval_reply(1, missing)], sent=[0, 1])
        eval_round(strategy, 2, [eval_reply(0, good), eval_reply(1, {**good, "num-examples": 4.5})], sent=[0, 1])
    summary = json.loads((run_root / "federated_summary.json").read_text())
    first, second = summary["val_curve"]
    assert first["n"] == 4 and first["success_rate"] == pytest.approx(0.25), first  # client 0's episodes only
    assert list(first["failed"]) == ["1"] and "client 1 (node 101)" in first["failed"]["1"]
    assert "'num-examples' is missing" in first["failed"]["1"], first["failed"]
    assert second["n"] == 4 and "'num-examples' must be int, got float '4.5'" in second["failed"]["1"], second
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("round 1" in w and "client 1 (node 101)" in w and "num-examples" in w for w in warnings), warnings
    # Every client's reply malformed in different ways: the evaluation recorded nothing, the run is degraded.
    eval_round(strategy, 3, [eval_reply(0, missing), eval_reply(1, {**good, "num-examples": [4]})], sent=[0, 1])
    lost = json.loads((run_root / "federated_summary.json").read_text())["eval_failures"]
    assert [(e["round"], sorted(e["failed"])) for e in lost] == [(3, ["0", "1"])]
    assert "client 1 (node 101)" in lost[0]["failed"]["1"] and "'num-examples' must be int" in lost[0]["failed"]["1"]
    # ... in the same way: the run stops, naming the problem.
    with pytest.raises(RoundFailedError, match=r"^evaluation of round 4: every client \(2\) failed the same way, "
                                               r"so the run stops: malformed evaluation reply from client 0 "
                                               r"\(node 100\): .*'num-examples' is missing"):
        eval_round(strategy, 4, [eval_reply(0, missing), eval_reply(1, missing)], sent=[0, 1])


@pytest.mark.parametrize(("change", "why"), [
    ({"num-examples": 0}, "'num-examples' = 0 is not a positive number of episodes"),
    ({"success-rate": 1.5}, "'success-rate' = 1.5 is not between 0 and 1"),
    ({"reward-mean": float("nan")}, "'reward-mean' not finite"),
    ({"score-mean": float("inf")}, "'score-mean' not finite"),
])
def test_an_evaluation_reply_with_impossible_values_is_refused(tmp_path: Path, change: dict, why: str) -> None:
    strategy, _ = connected_strategy(tmp_path, CheckpointRef.for_directory(stub_model(tmp_path)), clients=2)
    good = {"num-examples": 4, "success-rate": 0.25, "reward-mean": 2.5}
    metrics = strategy.aggregate_evaluate(1, [eval_reply(0, good), eval_reply(1, {**good, **change})])
    assert metrics is not None and metrics["num-examples"] == 4
    assert strategy.evaluation_refused == {1: f"malformed evaluation reply from client 1 (node 101): {why}"}


def test_evaluating_clients_that_failed_are_in_the_log_the_summary_and_metrics_and_survive_a_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An evaluation that lost clients for different reasons goes on (only a shared reason stops the
    run), but is not silent: a partial one's point names the clients it lacks, and one that
    recorded nothing at all (its round has no point in ``val_curve``) is in ``eval_failures``."""
    from fedagent_flwr.protocol import EvalReply
    from fedagent_flwr.serverapp.resume import load_previous_run

    def evaluated(client: int) -> Message:
        instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="evaluate")
        return Message(EvalReply(num_examples=4, success_rate=0.25, reward_mean=2.5).to_record(), reply_to=instruction)

    model = stub_model(tmp_path)
    run_root = tmp_path / "run"
    header = {"base_model": str(model), "total_rounds": 2, "config_sha256": None}
    recorder = RunRecorder(run_root, header)
    strategy = FedAvgFSDP(run_root=str(run_root), initial_model=CheckpointRef.for_directory(model), num_clients=2,
                          clients_per_round=2)
    connect(strategy, recorder, [0, 1])
    disk = "client 1 eval round 1: OSError: [Errno 28] No space left on device"
    with caplog.at_level(logging.WARNING, logger="flwr"):
        eval_round(strategy, 1, [evaluated(0), failed_eval_reply(1, disk)], sent=[0, 1])
        recorder.complete_round(1)
        # round 2: client 0 failed, client 1 never answered; different reasons, so the run goes on
        eval_round(strategy, 2, [failed_eval_reply(0, "client 0 eval round 2: TrainerFailed: killed")], sent=[0, 1])
        recorder.complete_round(2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("round 1" in w and "client 1" in w and "No space left" in w for w in warnings), warnings
    assert any("round 2" in w and "recorded nothing" in w and "no reply" in w for w in warnings), warnings
    summary = json.loads(recorder.summary_path.read_text())
    (point,) = summary["val_curve"]
    assert point["round"] == 1 and point["n"] == 4 and point["failed"] == {"1": disk}
    assert summary["eval_failures"] == [{"round": 2, "model": "aggregated", "failed": {
        "0": "client 0 eval round 2: TrainerFailed: killed", "1": "no reply within the round timeout"}}]
    events = [json.loads(line) for line in (run_root / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["round"]) for e in events] == [("evaluate", 1), ("evaluate_failed", 2)]
    assert events[0]["failed"] == {"1": disk} and events[1]["failed"] == summary["eval_failures"][0]["failed"]
    # A round without a validation point makes the run degraded (exit 3), saying which and why.
    status, why = recorder.outcome()
    assert status == "degraded", (status, why)
    assert "the evaluation of round(s) [2] recorded nothing" in why and "TrainerFailed: killed" in why, why
    # A re-run keeps what the committed rounds recorded.
    previous = load_previous_run(run_root, header)
    assert previous is not None
    again = json.loads(RunRecorder(run_root, header, previous).summary_path.read_text())
    assert again["eval_failures"] == summary["eval_failures"] and again["val_curve"] == summary["val_curve"]
