"""Start a real Flower SuperLink (simulation mode) on free loopback ports and run the app.

Tests start the SuperLink themselves, rather than letting ``flwr run`` spawn its detached local
one, so that they know its PID and stop exactly it, and so that runtime dependency installation
is off (it would re-resolve torch for every run).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
from flwr.cli.build import build_fab_from_disk

from fedagent_flwr.deploy import write_connection
from fedagent_flwr.launch import stop_superlink_tree
from fedagent_flwr.procs import ProcessRef, pids_with_cmdline, signal_each

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
T = TypeVar("T")


@functools.cache
def app_dir() -> Path:
    """The app directory the tests hand to ``flwr run``: the files of the FAB that ``flwr run``
    builds from the repository, unpacked once per test process into a temporary directory.

    Why not the repository itself: to build a FAB, Flower walks and resolves every file under the
    app directory before it applies ``fab-include``, the ~63k files of the repository's ``.venv``
    included, which took ~6 s of every ``flwr run`` on a 2-core machine. The unpacked FAB holds
    exactly what Flower ships (its own builder picks the files), so a run of it is a run of the
    repository's app; only ``pyproject.toml`` is Flower's rewrite of ours, as in every FAB."""
    root = Path(tempfile.mkdtemp(prefix="fedagent-app-"))
    atexit.register(shutil.rmtree, root, True)
    with warnings.catch_warnings():  # pathspec's deprecation of a pattern class Flower uses, not ours
        warnings.simplefilter("ignore", DeprecationWarning)
        fab_bytes = build_fab_from_disk(REPO)
    with zipfile.ZipFile(io.BytesIO(fab_bytes)) as fab:
        fab.extractall(root, [name for name in fab.namelist() if not name.startswith(".info/")])
    return root


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def flower_env(home: Path, **extra: str) -> dict[str, str]:
    """Environment for Flower processes of a test: its own FLWR_HOME, no telemetry, no runtime
    dependency installation, and this venv's Flower commands on PATH (they start each other by
    name: flower-superexec, flwr-simulation, flwr-serverapp, flwr-clientapp)."""
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        PYTHONUNBUFFERED="1",
        PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
        **extra,
    )
    return env


def wait_healthy(process: subprocess.Popen[bytes], url: str, log_file: Path, verify: Any = True,
                 limit_s: float = 120) -> None:
    """Poll a SuperLink's ``/health`` until it answers; fail with its log file if it exits."""
    deadline = time.monotonic() + limit_s  # a hang guard: start-up takes a few seconds
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {process.returncode}; see {log_file}")
        try:
            if httpx.get(url, verify=verify, timeout=1.0).is_success:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"flower-superlink did not become healthy; see {log_file}")
        time.sleep(0.3)


# Ray places one ClientApp actor per this many CPUs: with 1, two simulated clients work at once
# on a 2-core CI machine (their trainers are subprocesses; most of a job is interpreter and model
# start-up, which overlaps well), which cut a 2-client x 2-round run from ~58 s to ~38 s.
CLIENT_CPUS = 1


@dataclass
class SuperLink:
    """A running SuperLink and the environment in which ``flwr`` talks to it."""

    env: dict[str, str]
    connection: str
    log_file: Path
    process: subprocess.Popen[bytes]
    #: (pid, start time) of each run's flwr-simulation -> when stop_runaway_runs first saw it
    first_seen: dict[tuple[int, float], float] = field(default_factory=dict)

    def command(self, overrides: str = "", supernodes: int = 2, app: Path | None = None,
                extra_run_config: str = "", run_config_file: Path | None = None) -> list[str]:
        """``flwr run <app> <connection> --stream`` (``app`` by default the repository's app,
        :func:`app_dir`) with the given Hydra overrides (or, when ``run_config_file`` is given, that
        TOML file alone: Flower does not mix the two)."""
        run_config = f'overrides="{overrides}"'
        if extra_run_config:
            run_config += f" {extra_run_config}"
        if run_config_file is not None:
            run_config = str(run_config_file)
        return [
            str(BIN / "flwr"), "run", str(app or app_dir()), self.connection, "--stream",
            "--run-config", run_config,
            "--federation-config", f"num-supernodes={supernodes} client-resources-num-cpus={CLIENT_CPUS}",
        ]

    def run(self, overrides: str = "", supernodes: int = 2, timeout: float = 900, app: Path | None = None,
            extra_run_config: str = "", run_config_file: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run a job to its end and capture its output."""
        return subprocess.run(self.command(overrides, supernodes, app, extra_run_config, run_config_file),
                              env=self.env,
                              cwd=self.env["FEDAGENT_TEST_CWD"], text=True, capture_output=True, timeout=timeout)

    def start(self, overrides: str, supernodes: int, log_file: Path) -> subprocess.Popen[bytes]:
        """Start a job without waiting for it; its output goes to ``log_file``."""
        with open(log_file, "wb") as log:
            return subprocess.Popen(self.command(overrides, supernodes), env=self.env,
                                    cwd=self.env["FEDAGENT_TEST_CWD"], stdout=log, stderr=subprocess.STDOUT)

    def simulation_pids(self) -> list[int]:
        """Live ``flwr-simulation`` processes (each runs one run's ServerApp and its simulated
        clients) that this SuperLink's SuperExec started."""
        superexecs = set(pids_with_cmdline(f"--parent-pid {self.process.pid}"))
        return [pid for pid in pids_with_cmdline("flwr-simulation") if parent_pid(pid) in superexecs]


    def stop_runaway_runs(self, after_s: float = 120.0) -> list[int]:
        """Kill, with their processes, the runs seen going at an earlier call and still going
        ``after_s`` later; their pids. A run normally ends with its ``flwr run`` (its
        ``flwr-simulation`` takes a few more seconds to exit, which is left alone), but a ``flwr
        run`` that timed out or a test that failed half-way leaves its run training, and on a
        shared SuperLink it would compete with every later test."""
        now = time.monotonic()
        live: dict[tuple[int, float], psutil.Process] = {}
        for pid in self.simulation_pids():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                live[(pid, process.create_time())] = process
        self.first_seen = {key: self.first_seen.get(key, now) for key in live}
        runaway = [key for key in live if now - self.first_seen[key] >= after_s]
        for key in runaway:
            try:
                tree = [live[key], *live[key].children(recursive=True)]
            except psutil.Error:
                continue
            signal_each(tree)
            psutil.wait_procs(tree, timeout=30)
        return [pid for pid, _ in runaway]


def parent_pid(pid: int) -> int:
    """The parent of ``pid`` (0 if it is gone)."""
    try:
        return int(psutil.Process(pid).ppid())
    except psutil.Error:
        return 0


def is_running(pid: int) -> bool:
    """True while ``pid`` runs (an exited child its parent has not reaped yet is a zombie)."""
    return ProcessRef.of(pid) is not None


@contextmanager
def simulation_superlink(workdir: Path, pythonpath: list[Path] | None = None,
                         env_extra: dict[str, str] | None = None) -> Iterator[SuperLink]:
    """Yield a simulation SuperLink whose working directory (and so the apps' cwd) is ``workdir``;
    ``env_extra`` reaches every process it starts (ServerApp and ClientApps included)."""
    home = workdir / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    write_connection(home, "test", f"127.0.0.1:{port}", insecure=True)
    env = flower_env(home, FEDAGENT_TEST_CWD=str(workdir), **(env_extra or {}))
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(p) for p in pythonpath] + [env.get("PYTHONPATH", "")])
    log_file = home / "superlink.log"
    process = subprocess.Popen(
        [str(BIN / "flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
         "--host", "127.0.0.1", "--port", str(port),
         "--disable-runtime-dependency-installation", "--log-file", str(log_file)],
        cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_healthy(process, f"http://127.0.0.1:{port}/health", log_file)
        yield SuperLink(env=env, connection="test", log_file=log_file, process=process)
    finally:
        stop_superlink_tree(process.pid)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # already reaped by stop_superlink_tree
            pass


def wait_until(check: Callable[[], T], what: str, limit_s: float = 600.0) -> T:
    """Poll ``check`` until it returns something true and return that; a hang guard, not a
    timing bound (AssertionError naming ``what`` after ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)
    return value


def run_to_crash_point(link: SuperLink, overrides: str, supernodes: int, log: Path, trainers_in: Path) -> None:
    """Start a run on ``link`` (a SuperLink started with a crash point armed, ``CRASH_FILE_ENV``)
    and wait until its ServerApp has killed itself there and no trainer of the run works in
    ``trainers_in`` any more (the run directory with the shared-filesystem store; with a node-local
    store, the nodes' own directory, where the clients and their trainers work)."""
    job = link.start(overrides, supernodes, log)
    try:
        serverapp = wait_until(lambda: next(iter(link.simulation_pids()), 0), "the ServerApp to start")
        wait_until(lambda: not is_running(serverapp), "the ServerApp to kill itself at its crash point")
        wait_until(lambda: not pids_with_cmdline(str(trainers_in)), "the killed run's trainers to exit")
    finally:
        job.terminate()  # `flwr run --stream` would wait for the dead run for ever
        job.wait()
