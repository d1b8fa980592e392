"""Start, find again, health-check, restart and stop an env service subprocess.

A Flower deployment runs every message of a ClientApp in a fresh process, so the process that
needs the service in round 5 is not the one that started it in round 1. The manager therefore
keeps a small JSON state file (pid, process group, the process's kernel start time, URL, log file
and how to launch it again) and :meth:`EnvServiceManager.attach` rebuilds a manager from it in
any later process: health-check and reuse the service, restart it if it died, or stop it.

The service runs in its own session and process group, so :meth:`EnvServiceManager.stop` takes
down everything it started (SIGTERM, then SIGKILL after a grace period) and nothing else. The
recorded start time guards against a recycled pid: a state file left by a crashed run never
makes the manager signal an unrelated process that happens to have the same pid now.

Linux only (``/proc``), like the rest of the training stack.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from fedagent_flwr.atomic import write_json_atomic
from fedagent_flwr.launch import is_live_process, proc_stat, process_group_members, process_start_ticks

_POLL_S = 0.05  # start-up and shutdown polling interval; short, since start-up is usually ~1 s
_SERVER_MODULE = "fedagent_flwr.envs.service.server"
# Runs a module of this package under another interpreter: argv[1] is the directory holding the
# package (appended, so that interpreter's own packages win), argv[2] the module.
_FOREIGN_BOOTSTRAP = (
    "import runpy, sys; sys.path.append(sys.argv.pop(1)); "
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)


def module_command(module: str, interpreter: str) -> list[str]:
    """``python -m module`` for a module of this package under ``interpreter``, which need not
    have the package installed (an env's own virtual environment)."""
    package_root = str(Path(__file__).resolve().parents[3])
    return [interpreter, "-c", _FOREIGN_BOOTSTRAP, package_root, module]


class EnvServiceError(RuntimeError):
    """The env service could not be started, found, or reached."""


@dataclass(frozen=True)
class ServiceLaunch:
    """Everything needed to (re)start one env service process."""

    env: str
    config: dict[str, Any] = field(default_factory=dict)
    pool_size: int = 4
    partition: dict[str, Any] = field(default_factory=dict)
    variant: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    create_timeout_s: float | None = None
    max_body_bytes: int | None = None
    log_level: str = "warning"
    owner_pid: int | None = None  # the service exits when this process is gone
    # An interpreter other than the caller's (an env's own virtual environment, e.g. ALFWorld's);
    # the directory holding this package is appended to its sys.path, after its own packages.
    interpreter: str | None = None

    def command(self, ready_file: Path, python: str) -> list[str]:
        """The command line of the server module for this launch."""
        head = module_command(_SERVER_MODULE, self.interpreter) if self.interpreter else [python, "-m", _SERVER_MODULE]
        cmd = [
            *head,
            "--env", self.env,
            "--config", json.dumps(self.config, sort_keys=True),
            "--partition", json.dumps(self.partition, sort_keys=True),
            "--variant", json.dumps(self.variant, sort_keys=True),
            "--pool", str(self.pool_size),
            "--host", self.host,
            "--port", "0",
            "--ready-file", str(ready_file),
            "--log-level", self.log_level,
        ]
        if self.create_timeout_s is not None:
            cmd += ["--create-timeout", str(self.create_timeout_s)]
        if self.max_body_bytes is not None:
            cmd += ["--max-body-bytes", str(self.max_body_bytes)]
        if self.owner_pid is not None:
            cmd += ["--owner-pid", str(self.owner_pid)]
        return cmd


# --- /proc helpers ------------------------------------------------------------------------------

def _reap(pid: int, wait_s: float = 0.0) -> None:
    """Collect ``pid``'s exit status if this process is its parent, waiting up to ``wait_s``.

    Only the parent can reap; in any other process the child is init's (or a subreaper's) job.
    Waiting matters: a killed multi-threaded process shows as a zombie before its last thread is
    gone, and until then it cannot be reaped.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reaped, _status = os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            return  # not our child, or already reaped
        if reaped or time.monotonic() >= deadline:
            return
        time.sleep(_POLL_S)


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class EnvServiceManager:
    """Owns one env service process, across processes, through its state file.

    Typical use in a ClientApp message handler (fresh process each time)::

        manager = EnvServiceManager.attach_or_create(state_file, launch)
        url = manager.ensure_running()   # starts, reuses, or restarts
        ...
        manager.stop()                   # at the end of the run
    """

    def __init__(
        self,
        launch: ServiceLaunch,
        state_file: str | os.PathLike[str],
        *,
        startup_timeout_s: float = 120.0,
        stop_grace_s: float = 10.0,
        python: str = sys.executable,
    ) -> None:
        self.launch = launch
        self.state_file = Path(state_file)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.python = python
        self._popen: subprocess.Popen[bytes] | None = None

    # --- paths and state ------------------------------------------------------------------

    @property
    def log_file(self) -> Path:
        """Where the service's stdout and stderr go (appended across restarts)."""
        return self.state_file.with_name(self.state_file.name + ".log")

    @property
    def _ready_file(self) -> Path:
        return self.state_file.with_name(self.state_file.name + ".ready")

    @property
    def _lock_file(self) -> Path:
        return self.state_file.with_name(self.state_file.name + ".lock")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # Two messages on one node may both try to (re)start the service; one wins, one reuses.
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_file, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _load_state(self) -> dict[str, Any] | None:
        try:
            state = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as exc:
            raise EnvServiceError(f"env service state file {self.state_file} is unreadable: {exc}") from None
        return state

    @property
    def url(self) -> str:
        """The recorded service URL; raises if no service is recorded or it is still starting."""
        # Read the file every time: another process may have restarted the service meanwhile.
        state = self._load_state()
        if not state:
            raise EnvServiceError(f"no env service recorded in {self.state_file}; call ensure_running()")
        if not state.get("url"):
            raise EnvServiceError(f"env service in {self.state_file} is still starting (no URL yet)")
        return str(state["url"])

    @property
    def pid(self) -> int | None:
        """Pid of the recorded service process, if any."""
        state = self._load_state()
        return int(state["pid"]) if state else None

    @classmethod
    def attach(
        cls,
        state_file: str | os.PathLike[str],
        *,
        startup_timeout_s: float = 120.0,
        stop_grace_s: float = 10.0,
        python: str = sys.executable,
    ) -> EnvServiceManager:
        """A manager for the service recorded in ``state_file`` by an earlier (other) process."""
        path = Path(state_file)
        try:
            state = json.loads(path.read_text())
            launch = ServiceLaunch(**state["launch"])
        except FileNotFoundError:
            raise EnvServiceError(f"no env service state file at {path}") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise EnvServiceError(f"env service state file {path} is unreadable: {exc}") from None
        return cls(launch, path, startup_timeout_s=startup_timeout_s, stop_grace_s=stop_grace_s, python=python)

    @classmethod
    def attach_or_create(
        cls,
        state_file: str | os.PathLike[str],
        launch: ServiceLaunch,
        **kwargs: Any,
    ) -> EnvServiceManager:
        """Attach to the recorded service if it was launched with ``launch``; else a new manager.

        A recorded service with a different launch (another partition, say) is stopped first,
        so a client never silently trains against a world it did not ask for.
        """
        path = Path(state_file)
        if path.exists():
            try:
                existing = cls.attach(path, **kwargs)
            except EnvServiceError:
                existing = None
            # The owner is whoever started the service; another process of the same node may ask
            # for the same service (a simulation node can move between Ray actors).
            if existing is not None and replace(existing.launch, owner_pid=None) == replace(launch, owner_pid=None):
                return existing
            if existing is not None:
                existing.stop()
        return cls(launch, path, **kwargs)

    # --- liveness ---------------------------------------------------------------------------

    def _process_alive(self, state: Mapping[str, Any]) -> bool:
        pid = int(state["pid"])
        _reap(pid)
        # A different start time means the pid now belongs to some other process.
        return is_live_process(pid, state.get("start_ticks"))

    def health(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The service's ``/health`` reply; raises :class:`EnvServiceError` if unreachable."""
        try:
            response = httpx.get(f"{self.url}/health", timeout=timeout_s)
            response.raise_for_status()
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise EnvServiceError(f"env service at {self.url} is not healthy: {exc}") from None
        if not isinstance(body, dict):
            raise EnvServiceError(f"env service at {self.url} sent a malformed /health reply")
        return body

    def is_alive(self) -> bool:
        """True if the recorded process runs and its ``/health`` says it is ready."""
        state = self._load_state()
        if not state or not self._process_alive(state):
            return False
        try:
            return bool(self.health().get("ready"))
        except EnvServiceError:
            return False

    # --- lifecycle --------------------------------------------------------------------------

    def ensure_running(self) -> str:
        """Reuse the recorded service if it is alive and ready; otherwise (re)start it. Returns the URL."""
        with self._locked():
            if self.is_alive():
                return self.url
            self._stop_unlocked()
            return self._start_unlocked()

    def start(self) -> str:
        """Start a fresh service (stopping any recorded one first) and return its URL."""
        with self._locked():
            self._stop_unlocked()
            return self._start_unlocked()

    def _start_unlocked(self) -> str:
        self._ready_file.unlink(missing_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_file, "ab") as log:
            log.write(f"\n=== starting env service {self.launch.env} at {time.ctime()} ===\n".encode())
            log.flush()
            popen = subprocess.Popen(
                self.launch.command(self._ready_file, self.python),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # own session and process group: stop() reaches it all
                env=env,
            )
        self._popen = popen
        state: dict[str, Any] = {
            "pid": popen.pid,
            "pgid": popen.pid,
            "start_ticks": process_start_ticks(popen.pid),
            "url": None,
            "log_file": str(self.log_file),
            "launch": asdict(self.launch),
            "started_at": time.time(),
        }
        # Recorded before waiting, so a crash while waiting still leaves a stoppable record.
        write_json_atomic(self.state_file, state)
        try:
            state["url"] = self._wait_ready(popen)
        except BaseException:
            self._stop_unlocked()
            raise
        write_json_atomic(self.state_file, state)
        return str(state["url"])

    def _wait_ready(self, popen: subprocess.Popen[bytes]) -> str:
        deadline = time.monotonic() + self.startup_timeout_s
        url: str | None = None
        last_problem = "no ready file yet"
        while time.monotonic() < deadline:
            code = popen.poll()
            if code is not None:
                raise EnvServiceError(
                    f"env service {self.launch.env} exited with code {code} before it was ready; "
                    f"log {self.log_file}:\n{_log_tail(self.log_file)}"
                )
            if url is None and self._ready_file.exists():
                url = self._ready_file.read_text().strip() or None
            if url is not None:
                try:
                    body = httpx.get(f"{url}/health", timeout=5.0).json()
                except (httpx.HTTPError, ValueError) as exc:
                    last_problem = f"/health not answering: {exc}"
                else:
                    if body.get("error"):
                        raise EnvServiceError(
                            f"env service {self.launch.env} failed to start: {body['error']}; log {self.log_file}"
                        )
                    if body.get("ready"):
                        return url
                    last_problem = "pool still warming up"
            time.sleep(_POLL_S)
        raise EnvServiceError(
            f"env service {self.launch.env} not ready within {self.startup_timeout_s:g} s ({last_problem}); "
            f"log {self.log_file}:\n{_log_tail(self.log_file)}"
        )

    def stop(self) -> None:
        """Stop the recorded service and everything in its process group; a no-op if none runs."""
        with self._locked():
            self._stop_unlocked()

    def _stop_unlocked(self) -> None:
        state = self._load_state()
        if state:
            self._terminate_group(state)
            self.state_file.unlink(missing_ok=True)
        self._ready_file.unlink(missing_ok=True)
        popen, self._popen = self._popen, None
        if popen is not None and popen.poll() is None and (not state or int(state["pid"]) != popen.pid):
            # Our own child, but no longer the recorded one (state file removed or replaced).
            self._terminate_group({"pid": popen.pid, "pgid": popen.pid,
                                   "start_ticks": process_start_ticks(popen.pid)})
        if popen is not None:
            popen.poll()  # lets subprocess record the exit status it may already have reaped

    def _terminate_group(self, state: Mapping[str, Any]) -> None:
        pid, pgid = int(state["pid"]), int(state["pgid"])
        leader = proc_stat(pid)
        if leader is not None and leader[2] != state.get("start_ticks"):
            return  # pid (and so the group id) was recycled by an unrelated process: hands off
        # With the leader gone, remaining members still prove the group is ours: Linux does not
        # reuse a pid while a process group of that id exists.
        for sig, wait_s in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, self.stop_grace_s)):
            if not self._group_alive(pid, pgid):
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self._group_alive(pid, pgid):
                time.sleep(_POLL_S)
        _reap(pid, wait_s=self.stop_grace_s)
        if self._group_alive(pid, pgid):
            raise EnvServiceError(f"env service process group {pgid} survived SIGKILL")

    @staticmethod
    def _group_alive(pid: int, pgid: int) -> bool:
        _reap(pid)
        return bool(process_group_members(pgid))

    def __enter__(self) -> EnvServiceManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
