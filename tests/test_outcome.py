"""A run's outcome as an exit status (``python -m fedagent_flwr.outcome``), from real summaries
written by the recorder and from the ServerApp's log lines. ``tests/e2e/test_fail_fast.py`` runs the wrapper
around real `flwr run` simulations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.outcome import SUMMARY_FILE, SummaryError, load_summary, outcome_of_log
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


def _status(run: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedagent_flwr.outcome", "status", str(run)],
                          capture_output=True, text=True)


def test_a_mistyped_path_is_bad_input_and_a_run_directory_without_a_record_a_failed_run(tmp_path: Path) -> None:
    """Before, both were "run failed: ... does not exist: the run wrote no record" (exit 1)."""
    typo = _status(tmp_path / "nope")
    assert (typo.returncode, typo.stdout) == (2, ""), typo.stdout + typo.stderr
    assert typo.stderr == (f"python -m fedagent_flwr.outcome: {tmp_path / 'nope'} does not exist: check the path "
                           "(give a run directory holding federated_summary.json, or a summary file)\n")
    (tmp_path / "link").symlink_to(tmp_path / "gone")  # a link to nothing: no path to a run either
    assert _status(tmp_path / "link").returncode == 2
    empty = _status(tmp_path)  # a run directory whose run wrote no record: a failed run, as before
    assert (empty.returncode, empty.stderr) == (1, "")
    assert empty.stdout == f"[fedagent] run failed: {tmp_path / SUMMARY_FILE} does not exist: the run wrote no record\n"


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda s: {k: v for k, v in s.items() if k != "status"},
     " lacks key 'status' (every run record has it from its start)"),
    (lambda s: {**s, "status": None}, ": key 'status' is a JSON null, not a string"),
    (lambda s: list(s), " holds a JSON array, not an object"),
])
def test_a_summary_lacking_its_status_is_named_with_the_key_not_a_python_error(
    tmp_path: Path, edit: Callable[[dict[str, Any]], Any], problem: str
) -> None:
    """A real summary, edited: the line names the file and the key (before: "cannot be read:
    KeyError: 'status'"), from :func:`load_summary` (which ``compare`` reads summaries with too) and
    in ``status``'s line."""
    path = _summary(tmp_path, "completed") / SUMMARY_FILE
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    expected = (f"{path}{problem}: not a run's federated_summary.json as the ServerApp writes it; give that file "
                "or its run directory")
    with pytest.raises(SummaryError) as refused:
        load_summary(tmp_path)
    assert str(refused.value) == expected
    for given in (tmp_path, path):  # the run directory, or its summary file
        proc = _status(given)
        assert (proc.returncode, proc.stderr) == (1, ""), proc.stderr
        assert proc.stdout == f"[fedagent] run failed: {expected}\n"


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


@pytest.mark.parametrize(("run_config", "message"), [
    ("num-server-roundz=3", "run config key 'num-server-roundz' (did you mean 'num-server-rounds'?) is not declared "
                            "by the app ("),
    ("num-server-rounds=3 foo=1 bar=2", "run config keys 'bar', 'foo' are not declared by the app ("),
])
def test_a_run_config_key_the_app_does_not_declare_is_named_before_flower_starts(run_config: str, message: str) -> None:
    # Flower says only "Invalid run configuration" (code 15), after starting its SuperLink. The flwr
    # named here does not exist: the refusal must come before anything is started.
    repo = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "fedagent_flwr.outcome", "run", "--stop-local", str(repo / "no-such-home"), "--",
               "/nonexistent/flwr", "run", str(repo), "--stream", "--run-config", run_config]
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        f"[fedagent] cannot start the run: {message}{repo / 'pyproject.toml'}, [tool.flwr.app.config]); any other "
        "setting goes in overrides='key=value ...' (README, \"Configuration\")"]


def test_declared_run_config_keys_pass_the_check() -> None:
    from fedagent_flwr.outcome import undeclared_run_config

    repo = str(Path(__file__).resolve().parents[1])
    assert undeclared_run_config(["flwr", "run", repo, "--run-config", "num-server-rounds=3 overrides='seed=1'",
                                  "-c", "strategy='fedprox'"]) is None
    assert undeclared_run_config(["flwr", "run", repo, "--run-config=foo=1"]) is not None
    assert undeclared_run_config(["flwr", "ls"]) is None  # not a run: nothing to check
    # options before the app: which word is the app is Flower's to parse, so nothing is refused here
    assert undeclared_run_config(["flwr", "run", "--stream", "/elsewhere/app", "-c", "foo=2"]) is None


def wait_for_the_child(wrapper: subprocess.Popen[str], pid_file: Path) -> None:
    """Wait (up to a minute) until the wrapper's command has written its pid, failing the test with
    the wrapper's output if the wrapper ends first."""
    import time

    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert wrapper.poll() is None and time.monotonic() < deadline, wrapper.communicate()[0]
        time.sleep(0.1)


def test_a_sigterm_to_the_wrapper_stops_what_it_runs_and_exits_143(tmp_path: Path) -> None:
    """make, on its way out, or a closed terminal signals only the wrapper: it stops its command and
    the local SuperLink (none runs for this FLWR_HOME here) as at a Ctrl-C, with 128 + the signal."""
    import signal

    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    wrapper = subprocess.Popen([sys.executable, "-m", "fedagent_flwr.outcome", "run", "--stop-local",
                                str(tmp_path / "home"), "--", sys.executable, "-c", child],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_the_child(wrapper, pid_file)
    wrapper.send_signal(signal.SIGTERM)
    output = wrapper.communicate(timeout=60)[0]
    assert wrapper.returncode == 128 + signal.SIGTERM, output
    assert output.splitlines() == ["[fedagent] interrupted: stopped following the run's log",
                                   "[fedagent] no local SuperLink runs for this FLWR_HOME"]
    with pytest.raises(ProcessLookupError):  # the command was stopped (and reaped), not left running
        os.kill(int(pid_file.read_text()), 0)


def test_a_ctrl_c_without_stop_local_names_the_run_and_how_to_stop_it(tmp_path: Path) -> None:
    """Without --stop-local (a deployment's SuperLink) a Ctrl-C stops only the log stream; the run
    goes on, so the wrapper says which run it is and the `flwr stop` command that ends it."""
    import signal

    pid_file = tmp_path / "child.pid"
    child = ("import os, time; print('\\x1b[32mSuccessfully started run 4242\\x1b[0m', flush=True); "
             f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    # SIGINT back to its default, so Python turns it into KeyboardInterrupt even where the test
    # runner was started with it ignored (a background job)
    wrapper = subprocess.Popen([sys.executable, "-m", "fedagent_flwr.outcome", "run", "--",
                                sys.executable, "-c", child],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for_the_child(wrapper, pid_file)
    wrapper.send_signal(signal.SIGINT)
    output = wrapper.communicate(timeout=60)[0]
    assert wrapper.returncode == 130, output
    assert output.splitlines()[-2:] == [
        "[fedagent] interrupted: stopped following the run's log",
        "[fedagent] run 4242 is still running on its SuperLink; to stop it: flwr stop 4242"]


def test_the_stop_hint_names_the_superlink_connection_the_run_was_started_on() -> None:
    from fedagent_flwr.outcome import _stop_hint

    started = ["Loading project configuration...\n", "Successfully started run 7 in federation lab\n"]
    assert _stop_hint(["flwr", "run", ".", "lab", "--stream"], started) == (
        "[fedagent] run 7 is still running on its SuperLink; to stop it: flwr stop 7 lab")
    assert _stop_hint(["flwr", "run", ".", "--stream"], started) == (
        "[fedagent] run 7 is still running on its SuperLink; to stop it: flwr stop 7")
    assert _stop_hint(["flwr", "run", ".", "lab"], ["Loading project configuration...\n"]) is None
