"""Tracking sinks: the run record's events as TensorBoard scalars, read back from the event files."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.tracking import TENSORBOARD_DIR, scalars_of
from testkit.tensorboard_events import read_scalars


def test_the_record_reaches_tensorboard(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, {"base_model": "/m"}, tracking=("jsonl", "tensorboard"))
    recorder.record_eval(server_round=0, model="/m", metrics={"num-examples": 64, "success-rate": 0.0625,
                                                              "reward-mean": 0.0625, "score-mean": 0.25})
    recorder.complete_round(0)
    recorder.record_round(
        server_round=1, clients=[0, 1], started_from="/m", client_actors={0: "/c0", 1: "/c1"}, aggregated="/g1",
        rejected={}, client_metrics={0: {"num-examples": 512, "success-rate": 0.1, "verl.actor.entropy": 2.5},
                                     1: {"num-examples": 512, "success-rate": 0.2, "note": "text is skipped"}},
        update_stats={"mode": "full", "norm_ratio": 0.75, "mean_pairwise_cosine": 0.1, "num_params": 10},
    )
    recorder.record_eval(server_round=1, model="/g1", metrics={"num-examples": 64, "success-rate": 0.25,
                                                               "reward-mean": 0.25, "score-mean": 0.5})
    recorder.complete_round(1)
    recorder.finish()
    scalars = read_scalars(tmp_path / TENSORBOARD_DIR)
    assert scalars["val/success_rate"] == [(0, 0.0625), (1, 0.25)]
    assert scalars["val/score_mean"] == [(0, 0.25), (1, 0.5)]
    assert [step for step, _ in scalars["val/success_ci95_low"]] == [0, 1]
    assert scalars["val/episodes"] == [(0, 64.0), (1, 64.0)]
    assert scalars["client_0/verl.actor.entropy"] == [(1, 2.5)]
    assert scalars["client_1/success-rate"] == [(1, pytest.approx(0.2))]
    assert "client_1/note" not in scalars  # only numbers are scalars
    assert scalars["aggregate/norm_ratio"] == [(1, 0.75)] and scalars["aggregate/clients"] == [(1, 2.0)]
    assert "aggregate/mode" not in scalars
    assert [step for step, _ in scalars["time/round_seconds"]] == [1]  # round 0 is the base evaluation
    # metrics.jsonl is unchanged by tracking: the same events, none of the sinks' own
    assert [line.count('"event"') for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1] * 5


def test_events_without_numbers_give_no_scalars() -> None:
    assert scalars_of({"event": "resume", "round": 3}) == {}
    assert scalars_of({"event": "evaluate", "round": 0, "success_rate": float("nan")}) == {}


def test_tracking_is_checked_before_the_run() -> None:
    assert load_settings(overrides="tracking=[tensorboard]").tracking == ("jsonl", "tensorboard")
    assert load_settings().tracking == ("jsonl",)
    with pytest.raises(ConfigError, match=r"config key 'tracking' = \['neptune'\]: \['neptune'\] not available"):
        load_settings(overrides="tracking=[neptune]")
