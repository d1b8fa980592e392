"""An env service runs the env and reward code it imported at its start: a ClientApp that would
start a service on other code (an updated app on a SuperNode that stayed up, another interpreter
or PYTHONPATH) must get a new service, not the old one. Real services, started by real ClientApp-like
processes on a copy of the package; nothing is mocked."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import site
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fedagent_flwr
from fedagent_flwr.code_identity import package_digest
from fedagent_flwr.envs.service.client import ServiceTextEnv
from fedagent_flwr.envs.service.manager import EnvServiceManager, ServiceLaunch
from fedagent_flwr.procs import ProcessRef
from testkit.env_service import TINY_CONFIG, play
from testkit.installs import BROKEN, install, make_interpreter

PACKAGE_DIR = Path(fedagent_flwr.__file__).resolve().parent
REPO_ROOT = Path(__file__).resolve().parents[3]
MARKER = "tiny_guess of the updated app imported"

# One message of a ClientApp (a fresh process, as a SuperNode's flwr-clientapp): imports the package
# from argv[2] the way Flower imports an installed app bundle (sys.path, not PYTHONPATH), makes sure
# its service runs and prints the service's state file.
_CLIENTAPP = """
import json, sys
sys.path.insert(0, sys.argv[2])
import fedagent_flwr
assert fedagent_flwr.__file__.startswith(sys.argv[2]), fedagent_flwr.__file__
from fedagent_flwr.envs.service.manager import EnvServiceManager, ServiceLaunch
launch = ServiceLaunch(env="TinyGuess", config=json.loads(sys.argv[3]), pool_size=1)
EnvServiceManager.attach_or_create(sys.argv[1], launch, stop_grace_s=5.0).ensure_running()
print("STATE " + open(sys.argv[1]).read().replace("\\n", " "), flush=True)
"""


def _copy_package(root: Path) -> Path:
    """A copy of the package under ``root`` (as Flower installs an app bundle); its folder."""
    copy = root / "fedagent_flwr"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _clientapp(tmp: Path, state_file: Path, app: Path, pythonpath: str = "") -> tuple[dict[str, Any], str]:
    """Run one ClientApp message on the package in ``app``; the service's state and the stderr.
    Its working folder holds no package, and ``pythonpath`` is its PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run([sys.executable, "-c", _CLIENTAPP, str(state_file), str(app), json.dumps(TINY_CONFIG)],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    line = [line for line in done.stdout.splitlines() if line.startswith("STATE ")][-1]
    return dict(json.loads(line.removeprefix("STATE "))), done.stderr


def _reward_of_a_solved_episode(state: dict[str, Any]) -> float:
    transcript = asyncio.run(play(ServiceTextEnv({"url": state["url"], "env": "TinyGuess"}), 1))
    obs, reward, done, info = transcript[-1]
    assert info["success"] is True
    return float(reward)


@pytest.fixture()
def state_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "services" / "train_0.json"
    yield path
    if path.exists():
        EnvServiceManager.attach(path, stop_grace_s=5.0).stop()


def test_a_service_on_updated_code_is_replaced_and_the_new_one_says_why(tmp_path: Path, state_file: Path) -> None:
    app = tmp_path / "app"
    copy = _copy_package(app)
    first, _ = _clientapp(tmp_path, state_file, app)
    assert first["code"]["package_sha256"] == package_digest(copy) and first["reason"] == ""
    assert first["code"]["pythonpath"].split(os.pathsep)[0] == str(app)  # the ClientApp's copy comes first
    assert first["code"]["executable"] == sys.executable
    assert _reward_of_a_solved_episode(first) == 1.0
    # Same code, another ClientApp process: the same service serves it (no needless restart).
    again, _ = _clientapp(tmp_path, state_file, app)
    assert again["pid"] == first["pid"] and again["started_at"] == first["started_at"]

    # The app is updated in place (a new reward): the next message's ClientApp runs the new code,
    # and so must the service that computes its rewards.
    env_module = copy / "envs" / "tiny_guess.py"
    text = env_module.read_text()
    assert text.count("CORRECT_OBS, 1.0, True") == 1
    env_module.write_text(text.replace("CORRECT_OBS, 1.0, True", "CORRECT_OBS, 2.0, True")
                          + f"\nprint({MARKER!r}, flush=True)\n")
    updated, stderr = _clientapp(tmp_path, state_file, app)
    assert updated["pid"] != first["pid"], "a service running the old env code served the updated app"
    assert not ProcessRef.from_json(first).alive()  # stopped, through the ownership-checked stop path
    old, new = first["code"]["package_sha256"], updated["code"]["package_sha256"]
    assert old != new == package_digest(copy)
    assert updated["reason"] == f"code changed: fedagent_flwr's .py files {old!r} -> {new!r}"
    assert f"runs other code than a new one would ({updated['reason']}); stopping it" in stderr
    log = Path(updated["log_file"]).read_text()
    assert f"(replacing a running one: {updated['reason']})" in log
    assert log.count(MARKER) == 1  # the new service imported the new code
    assert _reward_of_a_solved_episode(updated) == 2.0

    # Another PYTHONPATH (other modules may be found through it) is other code too.
    extra = tmp_path / "extra"
    extra.mkdir()
    moved, _ = _clientapp(tmp_path, state_file, app, pythonpath=str(extra))
    assert moved["pid"] != updated["pid"] and not ProcessRef.from_json(updated).alive()
    assert moved["reason"].startswith("code changed: PYTHONPATH ")
    assert moved["code"]["pythonpath"] == os.pathsep.join([str(app), str(extra)])


def test_a_service_recorded_without_its_code_is_replaced(tmp_path: Path, state_file: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    launch = ServiceLaunch(env="TinyGuess", config=TINY_CONFIG, pool_size=1)
    EnvServiceManager.attach_or_create(state_file, launch, stop_grace_s=5.0).ensure_running()
    first = json.loads(state_file.read_text())
    assert EnvServiceManager.attach_or_create(state_file, launch).ensure_running() == first["url"]  # reused
    # A state file written by a fedagent_flwr that did not record the service's code.
    old_state = {key: value for key, value in first.items() if key not in ("code", "reason")}
    state_file.write_text(json.dumps(old_state))
    with caplog.at_level(logging.WARNING, logger="fedagent_flwr.envs.service.manager"):
        EnvServiceManager.attach_or_create(state_file, launch, stop_grace_s=5.0).ensure_running()
    second = json.loads(state_file.read_text())
    assert second["pid"] != first["pid"] and not ProcessRef.from_json(first).alive()
    assert second["reason"] == "code changed: the service's code is unknown (started by an older fedagent_flwr)"
    assert second["reason"] in caplog.text
    assert _reward_of_a_solved_episode(second) == 1.0


# One message of a ClientApp whose env service runs under the env's own interpreter (argv[2], as
# ALFWorld's does); argv[3] bounds how long that interpreter may take to say where its packages are.
_FOREIGN_CLIENTAPP = """
import json, sys
from fedagent_flwr import code_identity
from fedagent_flwr.envs.service.manager import EnvServiceManager, ServiceLaunch
code_identity.SITE_QUERY_TIMEOUT_S = float(sys.argv[3])
launch = ServiceLaunch(env="TinyGuess", config=json.loads(sys.argv[4]), pool_size=1, interpreter=sys.argv[2])
EnvServiceManager.attach_or_create(sys.argv[1], launch, stop_grace_s=5.0).ensure_running()
print("STATE " + open(sys.argv[1]).read().replace("\\n", " "), flush=True)
"""


def _foreign_clientapp(tmp: Path, state_file: Path, python: Path, query_timeout_s: float = 60.0) -> tuple[
        dict[str, Any], str]:
    """Run one ClientApp message (this checkout's package) whose service runs under ``python``."""
    done = subprocess.run([sys.executable, "-c", _FOREIGN_CLIENTAPP, str(state_file), str(python),
                           str(query_timeout_s), json.dumps(TINY_CONFIG)],
                          cwd=tmp, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    line = [line for line in done.stdout.splitlines() if line.startswith("STATE ")][-1]
    return dict(json.loads(line.removeprefix("STATE "))), done.stderr


def _env_venv(tmp: Path) -> Path:
    """A venv of its own for the env (as ALFWorld's), with textworld 1.6.0 installed (its metadata)
    and this venv's packages reachable through a ``.pth`` file (the service needs uvicorn); its python."""
    venv = tmp / "env-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site_dir = Path(subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    (site_dir / "trainer-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install(site_dir, "textworld", "1.6.0")
    return python


def test_a_service_whose_interpreter_cannot_say_what_it_imports_is_kept(tmp_path: Path, state_file: Path) -> None:
    """The env's interpreter could not say where its packages are: at the first start (it took
    too long) the service starts all the same; while it cannot, a running service is kept (it used
    to read as "nothing installed": the healthy service was stopped and the restart under the
    broken interpreter failed); the caller warns, naming the interpreter and its error, once per
    service and error (it warned on every job of every round)."""
    real = _env_venv(tmp_path)
    python = make_interpreter(tmp_path / "env-python", f'exec {real} "$@"')  # as a launch may name it

    first, stderr = _foreign_clientapp(tmp_path, state_file, python, query_timeout_s=0.001)
    timed_out = f"{python} did not say where its packages are within 0.001 s"
    assert first["code"]["executable"] == str(python) and first["launch"]["interpreter"] == str(python)
    assert first["code"]["dist:textworld"] == "unknown" and first["reason"] == ""
    assert first["code"]["versions_unknown"] == timed_out
    assert f"the installed library versions are unknown: {timed_out}; starting it all the same" in stderr
    assert _reward_of_a_solved_episode(first) == 1.0
    again, stderr = _foreign_clientapp(tmp_path, state_file, python, query_timeout_s=0.001)
    assert again["pid"] == first["pid"] and again["started_at"] == first["started_at"]
    assert f"the installed library versions are unknown: {timed_out}; keeping the running service" in stderr
    # Every job of every round asks, each in a fresh process: the same reason is not warned again.
    later = [_foreign_clientapp(tmp_path, state_file, python, query_timeout_s=0.001) for _ in range(2)]
    assert {state["pid"] for state, _ in later} == {first["pid"]}
    assert sum(err.count("keeping the running service") for _, err in later) == 0

    # It answers again: the service that never said what it imported is replaced, once.
    known, _ = _foreign_clientapp(tmp_path, state_file, python)
    assert known["pid"] != first["pid"] and not ProcessRef.from_json(first).alive()
    assert known["reason"] == ("code changed: the library versions the service imported are unknown (when it "
                               f"started: {timed_out})")
    assert known["code"]["dist:textworld"] == "1.6.0" and "versions_unknown" not in known["code"]
    assert _foreign_clientapp(tmp_path, state_file, python)[0]["pid"] == known["pid"]

    # The interpreter breaks while its service runs: the service is kept and still serves.
    make_interpreter(python, BROKEN)
    kept, stderr = _foreign_clientapp(tmp_path, state_file, python)
    assert kept["pid"] == known["pid"] and kept["started_at"] == known["started_at"]
    assert (f"the installed library versions are unknown: {python} failed to say where its packages are (exit "
            "status 1: Fatal Python error: init_import_site: Failed to import the site module); keeping the "
            "running service") in stderr
    assert "runs other code" not in stderr
    assert _reward_of_a_solved_episode(kept) == 1.0
    still, stderr = _foreign_clientapp(tmp_path, state_file, python)
    assert still["pid"] == known["pid"] and "keeping the running service" not in stderr
    # It fails another way: the new reason is warned about, once.
    make_interpreter(python, "echo 'no such venv' >&2; exit 2")
    other = [_foreign_clientapp(tmp_path, state_file, python)[1] for _ in range(2)]
    assert [err.count("keeping the running service") for err in other] == [1, 0]
    assert "(exit status 2: no such venv); keeping the running service" in other[0]
