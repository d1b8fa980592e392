"""The process library (fedagent_flwr.procs) on real processes: detached spawn, identity safe
against pid reuse, owner watching and group stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from fedagent_flwr import procs
from fedagent_flwr.procs import OwnerWatch, ProcessRef

ROOT = Path(__file__).resolve().parents[1]
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture()
def cleanup() -> Iterator[list[int]]:
    """Process groups to SIGKILL at the end, whatever the test did."""
    groups: list[int] = []
    yield groups
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _spawn(tmp_path: Path, command: list[str], cleanup: list[int], name: str = "log") -> tuple[ProcessRef, Path]:
    log_path = tmp_path / f"{name}.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log_path, "w") as log:
        ref = procs.spawn_detached(command, env, log)
    cleanup.append(ref.pid)
    return ref, log_path


def test_spawn_detached_starts_an_orphan_in_its_own_session(tmp_path: Path, cleanup: list[int]) -> None:
    ref, log = _spawn(tmp_path, [sys.executable, "-c", "import os, time; print('hello', os.getpid(), flush=True); "
                                 "time.sleep(600)"], cleanup)
    assert ref.alive() and ref.boot == procs.boot_id() and ref.name.startswith("python")
    process = psutil.Process(ref.pid)
    # Its own session and process group, and not our child (init or a subreaper adopted it).
    assert os.getsid(ref.pid) == ref.pid and os.getpgid(ref.pid) == ref.pid
    assert process.ppid() != os.getpid()
    wait_for(lambda: f"hello {ref.pid}" in log.read_text(), "its output in the log")
    assert procs.stop_group(ref.pid, grace_s=10) is True
    assert not ref.alive()


def test_spawn_detached_names_a_command_that_cannot_start(tmp_path: Path) -> None:
    with open(tmp_path / "log.txt", "w") as log, pytest.raises(OSError, match=r"could not start /no/such/prog"):
        procs.spawn_detached(["/no/such/prog", "x"], dict(os.environ), log)


def test_a_command_that_dies_at_once_still_gets_a_ref(tmp_path: Path, cleanup: list[int]) -> None:
    ref, _ = _spawn(tmp_path, [sys.executable, "-c", "raise SystemExit(3)"], cleanup)
    assert ref.pid > 0 and ref.since_boot > 0  # read while it was still its launcher's zombie
    wait_for(lambda: not ref.alive(), "the dead command to be seen as gone")


@pytest.mark.parametrize(("script", "returncode"), [("raise SystemExit(3)", 3),
                                                    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9)])
def test_an_exit_file_records_how_a_detached_command_ended(
        tmp_path: Path, cleanup: list[int], script: str, returncode: int) -> None:
    exit_file = tmp_path / "exit.json"
    with open(tmp_path / "log.txt", "w") as log:
        ref = procs.spawn_detached([sys.executable, "-c", f"import time; time.sleep(0.5); {script}"],
                                   dict(os.environ), log, exit_file=exit_file)
    cleanup.append(ref.pid)
    assert psutil.Process(ref.pid).ppid() != os.getpid()  # its supervisor's child, not ours
    wait_for(exit_file.exists, "the exit file")
    assert json.loads(exit_file.read_text()) == {"pid": ref.pid, "returncode": returncode}


def test_the_exit_is_recorded_even_if_the_caller_died_before_reading_the_pid(tmp_path: Path) -> None:
    # The launcher as spawn_detached runs it, but its caller closes the pipes at once (as a caller
    # killed in between would): the supervisor's pid report then meets a closed pipe, and must go
    # on supervising so the command's end is still recorded.
    exit_file = tmp_path / "exit.json"
    read_end, write_end = os.pipe()
    os.close(read_end)  # closed before the launcher starts: its pid report always meets a closed pipe
    try:
        launcher = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", procs._LAUNCHER, str(exit_file),
             sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(4)"],
            stdin=subprocess.DEVNULL, stdout=write_end, stderr=subprocess.DEVNULL)
    finally:
        os.close(write_end)
    launcher.wait(timeout=30)
    wait_for(exit_file.exists, "the exit file")
    assert json.loads(exit_file.read_text())["returncode"] == 4
    assert not list(tmp_path.glob("*.tmp"))


def test_identity_is_pid_and_start_time_so_a_reused_pid_is_another_process() -> None:
    child = subprocess.Popen(SLEEP)
    try:
        ref = ProcessRef.of(child.pid)
        assert ref is not None and ref.alive()
        assert ProcessRef.from_json(json.loads(json.dumps(ref.to_json()))) == ref  # survives a record
        # The same pid with another start time is another process: a pid reused since the record.
        reused = ProcessRef(ref.pid, ref.since_boot - 1.0, ref.boot, ref.name)
        assert reused != ref and not reused.alive() and reused.process() is None
        # A record from another boot (a channel on a shared filesystem) names nothing here.
        assert not ProcessRef(ref.pid, ref.since_boot, "another-boot").alive()
        # A process younger than the ref "started since" it; the ref's own process as well.
        assert procs.started_since(psutil.Process(child.pid), ref)
        assert not procs.started_since(psutil.Process(child.pid), ProcessRef(1, ref.since_boot + 1, ref.boot))
    finally:
        child.kill()
        child.wait()
    assert not ref.alive() and ProcessRef.of(child.pid) is None
    for bad in (None, [], {"pid": "1", "since_boot": 1.0, "boot": "b"}, {"pid": True, "since_boot": 1, "boot": "b"},
                {"pid": 1, "boot": "b"}):
        assert ProcessRef.from_json(bad) is None


def test_a_zombie_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ref = ProcessRef.of(child.pid, zombie_ok=True)
    wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, "the child to exit")
    assert ref is not None and not ref.alive() and ProcessRef.of(child.pid) is None
    procs.reap(child.pid)
    assert not psutil.pid_exists(child.pid)
    child.poll()


@pytest.fixture(params=["pidfd", "no-pidfd"])
def pidfds(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run with pidfds, and as on a kernel or interpreter without them (the start-time fallback)."""
    if request.param == "no-pidfd":
        def unavailable(pid: int) -> int:
            raise OSError(38, "Function not implemented")  # ENOSYS, as on Linux < 5.3

        monkeypatch.setattr(procs.os, "pidfd_open", unavailable)
    return str(request.param)


def test_owner_watch_sees_the_owner_die_and_never_a_stranger(pidfds: str) -> None:
    owner = subprocess.Popen(SLEEP)
    watch = OwnerWatch(owner.pid)
    try:
        assert not watch.gone()
        owner.kill()
        wait_for(watch.gone, "the owner's death (a zombie counts)")
    finally:
        owner.kill()
        owner.wait()
        watch.close()
    me = ProcessRef.current()
    assert not OwnerWatch(me).gone()
    # A record whose pid now belongs to another process: gone from the start.
    assert OwnerWatch(ProcessRef(me.pid, me.since_boot - 5, me.boot, "raylet")).gone()
    assert OwnerWatch(2**22 + 11).gone()  # no such process


_WATCHER = """
import sys, time
from fedagent_flwr.procs import OwnerWatch
watch = OwnerWatch(int(sys.argv[1]))
print("watching", flush=True)
while not watch.gone():
    time.sleep(0.05)
print("owner gone", flush=True)
"""


def test_a_detached_helper_exits_when_its_owner_dies(tmp_path: Path, cleanup: list[int]) -> None:
    owner = subprocess.Popen(SLEEP)
    try:
        helper, log = _spawn(tmp_path, [sys.executable, "-c", _WATCHER, str(owner.pid)], cleanup)
        wait_for(lambda: "watching" in log.read_text(), "the helper to start watching")
        assert helper.alive()
        owner.kill()
        owner.wait()
        wait_for(lambda: not helper.alive(), "the helper to exit with its owner")
        assert "owner gone" in log.read_text()
    finally:
        owner.kill()
        owner.wait()


# A member that notes each SIGTERM in the file argv[1] and goes on: only SIGKILL stops it.
_STUBBORN = """
import signal, sys, time
def note(signum, frame):
    with open(sys.argv[1], "a") as marks:
        marks.write("stubborn: SIGTERM\\n")
signal.signal(signal.SIGTERM, note)
print("ready", flush=True)
while True:
    time.sleep(600)
"""
# A member that notes a SIGTERM in the file argv[1] and exits.
_POLITE = """
import signal, sys, time
def note(signum, frame):
    with open(sys.argv[1], "a") as marks:
        marks.write("polite: SIGTERM\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, note)
print("ready", flush=True)
time.sleep(600)
"""
# A group leader (argv: the two members' scripts, the marks file) with those two members.
_GROUP = """
import subprocess, sys, time
polite, stubborn, marks = sys.argv[1:4]
members = [subprocess.Popen([sys.executable, "-c", script, marks, "fa-procs-member"], stdout=subprocess.PIPE)
           for script in (polite, stubborn)]
for member in members:
    member.stdout.readline()  # its SIGTERM handler is in place
print("members", *(member.pid for member in members), flush=True)
time.sleep(600)
"""


def test_stop_group_stops_every_member_terminating_first_then_killing(tmp_path: Path, cleanup: list[int]) -> None:
    bystander = subprocess.Popen([*SLEEP, "fa-procs-member"], start_new_session=True)  # another group
    marks = tmp_path / "marks.txt"
    try:
        leader, log = _spawn(tmp_path, [sys.executable, "-c", _GROUP, _POLITE, _STUBBORN, str(marks)], cleanup)
        wait_for(lambda: "members" in log.read_text(), "the group's members")
        members = [int(p) for p in log.read_text().split("members")[1].split()]
        assert sorted(p.pid for p in procs.group_members(leader.pid)) == sorted([leader.pid, *members])
        assert set(members) | {bystander.pid} <= set(procs.pids_with_cmdline("fa-procs-member"))
        assert procs.stop_group(leader.pid, grace_s=3.0, kill_wait_s=10.0) is True
        # Every member got SIGTERM first, once; the one that ignored it is gone too: SIGKILL followed.
        assert sorted(marks.read_text().splitlines()) == ["polite: SIGTERM", "stubborn: SIGTERM"]
        assert procs.group_members(leader.pid) == [] and not leader.alive()
        assert bystander.poll() is None  # another group is never touched
        assert procs.stop_group(leader.pid) is True  # an empty group: nothing to do
    finally:
        bystander.kill()
        bystander.wait()


# A process that notes a SIGTERM in the file argv[1], then finishes its shutdown (and notes that)
# only once the file argv[2] exists: a shutdown that takes as long as the test says.
_SLOW_SHUTDOWN = """
import os, signal, sys, time
def shut_down(signum, frame):
    with open(sys.argv[1], "a") as marks:
        marks.write("SIGTERM\\n")
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
    with open(sys.argv[1], "a") as marks:
        marks.write("shut down\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, shut_down)
print("ready", flush=True)
time.sleep(600)
"""


def test_stop_group_lets_a_member_finish_its_shutdown_within_the_grace_period(
    tmp_path: Path, cleanup: list[int]
) -> None:
    """SIGKILL waits for the grace period: a process busy shutting down after SIGTERM (a verl
    session stopping Ray) is not killed in the middle of it, however long the machine takes."""
    marks, go = tmp_path / "marks.txt", tmp_path / "go"
    leader, log = _spawn(tmp_path, [sys.executable, "-c", _SLOW_SHUTDOWN, str(marks), str(go)], cleanup)
    wait_for(lambda: "ready" in log.read_text(), "the process's SIGTERM handler")
    stopped: list[bool] = []
    stopper = threading.Thread(target=lambda: stopped.append(procs.stop_group(leader.pid, grace_s=300.0)))
    stopper.start()
    try:
        wait_for(lambda: marks.exists() and "SIGTERM" in marks.read_text(), "the SIGTERM")
        assert stopper.is_alive() and leader.alive()  # waiting for it, not killing it
    finally:
        go.touch()
        stopper.join(timeout=120)
    assert stopped == [True]
    assert marks.read_text() == "SIGTERM\nshut down\n"  # it finished its shutdown


def test_stop_each_and_kill_matching_reach_only_what_they_name(tmp_path: Path) -> None:
    marker = f"fa-procs-{os.getpid()}-{time.time_ns()}"
    env = {**os.environ, "FA_PROCS_MARK": marker}
    marked = [subprocess.Popen([*SLEEP, marker], env=env) for _ in range(2)]
    other = subprocess.Popen(SLEEP)
    try:
        found = procs.find(marker)
        assert sorted(p.pid for p in found) == sorted(p.pid for p in marked)
        assert all(procs.started_with_env(p, "FA_PROCS_MARK", marker) for p in found)
        assert not procs.started_with_env(psutil.Process(other.pid), "FA_PROCS_MARK", marker)
        assert procs.stop_each(lambda: procs.find(marker), grace_s=10) is True
        assert all(p.wait(10) == -signal.SIGTERM for p in marked)
        assert procs.kill_matching(marker) == 0 and other.poll() is None
    finally:
        for process in (*marked, other):
            process.kill()
            process.wait()


def test_find_ancestor_walks_up_to_the_marked_process() -> None:
    marker = f"fa-procs-ancestor-{time.time_ns()}"
    probe = ("from fedagent_flwr.procs import find_ancestor; a = find_ancestor(__import__('sys').argv[1]); "
             "print(a.pid if a else None); print(find_ancestor('fa-procs-' + 'unmarked'))")  # in no command line
    shell = subprocess.run(["/bin/sh", "-c", f'{sys.executable} -c "{probe}" "$0"; echo "shell $$"', marker],
                           capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    found, missing, shell_line = shell.stdout.split("\n")[:3]
    assert found == shell_line.split()[1] and missing == "None", shell.stdout
