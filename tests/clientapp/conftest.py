"""Helpers shared by the persistent-trainer tests of this folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedagent_flwr.clientapp.job import TrainJob, save


def scripted_job(tmp: Path, name: str, **trainer: Any) -> Path:
    """Write a train job for the scripted test backend (``testkit/scripted_backend.py``), whose
    ``trainer`` settings (``script``, ``close_s``, ``fixed``, ...) say what its session does."""
    job = TrainJob(model_path="unused", output_dir=str(tmp / name), env_spec={}, round=1, client_id=0,
                   num_clients=1, data_seed=1, trainer=trainer)
    path = tmp / f"{name}.json"
    save(job, path)
    return path
