"""A run's outcome as an exit status (``python -m fedagent_flwr.outcome``), from real summaries
written by the recorder and from the ServerApp's log lines. ``tests/e2e/test_fail_fast.py`` runs the wrapper
around real `flwr run` simulations."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedagent_flwr.outcome import outcome_of_log
from fedagent_flwr.serverapp.recorder import RunRecorder


def _summary(run_dir: Path, status: str | None, reason: str = "") -> Path:
    recorder = RunRecorder(run_dir, {"run_id": 1, "base_model": "/m"})
    if status is not None:
        recorder.finish(status, reason)
    return run_dir


@pytest.mark.parametrize(("status", "reason", "code"), [
    ("completed", "", 0), ("degraded", "round(s) [1] aggregated no client checkpoint", 3),
    ("failed", "config key 'env.data_dir' = '/x': no data", 1), (None, "", 1),
])
def test_the_status_command_turns_a_summary_into_an_exit_status(
    tmp_path: Path, status: str | None, reason: str, code: int
) -> None:
    run_dir = _summary(tmp_path, status, reason)
    proc = subprocess.run([sys.executable, "-m", "fedagent_flwr.outcome", "status", str(run_dir)],
                          capture_output=True, text=True)
    assert proc.returncode == code, proc.stdout + proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line.startswith(f"[fedagent] run {status or 'failed'}") and reason in line
    missing = subprocess.run([sys.executable, "-m", "fedagent_flwr.outcome", "status", str(tmp_path / "nope")],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "does not exist" in missing.stdout


def test_the_outcome_of_a_log_is_its_run_directorys_summary_or_its_refusal(tmp_path: Path) -> None:
    degraded = _summary(tmp_path / "a", "degraded", "round(s) [2] aggregated no client checkpoint")
    log = ["\x1b[92mINFO \x1b[0m:      [fedagent] run directory: " + str(degraded) + "\n", "INFO : round 1\n"]
    assert outcome_of_log(log).exit_code == 3
    refused = ["\x1b[91mERROR \x1b[0m:     [fedagent] cannot start the run: unknown config key 'num_roundz'\n"]
    outcome = outcome_of_log(refused)
    assert (outcome.status, outcome.reason, outcome.exit_code) == ("failed", "unknown config key 'num_roundz'", 1)
    # A run directory another ServerApp holds keeps that run's record: the refusal is the outcome.
    busy = _summary(tmp_path / "b", None)
    busy_log = [f"INFO : [fedagent] run directory: {busy}\n",
                "ERROR : [fedagent] cannot start the run: another ServerApp is running the run in it\n"]
    assert outcome_of_log(busy_log).reason == "another ServerApp is running the run in it"
    assert outcome_of_log(["nothing of ours\n"]).exit_code == 1


# A stand-in for `flwr run --stream` of a run that failed: the ServerApp's last words, then a log
# stream that stays open (Flower winding the simulation down) until something stops it. It also
# ends once its parent (the wrapper) is gone, so a broken wrapper leaves nothing behind.
_STREAM_STAYS_OPEN = """
import os, sys, time
parent = os.getppid()
print("INFO :      [fedagent] run directory: " + sys.argv[1], flush=True)
print("ERROR :     [fedagent] run failed: round 1: every client (2) failed the same way", flush=True)
while os.getppid() == parent:
    time.sleep(0.1)
"""


def test_the_wrapper_stops_following_a_log_that_outlives_the_servers_last_words(tmp_path: Path) -> None:
    """Flower keeps a failed simulation's log stream open while it winds down (half a minute on a
    small machine): once the ServerApp has said the run failed, the wrapper stops following the
    stream and ends with the run's outcome, instead of waiting for a stream that ends on its own."""
    run_dir = _summary(tmp_path / "run", "failed", "round 1: every client (2) failed the same way")
    proc = subprocess.run([sys.executable, "-m", "fedagent_flwr.outcome", "run", "--",
                           sys.executable, "-c", _STREAM_STAYS_OPEN, str(run_dir)],
                          capture_output=True, text=True, timeout=120)  # a hang guard: the stream never ends by itself
    lines = proc.stdout.splitlines()
    assert lines[-2:] == [
        "[fedagent] the run has ended; stopped following its log (Flower ends the simulation by itself)",
        "[fedagent] run failed: round 1: every client (2) failed the same way "
        f"(summary: {run_dir / 'federated_summary.json'})",
    ], proc.stdout + proc.stderr
    assert proc.returncode == 1
