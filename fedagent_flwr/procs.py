"""Helper processes: start them detached, know them again, watch their owner, stop their group.

A node's persistent trainer and its env services outlive the process that starts them; a later
process (the next Flower message, another simulation actor) finds them again and must never
signal a stranger that got a recorded pid since. So a helper is named by a :class:`ProcessRef`:
pid, the kernel's start time (seconds after boot, unmoved by clock changes) and the boot id. Each
helper leads a session and process group of its own, so stopping the group reaches all it started
(verl's Ray and vLLM, an env's engine workers) and nothing else, and it exits once its owner is
gone (:class:`OwnerWatch`). Linux only, on psutil; an env service under an env's own interpreter
(ALFWorld's venv, without psutil) uses only :class:`OwnerWatch`, which needs the standard library.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

try:
    import psutil
except ModuleNotFoundError:  # an env's own interpreter: only OwnerWatch is used there
    psutil = None  # type: ignore[assignment]

_POLL_S = 0.05


def end_process(process: subprocess.Popen[Any], grace_s: float) -> None:
    """Terminate the child ``process`` and reap it, killed if it has not ended within ``grace_s``."""
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@functools.cache
def boot_id() -> str:
    """This machine's boot id: a pid and a start time mean something only within one boot (a
    record on a shared filesystem may come from another host)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def since_boot(process: psutil.Process) -> float:
    """When ``process`` started, in seconds after boot (raises ``psutil.Error`` if it is gone).
    psutil's ``create_time`` adds the boot time, which follows the wall clock; this does not."""
    return round(process.create_time() - psutil.boot_time(), 2)


def _live(process: psutil.Process) -> bool:
    """Running: not a zombie (exited, not yet collected by its parent) and not exiting (a killed
    process gives up its memory, environment included, some time before it becomes a zombie)."""
    try:
        return bool(process.status() != psutil.STATUS_ZOMBIE and process.memory_info().vms > 0)
    except psutil.AccessDenied:
        return True
    except psutil.Error:
        return False


@dataclass(frozen=True)
class ProcessRef:
    """One process, safe against pid reuse: JSON-able, so another process can check it later."""

    pid: int
    since_boot: float  #: kernel start time, seconds after boot
    boot: str  #: :func:`boot_id` of the machine it runs on
    name: str = field(default="", compare=False)  #: command name, for messages

    @classmethod
    def of(cls, pid: int, *, zombie_ok: bool = False) -> ProcessRef | None:
        """The process ``pid`` now; None if there is none (or only a zombie, unless ``zombie_ok``)."""
        try:
            process = psutil.Process(pid)
            if not zombie_ok and not _live(process):
                return None
            return cls(pid, since_boot(process), boot_id(), process.name())
        except psutil.Error:
            return None

    @classmethod
    def current(cls) -> ProcessRef:
        """This process."""
        process = psutil.Process()
        return cls(process.pid, since_boot(process), boot_id(), process.name())

    @classmethod
    def from_json(cls, data: object) -> ProcessRef | None:
        """The ref in a record written by :meth:`to_json` (extra keys ignored); None if malformed."""
        if not isinstance(data, dict):
            return None
        pid, start, boot = data.get("pid"), data.get("since_boot"), data.get("boot")
        if type(pid) is not int or type(start) not in (int, float) or not isinstance(boot, str):
            return None
        return cls(pid, float(cast(float, start)), boot, str(data.get("name") or ""))

    def to_json(self) -> dict[str, Any]:
        """``{"pid", "since_boot", "boot", "name"}``."""
        return {"pid": self.pid, "since_boot": self.since_boot, "boot": self.boot, "name": self.name}

    def process(self) -> psutil.Process | None:
        """The process if this very one still runs (same boot, same start, not a zombie), else None."""
        if self.boot != boot_id() or self.pid <= 0:
            return None
        try:
            process = psutil.Process(self.pid)
            return process if since_boot(process) == self.since_boot and _live(process) else None
        except psutil.Error:
            return None

    def alive(self) -> bool:
        """Whether this very process still runs (a reused pid is another process: False)."""
        return self.process() is not None

    def describe(self) -> str:
        """``name (pid N)`` for messages."""
        return f"{self.name or 'process'} (pid {self.pid})"


def find_ancestor(marker: str) -> ProcessRef | None:
    """The nearest ancestor of this process whose command line contains ``marker``, if any."""
    try:
        for ancestor in psutil.Process().parents():
            if marker in " ".join(ancestor.cmdline()):
                return ProcessRef.of(ancestor.pid)
    except psutil.Error:
        pass
    return None


def find(*markers: str) -> list[psutil.Process]:
    """Live processes (this one excepted) whose command line contains every one of ``markers``."""
    return [p for p in psutil.process_iter(["cmdline"]) if p.pid != os.getpid()
            and all(m in " ".join(p.info["cmdline"] or ()) for m in markers) and _live(p)]


def pids_with_cmdline(*markers: str) -> list[int]:
    """Pids of :func:`find` (``markers`` all in the command line)."""
    return [process.pid for process in find(*markers)]


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of process group ``pgid``."""
    members = []
    for pid in psutil.pids():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(pid) == pgid and _live(process := psutil.Process(pid)):
                members.append(process)
    return members


def started_with_env(process: psutil.Process, key: str, value: str) -> bool:
    """Whether ``process`` runs as this user and was started with ``key=value`` in its environment
    (a marker its starter set: proof that a recorded process group is the one it started)."""
    try:
        return bool(process.uids().real == os.getuid() and process.environ().get(key) == value)
    except psutil.Error:
        return False


def find_with_env(key: str, value: str) -> list[psutil.Process]:
    """Live processes of this user (this one excepted) started with ``key=value`` in their
    environment (:func:`started_with_env`): what a starter that set that marker started, found
    without any record of their pids."""
    return [p for p in psutil.process_iter() if p.pid != os.getpid() and started_with_env(p, key, value) and _live(p)]


def started_since(process: psutil.Process, ref: ProcessRef) -> bool:
    """Whether ``process`` started on ``ref``'s boot no earlier than ``ref`` did (what ``ref``
    started is younger; an older process that got a pid ``ref`` left behind is not)."""
    try:
        return ref.boot == boot_id() and since_boot(process) >= ref.since_boot
    except psutil.Error:
        return False


def signal_each(processes: Sequence[psutil.Process], sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to each process (psutil refuses one whose pid was reused); how many got it."""
    hit = 0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.send_signal(sig)
            hit += 1
    return hit


def kill_matching(marker: str) -> int:
    """SIGKILL every process (this one excepted) whose command line contains ``marker``."""
    return signal_each(find(marker))


def reap(pid: int, wait_s: float = 0.0) -> None:
    """Collect ``pid``'s exit status if it is this process's exited child, waiting up to ``wait_s``
    (a killed multi-threaded process is a zombie before it can be collected)."""
    deadline = time.monotonic() + wait_s
    with contextlib.suppress(OSError):  # not our child, or already collected
        while not os.waitpid(pid, os.WNOHANG)[0] and time.monotonic() < deadline:
            time.sleep(_POLL_S)


def _stop(send: Callable[[int], object], running: Callable[[], Sequence[psutil.Process]],
          grace_s: float, kill_wait_s: float) -> bool:
    """SIGTERM, wait up to ``grace_s``, SIGKILL, wait up to ``kill_wait_s``; True once none runs.
    Zombies count as gone: collecting them is their parent's business."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        if running():
            send(sig)
        deadline = time.monotonic() + wait_s
        while running() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    return not running()


def stop_group(pgid: int, grace_s: float = 15.0, kill_wait_s: float = 10.0) -> bool:
    """Stop process group ``pgid``: SIGTERM, SIGKILL what is left after ``grace_s``; True once no
    member runs."""

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    return _stop(send, lambda: group_members(pgid), grace_s, kill_wait_s)


def stop_each(running: Callable[[], Sequence[psutil.Process]], grace_s: float = 15.0,
              kill_wait_s: float = 10.0) -> bool:
    """Stop what ``running()`` returns, found again before each signal (members of a group whose
    leader is gone), like :func:`stop_group`; True once it returns none."""
    return _stop(lambda sig: signal_each(running(), sig), running, grace_s, kill_wait_s)


# Run by the intermediate process of spawn_detached (``-I -S``: the standard library only). It
# starts the command in a session of its own, reports its pid and waits until the caller has read
# the command's start time: until this process exits, a command that died at once is its zombie,
# whose start time can still be read. Then it exits, and init (or a subreaper) adopts the command.
# With an exit file (argv[1], else ""), it forks first and its child, in a session of its own (so
# not the caller's child either), does all that and then stays the command's parent: it waits for
# the command and writes ``{"pid", "returncode"}`` there (atomically), the one way to learn that
# an orphan was killed by a signal (a SIGKILL, most often the out-of-memory killer).
_LAUNCHER = """
import json, os, subprocess, sys
exit_file = sys.argv.pop(1)
if exit_file:
    if os.fork():
        os._exit(0)
    os.setsid()
try:
    child = subprocess.Popen(sys.argv[1:], start_new_session=True, stdin=subprocess.DEVNULL, stdout=2, stderr=2)
except OSError as exc:
    print("E:%s" % exc, flush=True)
    sys.exit(127)
try:
    print(child.pid, flush=True)
    sys.stdin.read()
except OSError:  # the caller died before reading: still supervise, so the exit is recorded
    pass
if exit_file:
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    code = child.wait()
    part = "%s.%d.tmp" % (exit_file, os.getpid())
    with open(part, "w") as out:
        json.dump({"pid": child.pid, "returncode": code}, out)
    os.replace(part, exit_file)
"""


def spawn_detached(command: Sequence[str], env: dict[str, str], stdout: IO[Any],
                   exit_file: Path | None = None) -> ProcessRef:
    """Start ``command`` as an orphan in a session (and process group) of its own, with stdout and
    stderr to ``stdout``; return it. Raises OSError, naming the command, if it could not start.
    With ``exit_file``, a small supervisor (in a session of its own as well) writes the command's
    ``{"pid", "returncode"}`` there once it ends (a negative returncode: killed by that signal).

    Not a child of this process: a simulation's ClientApp runs in a Ray actor, and Ray SIGKILLs an
    actor's children when the actor exits (``kill_child_processes_on_worker_exit``), which would
    kill a long-lived helper (the persistent trainer) before it can shut down what it started.
    """
    launcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCHER, str(exit_file or ""), *command],
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stdout, text=True)
    assert launcher.stdin is not None and launcher.stdout is not None
    try:
        reported = launcher.stdout.readline().strip()
        ref = ProcessRef.of(int(reported), zombie_ok=True) if reported.isdigit() else None
    finally:
        launcher.stdin.close()
        launcher.stdout.close()
        launcher.wait()
    if ref is None:
        raise OSError(f"could not start {' '.join(command[:4])}: {reported[2:] or 'the launcher failed'}")
    return ref


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (state first, start time at index 19), or None."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


class OwnerWatch:
    """Tells when an owner process is gone, exactly: a pidfd refers to one process, never to a
    later one that got its pid. Where pidfds are unavailable (Python < 3.9, Linux < 5.3, a seccomp
    filter) it compares the pid's start time instead. Needs only the standard library (see the
    module docstring)."""

    def __init__(self, owner: int | ProcessRef) -> None:
        """``owner`` a pid (taken to be the process running now) or a :class:`ProcessRef`."""
        self.pid = owner if isinstance(owner, int) else owner.pid
        self._fd: int | None = None
        self._ticks: str | None = None  # the fallback's identity of the owner
        try:
            self._fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            pass  # already gone
        except (AttributeError, OSError):
            fields = _stat_fields(self.pid)
            self._ticks = fields[19] if fields else None
        if isinstance(owner, ProcessRef) and not owner.alive():
            self.close()  # the pid was reused before the watch began: the owner is gone

    def gone(self) -> bool:
        """Whether the owner has exited (its pidfd turns readable then; a zombie counts as gone)."""
        if self._fd is not None:
            return bool(select.select([self._fd], [], [], 0)[0])
        if self._ticks is not None:
            fields = _stat_fields(self.pid)
            return fields is None or fields[19] != self._ticks or fields[0] == "Z"
        return True

    def close(self) -> None:
        """Release the pidfd; the watch then reports the owner gone."""
        self._ticks = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
