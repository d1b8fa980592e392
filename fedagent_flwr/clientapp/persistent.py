"""The ClientApp's side of the persistent trainer (``trainer.mode: persistent``).

A verl job spends minutes starting Ray, FSDP and vLLM before its first step (80% of a client
round on an H200); FedAgent measured the same and cut total time by 43-62% by keeping the trainer
alive. Here each node keeps one trainer process (``python -m <backend> serve CHANNEL``, see
:mod:`.trainer_server`) for the whole run and sends it one job file at a time, the same job files
the subprocess path uses.

* **Start** on the first job of the node; **track** it by pid and process start time in
  ``CHANNEL/process.json`` (and in the node's ``context.state``), so any process hosting the
  node's ClientApp (a simulation actor, a SuperNode's ``flwr-clientapp``) finds it again and a
  reused pid is never mistaken for it. Every start is appended to ``CHANNEL/starts.jsonl``.
* **Restart**: if the trainer is gone when a job arrives, a new one starts; if it dies during a
  job, that job is run again in a fresh subprocess (:class:`TrainerDied`, handled by the caller)
  and the next job starts a new trainer.
* **Stop** at the end of the run (the server's ``shutdown`` query), on a job timeout, or by itself
  after ``persistent_idle_s`` without a job.

The server's output is streamed to the node's log with the client's label and copied into the
job's own log file, exactly like a subprocess's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fedagent_flwr.atomic import write_json_atomic
from fedagent_flwr.clientapp.backend import BACKEND_MODULES, TrainerFailed, trainer_environment
from fedagent_flwr.clientapp.trainer_server import (
    IDLE_ENV,
    INBOX,
    LEFTOVERS_FILE,
    LOG_FILE,
    OUTBOX,
    process_start_ticks,
)
from fedagent_flwr.launch import pids_with_cmdline, stop_group

PROCESS_FILE = "process.json"
STARTS_FILE = "starts.jsonl"
_POLL_S = 0.2


class TrainerDied(TrainerFailed):
    """The persistent trainer process is gone (crashed, killed) before answering a job."""


def channel_dir(run_root: Path, client_id: int) -> Path:
    """The node-local channel of the trainer that serves ``client_id``."""
    return Path(run_root) / "trainers" / f"client_{client_id}"


class PersistentTrainer:
    """Handle on one node's long-lived trainer process, found again through its channel."""

    def __init__(self, backend: str, channel: Path, idle_timeout_s: float = 3600.0) -> None:
        """``backend`` is needed only to start a trainer (``""`` is fine for :meth:`stop`)."""
        self.backend = backend
        self.channel = Path(channel)
        self.idle_timeout_s = idle_timeout_s

    # -- process tracking ------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """What ``process.json`` says about the last started trainer ({} if none)."""
        try:
            return dict(json.loads((self.channel / PROCESS_FILE).read_text()))
        except (OSError, json.JSONDecodeError, TypeError, ValueError):
            return {}

    def alive_pid(self) -> int | None:
        """The pid of this node's trainer if that very process still runs, else None."""
        record = self.record()
        pid, ticks = record.get("pid"), record.get("start_ticks")
        if isinstance(pid, int) and ticks is not None and process_start_ticks(pid) == ticks:
            return pid
        return None

    def ensure_started(self) -> int:
        """The running trainer's pid; starts one (clearing a dead one's leftovers) if none runs."""
        pid = self.alive_pid()
        if pid is not None:
            return pid
        if self.backend not in BACKEND_MODULES:
            raise TrainerFailed(f"unknown trainer backend {self.backend!r} (known: {sorted(BACKEND_MODULES)})")
        previous = self.record().get("pid")
        reason = f"restart: trainer pid {previous} is gone" if previous else "first job"
        if previous:
            self._stop_leftovers(int(previous))  # a dead trainer's helpers must not hold the GPU
        for box in (INBOX, OUTBOX):  # requests and answers of a dead trainer mean nothing now
            for stale in (self.channel / box).glob("*"):
                stale.unlink(missing_ok=True)
        self.channel.mkdir(parents=True, exist_ok=True)
        env = trainer_environment()
        env[IDLE_ENV] = repr(float(self.idle_timeout_s))
        command = [sys.executable, "-m", BACKEND_MODULES[self.backend], "serve", str(self.channel)]
        with open(self.channel / LOG_FILE, "a") as log:
            # Its own session: a timeout or the shutdown stops the trainer's whole tree (a verl
            # session's Ray and vLLM processes included) and nothing else.
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True, stdin=subprocess.DEVNULL)
        # Reap it when it exits, so it never lingers as a zombie that looks alive.
        threading.Thread(target=process.wait, daemon=True).start()
        ticks = process_start_ticks(process.pid)
        starts = int(self.record().get("starts", 0)) + 1
        record = {"pid": process.pid, "start_ticks": ticks, "backend": self.backend, "starts": starts,
                  "started_at": time.time(), "reason": reason}
        write_json_atomic(self.channel / PROCESS_FILE, record)
        with open(self.channel / STARTS_FILE, "a") as history:
            history.write(json.dumps(record) + "\n")
        print(f"persistent trainer: started {self.backend} trainer pid {process.pid} ({reason}; start #{starts})",
              flush=True)
        return process.pid

    # -- jobs -------------------------------------------------------------------------------

    def run(self, mode: str, job_path: Path, log_path: Path, label: str, timeout_s: float) -> None:
        """Have the trainer run one job (``mode`` train|evaluate); return when its result is written.

        Raises TrainerDied if the trainer process disappears first (the caller falls back to a
        subprocess), TrainerFailed if the job failed, was rejected or timed out.
        """
        pid = self.ensure_started()
        log_file = self.channel / LOG_FILE
        offset = log_file.stat().st_size if log_file.exists() else 0
        seq = time.time_ns()
        answer_path = self.channel / OUTBOX / f"{seq}.json"
        write_json_atomic(self.channel / INBOX / f"{seq}.json", {"seq": seq, "mode": mode, "job": str(job_path)})
        deadline = time.monotonic() + timeout_s
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as own_log:
            tail = _LogFollower(log_file, offset, own_log, label)
            while True:
                tail.pump()
                if answer_path.exists():
                    tail.pump()
                    answer = json.loads(answer_path.read_text())
                    answer_path.unlink(missing_ok=True)
                    break
                if self.alive_pid() != pid:
                    time.sleep(_POLL_S)  # its last words may still be in flight
                    tail.pump()
                    if answer_path.exists():
                        continue
                    self._stop_leftovers(pid)
                    raise TrainerDied(f"{label}: the persistent {self.backend} trainer (pid {pid}) died during "
                                      f"the {mode} job: {tail.last_lines()} (log: {log_file})")
                if time.monotonic() > deadline:
                    self.stop(grace_s=20.0)
                    raise TrainerFailed(f"{label}: trainer killed after the {timeout_s:.0f} s timeout "
                                        f"(persistent trainer pid {pid}; log: {log_file})")
                time.sleep(_POLL_S)
        if not answer.get("ok"):
            what = "rejected the job" if answer.get("kind") == "bad_input" else "failed"
            raise TrainerFailed(f"{label}: {self.backend} trainer {what}: {answer.get('error')} (log: {log_path})")

    def stop(self, grace_s: float = 30.0) -> bool:
        """Ask the trainer to stop, kill its session after ``grace_s``; True if one was running."""
        pid = self.alive_pid()
        if pid is None:
            return False
        write_json_atomic(self.channel / INBOX / f"{time.time_ns()}.json", {"mode": "stop"})
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self.alive_pid() == pid:
            time.sleep(_POLL_S)
        if self.alive_pid() == pid:
            stop_group(pid, grace_s=10.0)
        self._stop_leftovers(pid)
        return True

    def _stop_leftovers(self, pid: int) -> None:
        """SIGKILL what a gone trainer left: its process group, and the processes its session
        declared in ``leftovers.json`` (a verl session's Ray cluster, which lives outside it)."""
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            declared = json.loads((self.channel / LEFTOVERS_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            return
        if not isinstance(declared, dict) or declared.get("pid") != pid:
            return  # another (earlier) trainer's declaration
        killed = []
        for marker in declared.get("markers", []):
            for leftover in pids_with_cmdline(str(marker)) if str(marker).strip() else []:
                if leftover != os.getpid():
                    try:
                        os.kill(leftover, signal.SIGKILL)
                        killed.append(leftover)
                    except ProcessLookupError:
                        pass
        if killed:
            print(f"persistent trainer: stopped {len(killed)} process(es) left by trainer pid {pid}", flush=True)

    def state(self) -> dict[str, Any]:
        """A summary for the node's ``context.state`` (pid, number of starts, channel)."""
        record = self.record()
        return {"pid": int(record.get("pid", -1)), "starts": int(record.get("starts", 0)),
                "channel": str(self.channel), "backend": self.backend}


class _LogFollower:
    """Copies what the server appends to its log (from ``offset`` on) into the job's log and the
    node's output, line by line with the client's label."""

    def __init__(self, path: Path, offset: int, sink: Any, label: str) -> None:
        self.path, self.offset, self.sink, self.label = path, offset, sink, label
        self.partial = ""
        self.recent: list[str] = []

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return
        self.offset += len(data)
        lines = (self.partial + data.decode(errors="replace")).split("\n")
        self.partial = lines.pop()
        for line in lines:
            self.sink.write(line + "\n")
            print(f"[{self.label}] {line}", flush=True)
            self.recent = (self.recent + [line])[-15:]
        self.sink.flush()

    def last_lines(self) -> str:
        text = " | ".join(line for line in self.recent if line.strip())
        return text[-800:] or "no output"

