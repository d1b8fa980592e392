"""A run's outcome as an exit status, for ``make run`` and scripts.

``flwr run . --stream`` exits 0 whatever became of the run: it starts the run and streams its log,
and a failed ServerApp only shows up in that log (and as ``finished:failed`` in ``flwr ls``). The
run's own record, ``federated_summary.json``, says how it ended (``status``: ``completed``,
``degraded``, ``failed``, or ``running`` if the ServerApp died before writing its end). This module
turns that into an exit status::

    python -m fedagent_flwr.outcome status outputs/run-<id>       # one line, exit status below
    python -m fedagent_flwr.outcome run -- flwr run . --stream ...  # run it, pass the log through,
                                                                     # exit with the run's status
    python -m fedagent_flwr.outcome run --stop-local .flwr -- ...   # then, or at Ctrl-C, stop the
                                                                     # local SuperLink and its run

Exit status: 0 completed, 3 degraded (some round aggregated nothing or lost a selected client, no
round had a learning signal, or an evaluation recorded nothing or lacked a client), 1 failed, still
running or no record found (a run directory without a readable summary), 2 for ``status`` of a path
that does not exist (a typo, not a run); ``run`` returns flwr's own status when flwr itself failed. ``run``
finds the run directory in the ServerApp's ``[fedagent] run directory:`` log line; a run refused
before it had one (an unknown config key) is failed by its ``[fedagent] cannot start the run:`` line.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, Queue
from typing import Any

from fedagent_flwr.cli import program
from fedagent_flwr.procs import end_process

SUMMARY_FILE = "federated_summary.json"  # fedagent_flwr.serverapp.recorder.SUMMARY_FILE, without importing Flower
EXIT_COMPLETED, EXIT_FAILED, EXIT_DEGRADED = 0, 1, 3
EXIT_USAGE = 2  # ``status`` given a path that does not exist (argparse's own errors exit 2 too)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RUN_DIR = re.compile(r"\[fedagent\] run directory: (?P<value>.+?)\s*$")
_STARTED = re.compile(r"Successfully started run (?P<run_id>\d+)")
_CANNOT_START = re.compile(r"\[fedagent\] cannot start the run: (?P<value>.+?)\s*$")
# The ServerApp's last words when it stops early: the outcome is known from here on.
_ENDED = re.compile(r"\[fedagent\] (?:cannot start the run|run failed): ")
#: Seconds the log is still followed after the ServerApp's last words (see :func:`run_and_report`).
STOPPED_GRACE_S = 5.0


@dataclass(frozen=True)
class Outcome:
    """How a run ended: its status, why (empty when completed) and its summary file, if any."""

    status: str
    reason: str = ""
    summary: Path | None = None

    @property
    def exit_code(self) -> int:
        """0 completed, 3 degraded, 1 anything else (failed, still running, unknown)."""
        return {"completed": EXIT_COMPLETED, "degraded": EXIT_DEGRADED}.get(self.status, EXIT_FAILED)

    def line(self) -> str:
        """One line for a person: the status, why, and where the record is."""
        where = f" (summary: {self.summary})" if self.summary is not None else ""
        return f"[fedagent] run {self.status}{': ' + self.reason if self.reason else ''}{where}"


class SummaryError(ValueError):
    """A run's summary cannot be read; the message names the file and why, in one line."""


def summary_path(run: str | os.PathLike[str]) -> Path:
    """The summary file of ``run``: ``run/federated_summary.json`` for a run directory, ``run``
    itself for a file (a summary copied elsewhere, as ``docs/gpu-runs`` commits them)."""
    path = Path(run)
    return path if path.is_file() else path / SUMMARY_FILE


def load_summary(run: str | os.PathLike[str]) -> dict[str, Any]:
    """The summary of ``run`` (:func:`summary_path`) as the recorder wrote it, with a ``status``.

    The one reader of the file outside the ServerApp (``outcome``, ``compare``), so that a missing
    or torn record is reported alike. Raises :class:`SummaryError`."""
    path = summary_path(run)
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise SummaryError(f"{path} does not exist: the run wrote no record") from None
    except (OSError, ValueError) as exc:  # ValueError: not JSON (a torn write), or not UTF-8
        raise SummaryError(f"{path} cannot be read: {type(exc).__name__}: {exc}") from None
    # Read but not a run record: say which key is wrong, not how Python tripped over it.
    not_a_record = "not a run's federated_summary.json as the ServerApp writes it; give that file or its run directory"
    if not isinstance(summary, dict):
        raise SummaryError(f"{path} holds a JSON {json_kind(summary)}, not an object: {not_a_record}")
    if "status" not in summary:
        raise SummaryError(f"{path} lacks key 'status' (every run record has it from its start): {not_a_record}")
    if not isinstance(summary["status"], str):
        raise SummaryError(f"{path}: key 'status' is a JSON {json_kind(summary['status'])}, not a string: "
                           f"{not_a_record}")
    return summary


def json_kind(value: object) -> str:
    """JSON's name for the type of a parsed ``value`` (object, array, string, ...), for messages
    about a file a person wrote or edited, who knows the JSON words rather than Python's."""
    if isinstance(value, bool):  # before int: bool is an int in Python
        return "boolean"
    kinds = ((dict, "object"), (list, "array"), (str, "string"), ((int, float), "number"), (type(None), "null"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def read_outcome(run_dir: str | os.PathLike[str]) -> Outcome:
    """The outcome recorded in ``run_dir``'s summary; ``failed`` when there is no readable one."""
    path = summary_path(run_dir)
    try:
        summary = load_summary(run_dir)
    except SummaryError as exc:
        return Outcome("failed", str(exc))
    status = summary["status"]
    if status == "running":
        return Outcome("failed", "the run stopped without recording its end (status 'running'): the ServerApp "
                       "was killed or crashed; see its log", path)
    reason = str(summary.get("error") or summary.get("warning") or "")
    return Outcome(status, reason, path)


def outcome_of_log(lines: Sequence[str]) -> Outcome:
    """The outcome of the run whose ServerApp log is ``lines`` (one run's ``flwr run --stream``)."""
    run_dir = cannot_start = None
    for raw in lines:
        line = _ANSI.sub("", raw)
        if match := _RUN_DIR.search(line):
            run_dir = match.group("value")
        elif match := _CANNOT_START.search(line):
            cannot_start = match.group("value")
    recorded = read_outcome(run_dir) if run_dir is not None else None
    if cannot_start is not None:
        # The refusal is the outcome; the summary is named only when it records this refusal (a run
        # directory locked by another ServerApp, or holding another run, keeps that run's record).
        ours = recorded is not None and recorded.status == "failed" and recorded.reason == cannot_start
        return Outcome("failed", cannot_start, recorded.summary if ours and recorded else None)
    if recorded is not None:
        return recorded
    return Outcome("failed", "the log has no '[fedagent] run directory' line: the ServerApp did not start "
                   "(see the log above)")


def run_and_report(command: Sequence[str], grace_s: float = STOPPED_GRACE_S, stops_the_run: bool = False) -> int:
    """Run ``command`` (``flwr run ... --stream``), pass its output through, then print the run's
    outcome in one line and return its exit status (flwr's own when flwr failed).

    A Ctrl-C stops only the log stream: the run keeps running on its SuperLink, so unless the caller stops
    it (``stops_the_run``: ``--stop-local``), the message names the run and the ``flwr stop``
    command that ends it.

    Once the ServerApp has logged that the run cannot start or has failed, the outcome is known; in a
    simulation Flower still waits for Ray to come up before it ends the run (half a minute on a small
    machine), so after ``grace_s`` more seconds the log is no longer followed: ``flwr`` (the log
    stream, not the run) is stopped, and the simulation ends by itself.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the log as it comes, not in pipe-sized blocks
    lines: list[str] = []
    queue: Queue[str | None] = Queue()
    with subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace", env=env) as process:
        stream = process.stdout
        assert stream is not None

        def forward() -> None:  # a thread, so that the wait for more log can time out
            for text in stream:
                queue.put(text)
            queue.put(None)

        threading.Thread(target=forward, daemon=True).start()
        deadline: float | None = None
        stopped = False
        try:
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    line = queue.get(timeout=timeout)
                except Empty:
                    process.terminate()
                    stopped = True
                    print("[fedagent] the run has ended; stopped following its log (Flower ends the "
                          "simulation by itself)", flush=True)
                    break
                if line is None:
                    break
                sys.stdout.write(line)
                sys.stdout.flush()
                lines.append(line)
                if deadline is None and _ENDED.search(_ANSI.sub("", line)):
                    deadline = time.monotonic() + grace_s
        except KeyboardInterrupt:  # Ctrl-C reaches flwr too; a SIGTERM or SIGHUP (main) only this process
            end_process(process, grace_s=30)
            print("[fedagent] interrupted: stopped following the run's log", flush=True)
            if not stops_the_run and (hint := _stop_hint(command, lines)):
                print(hint, flush=True)
            return 130
        returncode = process.wait()
    if returncode != 0 and not stopped:
        print(f"[fedagent] {command[0]} exited with status {returncode}", flush=True)
        return returncode
    outcome = outcome_of_log(lines)
    print(outcome.line(), flush=True)
    return outcome.exit_code


def _stop_hint(command: Sequence[str], lines: Sequence[str]) -> str | None:
    """How to stop the run that ``command`` started, from flwr's "Successfully started run N" line
    (None before that line: no run was started yet, or flwr's wording changed)."""
    started = next((m for line in lines if (m := _STARTED.search(_ANSI.sub("", line)))), None)
    if started is None:
        return None
    # `flwr run [APP] [SUPERLINK]`: the connection name, if given, is the word after the app
    named = len(command) > 3 and command[1] == "run" and not any(word.startswith("-") for word in command[2:4])
    connection = f" {command[3]}" if named else ""
    run_id = started.group("run_id")
    return f"[fedagent] run {run_id} is still running on its SuperLink; to stop it: flwr stop {run_id}{connection}"


def undeclared_run_config(command: Sequence[str]) -> str | None:
    """Why ``flwr run`` will refuse this command's ``--run-config``, or None if it will not (or it
    cannot be told here: another app argument, a value Flower cannot parse; Flower answers those).

    A key the app does not declare gets only Flower's "Invalid run configuration" (code 15), after its
    SuperLink has started; this names the key, the closest declared one, and where other settings go.
    """
    if len(command) < 2 or command[1] != "run":
        return None
    if len(command) > 2 and command[2].startswith("-"):
        return None  # options before the app: which word is the app is Flower's to parse
    app = Path(command[2]) if len(command) > 2 else Path(".")
    values = [value for option, value in zip(command, command[1:]) if option in ("--run-config", "-c")]
    values += [word.split("=", 1)[1] for word in command if word.startswith("--run-config=")]
    try:
        from flwr.common.config import flatten_dict, get_project_config, parse_config_args

        # the keys as Flower reads and flattens them for its own check (fuse_dicts)
        declared = set(flatten_dict(get_project_config(app)["tool"]["flwr"]["app"]["config"]))
        given = parse_config_args(values) if values else {}
    except Exception:  # noqa: BLE001 - any fault here is Flower's to report, with its own words
        return None
    unknown = sorted(set(given) - declared)
    if not unknown:
        return None
    close = difflib.get_close_matches(unknown[0], sorted(declared), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    named = f"key {unknown[0]!r}{hint} is" if len(unknown) == 1 else f"keys {', '.join(map(repr, unknown))} are"
    return (f"run config {named} not declared by the app ({app / 'pyproject.toml'}, [tool.flwr.app.config]); "
            "any other setting goes in overrides='key=value ...' (README, \"Configuration\")")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=program("python -m fedagent_flwr.outcome"),
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="print a run directory's outcome; exit 0/3/1 (2: no such path)")
    status.add_argument("run_dir", type=Path)
    run = commands.add_parser("run", help="run `flwr run ... --stream` and exit with the run's outcome")
    run.add_argument("--stop-local", metavar="FLWR_HOME",
                     help="then stop this FLWR_HOME's local SuperLink and what it runs, also when interrupted "
                          "(make run: Ctrl-C stops the run, not only the log stream)")
    run.add_argument("flwr_command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "status":
        return _status(args.run_dir, parser.prog)
    command = args.flwr_command[1:] if args.flwr_command[:1] == ["--"] else args.flwr_command
    if not command:
        parser.error("run needs the flwr command, e.g. run -- flwr run . --stream")
    if problem := undeclared_run_config(command):
        print(f"[fedagent] cannot start the run: {problem}", flush=True)
        return EXIT_FAILED
    if args.stop_local is None:
        return run_and_report(command)
    return _run_then_stop_local(command, args.stop_local)


def _status(run: Path, prog: str) -> int:
    """``status``: print ``run``'s outcome and return its exit status, or 2 when ``run`` itself does
    not exist. A mistyped path is bad input, not a failed run: only a run directory that exists and
    holds no summary is a run that wrote no record (failed, 1). :func:`read_outcome` cannot tell the
    two apart for :func:`outcome_of_log`, whose run directory comes from the ServerApp's own log line
    (and may lie on another machine), so the check is here, on the path a person typed."""
    if not os.path.exists(run):  # a link to nothing leads nowhere either
        print(f"{prog}: {run} does not exist: check the path (give a run directory holding {SUMMARY_FILE}, "
              "or a summary file)", file=sys.stderr)
        return EXIT_USAGE
    outcome = read_outcome(run)
    print(outcome.line())
    return outcome.exit_code


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _run_then_stop_local(command: Sequence[str], flwr_home: str) -> int:
    """:func:`run_and_report`, then stop ``flwr_home``'s local SuperLink and the run on it, also when
    interrupted: that SuperLink runs in a session of its own, so a Ctrl-C reaches only flwr's log
    stream and the run would go on in the background. A SIGTERM (make's, on its way out) or a SIGHUP
    (the terminal closed) is taken as a Ctrl-C; the status is then 128 + the signal's number."""
    from fedagent_flwr.launch import stop_local_superlink

    received: list[int] = []
    stopping = False

    def interrupt(signum: int, frame: object) -> None:
        received.append(signum)
        # Once the stop has begun, a signal must not break it off: one caught between entering the
        # finally block and ignoring the signals below would otherwise skip stopping the SuperLink.
        if not stopping:
            raise KeyboardInterrupt

    for handled in _STOP_SIGNALS[1:]:
        signal.signal(handled, interrupt)
    try:
        status = run_and_report(command, stops_the_run=True)
    finally:
        stopping = True  # first, before any call: Python runs pending signal handlers after calls
        for handled in _STOP_SIGNALS:  # the stop is bounded (a grace period); let it finish
            signal.signal(handled, signal.SIG_IGN)
        pids = stop_local_superlink(flwr_home)
        print(f"[fedagent] stopped the local SuperLink {pids}, and the run on it if any" if pids
              else "[fedagent] no local SuperLink runs for this FLWR_HOME", flush=True)
    return 128 + received[0] if received else status


if __name__ == "__main__":
    sys.exit(main())
