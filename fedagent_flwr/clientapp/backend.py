"""Run a trainer backend as a subprocess and turn its failures into one readable error.

The trainer runs in its own process (never inside Flower's Ray actor or ``flwr-clientapp``
process) so that a crash, an out-of-memory kill or a CUDA fault costs one client-round, not the
node. Its output is streamed line by line to the node's log, prefixed with the client, and kept in
a log file beside the job.

**Progress watchdog** (``trainer.stall_timeout_s``, both modes, every backend): a job whose output
shows no progress for that long is stopped, with the reason "no progress for N s
(trainer.stall_timeout_s): last line: ...", instead of waiting for ``trainer.timeout_s`` (an hour).
*Progress* is a new output line that is not a known stall warning (:data:`STALL_WARNINGS`); a
progress bar's carriage-return update (tqdm's ``\r``) is a line too (:class:`TrainerOutput`). Why
output lines and not a heartbeat the trainer writes: the stall this catches (a verl session whose
vLLM worker waits forever, issue 18) leaves every process alive and their threads running, so a
heartbeat thread would keep beating; only the work itself can say it moved on, and the job's
output is where all of it speaks (verl's step lines, Ray's and vLLM's per-phase lines, the
reference trainer's rollout and step lines), at a far finer grain than verl's step lines alone (a
step can take minutes, the first one comes after the cold start). What such a stalled job does
print is the waiting messages of the layers underneath, repeated: those are listed in
:data:`STALL_WARNINGS` and do not count. A backend must therefore print a line at least once per
``stall_timeout_s`` while it works (the reference trainer prints rollout progress for that).
"""

from __future__ import annotations

import codecs
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, TextIO

from fedagent_flwr.clientapp.trainer_server import CHANNEL_ENV
from fedagent_flwr.procs import stop_group
from fedagent_flwr.schema.trainer import CLIENTAPP_TRAINER_KEYS  # noqa: F401  # re-exported: the ClientApp's own keys
from fedagent_flwr.trainers import BACKEND_MODULES  # the registry (trainer.backend -> module)


class TrainerFailed(RuntimeError):
    """The trainer subprocess exited non-zero, timed out or wrote no result."""


# Lines that layers under a trainer repeat while *waiting*: they show the job is stuck, not that
# it moved on, so the watchdog does not count them as progress.
STALL_WARNINGS = (
    # vLLM: the engine waits for a worker's answer (or a free ring-buffer block); logged once a
    # minute for as long as the worker is stuck (issue 18: a woken engine stuck in a weight update).
    re.compile(r"No available shared memory broadcast block found"),
    # vLLM's periodic stats line while requests are in flight but no token comes out.
    re.compile(r"Avg prompt throughput: 0\.0 tokens/s, Avg generation throughput: 0\.0 tokens/s"),
    # Ray: a task or actor waits for resources (GPUs, CPUs) that another job holds.
    re.compile(r"resource request cannot be scheduled right now"),
)
_QUOTE_CHARS = 300


def is_stall_warning(line: str) -> bool:
    """Whether ``line`` is one of the :data:`STALL_WARNINGS` (a sign of waiting, not progress)."""
    return any(pattern.search(line) for pattern in STALL_WARNINGS)


class ProgressWatch:
    """When a job last made progress, judged from its output lines (see the module docstring).

    ``stall_timeout_s`` <= 0 disables it. Fed by the thread that reads the output (:meth:`line`),
    asked by another (:meth:`stalled`); plain attribute updates, so no lock is needed.
    """

    def __init__(self, stall_timeout_s: float, clock: Any = time.monotonic) -> None:
        self.stall_timeout_s = float(stall_timeout_s)
        self.clock = clock
        self.last_progress = clock()
        self.last_line = ""
        self.warnings_since = 0
        self.last_warning = ""

    def line(self, text: str) -> None:
        """One line of the job's output."""
        text = text.rstrip()
        if not text.strip():
            return
        if is_stall_warning(text):
            self.warnings_since += 1
            self.last_warning = text
            return
        self.last_progress = self.clock()
        self.last_line = text
        self.warnings_since = 0

    def stalled(self) -> str:
        """The reason to stop the job if it made no progress for ``stall_timeout_s``, else ``""``."""
        if self.stall_timeout_s <= 0 or self.clock() - self.last_progress <= self.stall_timeout_s:
            return ""
        last = _quote(self.last_line) if self.last_line else "none (no output since the job started)"
        reason = f"no progress for {self.stall_timeout_s:.0f} s (trainer.stall_timeout_s): last line: {last}"
        if self.warnings_since:
            reason += (f"; since then only {self.warnings_since} stall warning(s), the last: "
                       f"{_quote(self.last_warning)}")
        return reason

    def poll_interval(self) -> float:
        """How often to ask :meth:`stalled` (a tenth of the timeout, at most 1 s)."""
        return max(0.05, min(1.0, self.stall_timeout_s / 10))


class TrainerOutput:
    """A trainer's output as it arrives, in byte chunks (a pipe's reads, what a log file grew by):
    each line goes to the job's log (``sink``), to the node's output with the client's ``label``,
    to the progress ``watch`` and to :attr:`recent` (the last lines, for error messages).

    Used by both trainer modes (a subprocess's pipe, a persistent trainer's log), so both judge
    progress alike. Lines end at ``\n``, ``\r\n`` or a lone ``\r``: a progress bar (tqdm) redraws
    itself after a ``\r`` without a newline, and each redraw is progress. A ``\r`` on an empty
    line is only the cursor moving back, so it makes no line; a UTF-8 character split between two
    chunks is decoded whole.
    """

    RECENT_LINES = 15

    def __init__(self, sink: TextIO, label: str, watch: ProgressWatch | None = None) -> None:
        self.sink, self.label, self.watch = sink, label, watch
        self.recent: deque[str] = deque(maxlen=self.RECENT_LINES)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""
        self._after_cr = False  # the last chunk ended with \r: a \n opening the next one is its pair

    def feed(self, data: bytes) -> None:
        """Take the next chunk of output; emit the lines it completes."""
        self._split(self._decoder.decode(data))

    def close(self) -> None:
        """Emit an unfinished last line (output that ended without a newline)."""
        self._split(self._decoder.decode(b"", final=True))
        rest, self._partial = self._partial, ""
        if rest:
            self._emit(rest)
            self.sink.flush()

    def last_lines(self) -> str:
        """The last non-blank lines, joined with `` | `` (at most 800 characters)."""
        text = " | ".join(line for line in self.recent if line.strip())
        return text[-800:] or "no output"

    def _split(self, text: str) -> None:
        if not text:
            return
        if self._after_cr and text.startswith("\n"):
            text = text[1:]
        self._after_cr = text.endswith("\r")
        pieces = re.split(r"(\r\n|\r|\n)", self._partial + text)
        self._partial = pieces.pop()
        emitted = False
        for line, end in zip(pieces[::2], pieces[1::2], strict=True):
            if line or end != "\r":
                self._emit(line)
                emitted = True
        if emitted:
            self.sink.flush()

    def _emit(self, line: str) -> None:
        if self.watch is not None:
            self.watch.line(line)
        self.sink.write(line + "\n")
        self.recent.append(line.rstrip())
        print(f"[{self.label}] {line.rstrip()}", flush=True)


def _quote(line: str) -> str:
    line = " ".join(line.split())
    return repr(line if len(line) <= _QUOTE_CHARS else line[:_QUOTE_CHARS] + "...")


def trainer_environment() -> dict[str, str]:
    """The subprocess environment: Flower's Ray variables removed so a trainer that starts its
    own Ray (verl) never joins Flower's simulation cluster by accident."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # A subprocess trainer is never a persistent trainer's session, even when this process is one
    # (or once served one): the channel variable would make a session think it is being served.
    env.pop(CHANNEL_ENV, None)
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
    stall_timeout_s: float = 0.0,
) -> None:
    """Run ``python -m <backend module> <mode> <job_path>``; raise TrainerFailed on failure.

    ``label`` names the client in progress lines and errors (e.g. ``client 1 round 2``). The job is
    stopped after ``timeout_s`` in all, or after ``stall_timeout_s`` without progress (0: never;
    see :class:`ProgressWatch`).
    """
    if backend not in BACKEND_MODULES:
        raise TrainerFailed(f"{label}: unknown trainer backend {backend!r} (known: {sorted(BACKEND_MODULES)})")
    command = [sys.executable, "-m", BACKEND_MODULES[backend], mode, str(job_path)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log_file:
        # A session of its own: on timeout the whole tree goes (a verl job's driver, Ray and
        # vLLM processes included), not just the backend's own process.
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=trainer_environment(),
            bufsize=0, start_new_session=True,
        )
        timed_out = threading.Event()
        watch = ProgressWatch(stall_timeout_s)
        output = TrainerOutput(log_file, label, watch)
        stalled: list[str] = []
        finished = threading.Event()

        def kill_on_timeout() -> None:
            timed_out.set()
            # SIGTERM first: a verl backend then stops its own job; SIGKILL after 20 s.
            stop_group(process.pid, grace_s=20.0)

        def kill_on_stall() -> None:
            while not finished.wait(watch.poll_interval()):
                reason = watch.stalled()
                if reason:
                    stalled.append(reason)
                    print(f"[{label}] stopping the trainer: {reason}", flush=True)
                    stop_group(process.pid, grace_s=20.0)
                    return

        timer = threading.Timer(timeout_s, kill_on_timeout)
        timer.start()
        watchdog = threading.Thread(target=kill_on_stall, daemon=True)
        if stall_timeout_s > 0:
            watchdog.start()
        try:
            assert process.stdout is not None
            # Whatever has arrived, not whole lines: a progress bar's redraw ends with no newline.
            while chunk := os.read(process.stdout.fileno(), 65536):
                output.feed(chunk)
            output.close()
            code = process.wait()
        finally:
            timer.cancel()
            finished.set()
            if watchdog.is_alive():
                watchdog.join()
            if process.poll() is None:
                stop_group(process.pid, grace_s=20.0)
                process.wait()
    if timed_out.is_set():
        raise TrainerFailed(f"{label}: trainer killed after the {timeout_s:.0f} s timeout (log: {log_path})")
    if stalled:
        raise TrainerFailed(f"{label}: {backend} trainer stopped: {stalled[0]} (log: {log_path})")
    if code != 0:
        # A backend that explains itself ("<prog>: error: ...") is quoted alone; otherwise the
        # output's last lines (a traceback) are.
        own = [line for line in output.recent if re.match(r"^[\w.-]+: error: ", line)]
        last = own[-1] if own else output.last_lines()
        raise TrainerFailed(f"{label}: {backend} trainer {exit_reason(code)}: {last} (log: {log_path})")


def exit_reason(code: int) -> str:
    """How a trainer process ended, in words: its exit status, or the signal that killed it (a
    negative ``returncode``). A SIGKILL that neither the timeout nor the watchdog sent (those are
    reported as such) came from outside, most often the kernel's out-of-memory killer: its last
    output lines are then ordinary progress and would not say so."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    reason = f"was killed by {name} (exit code {code})"
    if -code == signal.SIGKILL:
        reason += ", not by this ClientApp: most likely the out-of-memory killer (see dmesg or the node's memory)"
    return reason

