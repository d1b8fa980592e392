"""Episodes cut short by the context budget are reported, per client, round and phase, without
changing how the run ends: the real recorder, strategy and round loop bookkeeping fed the replies
clients send (the whole path, from the reference trainer's episodes on, runs in
``tests/e2e/test_simulation_truncation.py``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from flwr.app import Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.protocol import NUM_EXAMPLES, REWARD_MEAN, SUCCESS_RATE, TRUNCATED_RATE, EvalReply
from fedagent_flwr.serverapp.recorder import SUMMARY_FILE, RunRecorder
from fedagent_flwr.serverapp.strategy import FedAvgFSDP
from testkit.round_harness import connect, eval_round


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    # Flower sets this inside real runs; building Messages in a unit test needs it too.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


def _evaluated(client: int, content: RecordDict) -> Message:
    """An evaluation reply of client ``client``'s node (node 100 + client)."""
    return Message(content, reply_to=Message(RecordDict(), dst_node_id=100 + client, message_type="evaluate"))


def _strategy(tmp_path: Path, backend: str) -> tuple[FedAvgFSDP, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x")  # no weight is read in an evaluation's bookkeeping
    run_root = tmp_path / "run"
    run_root.mkdir()
    initial = CheckpointRef.for_directory(model)
    recorder = RunRecorder(run_root, {"base_model": initial.path, "trainer_backend": backend})
    strategy = FedAvgFSDP(run_root=str(run_root), initial_model=initial, num_clients=3, clients_per_round=3)
    connect(strategy, recorder, range(3))
    return strategy, run_root


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "were truncated" in r.getMessage()]


def test_an_evaluation_records_and_warns_about_each_clients_truncated_episodes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Client 0 had 1 of its 2 validation episodes cut short, client 1 none of its 6, and client 2 is
    an older client whose reply does not report the share: the evaluation is recorded (Flower's
    all-replies-alike check would otherwise stop the run) with the reporting clients' episode-weighted
    share, client 0's own, the 8 of its 10 episodes that share covers (``truncated_n``, which the
    note repeats), and one warning naming client 0, the phase and verl's budget keys."""
    strategy, run_root = _strategy(tmp_path, "verl")
    replies = [_evaluated(c, EvalReply(num_examples=n, success_rate=0.0, reward_mean=0.0, truncated_rate=share)
                          .to_record()) for c, n, share in ((0, 2, 0.5), (1, 6, 0.0), (2, 2, None))]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        eval_round(strategy, 1, replies, sent=[0, 1, 2])
    summary = json.loads((run_root / SUMMARY_FILE).read_text())
    (point,) = summary["val_curve"]
    assert point["n"] == 10 and "failed" not in point
    assert point["truncated_rate"] == pytest.approx(1 / 8) and point["truncated"] == {"0": 0.5}
    # the share is over the 8 episodes of the clients that reported one, not the point's 10
    assert point["truncated_n"] == 8
    (warning,) = _warnings(caplog)
    assert warning.startswith("[fedagent] round 1: 50% of client 0's validation episodes (1 of 2) were truncated: ")
    assert "trainer.max_response_length" in warning and "trainer.max_prompt_length" in warning
    assert "lower trainer.max_new_tokens" in warning and "trainer.max_model_len" not in warning
    (entry,) = summary["truncation"]["validation"]
    assert entry == {"round": 1, "model": "aggregated", "truncated_rate": pytest.approx(1 / 8), "clients": {"0": 0.5},
                     "n": 10, "truncated_n": 8}
    note = summary["truncation"]["note"]
    assert "training" not in summary["truncation"] and "trainer.max_response_length" in note
    assert "covers only the episodes of the clients that reported one (round 1: 8 of 10" in note

    # Every client reports it: Flower's episode-weighted mean; nobody truncated: no warning, no note.
    caplog.clear()
    clean = [_evaluated(c, EvalReply(num_examples=2, success_rate=0.0, reward_mean=0.0, truncated_rate=0.0)
                        .to_record()) for c in range(3)]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        eval_round(strategy, 2, clean, sent=[0, 1, 2])
    last = json.loads((run_root / SUMMARY_FILE).read_text())["val_curve"][-1]
    assert last["truncated_rate"] == 0.0 and "truncated" not in last and not _warnings(caplog)
    assert "truncated_n" not in last  # the share covers all of n


def test_the_notes_largest_share_counts_an_evaluating_clients_own(tmp_path: Path) -> None:
    """Client 0 had 3 of its 4 validation episodes cut short, client 1 none of its 12: the
    evaluation's share is 3/16, but the note's "at most ... of a client's or an evaluation's
    episodes" must say 75%, client 0's (it said 19%, the evaluation's, hiding client 0's)."""
    strategy, run_root = _strategy(tmp_path, "reference")
    replies = [_evaluated(c, EvalReply(num_examples=n, success_rate=0.0, reward_mean=0.0, truncated_rate=share)
                          .to_record()) for c, n, share in ((0, 4, 0.75), (1, 12, 0.0))]
    eval_round(strategy, 1, replies, sent=[0, 1])
    truncation = json.loads((run_root / SUMMARY_FILE).read_text())["truncation"]
    assert truncation["validation"][0]["truncated_rate"] == pytest.approx(3 / 16)
    assert truncation["max_share"] == 0.75
    assert "at most 75% of a client's or an evaluation's episodes" in truncation["note"]


def test_a_truncated_share_outside_0_1_is_a_malformed_reply(tmp_path: Path) -> None:
    strategy, run_root = _strategy(tmp_path, "reference")
    good = {NUM_EXAMPLES: 2, SUCCESS_RATE: 0.5, REWARD_MEAN: 0.5, TRUNCATED_RATE: 0.0}
    eval_round(strategy, 1, [_evaluated(0, RecordDict({"metrics": MetricRecord(good)})),
                             _evaluated(1, RecordDict({"metrics": MetricRecord({**good, TRUNCATED_RATE: 1.5})}))],
               sent=[0, 1])
    (point,) = json.loads((run_root / SUMMARY_FILE).read_text())["val_curve"]
    assert point["n"] == 2 and "'truncated-rate' = 1.5 is not between 0 and 1" in point["failed"]["1"]


def test_truncated_training_episodes_warn_but_leave_a_completed_run_completed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A budget setting lowers the numbers the run records; the rounds still aggregated and were
    evaluated as configured, so the status stays ``completed`` and the summary carries the note."""
    recorder = RunRecorder(tmp_path, {"run_id": 7, "base_model": "/m", "adv_estimator": "ppo",
                                      "trainer_backend": "reference"})
    metrics = {0: {NUM_EXAMPLES: 8, SUCCESS_RATE: 0.25, REWARD_MEAN: 0.25, TRUNCATED_RATE: 0.375},
               1: {NUM_EXAMPLES: 8, SUCCESS_RATE: 0.5, REWARD_MEAN: 0.5, TRUNCATED_RATE: 0.0}}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        recorder.record_round(server_round=1, clients=[0, 1], started_from="/m", client_actors={0: "/c0", 1: "/c1"},
                              aggregated="/g1", rejected={}, client_metrics=metrics)
        recorder.record_eval(server_round=1, model="aggregated", metrics={NUM_EXAMPLES: 4, SUCCESS_RATE: 0.5,
                                                                           REWARD_MEAN: 0.5, TRUNCATED_RATE: 0.0})
    (warning,) = _warnings(caplog)
    assert warning.startswith("[fedagent] round 1: 38% of client 0's training episodes (3 of 8) were truncated: ")
    assert warning.endswith("raise trainer.max_model_len or lower trainer.max_new_tokens")
    assert recorder.outcome() == ("completed", "")
    recorder.finish(*recorder.outcome())
    summary = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert summary["status"] == "completed" and "warning" not in summary
    assert [p.get("truncated_rate") for p in summary["client_curve"]] == [0.375, 0.0]
    assert summary["truncation"]["training"] == [{"round": 1, "client": 0, "truncated_rate": 0.375}]
    assert summary["truncation"]["max_share"] == 0.375
    assert summary["truncation"]["note"].startswith(
        "some episodes were truncated (training in round(s) [1]; at most 38%")


def test_a_share_near_either_end_keeps_a_decimal() -> None:
    from fedagent_flwr.serverapp.truncation import percent

    assert [percent(s) for s in (0.0, 0.004, 0.5, 0.995, 1.0)] == ["0%", "0.4%", "50%", "99.5%", "100%"]
