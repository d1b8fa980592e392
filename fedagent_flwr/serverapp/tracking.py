"""Experiment tracking: the run record's events as scalars for TensorBoard (``tracking`` in the config).

The run record (:mod:`.recorder`) is the one source: every event it writes to ``metrics.jsonl``
(a client's training metrics, an aggregation with its update statistics, an evaluation, a round's
wall time) is also turned into named scalars at step = round and handed to each configured sink.
``jsonl`` is the record itself and is always written (resume reads it); ``tensorboard`` writes
event files under ``<run dir>/tensorboard`` (``tensorboard --logdir <run dir>``). ``wandb`` and
``mlflow`` need the ``tracking`` extra (``pip install 'fedagent-flwr[tracking]'``) and stay local
unless told otherwise: W&B runs offline under ``<run dir>/wandb`` (``wandb sync`` uploads it later)
unless ``WANDB_MODE`` says otherwise; MLflow writes to ``sqlite:///<run dir>/mlflow.db`` unless
``MLFLOW_TRACKING_URI`` names a server (``mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow.db``).
A run is named after its run directory.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from fedagent_flwr.atomic import write_json_atomic

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DB = "mlflow.db"
TRACKING_IDS = "tracking_ids.json"  # the W&B and MLflow run ids, so that a resumed run continues them
PROJECT = "fedagent_flwr"  # the W&B project and the MLflow experiment
# The package each tracker needs besides the default install (the ``tracking`` extra).
_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}


class Sink(Protocol):
    """Where scalars go besides ``metrics.jsonl``."""

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None for anything that is not a plain finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def scalars_of(event: dict[str, Any]) -> dict[str, float]:
    """The scalars one ``metrics.jsonl`` event stands for, by tag (``val/...``, ``client_<c>/...``
    (``client_<c>/val_...`` for per-client validation), ``aggregate/...``, ``time/...``); events of
    other kinds give none."""
    kind = event.get("event")
    out: dict[str, float] = {}
    if kind == "evaluate":
        for key in ("success_rate", "reward_mean", "score_mean", "truncated_rate"):
            if (value := _number(event.get(key))) is not None:
                out[f"val/{key}"] = value
        low_high = event.get("success_ci95") or []
        if len(low_high) == 2:
            out["val/success_ci95_low"], out["val/success_ci95_high"] = float(low_high[0]), float(low_high[1])
        if (n := _number(event.get("n"))) is not None:
            out["val/episodes"] = n
    elif kind == "client_val":  # a trained client's own model on the validation episodes
        client = event.get("client")
        for key in ("success_rate", "reward_mean", "score_mean", "truncated_rate", "n"):
            if (value := _number(event.get(key))) is not None:
                out[f"client_{client}/val_{'episodes' if key == 'n' else key}"] = value
    elif kind == "train":
        client = event.get("client")
        for key, raw in sorted((event.get("metrics") or {}).items()):
            if (value := _number(raw)) is not None:
                out[f"client_{client}/{key}"] = value
    elif kind == "aggregate":
        out["aggregate/clients"] = float(len(event.get("clients") or []))
        out["aggregate/rejected"] = float(len(event.get("rejected") or {}))
        for key, raw in sorted((event.get("update_stats") or {}).items()):
            if (value := _number(raw)) is not None:
                out[f"aggregate/{key}"] = value
    elif kind == "round_time":
        if (value := _number(event.get("wall_seconds"))) is not None:
            out["time/round_seconds"] = value
    return out


class TensorBoardSink:
    """Scalars as TensorBoard event files (torch's writer; flushed after every event, so a crashed
    run's curves are on disk up to its last event)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars as a W&B run (offline under ``<run dir>/wandb`` unless ``WANDB_MODE`` is set)."""

    def __init__(self, run_dir: Path) -> None:
        import wandb

        # A resumed run continues the same W&B run (its id is kept in the run directory).
        run_id = _stored_id(run_dir, "wandb", lambda: uuid.uuid4().hex[:16])
        self.run = wandb.init(project=PROJECT, name=run_dir.name, dir=str(run_dir), id=run_id, resume="allow",
                              mode=None if os.environ.get("WANDB_MODE") else "offline",  # set: wandb reads it
                              reinit="create_new")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def _stored_id(run_dir: Path, tracker: str, make: Callable[[], str]) -> str:
    """``tracker``'s run id recorded in ``run_dir`` (made with ``make`` and kept when absent)."""
    ids = _read_ids(run_dir)
    if tracker not in ids:
        made = make()
        if made:
            _store_id(run_dir, tracker, made)
        return made
    return str(ids[tracker])


def _read_ids(run_dir: Path) -> dict[str, Any]:
    try:
        ids = json.loads((run_dir / TRACKING_IDS).read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _store_id(run_dir: Path, tracker: str, run_id: str) -> None:
    write_json_atomic(run_dir / TRACKING_IDS, {**_read_ids(run_dir), tracker: run_id})


_MLFLOW_UNSAFE = re.compile(r"[^A-Za-z0-9_\-./ ]")


class MlflowSink:
    """Scalars as an MLflow run (``sqlite:///<run dir>/mlflow.db`` unless ``MLFLOW_TRACKING_URI``
    is set); the client API, so no global active run is left in the ServerApp's process."""

    def __init__(self, run_dir: Path) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir / MLFLOW_DB}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(PROJECT)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(PROJECT)
        # A resumed run continues the same MLflow run (its id is kept in the run directory).
        known = _stored_id(run_dir, "mlflow", lambda: "")
        if known and self._exists(known):
            self.run_id = known
            self.client.update_run(known, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            _store_id(run_dir, "mlflow", self.run_id)

    def _exists(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
        except Exception:  # noqa: BLE001  # MlflowException: another store, or the run was deleted
            return False
        return True

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # MLflow refuses names outside [A-Za-z0-9_-./ ] (a plugin's metric with '@' or '[' would
        # turn the sink off for the rest of the run); such characters become '_'.
        self.client.log_batch(self.run_id, metrics=[Metric(_MLFLOW_UNSAFE.sub("_", tag), value, now, step)
                                                    for tag, value in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def missing_packages(names: Sequence[str]) -> list[str]:
    """The trackers among ``names`` whose package is not installed (checked before the run starts)."""
    return [n for n in names if n in _PACKAGES and importlib.util.find_spec(_PACKAGES[n]) is None]


def open_sinks(names: Sequence[str], run_dir: Path) -> list[Sink]:
    """The sinks of ``names`` (the config's ``tracking`` list, checked by the config) for ``run_dir``."""
    sinks: list[Sink] = []
    if "tensorboard" in names:
        sinks.append(TensorBoardSink(run_dir / TENSORBOARD_DIR))
    if "wandb" in names:
        sinks.append(WandbSink(run_dir))
    if "mlflow" in names:
        sinks.append(MlflowSink(run_dir))
    return sinks
