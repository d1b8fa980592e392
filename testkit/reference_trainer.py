"""The CPU reference GRPO trainer as the tests run it: a real subprocess (``python -m
fedagent_flwr.trainers.reference``) on a train job written for the tiny model and TinyGuess.

Shared by the reference trainer's own tests, the persistent trainer's (which check that a
long-lived session gives the subprocess's checkpoints) and windowed mode's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from fedagent_flwr.clientapp.job import TrainJob, save

#: The module the trainer subprocess runs.
MODULE = "fedagent_flwr.trainers.reference"
#: Two TinyGuess envs of at most two turns: episodes short enough for the tiny model on CPU.
SPEC = {"envs": [{"name": "TinyGuess", "n_envs": 2, "max_turns": 2, "config": {"lo": 1, "hi": 50}}]}
# A learning rate this high moves the tiny model's weights measurably in two optimiser steps. The
# large entropy bonus gives every weight a gradient well above Adam's epsilon in the first step:
# with FedAgent's 0.001 most embedding rows barely move at first, and Adam's normalised step on
# the proximal gradient then overshoots the start by ~lr, so FedProx would not look "closer".
TRAINER = {"rollout_n": 2, "max_new_tokens": 8, "lr": 1e-2, "ppo_epochs": 2, "entropy_coeff": 0.1,
           "num_threads": 2}


def run_trainer(mode: str, job_path: Path) -> subprocess.CompletedProcess[str]:
    """Run the reference trainer's ``mode`` (``train`` or ``evaluate``) on the job at ``job_path`` in
    a fresh subprocess, as the ClientApp's subprocess mode does; its output is captured."""
    return subprocess.run([sys.executable, "-m", MODULE, mode, str(job_path)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))


def train_job(tmp: Path, model: Path, name: str, **overrides: Any) -> Path:
    """Write (to ``tmp/<name>.json``) a train job of client 1 of 2 on ``model`` with :data:`SPEC` and
    :data:`TRAINER`, writing to ``tmp/<name>``; ``overrides`` replace the job's fields."""
    job = TrainJob(model_path=str(model), output_dir=str(tmp / name), env_spec=SPEC, round=1,
                   client_id=1, num_clients=2, data_seed=42 + 100 + 1, local_steps=1,
                   partition={"strategy": "uniform", "min_goals_per_client": 10}, trainer=dict(TRAINER))
    for key, value in overrides.items():
        setattr(job, key, value)
    path = tmp / f"{name}.json"
    save(job, path)
    return path
