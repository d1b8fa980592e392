"""The env service's server process and its manager: start, attach, restart and stop; damaged or
forged state files; start failures; the server module's command line; and a service exiting with
its owner.

Everything runs for real: the server as a subprocess, httpx clients; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from fedagent_flwr.envs.service.client import ServiceTextEnv
from fedagent_flwr.envs.service.manager import (
    EnvServiceError,
    EnvServiceManager,
    ServiceLaunch,
)
from fedagent_flwr.procs import ProcessRef, group_members
from testkit.env_service import HANG_GUARD_S, TINY_CONFIG, play, wait_until


def _proc_exists(process: ProcessRef | None) -> bool:
    """Whether that very process exists, even as a zombie (its pid may belong to another one by
    now: pids wrap quickly on a busy machine)."""
    return process is not None and ProcessRef.of(process.pid, zombie_ok=True) == process


def test_manager_start_attach_restart_stop(tmp_path: Path) -> None:
    state_file = tmp_path / "svc" / "tinyguess.json"
    launch = ServiceLaunch(env="TinyGuess", config=TINY_CONFIG, pool_size=2,
                           partition={"name": "uniform", "goal_indices": [0, 2, 4]})
    manager = EnvServiceManager(launch, state_file, stop_grace_s=5.0)
    try:
        url = manager.ensure_running()
        health = httpx.get(f"{url}/health").json()
        assert health["ready"] and health["partition"] == {"name": "uniform", "goal_indices": [0, 2, 4]}
        assert health["info"] == {"num_goals": 3}  # the partition restricted the goal pool
        assert url.startswith("http://127.0.0.1:")
        first_pid = manager.pid
        assert first_pid is not None and [p.pid for p in group_members(first_pid)] == [first_pid]
        # A CPU program beside the trainers: it sees no GPU, and JAX (bm25s's backend) stays on the CPU.
        service_env = psutil.Process(first_pid).environ()
        assert service_env.get("CUDA_VISIBLE_DEVICES") == "" and service_env.get("JAX_PLATFORMS") == "cpu"

        # A fresh process (as Flower runs each message) finds and reuses the same service.
        probe = subprocess.run(
            [sys.executable, "-c",
             "import json, sys\n"
             "from fedagent_flwr.envs.service.manager import EnvServiceManager\n"
             "m = EnvServiceManager.attach(sys.argv[1])\n"
             "print(json.dumps({'alive': m.is_alive(), 'url': m.ensure_running(), 'pid': m.pid}))\n",
             str(state_file)],
            capture_output=True, text=True, timeout=HANG_GUARD_S, check=True,
        )
        assert json.loads(probe.stdout) == {"alive": True, "url": url, "pid": first_pid}
        attached = EnvServiceManager.attach(state_file)
        assert attached.launch == launch and attached.url == url and attached.is_alive()

        # kill -9: the attached manager notices and restarts it on a new process and port.
        first = ProcessRef.of(first_pid)
        os.kill(first_pid, signal.SIGKILL)
        wait_until(lambda: not attached.is_alive(), "the killed service to be seen as dead")
        new_url = attached.ensure_running()
        assert attached.pid != first_pid and first is not None and not _proc_exists(first)  # reaped, not a zombie
        assert httpx.get(f"{new_url}/health").json()["ready"] is True
        assert EnvServiceManager.attach(state_file).url == new_url
        # The restarted service serves a full episode.
        env = ServiceTextEnv({"url": new_url, "env": "TinyGuess"})
        assert asyncio.run(play(env, 1))[-1][3]["success"] is True

        # Stopping from another manager instance leaves no process and no process group.
        second_pid = attached.pid
        assert second_pid is not None
        second = ProcessRef.of(second_pid)
        EnvServiceManager.attach(state_file).stop()
        assert second is not None and not _proc_exists(second)
        assert group_members(second_pid) == []
        assert not state_file.exists() and not manager.is_alive()
        with pytest.raises(EnvServiceError, match="no env service state file"):
            EnvServiceManager.attach(state_file)
        manager.stop()  # stopping again is a no-op
    finally:
        manager.stop()


def test_attach_or_create_replaces_a_service_with_another_partition(tmp_path: Path) -> None:
    state_file = tmp_path / "svc.json"
    launch_a = ServiceLaunch(env="TinyGuess", config=TINY_CONFIG, pool_size=1, partition={"goal_indices": [0]})
    launch_b = ServiceLaunch(env="TinyGuess", config=TINY_CONFIG, pool_size=1, partition={"goal_indices": [1]})
    first = EnvServiceManager.attach_or_create(state_file, launch_a)
    try:
        first.ensure_running()
        pid_a = first.pid
        assert pid_a is not None
        service_a = ProcessRef.of(pid_a)
        assert EnvServiceManager.attach_or_create(state_file, launch_a).pid == pid_a  # reused
        second = EnvServiceManager.attach_or_create(state_file, launch_b)
        assert service_a is not None and not _proc_exists(service_a)  # the other partition's service is gone
        url = second.ensure_running()
        assert httpx.get(f"{url}/health").json()["partition"] == {"goal_indices": [1]}
        second.stop()
    finally:
        first.stop()
        EnvServiceManager.attach_or_create(state_file, launch_b).stop()


@pytest.mark.parametrize("damage", ["unknown launch key", "no launch", "not JSON"])
def test_attach_or_create_stops_the_service_of_a_state_file_it_cannot_parse(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    """The old service is stopped and the file moved aside with a warning naming both; the same call
    then serves a new service: the job that met the damaged file is not failed for it (after a
    package upgrade every client meets one at once, and failing them all alike stopped the run)."""
    state_file = tmp_path / "svc.json"
    launch = ServiceLaunch(env="TinyGuess", config=TINY_CONFIG, pool_size=1)
    first = EnvServiceManager.attach_or_create(state_file, launch, stop_grace_s=5.0)
    try:
        first.ensure_running()
        pid = first.pid
        assert pid is not None
        service = ProcessRef.of(pid)
        state = json.loads(state_file.read_text())
        if damage == "unknown launch key":  # written by another version of the package, say
            state["launch"]["pool_timeout_s"] = 3.0
        elif damage == "no launch":
            del state["launch"]
        damaged = json.dumps(state) if damage != "not JSON" else state_file.read_text()[:40]
        state_file.write_text(damaged)
        with caplog.at_level(logging.WARNING, logger="fedagent_flwr.envs.service.manager"):
            second = EnvServiceManager.attach_or_create(state_file, launch, stop_grace_s=5.0)
        message = caplog.text
        assert f"env service state file {state_file} is unreadable" in message
        assert f"its service (pid {pid}) was stopped" in message and "svc.json.unreadable" in message
        assert service is not None and not _proc_exists(service) and group_members(pid) == []
        assert not state_file.exists() and (tmp_path / "svc.json.unreadable").read_text() == damaged
        # This very call's manager starts a new service.
        assert httpx.get(f"{second.ensure_running()}/health").json()["ready"] and second.pid != pid
    finally:
        EnvServiceManager.attach_or_create(state_file, launch).stop()
        first.stop()


@contextlib.contextmanager
def bystander_groups() -> Iterator[dict[str, int]]:
    """Process groups this manager did not start: a live group, and a group whose leader has
    exited but whose member lives on. Each is stopped by its pid at the end."""
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    orphaned = subprocess.Popen(["/bin/sh", "-c", "sleep 600 & echo $!"], start_new_session=True,
                                stdout=subprocess.PIPE, text=True)
    assert orphaned.stdout is not None
    member = int(orphaned.stdout.readline())
    orphaned.wait()  # the leader is gone (and reaped); its group lives on in `member`
    orphaned.stdout.close()
    try:
        yield {"alive": alive.pid, "orphaned": orphaned.pid, "member": member}
    finally:
        for pid in (alive.pid, member):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        alive.wait()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(member, 0)


def test_a_forged_state_file_never_makes_the_manager_signal_another_group(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    launch = ServiceLaunch(env="TinyGuess", config=TINY_CONFIG, pool_size=1)
    other = EnvServiceManager(launch, tmp_path / "other.json")  # a real service, of another state file
    other.ensure_running()
    state_file = tmp_path / "svc.json"
    try:
        with bystander_groups() as victims:
            alive_ref = ProcessRef.of(victims["alive"])

            def forge(pid: int, pgid: int) -> None:
                started = ProcessRef.of(pid)
                state_file.write_text(json.dumps({
                    **(started.to_json() if started else {"pid": pid}), "pgid": pgid, "url": "http://127.0.0.1:9",
                    "log_file": str(tmp_path / "x.log"), "launch": dataclasses.asdict(launch)}))

            forgeries = [
                (victims["alive"], victims["alive"]),  # a live group, with its true start time
                (2**22 + 7, victims["alive"]),  # a pid that does not exist, and someone's group
                (os.getpid(), victims["alive"]),  # a live pid with another group
                (victims["orphaned"], victims["orphaned"]),  # a group whose leader exited
                (other.pid, other.pid),  # our own service, but started for another state file
            ]
            for pid, pgid in forgeries:
                assert pid is not None and pgid is not None
                forge(pid, pgid)
                with caplog.at_level(logging.WARNING):
                    EnvServiceManager.attach(state_file).stop()
                assert not state_file.exists()
                assert all(Path(f"/proc/{v}").exists() for v in (victims["alive"], victims["member"]))
                assert other.is_alive()
            assert "which this manager did not start" in caplog.text
            # A forged record is not reused either: ensure_running starts a service of its own.
            forge(victims["alive"], victims["alive"])
            manager = EnvServiceManager.attach_or_create(state_file, launch)
            url = manager.ensure_running()
            assert manager.pid != victims["alive"] and httpx.get(f"{url}/health").json()["ready"]
            manager.stop()
            assert Path(f"/proc/{victims['alive']}").exists() and alive_ref is not None and alive_ref.alive()
    finally:
        other.stop()
        EnvServiceManager.attach_or_create(state_file, launch).stop()


def test_manager_reports_a_service_that_cannot_start(tmp_path: Path) -> None:
    state_file = tmp_path / "bad.json"
    manager = EnvServiceManager(ServiceLaunch(env="TinyGuess", config={"lo": 5, "hi": 1}), state_file)
    with pytest.raises(EnvServiceError) as err:
        manager.ensure_running()
    message = str(err.value)
    assert "exited with code 2" in message and str(manager.log_file) in message
    assert "'hi' (1) must be >= 'lo' (5)" in message
    assert not state_file.exists()


def test_server_module_writes_its_url_and_exits_on_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready" / "url.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedagent_flwr.envs.service.server", "--env", "tinyguess",
         "--config", json.dumps(TINY_CONFIG), "--pool", "1", "--port", "0", "--ready-file", str(ready),
         "--variant", "{}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, "the ready file")
        url = ready.read_text().strip()
        health = httpx.get(f"{url}/health").json()
        assert health["env"] == "TinyGuess" and health["pool_size"] == 1
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught: -SIGTERM, not 0.
        assert proc.wait(HANG_GUARD_S) in (0, -signal.SIGTERM)
        assert proc.stdout is not None and f"listening on {url}" in proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_server_module_refuses_bad_arguments() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fedagent_flwr.envs.service.server", "--env", "TinyGuess",
         "--partition", "[1]"],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert result.returncode == 2 and "--partition must be a JSON object" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "fedagent_flwr.envs.service.server", "--env", "NoSuchEnv", "--pool", "1"],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert result.returncode == 2 and "unknown environment 'NoSuchEnv'" in result.stderr


def test_service_exits_with_its_owner_so_a_crash_leaves_no_orphan(tmp_path: Path) -> None:
    # The owner stands in for the node's long-lived process (a Ray actor, a SuperNode) that
    # dies without a clean shutdown: SIGKILL, so no shutdown message ever arrives.
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        launch = ServiceLaunch(env="TinyGuess", config=TINY_CONFIG, pool_size=1, owner_pid=owner.pid)
        manager = EnvServiceManager(launch, tmp_path / "svc.json")
        manager.ensure_running()
        service_pid = manager.pid
        assert service_pid is not None and manager.is_alive()
        # Another process of the same node (new owner pid) reuses the running service.
        same = EnvServiceManager.attach_or_create(tmp_path / "svc.json",
                                                  dataclasses.replace(launch, owner_pid=os.getpid()))
        assert same.pid == service_pid
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 60  # bounded wait for the watchdog (checks every 2 s)
        while Path(f"/proc/{service_pid}").exists() and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(service_pid, os.WNOHANG)  # reap it: we are its parent here
            time.sleep(0.2)
        assert not Path(f"/proc/{service_pid}").exists(), "the service outlived its owner"
        assert "owner process" in manager.log_file.read_text()
        # The next caller restarts it watching its own owner, not the recorded one that is gone
        # (the new service would exit at once: a node that lost its service would never get one).
        restarted = EnvServiceManager.attach_or_create(tmp_path / "svc.json",
                                                       dataclasses.replace(launch, owner_pid=os.getpid()))
        restarted.ensure_running()
        new_pid = restarted.pid
        assert new_pid is not None and new_pid != service_pid and restarted.is_alive()
        assert psutil.Process(new_pid).cmdline()[-2:] == ["--owner-pid", str(os.getpid())]
        assert json.loads((tmp_path / "svc.json").read_text())["launch"]["owner_pid"] == os.getpid()
    finally:
        if owner.poll() is None:
            owner.kill()
        with contextlib.suppress(Exception):
            EnvServiceManager.attach(tmp_path / "svc.json").stop()
