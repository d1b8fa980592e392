"""Stopping a Flower SuperLink together with everything it started, by PID.

A SuperLink starts ``flower-superexec`` in a session of its own, which runs ``flwr-simulation``
and Ray; Ray's agents outlive their parents when the SuperLink alone is stopped. ``flwr run .``
also leaves its managed local SuperLink running after the run (Flower's design). ``make run``
gives that SuperLink a project-local ``FLWR_HOME``; :func:`stop_local_superlink` finds it by the
log path only it uses and stops its process tree, so nothing else on the machine is touched.

    python -m fedagent_flwr.launch stop-local .flwr
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, start time in clock ticks since boot) of ``pid``, or None if it does
    not exist. The start time together with the pid names one process (pids are reused)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and parentheses; fields resume after the last ')'.
    rest = raw[raw.rindex(")") + 2:].split()
    return rest[0], int(rest[2]), int(rest[19])


def process_start_ticks(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks since boot), or None if it does not exist."""
    stat = proc_stat(pid)
    return None if stat is None else stat[2]


def process_name(pid: int) -> str:
    """The command name of ``pid`` (``/proc/<pid>/comm``), or ``""`` if it does not exist."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def is_live_process(pid: int, start_ticks: int | None) -> bool:
    """Whether the process ``pid`` that started at ``start_ticks`` still runs (not a zombie, and
    the pid not reused by another process since)."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X") and stat[2] == start_ticks


def process_group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None and stat[1] == pgid and stat[0] != "Z":
                members.append(int(entry))
    return members


def pids_with_cmdline(marker: str) -> list[int]:
    """PIDs whose command line contains ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


# Runs in the intermediate process of spawn_detached: fork and exit. The child becomes a session
# (and process group) leader, then reports its pid, then execs the command; the report pipe is
# close-on-exec, so end-of-file means "exec'd" unless an error line ("E:...") came first.
_DETACH = """
import os, sys
report = int(sys.argv[1])
if os.fork():
    os._exit(0)
try:
    os.setsid()
    os.write(report, b"%d\\n" % os.getpid())
    os.set_inheritable(report, False)
    os.execv(sys.argv[2], sys.argv[2:])
except BaseException as exc:
    os.write(report, ("E:%s: %s" % (type(exc).__name__, exc)).encode())
    os._exit(127)
"""
_DETACH_TIMEOUT_S = 60.0


def spawn_detached(command: Sequence[str], env: dict[str, str], stdout: IO[Any]) -> int:
    """Start ``command`` (``command[0]`` an absolute path) as an orphan in a session of its own,
    with stdout and stderr to ``stdout``; return its pid, which is also its process group (set
    before the pid is returned). Raises OSError, naming the command, if it could not be started.

    Not a child of this process: a simulation's ClientApp runs in a Ray actor, and Ray SIGKILLs an
    actor's children when the actor exits (``kill_child_processes_on_worker_exit``), which would
    kill a long-lived helper (the persistent trainer) before it can shut down what it started. An
    intermediate process forks it and exits at once, so init (or the nearest subreaper) adopts
    and reaps it.
    """
    import select

    read_end, write_end = os.pipe()
    try:
        try:
            # -I -S: the intermediate needs only os and sys; the command gets ``env`` through execv.
            launcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", _DETACH, str(write_end), *command],
                                        env=env, stdout=stdout, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, pass_fds=(write_end,))
        finally:
            os.close(write_end)
        chunks, deadline = [], time.monotonic() + _DETACH_TIMEOUT_S
        while True:  # until end-of-file: the command was exec'd, or failed and said why
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                launcher.kill()
                chunks = [b"E:no answer in %d s" % _DETACH_TIMEOUT_S]
                break
            chunk = os.read(read_end, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
    launcher.wait()
    reported = b"".join(chunks).decode(errors="replace")
    pid_text, _, error = reported.partition("\n")
    if pid_text.startswith("E:"):
        pid_text, error = "", pid_text
    if not pid_text.isdigit() or error:
        raise OSError(f"could not start {' '.join(command[:4])}: {error[2:] or 'the launcher failed'}")
    return int(pid_text)


def stop_group(group: int, grace_s: float = 15.0) -> None:
    """SIGTERM a process group, SIGKILL whatever is left after ``grace_s``."""
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        # Reap members that are our own children: an exited but unreaped child (a zombie) keeps
        # its group "alive" and would make us wait out the whole grace period.
        try:
            while os.waitpid(-group, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        if not process_group_members(group):  # zombies left for another process to reap do not count
            return
        time.sleep(0.3)
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_superlink_tree(pid: int, grace_s: float = 15.0) -> None:
    """Stop a SuperLink (its process group) and the superexec group(s) it launched."""
    groups = []
    for child in pids_with_cmdline(f"--parent-pid {pid}"):
        try:
            groups.append(os.getpgid(child))
        except ProcessLookupError:
            continue
    try:
        groups.insert(0, os.getpgid(pid))
    except ProcessLookupError:
        pass
    for group in dict.fromkeys(groups):
        stop_group(group, grace_s)


def local_superlink_pids(flwr_home: str | os.PathLike[str]) -> list[int]:
    """PIDs of ``flower-superlink`` processes started by ``flwr run`` for this ``FLWR_HOME``."""
    marker = str(Path(flwr_home).resolve() / "local-superlink")
    return [pid for pid in pids_with_cmdline(marker) if pid != os.getpid()
            and "flower-superlink" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]


def stop_local_superlink(flwr_home: str | os.PathLike[str]) -> list[int]:
    """Stop this home's managed local SuperLink(s) and their children; return the PIDs."""
    pids = local_superlink_pids(flwr_home)
    for pid in pids:
        stop_superlink_tree(pid)
    return pids


def main(argv: list[str] | None = None) -> int:
    """``stop-local FLWR_HOME``: used by ``make run`` after ``flwr run`` returns."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "stop-local":
        print("usage: python -m fedagent_flwr.launch stop-local FLWR_HOME", file=sys.stderr)
        return 2
    pids = stop_local_superlink(args[1])
    print(f"stopped the local SuperLink {pids}" if pids else "no local SuperLink runs for this FLWR_HOME")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
