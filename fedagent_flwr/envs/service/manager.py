"""Start, find again, health-check, restart and stop an env service subprocess.

A Flower deployment runs every message of a ClientApp in a fresh process, so the process that
needs the service in round 5 is not the one that started it in round 1. The manager therefore
keeps a small JSON state file (pid, process group, the process's kernel start time, URL, log file
and how to launch it again) and :meth:`EnvServiceManager.attach` rebuilds a manager from it in
any later process: health-check and reuse the service, restart it if it died or runs other code
than a service started now would (an app update: :mod:`.launch`), or stop it.

The service runs in its own session and process group, so :meth:`EnvServiceManager.stop` takes
down everything it started (SIGTERM, then SIGKILL after a grace period; :mod:`fedagent_flwr.procs`)
and nothing else.

The state file is only a hint, never a proof: it lies in a working directory others may write,
and a stale one (a crashed run) or a forged one could name any pid and process group. So a
group is signalled only when the process table shows that this manager's code started it for
this very state file (:func:`service_group_owned`): its leader is the recorded process (pid and
start time), leads its own process group, runs as this user and carries in its environment the
marker :data:`STATE_ENV` naming this state file's absolute path, which the manager sets at
launch (the state file cannot choose its own path). Once the leader is gone, only the members
that carry the marker are signalled, one by one. Anything else is left alone and reported.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import psutil

from fedagent_flwr.atomic import write_json_atomic
from fedagent_flwr.code_identity import code_change, versions_unknown
from fedagent_flwr.envs.service.launch import ServiceLaunch, service_code
from fedagent_flwr.procs import (
    ProcessRef,
    find_with_env,
    group_members,
    reap,
    started_with_env,
    stop_each,
    stop_group,
)
from fedagent_flwr.schema.run import EnvService

logger = logging.getLogger(__name__)

#: Environment variable set in every env service (and so in its children): the absolute path of
#: the state file it was started for. Proves to a later :meth:`EnvServiceManager.stop` that a
#: process group is the one this state file's manager started (see the module docstring).
STATE_ENV = "FEDAGENT_ENV_SERVICE_STATE"

_POLL_S = 0.05  # start-up and shutdown polling interval; short, since start-up is usually ~1 s


class EnvServiceError(RuntimeError):
    """The env service could not be started, found, or reached."""


# --- ownership ----------------------------------------------------------------------------------

def service_group_owned(state: Mapping[str, Any], state_file: Path) -> tuple[str, list[psutil.Process]]:
    """What of the service recorded in ``state`` may be signalled, proven from the process table.

    Returns ``("group", [leader])`` when the recorded leader still runs and is ours (recorded pid
    and start time, leader of its own group, this user, :data:`STATE_ENV` naming ``state_file``);
    ``("members", processes)`` when the leader is gone and only these group members carry the
    marker; ``("none", [])`` when nothing is ours (a recycled pid, or a forged or stale state
    file); raises ValueError for a state without integer pid and pgid.
    """
    pid, pgid = state.get("pid"), state.get("pgid")
    if isinstance(pid, bool) or isinstance(pgid, bool) or not isinstance(pid, int) or not isinstance(pgid, int):
        raise ValueError(f"pid {pid!r} and pgid {pgid!r} must be integers")
    if pid <= 1 or pgid != pid:
        return "none", []  # the manager always starts the service as the leader of its own group
    recorded = ProcessRef.from_json(state)
    leader = recorded.process() if recorded is not None else None
    if leader is None and ProcessRef.of(pid) is None:
        # Leader gone (or a zombie): its pid, and so the group id, cannot be reused while members
        # live, but the state file could still name someone else's group. Only marked members count.
        return "members", [member for member in group_members(pgid)
                           if started_with_env(member, STATE_ENV, str(state_file))]
    with contextlib.suppress(OSError):
        if leader is not None and os.getpgid(pid) == pid and started_with_env(leader, STATE_ENV, str(state_file)):
            return "group", [leader]
    return "none", []  # another process has the pid (a stale file), or the file names a stranger


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


#: The state file's key for the reason last warned about when a running service was kept though the
#: library versions could not be determined (:meth:`EnvServiceManager.ensure_running`).
KEPT_WARNED = "versions_unknown_warned"


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
        startup_timeout_s: float = EnvService.startup_timeout_s,
        stop_grace_s: float = 10.0,
    ) -> None:
        self.launch = launch
        # Absolute and resolved: the marker every service of this state file carries (STATE_ENV).
        self.state_file = Path(state_file).resolve()
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
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
        if not isinstance(state, dict):
            raise EnvServiceError(f"env service state file {self.state_file} does not hold a JSON object")
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
        startup_timeout_s: float = EnvService.startup_timeout_s,
        stop_grace_s: float = 10.0,
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
        return cls(launch, path, startup_timeout_s=startup_timeout_s, stop_grace_s=stop_grace_s)

    @classmethod
    def attach_or_create(
        cls,
        state_file: str | os.PathLike[str],
        launch: ServiceLaunch,
        **kwargs: Any,
    ) -> EnvServiceManager:
        """Attach to the recorded service if it was launched with ``launch``; else a new manager.

        A recorded service with a different launch (another partition, say) is stopped first,
        so a client never silently trains against a world it did not ask for; one on other code
        is replaced by :meth:`ensure_running`. A state file that cannot be parsed is no record of
        what its service serves: that service is stopped and the file moved aside, with a warning
        naming it (:meth:`discard_unreadable`), and a new one starts.
        """
        path = Path(state_file)
        if path.exists():
            try:
                existing = cls.attach(path, **kwargs)
            except EnvServiceError as exc:  # nothing stands in the way of a new service once it is done
                if said := cls.discard_unreadable(path, exc, stop_grace_s=kwargs.get("stop_grace_s", 10.0)):
                    logger.warning("%s", said)
                existing = None
            # The owner is whoever started the service; another process of the same node may ask
            # for the same service (a simulation node can move between Ray actors) and reuses it.
            # The returned manager carries the caller's launch, owner included: should the service
            # have died (with its owner, say), the restart watches the caller's owner, not the
            # recorded one, which may be gone, so that the new service would exit at once.
            if existing is not None and replace(existing.launch, owner_pid=None) == replace(launch, owner_pid=None):
                return cls(launch, path, **kwargs)
            if existing is not None:
                existing.stop()
        return cls(launch, path, **kwargs)

    @classmethod
    def discard_unreadable(cls, state_file: str | os.PathLike[str], problem: Exception, *,
                           stop_grace_s: float = 10.0) -> str:
        """Stop the service of a state file that cannot be parsed (``problem`` says why), move the
        file aside and return a message naming them ("" if the file is gone); EnvServiceError if
        the recorded group survived SIGKILL (the file then stays).

        Only what is proven ours is stopped: the recorded group if pid and pgid can still be read
        (:meth:`_terminate_group`), and whatever carries this file's :data:`STATE_ENV` marker
        (which finds a service whose file is not JSON at all).
        """
        manager = cls(ServiceLaunch(env="(unreadable)"), state_file, stop_grace_s=stop_grace_s)  # no launch used
        path, grace = manager.state_file, stop_grace_s
        with manager._locked():
            try:
                text = path.read_text(errors="replace")
            except FileNotFoundError:
                return ""
            found = sorted(process.pid for process in find_with_env(STATE_ENV, str(path)))
            with contextlib.suppress(ValueError):
                if isinstance(state := json.loads(text), dict) and "pid" in state:
                    manager._terminate_group(state)
            survived = not stop_each(lambda: find_with_env(STATE_ENV, str(path)), grace, grace)
            for pid in found:
                reap(pid, wait_s=grace)  # a service this very process started
            aside = path.with_name(path.name + ".unreadable")
            path.replace(aside)
            manager._ready_file.unlink(missing_ok=True)
        stopped = f"its service (pid {', '.join(map(str, found))}) was stopped" if found else "no service of it ran"
        return (
            f"{problem}; {stopped}{' (some of it survived SIGKILL)' if survived else ''}; the file was moved "
            f"to {aside.name} beside it, and a new service starts when one is next needed"
        )

    # --- liveness ---------------------------------------------------------------------------

    def _process_alive(self, state: Mapping[str, Any]) -> bool:
        """Whether the recorded leader runs and is provably the service this manager started."""
        if isinstance(state.get("pid"), int):
            reap(state["pid"])  # a dead service that is this process's child must not stay a zombie
        try:
            return service_group_owned(state, self.state_file)[0] == "group"
        except ValueError:
            return False

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
        """Reuse the recorded service if it is alive, ready and runs the code a service started now
        would (:func:`.launch.service_code`: after an app update it runs the old env and reward
        code); otherwise stop it and start a new one, saying why. Returns the URL. Library versions
        that cannot be determined now (the env's interpreter could not say where its packages are:
        :func:`~fedagent_flwr.code_identity.code_change`) do not replace a running service; a
        warning names the interpreter and its error, once per service while the error stays the same."""
        code = service_code(self.launch, sys.executable)
        with self._locked():
            changed = ""
            if self.is_alive():
                state = self._load_state() or {}
                # A state file written before services recorded their code: unknown code, a restart.
                changed = code_change(state.get("code"), code, "the service")
                if not changed:
                    if unknown := versions_unknown(code):  # kept: no evidence it is out of date
                        self._warn_kept(state, unknown)
                    return self.url
                logger.warning("env service %s (pid %s, %s) runs other code than a new one would (%s); stopping "
                               "it and starting a new one", self.launch.env, state.get("pid"), self.state_file, changed)
            self._stop_unlocked()
            return self._start_unlocked(code, changed)

    def _warn_kept(self, state: dict[str, Any], unknown: str) -> None:
        """Warn that the running service is kept though the versions are unknown (``unknown``: why),
        once per service and reason: every job of every round asks, each in a fresh process, so the
        reason last warned about is kept in the state file (a new service's file has none); a
        different reason warns again. The caller holds the lock."""
        if state.get(KEPT_WARNED) == unknown:
            return
        logger.warning("env service %s (pid %s, %s): %s; keeping the running service",
                       self.launch.env, state.get("pid"), self.state_file, unknown)
        try:
            write_json_atomic(self.state_file, {**state, KEPT_WARNED: unknown})
        except OSError:  # only the next job's warning is at stake
            pass

    def _start_unlocked(self, code: dict[str, str], reason: str = "") -> str:
        """Start the service, recording ``code`` (:func:`.launch.service_code`) and why a running one
        was replaced (``reason``, also in the log)."""
        if unknown := versions_unknown(code):  # recorded as such: the next caller that can tell replaces it
            logger.warning("env service %s (%s): %s; starting it all the same", self.launch.env, self.state_file,
                           unknown)
        self._ready_file.unlink(missing_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        env = self.launch.environment({STATE_ENV: str(self.state_file)})
        with open(self.log_file, "ab") as log:
            why = f" (replacing a running one: {reason})" if reason else ""
            log.write(f"\n=== starting env service {self.launch.env} at {time.ctime()}{why} ===\n".encode())
            log.flush()
            popen = subprocess.Popen(
                self.launch.command(self._ready_file, sys.executable),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # own session and process group: stop() reaches it all
                env=env,
            )
        self._popen = popen
        state: dict[str, Any] = {
            **(ProcessRef.of(popen.pid, zombie_ok=True) or ProcessRef(popen.pid, -1.0, "")).to_json(),
            "pgid": popen.pid,
            "url": None,
            "log_file": str(self.log_file),
            "launch": asdict(self.launch),
            "code": code,
            "reason": reason,
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
        if popen is not None and popen.poll() is None and (not state or state.get("pid") != popen.pid):
            # Our own child, but no longer the recorded one (state file removed or replaced).
            stop_group(popen.pid, self.stop_grace_s, self.stop_grace_s)
            reap(popen.pid, wait_s=self.stop_grace_s)
        if popen is not None:
            popen.poll()  # lets subprocess record the exit status it may already have reaped

    def _terminate_group(self, state: Mapping[str, Any]) -> None:
        """SIGTERM, then SIGKILL, what of the recorded service is provably ours, and nothing else.

        A group proven ours once stays ours while any member lives (Linux does not reuse a pid
        that is still a process group id), so the whole group is signalled to the end. Without a
        live leader, the marked members are found again before each signal.
        """
        try:
            scope, _ = service_group_owned(state, self.state_file)
        except ValueError as exc:
            logger.warning("env service state file %s is malformed (%s); nothing signalled", self.state_file, exc)
            return
        pid = int(state["pid"])
        if scope == "none":
            logger.warning("env service state file %s names pid %s and group %s, which this manager did not "
                           "start (the pid was reused, or the file is stale or forged); nothing signalled",
                           self.state_file, pid, state.get("pgid"))
            return
        if scope == "group":
            stopped = stop_group(pid, self.stop_grace_s, self.stop_grace_s)
        else:
            stopped = stop_each(lambda: service_group_owned(state, self.state_file)[1], self.stop_grace_s,
                                self.stop_grace_s)
        reap(pid, wait_s=self.stop_grace_s)
        if not stopped:
            raise EnvServiceError(f"env service process group {pid} survived SIGKILL")

    def __enter__(self) -> EnvServiceManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
