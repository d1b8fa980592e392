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
  and the next job starts a new trainer. A small supervisor (:func:`~fedagent_flwr.procs.spawn_detached`)
  records the trainer's exit status in ``CHANNEL/exit.json``, so the error and the next start's
  record say how a trainer that left no last words ended, in the subprocess path's words
  (:func:`.backend.exit_reason`: a SIGKILL from outside is most likely the out-of-memory killer).
* **Stall**: a job whose output shows no progress for ``stall_timeout_s`` (the watchdog of
  :class:`.backend.ProgressWatch`: new lines other than known stall warnings) stops the trainer and
  is handled like a trainer that died during the job (:class:`TrainerStalled`): it runs again in a
  fresh subprocess, with what is left of its time.
* **Stop** at the end of the run (the server's ``shutdown`` query), on a job timeout, or by itself
  after ``persistent_idle_s`` (the latest job's: each job carries it) without a job or once the
  node process that started it is gone.
  The trainer is started detached (not a child of the ClientApp's process), so that a simulation
  actor's exit does not SIGKILL it before it has closed its session (verl's Ray and vLLM).
* **Code**: a trainer runs the code it imported when it started. Its record keeps the identity of
  that code (:func:`fedagent_flwr.code_identity.code_identity`: a hash of the package's ``.py``
  files, the interpreter, the ``PYTHONPATH`` it was given and the installed versions of the
  libraries it imports); a job whose ClientApp would start a trainer on other code (a resumed run
  of an updated app on a SuperNode that stayed up, an upgraded torch or verl in its venv) stops
  the old trainer and starts a new one, the record's reason saying what changed.
* **Session settings**: a backend's session may fix settings when it starts (verl: the algorithm
  and every ``trainer.*`` key). A job asking it for other values is answered ``settings_fixed``
  (:class:`.trainer_server.SessionSettingsFixed`, naming them), and the trainer is replaced as
  for a code change (stopped, a new one started, the record's reason naming the settings), once
  per job: a fresh trainer refusing the job as well fails it as bad input.

The server's output is streamed to the node's log with the client's label and copied into the
job's own log file, exactly like a subprocess's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from fedagent_flwr.atomic import write_json_atomic
from fedagent_flwr.clientapp.backend import (
    BACKEND_MODULES,
    ProgressWatch,
    TrainerFailed,
    TrainerOutput,
    exit_reason,
    trainer_environment,
)
from fedagent_flwr.clientapp.trainer_server import (
    CLOSING_FILE,
    IDLE_ENV,
    INBOX,
    LEFTOVERS_FILE,
    LOG_FILE,
    OUTBOX,
    SETTINGS_FIXED,
    WATCH_ENV,
)
from fedagent_flwr.code_identity import code_change, code_identity
from fedagent_flwr.procs import (
    ProcessRef,
    boot_id,
    find,
    group_members,
    signal_each,
    spawn_detached,
    started_since,
    stop_group,
)

PROCESS_FILE = "process.json"
STARTS_FILE = "starts.jsonl"
STOPPING_FILE = "stopping.json"  # written by stop(): a trainer that goes now was stopped, not crashed
EXIT_FILE = "exit.json"  # {"pid", "returncode"} of the last trainer that ended, by its supervisor (procs)
_POLL_S = 0.2


class TrainerDied(TrainerFailed):
    """The persistent trainer process is gone (crashed, killed) before answering a job."""


class TrainerStalled(TrainerDied):
    """The job made no progress for ``stall_timeout_s``; the trainer was stopped. Handled as a
    trainer that died during the job: the session may be what is stuck (issue 18: a verl session's
    vLLM worker waiting forever), so the job gets a fresh subprocess."""


# Taken when this process imports the module: by the time a trainer is started the parent may
# already be gone (a dying simulation), and os.getppid() would then name init or a subreaper.
# None under init (pid 1): nothing worth watching.
_PARENT_AT_IMPORT = ProcessRef.of(os.getppid()) if os.getppid() > 1 else None


def node_process() -> ProcessRef | None:
    """The process whose end means this node's run is over: the ClientApp process's parent.

    In simulation the ClientApp runs in a Ray actor, whose parent is the simulation's raylet; in
    deployment a ``flwr-clientapp`` lives for one message, but its parent (the SuperNode's
    ``flower-superexec``) lives on. The trainer watches it, so a simulation that ends without the
    shutdown message does not leave the trainer holding memory and GPU until its idle timeout.
    None under init (no parent worth watching). Raises :class:`TrainerFailed` if that parent is
    already gone: the run is over, and a trainer started now would watch the wrong process.
    """
    recorded = _PARENT_AT_IMPORT
    if recorded is None:
        return None
    if os.getppid() != recorded.pid or not recorded.alive():
        raise TrainerFailed(f"not starting a persistent trainer: {recorded.describe()}, "
                            "the node process of this ClientApp, is gone (the run is ending)")
    return recorded


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
        """The pid of this node's trainer if that very process still runs, else None (a channel
        on a shared filesystem may hold another host's record: its boot id tells)."""
        return self._live_pid(self.record())

    @staticmethod
    def _live_pid(record: dict[str, Any]) -> int | None:
        ref = ProcessRef.from_json(record)
        return ref.pid if ref is not None and ref.alive() else None

    def ensure_started(self) -> int:
        """The running trainer's pid; starts one (clearing a dead one's leftovers) if none runs,
        or if the one running serves another backend, runs other code than a trainer started now
        would (:func:`~fedagent_flwr.code_identity.code_change`: the app was updated, or another
        interpreter, PYTHONPATH or installed library version) or watches a node process that is gone.

        Nothing else of the ClientApp's settings is fixed in a running trainer: the job timeout and
        the stall watchdog are applied here, and ``trainer.persistent_idle_s`` travels with every
        job and is adopted by the server (:meth:`_exchange`), so a change of it takes effect
        without the cold start of a new trainer. What a backend's session fixes when it starts
        (verl: the algorithm and every trainer setting) is the backend's to check; a session
        refuses a job asking for other values, naming them, and :meth:`run` then replaces it.
        """
        record = self.record()
        pid = self._live_pid(record)
        orphaned = _watch_gone(record)
        env = trainer_environment()
        identity = code_identity(env)
        changed = code_change(record.get("code"), identity, "the trainer") if pid is not None else ""
        if pid is not None and record.get("backend") == self.backend and not orphaned and not changed:
            return pid
        if self.backend not in BACKEND_MODULES:
            raise TrainerFailed(f"unknown trainer backend {self.backend!r} (known: {sorted(BACKEND_MODULES)})")
        if pid is not None:
            # A trainer of another backend (the run's config changed on resume) or on other code
            # (the app was updated: its results would come from the code it imported at its start),
            # or one left by a killed run (its node process is gone: it would exit after one more
            # job); the latter may be busy with a job nobody waits for, so it gets SIGTERM (it
            # closes its session).
            if changed and not orphaned:
                print(f"persistent trainer: stopping trainer pid {pid}: {changed}", flush=True)
            self.stop(grace_s=0.0 if orphaned else 30.0, reason="" if orphaned else changed)
        previous = self.record()
        reason = "first job"
        if previous.get("pid"):
            reason = f"restart: trainer pid {previous['pid']} is gone"
            # Why it was stopped, if we stopped it for a reason (a stall); else why it ended itself.
            stopped = _marker(self.channel / STOPPING_FILE, previous["pid"]) or {}
            closing = _marker(self.channel / CLOSING_FILE, previous["pid"]) or {}
            ended = str(stopped.get("reason") or closing.get("reason") or "")
            if not ended and not stopped:  # no last words, and no ClientApp stopped it: how it ended
                ended = self._exit_reason(previous["pid"])
            if ended:  # it said why it ended (idle, failure, node gone, stopped), or how it was killed
                reason += f" ({ended})"
        self._stop_leftovers(previous)  # a dead trainer's helpers must not hold the GPU
        for box in (INBOX, OUTBOX):  # requests and answers of a dead trainer mean nothing now
            for stale in (self.channel / box).glob("*"):
                stale.unlink(missing_ok=True)
        self.channel.mkdir(parents=True, exist_ok=True)
        # The stop marker stays: it names the pid it was written for, so it never applies to the new
        # trainer, and a thread still waiting on the stopped one must find it (else the stop reads
        # as a crash, TrainerDied, and the job would be rerun).
        (self.channel / CLOSING_FILE).unlink(missing_ok=True)
        # Read above; it names a pid only, so it must not outlive its trainer (a new one with that pid).
        (self.channel / EXIT_FILE).unlink(missing_ok=True)
        env[IDLE_ENV] = repr(float(self.idle_timeout_s))
        watched = node_process()
        if watched is not None:
            env[WATCH_ENV] = json.dumps(watched.to_json())
        command = [sys.executable, "-m", BACKEND_MODULES[self.backend], "serve", str(self.channel)]
        with open(self.channel / LOG_FILE, "a") as log:
            # Its own session: a timeout or the shutdown stops the trainer's whole tree (a verl
            # session's Ray and vLLM processes included) and nothing else. Not our child: the
            # simulation actor that runs this ClientApp would SIGKILL it when the actor exits,
            # before it could close its session; it watches the node process instead.
            try:
                started = spawn_detached(command, env, log, exit_file=self.channel / EXIT_FILE)
            except OSError as exc:
                raise TrainerFailed(f"could not start the persistent {self.backend} trainer: {exc}") from None
        pid = started.pid
        starts = int(previous.get("starts", 0)) + 1
        record = {**started.to_json(), "backend": self.backend, "starts": starts, "started_at": time.time(),
                  "reason": reason, "watch": watched.to_json() if watched is not None else None,
                  "code": identity}
        write_json_atomic(self.channel / PROCESS_FILE, record)
        with open(self.channel / STARTS_FILE, "a") as history:
            history.write(json.dumps(record) + "\n")
        print(f"persistent trainer: started {self.backend} trainer pid {pid} ({reason}; start #{starts})",
              flush=True)
        return pid

    # -- jobs -------------------------------------------------------------------------------

    def run(self, mode: str, job_path: Path, log_path: Path, label: str, timeout_s: float,
            stall_timeout_s: float = 0.0) -> None:
        """Have the trainer run one job (``mode`` train|evaluate); return when its result is written.

        A trainer that exits without serving the job (idle exit, a broken session) gets it again
        once, from a fresh trainer; so does one whose session refuses the job for settings it fixed
        at its start (answer kind ``settings_fixed``), after it is stopped (:meth:`_replace`).
        Raises TrainerDied if the trainer process disappears in the middle of the job, or
        (TrainerStalled) if the job shows no progress for ``stall_timeout_s`` (0: never) and the
        trainer is stopped for it; the caller falls back to a subprocess.
        Raises TrainerFailed if the job failed, was rejected, timed out or the trainer was stopped
        on purpose (the run is over).
        """
        deadline = time.monotonic() + timeout_s
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as own_log:
            resent: set[str] = set()  # each of these answers gets the job sent again once
            while True:
                answer = self._exchange(mode, job_path, own_log, label, timeout_s, deadline, stall_timeout_s)
                kind = str(answer.get("kind"))
                if kind not in ("not_served", SETTINGS_FIXED) or kind in resent:
                    break
                resent.add(kind)
                if kind == SETTINGS_FIXED:
                    self._replace(answer, mode, own_log, label)
                else:
                    print(f"[{label}] the trainer exited before serving the {mode} job; starting a fresh one",
                          flush=True)
        if not answer.get("ok"):
            what = {"bad_input": "rejected the job", SETTINGS_FIXED: "rejected the job (a fresh trainer too)",
                    "stopped": "was stopped before finishing the job",
                    "not_served": "exited twice before serving the job"}.get(kind, "failed")
            raise TrainerFailed(f"{label}: {self.backend} trainer {what}: {answer.get('error')} (log: {log_path})")

    def _replace(self, answer: dict[str, Any], mode: str, own_log: Any, label: str) -> None:
        """Stop the trainer whose session refused a ``mode`` job for settings it fixed at its start
        (``answer``, kind ``settings_fixed``); the next exchange starts a fresh one, whose record
        gives the settings as its predecessor's end (as :meth:`ensure_started` does for code)."""
        names = [str(name) for name in answer.get("settings") or []]
        reason = (f"a {mode} job needs other values of settings fixed for its session's life: "
                  f"{', '.join(names) or 'unnamed'}")
        line = f"[{label}] replacing the persistent trainer (pid {self.alive_pid()}): {answer.get('error')}"
        print(line, flush=True)
        own_log.write(line + "\n")
        own_log.flush()
        self.stop(grace_s=30.0, reason=reason)

    def _exchange(self, mode: str, job_path: Path, own_log: Any, label: str, timeout_s: float,
                  deadline: float, stall_timeout_s: float = 0.0) -> dict[str, Any]:
        """Send one request to the (started) trainer and wait for its answer, watching its progress
        (everything the server logs from the request on, a fresh trainer's start-up included)."""
        self._wait_for_exit_of_a_closing_trainer(deadline)
        pid = self.ensure_started()
        log_file = self.channel / LOG_FILE
        offset = log_file.stat().st_size if log_file.exists() else 0
        seq = time.time_ns()
        answer_path = self.channel / OUTBOX / f"{seq}.json"
        # The current trainer.persistent_idle_s travels with every job: a live server adopts it,
        # so a change of it between jobs needs no new trainer (trainer_server's request format).
        write_json_atomic(self.channel / INBOX / f"{seq}.json", {"seq": seq, "mode": mode, "job": str(job_path),
                                                                 "idle_timeout_s": float(self.idle_timeout_s)})
        watch = ProgressWatch(stall_timeout_s)
        tail = _LogFollower(log_file, offset, own_log, label, watch)
        try:
            while True:
                tail.pump()
                if answer_path.exists():
                    tail.pump()
                    answer = dict(json.loads(answer_path.read_text()))
                    answer_path.unlink(missing_ok=True)
                    return answer
                if self.alive_pid() != pid:
                    time.sleep(_POLL_S)  # its last words may still be in flight
                    tail.pump()
                    if answer_path.exists():
                        continue
                    if _marker(self.channel / STOPPING_FILE, pid):
                        raise TrainerFailed(f"{label}: the persistent {self.backend} trainer (pid {pid}) was "
                                            f"stopped during the {mode} job (log: {log_file})")
                    self._stop_leftovers(self.record())
                    how = self._exit_reason(pid, wait_s=2.0)
                    raise TrainerDied(f"{label}: the persistent {self.backend} trainer (pid {pid}) died during "
                                      f"the {mode} job{f': it {how}' if how else ''}: {tail.last_lines()} "
                                      f"(log: {log_file})")
                if time.monotonic() > deadline:
                    self.stop(grace_s=20.0)
                    raise TrainerFailed(f"{label}: trainer killed after the {timeout_s:.0f} s timeout "
                                        f"(persistent trainer pid {pid}; log: {log_file})")
                stalled = watch.stalled()
                if stalled:
                    print(f"[{label}] stopping the persistent trainer (pid {pid}): {stalled}", flush=True)
                    # No grace: a server busy with a stuck job reads no stop request.
                    self.stop(grace_s=0.0, reason=f"no progress for {stall_timeout_s:.0f} s, trainer.stall_timeout_s")
                    raise TrainerStalled(f"{label}: the persistent {self.backend} trainer (pid {pid}) was stopped: "
                                         f"{stalled} (log: {log_file})")
                time.sleep(_POLL_S)
        finally:
            tail.close()

    def _exit_reason(self, pid: int, wait_s: float = 0.0) -> str:
        """How trainer ``pid`` ended (:func:`.backend.exit_reason`: its exit code, or the signal that
        killed it), from what its supervisor recorded; waits up to ``wait_s`` for that record
        (written as soon as the process is gone); "" if there is none."""
        deadline = time.monotonic() + wait_s
        while (ended := _marker(self.channel / EXIT_FILE, pid)) is None and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        code = (ended or {}).get("returncode")
        return exit_reason(code) if type(code) is int else ""

    def _wait_for_exit_of_a_closing_trainer(self, deadline: float) -> None:
        """A trainer that announced it is closing (idle exit, a failure) will serve nothing more:
        wait for it to go, so that the next request reaches its successor."""
        pid = self.alive_pid()
        while pid is not None and _marker(self.channel / CLOSING_FILE, pid) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            pid = self.alive_pid()

    def stop(self, grace_s: float = 30.0, reason: str = "") -> bool:
        """Ask the trainer to stop, kill its session after ``grace_s``; True if one was running.
        ``reason`` (e.g. a stall) is what the next start's record gives as its predecessor's end."""
        pid = self.alive_pid()
        if pid is None:
            return False
        # Whoever waits on this trainer must see a stop, not a crash (no fallback rerun).
        write_json_atomic(self.channel / STOPPING_FILE, {"pid": pid, "at": time.time(), "reason": reason})
        write_json_atomic(self.channel / INBOX / f"{time.time_ns()}.json", {"mode": "stop"})
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self.alive_pid() == pid:
            time.sleep(_POLL_S)
        if self.alive_pid() == pid:
            stop_group(pid, grace_s=10.0, kill_wait_s=10.0)
        self._stop_leftovers(self.record())
        return True

    def _stop_leftovers(self, record: dict[str, Any]) -> None:
        """SIGKILL what the gone trainer of ``record`` left behind: members of its process group
        and the processes its session declared in ``leftovers.json`` (a verl session's Ray
        cluster, which lives outside the group). Only processes of this boot that started after
        the trainer are touched, so a reused pid or group id is never hit."""
        trainer = ProcessRef.from_json(record)
        if trainer is None or trainer.boot != boot_id():
            return
        declared = _marker(self.channel / LEFTOVERS_FILE, trainer.pid) or {}
        markers = [str(m) for m in declared.get("markers", []) if str(m).strip()]
        victims = {p.pid: p for p in group_members(trainer.pid)}
        for marker in markers:
            victims.update((p.pid, p) for p in find(marker))
        killed = signal_each([p for pid, p in sorted(victims.items())
                              if pid != os.getpid() and started_since(p, trainer)])
        if killed:
            print(f"persistent trainer: stopped {killed} process(es) left by trainer pid {trainer.pid}", flush=True)

    def state(self) -> dict[str, Any]:
        """A summary for the node's ``context.state`` (pid, number of starts, channel)."""
        record = self.record()
        return {"pid": int(record.get("pid", -1)), "starts": int(record.get("starts", 0)),
                "channel": str(self.channel), "backend": self.backend}


def _watch_gone(record: dict[str, Any]) -> bool:
    """Whether ``record``'s trainer watches a node process that no longer runs."""
    watched = ProcessRef.from_json(record.get("watch"))
    return isinstance(record.get("watch"), dict) and (watched is None or not watched.alive())


def _marker(path: Path, pid: int) -> dict[str, Any] | None:
    """The JSON marker file ``path`` if it exists and names ``pid``, else None."""
    try:
        body = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return body if isinstance(body, dict) and body.get("pid") == pid else None


class _LogFollower:
    """Follows what the server appends to its log (from ``offset`` on) and passes it to a
    :class:`.backend.TrainerOutput`: into the job's log and the node's output, line by line with
    the client's label, each line also to ``watch`` (as a subprocess's output is)."""

    def __init__(self, path: Path, offset: int, sink: Any, label: str, watch: ProgressWatch | None = None) -> None:
        self.path, self.offset = path, offset
        self.output = TrainerOutput(sink, label, watch)

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return
        self.offset += len(data)
        self.output.feed(data)

    def close(self) -> None:
        """Emit an unfinished last line (output that ended without a newline)."""
        self.pump()
        self.output.close()

    def last_lines(self) -> str:
        return self.output.last_lines()
