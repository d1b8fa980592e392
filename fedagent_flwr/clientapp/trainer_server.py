"""The persistent trainer's side of the node-local channel: one process serves many jobs.

``python -m <backend module> serve CHANNEL_DIR`` runs :func:`serve`: it keeps one
:class:`TrainerSession` (a loaded model, for verl a whole Ray cluster with FSDP workers and a vLLM
engine) alive across rounds, so the cold start is paid once per run instead of once per
client-round. The ClientApp (:mod:`.persistent`) talks to it through files in ``CHANNEL_DIR``,
which works the same from a SuperNode's ClientApp process and from whichever simulation actor
hosts the node this round:

* ``server.json``: written (atomically) when the server is up: its pid, the process start time
  (a :class:`~fedagent_flwr.procs.ProcessRef`, so a reused pid is never taken for it), the backend.
* ``inbox/<seq>.json``: one request, ``{"seq", "mode": "train"|"evaluate"|"stop", "job",
  "idle_timeout_s"}``, where ``job`` is the path of the same job file the subprocess path uses and
  ``idle_timeout_s`` (optional) the sender's ``trainer.persistent_idle_s``, which the server adopts
  from then on: the one setting of the ClientApp's that the server applies itself, so a change
  between jobs takes effect without a restart (and its cold start). Requests are served one at a
  time in ``seq`` order.
* ``outbox/<seq>.json``: the answer, ``{"seq", "ok", "kind", "error"}``; the result itself is the
  job's usual result file. ``kind`` is ``"bad_input"`` (the session is intact and keeps serving),
  ``"failed"`` (the session may be broken: the server answers, then exits, and the ClientApp
  starts a fresh one for the next job) or ``"settings_fixed"`` (:data:`SETTINGS_FIXED`: the
  session cannot take this job because settings it fixed when it started differ, as the session
  said by raising :class:`SessionSettingsFixed`; the answer's ``"settings"`` lists their names;
  the session is intact, and the ClientApp replaces the trainer and sends the job to the fresh one).
* ``server.log``: the server's output; every request's part is framed by ``== request <seq>``
  lines so the ClientApp can copy it into the round's own log.
* ``closing.json``: ``{"pid", "reason"}`` once the server will serve nothing more (stop, idle,
  failure, its node process gone);
  requests that arrive meanwhile are answered ``"not_served"`` (or ``"stopped"``) before it exits.
* ``leftovers.json``: command-line markers of processes the session starts outside the server's
  process group (a verl session's Ray cluster: its temp dir), written by the session through
  :func:`record_leftover_markers` before it starts them, so that the ClientApp can stop them if
  the server dies without cleaning up (SIGKILL, OOM kill).

The server exits on ``stop``, after a failure, after ``idle_timeout_s`` without a request, and,
between requests, as soon as the node's process that started it is gone (``$FEDAGENT_TRAINER_WATCH``:
a simulation's raylet; in deployment the SuperNode's ``flower-superexec``): a simulation that
ended without the shutdown message (a crash, a Ctrl-C, a stopped SuperLink) must not keep a GPU
for the idle timeout, where the next run's trainer would find it taken.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from fedagent_flwr.atomic import write_json_atomic
from fedagent_flwr.clientapp.job import EvalJob, EvalResult, JobFileError, TrainJob, TrainResult, load
from fedagent_flwr.procs import OwnerWatch, ProcessRef
from fedagent_flwr.schema.fields import SettingError
from fedagent_flwr.schema.trainer import ClientAppKeys

PROTOCOL = 1
SERVER_FILE = "server.json"
LOG_FILE = "server.log"
INBOX = "inbox"
OUTBOX = "outbox"
DEFAULT_IDLE_TIMEOUT_S = ClientAppKeys.persistent_idle_s
IDLE_ENV = "FEDAGENT_TRAINER_IDLE_S"  # the ClientApp passes trainer.persistent_idle_s here
CHANNEL_ENV = "FEDAGENT_TRAINER_CHANNEL"  # set by serve() in its own process, for the session
# The ProcessRef (JSON) of the process whose end ends the server (set by the ClientApp).
WATCH_ENV = "FEDAGENT_TRAINER_WATCH"
LEFTOVERS_FILE = "leftovers.json"
CLOSING_FILE = "closing.json"  # {"pid", "reason"}: this server serves nothing more and is about to exit
_POLL_S = 0.1
SETTINGS_FIXED = "settings_fixed"  # the answer's kind for a SessionSettingsFixed refusal


class SessionSettingsFixed(Exception):
    """Raised by a session that cannot take a job because settings it fixed when it started (a
    verl session: the algorithm, every ``trainer.*`` key) differ from the job's. Answered with kind
    :data:`SETTINGS_FIXED` and the names in ``settings``; the session stays intact (it may serve
    on), but a fresh trainer would take the job, so the ClientApp replaces it."""

    def __init__(self, message: str, settings: Sequence[str]) -> None:
        super().__init__(message)
        self.settings = [str(name) for name in settings]


class TrainerSession(Protocol):
    """A backend kept alive across jobs. ``train``/``evaluate`` have the subprocess path's contract
    (they also write the job's result file)."""

    def train(self, job: TrainJob) -> TrainResult: ...

    def evaluate(self, job: EvalJob) -> EvalResult: ...

    def close(self) -> None: ...


def serve(
    channel_dir: str | os.PathLike[str],
    session_factory: Callable[[], TrainerSession],
    backend: str,
    bad_input: tuple[type[BaseException], ...],
    failures: tuple[type[BaseException], ...] = (),
    idle_timeout_s: float | None = None,
) -> int:
    """Serve jobs from ``channel_dir`` until stopped, idle or broken; return the exit status
    (0 stopped or idle, 1 a job failed and the session was closed).

    ``bad_input`` errors are answered and the session keeps serving; ``failures`` (the backend's
    own "the job ran but produced nothing usable") and any other exception end the session.
    """
    if idle_timeout_s is None:
        try:
            idle_timeout_s = float(os.environ.get(IDLE_ENV, DEFAULT_IDLE_TIMEOUT_S))
        except ValueError:
            idle_timeout_s = DEFAULT_IDLE_TIMEOUT_S
    # SIGTERM (a timeout, the shutdown) must still close the session: verl's Ray cluster and vLLM
    # engine would otherwise outlive this process.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    channel = Path(channel_dir)
    os.environ[CHANNEL_ENV] = str(channel.resolve())
    inbox, outbox = channel / INBOX, channel / OUTBOX
    inbox.mkdir(parents=True, exist_ok=True)
    outbox.mkdir(parents=True, exist_ok=True)
    session = session_factory()
    pid = os.getpid()
    write_json_atomic(channel / SERVER_FILE, {
        "protocol": PROTOCOL, **ProcessRef.current().to_json(), "backend": backend,
        "started_at": time.time(),
    })
    try:  # the process named by $FEDAGENT_TRAINER_WATCH; unset or unreadable: no watch
        watched = ProcessRef.from_json(json.loads(os.environ.get(WATCH_ENV) or "null"))
    except ValueError:
        watched = None
    owner = OwnerWatch(watched) if watched else None
    print(f"trainer server ({backend}) pid {pid} serving {channel}"
          + (f", while {watched.describe()} runs" if watched else ""), flush=True)
    served, last_request = 0, time.monotonic()
    end = "crashed"  # why it serves no more, for closing.json (the ClientApp names it on a restart)
    try:
        while True:
            request = _next_request(inbox)
            if request is None:
                now = time.monotonic()
                if now - last_request > idle_timeout_s:
                    print(f"trainer server: idle for {idle_timeout_s:g} s, exiting", flush=True)
                    end = f"idle for {idle_timeout_s:g} s, trainer.persistent_idle_s"
                    return 0
                if watched and owner and owner.gone():
                    print(f"trainer server: {watched.describe()}, the node process that "
                          "started this trainer, is gone: the run ended without a shutdown; exiting", flush=True)
                    end = f"{watched.describe()} is gone"
                    return 0
                time.sleep(_POLL_S)
                continue
            path, body = request
            seq = int(path.stem)  # the file's name is the request's number
            idle_timeout_s = _adopt_idle_timeout(body, idle_timeout_s)
            print(f"== request {seq} {body.get('mode')} begin", flush=True)
            answer, keep_serving = _handle(body, session, bad_input, failures, served)
            answer["seq"] = seq
            if answer["ok"] and body.get("mode") in ("train", "evaluate"):
                served += 1
            print(f"== request {seq} {body.get('mode')} end ok={answer['ok']}", flush=True)
            write_json_atomic(outbox / f"{path.stem}.json", answer)
            path.unlink(missing_ok=True)
            last_request = time.monotonic()
            if not keep_serving:
                end = "stopped" if body.get("mode") == "stop" else f"its {body.get('mode')} job failed"
                return 0 if answer["ok"] else 1
    except _Terminated:
        end = "terminated"  # a timeout or the run's end: the job in hand is not to be redone
        raise
    finally:
        # Announce the end first: a request written from now on is answered "not served" (or is
        # sent to the successor by a ClientApp that read this), never left without an answer.
        write_json_atomic(channel / CLOSING_FILE, {"pid": pid, "reason": end})
        (channel / SERVER_FILE).unlink(missing_ok=True)
        try:
            session.close()
        finally:
            # Requests still waiting get "stopped" after a stop (the run is over: nothing to redo),
            # "not_served" otherwise (idle exit, a broken session, the node gone: the ClientApp
            # starts a fresh trainer and sends the job again).
            _answer_pending(inbox, outbox, "stopped" if end in ("stopped", "terminated") else "not_served")


def _adopt_idle_timeout(body: dict[str, Any], current: float) -> float:
    """The request's ``idle_timeout_s`` if it carries a valid one (a positive number), else ``current``."""
    wanted = body.get("idle_timeout_s")
    if isinstance(wanted, bool) or not isinstance(wanted, (int, float)) or not 0 < wanted < float("inf"):
        return current
    if float(wanted) != current:
        print(f"trainer server: idle timeout now {wanted:g} s (was {current:g} s; trainer.persistent_idle_s)",
              flush=True)
    return float(wanted)


def _answer_pending(inbox: Path, outbox: Path, kind: str) -> None:
    """Answer every request still in the inbox with ``kind`` (the server is going away)."""
    while (request := _next_request(inbox)) is not None:
        path, body = request
        if body.get("mode") in ("train", "evaluate"):
            write_json_atomic(outbox / f"{path.stem}.json", {
                "seq": body.get("seq"), "ok": False, "kind": kind,
                "error": "the trainer server was stopped before finishing this job" if kind == "stopped"
                else "the trainer server exited before serving this job",
            })
        path.unlink(missing_ok=True)


def record_leftover_markers(markers: list[str]) -> None:
    """Tell the ClientApp which processes to stop should this server die without cleaning up:
    those whose command line contains one of ``markers``. A no-op outside :func:`serve`."""
    channel = os.environ.get(CHANNEL_ENV)
    if channel:
        write_json_atomic(Path(channel) / LEFTOVERS_FILE, {"pid": os.getpid(), "markers": list(markers)})


class _Terminated(SystemExit):
    """SIGTERM: the ClientApp (a timeout) or the run's end stops this server."""


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated(128 + signum)


def _next_request(inbox: Path) -> tuple[Path, dict[str, Any]] | None:
    """The lowest-numbered request (temporary files of an ongoing write have no numeric stem)."""
    numbered = [p for p in inbox.glob("*.json") if p.stem.isdigit()]
    if not numbered:
        return None
    path = min(numbered, key=lambda p: int(p.stem))
    try:
        body = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return path, {"mode": "invalid", "error": f"unreadable request {path.name}: {exc}"}
    return path, body if isinstance(body, dict) else {"mode": "invalid", "error": "request is not an object"}


def _handle(body: dict[str, Any], session: TrainerSession, bad_input: tuple[type[BaseException], ...],
            failures: tuple[type[BaseException], ...], served: int) -> tuple[dict[str, Any], bool]:
    """Run one request; return (answer, whether to keep serving)."""
    mode = body.get("mode")
    if mode == "stop":
        return {"ok": True, "kind": "stopped", "error": ""}, False
    if mode not in ("train", "evaluate"):
        return {"ok": False, "kind": "bad_input", "error": body.get("error") or f"unknown request mode {mode!r}"}, True
    started = time.monotonic()
    try:
        if mode == "train":
            session.train(load(TrainJob, str(body["job"])))
        else:
            session.evaluate(load(EvalJob, str(body["job"])))
    except SessionSettingsFixed as exc:  # before bad_input: a backend may make it one of those too
        return {"ok": False, "kind": SETTINGS_FIXED, "error": " ".join(str(exc).split()),
                "settings": exc.settings}, True
    except (JobFileError, SettingError, *bad_input) as exc:  # type: ignore[misc]  # mypy cannot type a starred except tuple
        return {"ok": False, "kind": "bad_input", "error": " ".join(str(exc).split())}, True
    except failures as exc:  # the backend explains itself
        return {"ok": False, "kind": "failed", "error": " ".join(str(exc).split())[:800]}, False
    except Exception as exc:  # noqa: BLE001 - anything else may have broken the session
        traceback.print_exc()
        sys.stdout.flush()
        return {"ok": False, "kind": "failed", "error": " ".join(f"{type(exc).__name__}: {exc}".split())[:800]}, False
    print(f"trainer server: {mode} #{served + 1} done in {time.monotonic() - started:.2f} s", flush=True)
    return {"ok": True, "kind": "done", "error": ""}, True
