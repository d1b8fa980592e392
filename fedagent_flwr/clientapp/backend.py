"""Run a trainer backend as a subprocess and turn its failures into one readable error.

The trainer runs in its own process (never inside Flower's Ray actor or ``flwr-clientapp``
process) so that a crash, an out-of-memory kill or a CUDA fault costs one client-round, not the
node. Its output is streamed line by line to the node's log, prefixed with the client, and kept in
a log file beside the job.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

# Trainer-group keys the ClientApp consumes itself; the rest are the backend's hyper-parameters.
CLIENTAPP_TRAINER_KEYS = ("backend", "timeout_s", "mode", "persistent_idle_s")
# subprocess: a fresh trainer process per (round, client) job; persistent: one per node, kept
# across rounds (:mod:`.persistent`).
TRAINER_MODES = ("subprocess", "persistent")

BACKEND_MODULES = {
    "reference": "fedagent_flwr.clientapp.reference_trainer",
    "verl": "fedagent_flwr.clientapp.verl_backend.entry",
}


class TrainerFailed(RuntimeError):
    """The trainer subprocess exited non-zero, timed out or wrote no result."""


def trainer_environment() -> dict[str, str]:
    """The subprocess environment: Flower's Ray variables removed so a trainer that starts its
    own Ray (verl) never joins Flower's simulation cluster by accident."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONUNBUFFERED"] = "1"
    # Run the same copy of the package as this ClientApp (Flower imports it from the installed
    # app bundle, which may differ from what site-packages holds).
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    return env


def run_trainer(
    backend: str,
    mode: str,
    job_path: Path,
    log_path: Path,
    label: str,
    timeout_s: float,
) -> None:
    """Run ``python -m <backend module> <mode> <job_path>``; raise TrainerFailed on failure.

    ``label`` names the client in progress lines and errors (e.g. ``client 1 round 2``).
    """
    if backend not in BACKEND_MODULES:
        raise TrainerFailed(f"{label}: unknown trainer backend {backend!r} (known: {sorted(BACKEND_MODULES)})")
    command = [sys.executable, "-m", BACKEND_MODULES[backend], mode, str(job_path)]
    tail: deque[str] = deque(maxlen=15)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log_file:
        # A session of its own: on timeout the whole tree goes (a verl job's driver, Ray and
        # vLLM processes included), not just the backend's own process.
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=trainer_environment(), bufsize=1, start_new_session=True,
        )
        timed_out = threading.Event()

        def kill_on_timeout() -> None:
            timed_out.set()
            _terminate_tree(process)

        timer = threading.Timer(timeout_s, kill_on_timeout)
        timer.start()
        try:
            assert process.stdout is not None
            for line in process.stdout:
                log_file.write(line)
                log_file.flush()
                tail.append(line.rstrip())
                print(f"[{label}] {line.rstrip()}", flush=True)
            code = process.wait()
        finally:
            timer.cancel()
            if process.poll() is None:
                _terminate_tree(process)
                process.wait()
    if timed_out.is_set():
        raise TrainerFailed(f"{label}: trainer killed after the {timeout_s:.0f} s timeout (log: {log_path})")
    if code != 0:
        # A backend that explains itself ("<prog>: error: ...") is quoted alone; otherwise the
        # output's last lines (a traceback) are.
        own = [line for line in tail if re.match(r"^[\w.-]+: error: ", line)]
        last = own[-1] if own else " | ".join(line for line in tail if line)[-800:]
        raise TrainerFailed(f"{label}: {backend} trainer exited with code {code}: {last} (log: {log_path})")


def _terminate_tree(process: subprocess.Popen[str]) -> None:
    """SIGTERM the backend's session (the verl backend then stops its own job), SIGKILL after 20 s."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
