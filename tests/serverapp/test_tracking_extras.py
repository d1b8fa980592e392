"""W&B and MLflow tracking (the ``tracking`` extra) in their local modes, read back from what they
wrote: W&B's offline run file, MLflow's SQLite store in the run directory. Each test is skipped,
saying so, where its package is not installed; selecting an absent one is a config error."""

from __future__ import annotations

import glob
import json
import struct
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.serverapp import tracking
from fedagent_flwr.serverapp.recorder import RunRecorder

ABSENT = "is not installed (pip install 'fedagent-flwr[tracking]')"


def record_two_rounds(run_dir: Path, trackers: tuple[str, ...]) -> None:
    """The base evaluation and one trained, aggregated and evaluated round."""
    recorder = RunRecorder(run_dir, {"base_model": "/m"}, tracking=trackers)
    recorder.record_eval(server_round=0, model="/m", metrics={"num-examples": 64, "success-rate": 0.0625,
                                                              "reward-mean": 0.0625, "score-mean": 0.25})
    recorder.complete_round(0)
    recorder.record_round(
        server_round=1, clients=[0], started_from="/m", client_actors={0: "/c0"}, aggregated="/g1", rejected={},
        client_metrics={0: {"num-examples": 512, "success-rate": 0.125}}, update_stats={"norm_ratio": 0.75},
    )
    recorder.record_eval(server_round=1, model="/g1", metrics={"num-examples": 64, "success-rate": 0.25,
                                                               "reward-mean": 0.25, "score-mean": 0.5})
    recorder.complete_round(1)
    recorder.finish()


def wandb_history(path: str) -> list[dict[str, Any]]:
    """The history rows of an offline W&B run file: W&B's record log (a 7-byte ``:W&B`` header, then
    32 KiB blocks of chunks with a 7-byte header: CRC32, little-endian length, type FULL=1, FIRST=2,
    MIDDLE=3, LAST=4), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.mark.skipif(find_spec("wandb") is None, reason=f"wandb {ABSENT}")
def test_wandb_records_the_run_offline_in_the_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    record_two_rounds(tmp_path, ("jsonl", "wandb"))
    # run.finish() returns once W&B's service has the run's last records, not once it has written
    # them: the run file can still hold only its 7-byte header (seen on a loaded machine). Stopping
    # the service (what the process's exit does) waits until the file is complete.
    import wandb

    wandb.teardown()
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = wandb_history(run_file)
    assert [(row["_step"], row["val/success_rate"]) for row in rows if "val/success_rate" in row] == [
        (0, 0.0625), (1, 0.25)]
    assert [row["client_0/success-rate"] for row in rows if "client_0/success-rate" in row] == [0.125]
    assert [row["aggregate/norm_ratio"] for row in rows if "aggregate/norm_ratio" in row] == [0.75]


@pytest.mark.skipif(find_spec("mlflow") is None, reason=f"mlflow {ABSENT}")
def test_mlflow_records_the_run_in_a_sqlite_store_in_the_run_directory(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "job"
    record_two_rounds(run_dir, ("jsonl", "mlflow"))
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / tracking.MLFLOW_DB}")
    experiment = client.get_experiment_by_name(tracking.PROJECT)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "job" and run.info.status == "FINISHED"
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/success_rate")]
    assert sorted(history) == [(0, 0.0625), (1, 0.25)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "client_0/success-rate")] == [0.125]


def test_a_tracker_whose_package_is_absent_is_refused_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(tracking._PACKAGES, "mlflow", "fedagent_no_such_package")
    with pytest.raises(ConfigError, match=r"\['mlflow'\] not installed on the ServerApp's machine; install the "
                                          r"tracking extra"):
        load_settings(overrides="tracking=[mlflow,tensorboard]")
    monkeypatch.undo()
    if find_spec("wandb") is not None:
        assert load_settings(overrides="tracking=[wandb]").tracking == ("jsonl", "wandb")


def test_mlflow_takes_a_metric_name_it_would_refuse_under_a_safe_spelling(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow", reason="the tracking extra is not installed")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    sink = tracking.MlflowSink(tmp_path)
    sink.log({"plugin@rule[0]": 0.5, "val/success_rate": 0.25}, 1)
    sink.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / tracking.MLFLOW_DB}")
    assert [m.value for m in client.get_metric_history(sink.run_id, "plugin_rule_0_")] == [0.5]
    assert [m.value for m in client.get_metric_history(sink.run_id, "val/success_rate")] == [0.25]


def test_a_resumed_run_continues_the_same_mlflow_and_wandb_runs(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow", reason="the tracking extra is not installed")
    pytest.importorskip("wandb", reason="the tracking extra is not installed")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_ids, wandb_ids = [], []
    for step in (1, 2):  # the first start, then a resume in the same run directory
        mlflow_sink, wandb_sink = tracking.MlflowSink(tmp_path), tracking.WandbSink(tmp_path)
        mlflow_sink.log({"val/success_rate": 0.25 * step}, step)
        wandb_sink.log({"val/success_rate": 0.25 * step}, step)
        mlflow_sink.close()
        wandb_sink.close()
        run_ids.append(mlflow_sink.run_id)
        wandb_ids.append(wandb_sink.run.id)
    assert run_ids[0] == run_ids[1] and wandb_ids[0] == wandb_ids[1]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / tracking.MLFLOW_DB}")
    (run,) = client.search_runs([client.get_experiment_by_name(tracking.PROJECT).experiment_id])
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/success_rate")) == [
        (1, 0.25), (2, 0.5)]
