"""`make run` for real: a Ctrl-C stops the run and the local SuperLink `flwr run` started for it.

Flower starts that SuperLink in a session of its own, so a Ctrl-C in the terminal reaches make, the
outcome wrapper and flwr's log stream only; before the wrapper stopped the SuperLink, the run went on
training in the background to `completed` and the SuperLink stayed up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fedagent_flwr.launch import local_superlink_pids, stop_local_superlink
from fedagent_flwr.procs import find_with_env
from testkit.flower_harness import REPO, free_port

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _cmdline(process: psutil.Process) -> str | None:
    """The command line of a live, non-zombie ``process``; None once it is gone."""
    with contextlib.suppress(psutil.Error):
        if process.status() != psutil.STATUS_ZOMBIE:
            return " ".join(process.cmdline())
    return None


def _wait_for(path: Path, text: str, make: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text(errors="replace"):
        assert make.poll() is None, f"make ended ({make.returncode}) before {text!r}:\n{path.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout_s:g} s:\n{path.read_text()[-4000:]}"
        time.sleep(0.5)


@pytest.mark.slow
def test_ctrl_c_stops_the_run_and_its_local_superlink(tmp_path: Path, tiny_model_dir: Path) -> None:
    flwr_home, log = tmp_path / "flwr", tmp_path / "make.log"
    venv = Path(sys.executable).parent.parent
    run_config = (f"num-server-rounds=20 model-path='{tiny_model_dir}' output-dir='{tmp_path / 'out'}' "
                  "run-name='job'")
    env = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    env.update(FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()), FLWR_LOCAL_CONTROL_API_PORT=str(free_port()))
    # -o install: the venv is this one, installed; make must not look at it (nor rebuild it)
    command = ["make", "-s", "-C", str(REPO), "-o", "install", "run", f"VENV={venv}", f"FLWR_HOME={flwr_home}",
               f'ARGS=--run-config "{run_config}"']
    with log.open("wb") as out:
        # A process group of its own, as a terminal's foreground job is: Ctrl-C signals all of it. And
        # SIGINT at its default, as in a terminal: a suite started in the background (`make test &`, a
        # CI runner) inherits it ignored, and an ignored SIGINT would reach no process of the run.
        make = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(log, "[fedagent] run directory:", make, timeout_s=240)
        assert local_superlink_pids(flwr_home), log.read_text()[-4000:]
        run_processes = find_with_env("FLWR_HOME", str(flwr_home))
        assert any("flwr-simulation" in (_cmdline(p) or "") for p in run_processes), run_processes
        os.killpg(make.pid, signal.SIGINT)
        make.wait(timeout=120)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
        stopped_here = stop_local_superlink(flwr_home)  # a failed test leaves no run behind either
    output = log.read_text(errors="replace")
    assert make.returncode != 0, output[-4000:]
    assert "[fedagent] interrupted: stopped following the run's log" in output, output[-4000:]
    assert "[fedagent] stopped the local SuperLink [" in output, output[-4000:]
    # Nothing of the run is left: the SuperLink, its executor, the simulation and Ray are all gone.
    assert stopped_here == [] and local_superlink_pids(flwr_home) == []
    deadline = time.monotonic() + 30  # gone, or a zombie its parent has not reaped yet
    while (alive := [p for p in run_processes if _cmdline(p) is not None]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive == []
    summary = (tmp_path / "out" / "job" / "federated_summary.json").read_text()
    assert '"status": "completed"' not in summary
