"""A persistent trainer runs the code it imported at its start: a job whose ClientApp runs other
code (an updated app on a SuperNode that stayed up, another interpreter or PYTHONPATH) must get a
new trainer, not the old one. Driven with real ClientApp processes on a copy of the package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import fedagent_flwr
from fedagent_flwr.clientapp.job import TrainJob, save
from fedagent_flwr.clientapp.persistent import PersistentTrainer
from fedagent_flwr.procs import ProcessRef
from testkit.installs import build_wheel, pip_install

PACKAGE_DIR = Path(fedagent_flwr.__file__).resolve().parent
REPO_ROOT = Path(__file__).resolve().parents[2]  # for testkit (the scripted backend)
MARKER = "trainer_server of the updated app imported"

# One job of a ClientApp process (as a SuperNode's flwr-clientapp runs one message), whose parent
# (this test process) is the node process the trainer watches; prints the trainer's record.
_CLIENTAPP = """
import json, sys
from pathlib import Path
from fedagent_flwr.clientapp import backend
from fedagent_flwr.clientapp.persistent import PersistentTrainer
backend.BACKEND_MODULES["scripted"] = "testkit.scripted_backend"
handle = PersistentTrainer("scripted", sys.argv[1], idle_timeout_s=600)
handle.run("train", Path(sys.argv[2]), Path(sys.argv[2]).with_suffix(".log"), "c0", 60)
print("RECORD " + json.dumps(handle.record()), flush=True)
"""


def _copy_package(root: Path) -> Path:
    """A copy of the package under ``root`` (as Flower installs an app bundle); its folder."""
    copy = root / "fedagent_flwr"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _job(tmp: Path, name: str) -> Path:
    job = TrainJob(model_path="unused", output_dir=str(tmp / name), env_spec={}, round=1, client_id=0,
                   num_clients=1, data_seed=1, trainer={"script": "ok"})
    path = tmp / f"{name}.json"
    save(job, path)
    return path


def _clientapp_job(tmp: Path, channel: Path, name: str, pythonpath: str) -> dict[str, Any]:
    """Run one job from a ClientApp process that imports the package through ``pythonpath``
    (its working folder holds no package: the copy on the path is the one imported)."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run([sys.executable, "-c", _CLIENTAPP, str(channel), str(_job(tmp, name))], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp / name / "train_result.json").exists()
    lines = [line for line in done.stdout.splitlines() if line.startswith("RECORD ")]
    return dict(json.loads(lines[-1].removeprefix("RECORD ")))


@pytest.fixture()
def channel(tmp_path: Path) -> Path:
    path = tmp_path / "channel"
    yield path
    PersistentTrainer("", path).stop(grace_s=5)


def test_a_job_on_updated_code_gets_a_new_trainer_that_says_why(tmp_path: Path, channel: Path) -> None:
    app = tmp_path / "app"
    copy = _copy_package(app)
    pythonpath = os.pathsep.join([str(app), str(REPO_ROOT)])
    first = _clientapp_job(tmp_path, channel, "a", pythonpath)
    # Same code, another ClientApp process: the same trainer serves it (no needless cold start).
    again = _clientapp_job(tmp_path, channel, "b", pythonpath)
    assert again["pid"] == first["pid"] and again["starts"] == 1

    # The app is updated in place: the next job's ClientApp imports the new code, and so must the
    # trainer that serves it.
    server = copy / "clientapp" / "trainer_server.py"
    server.write_text(server.read_text() + f"\nprint({MARKER!r}, flush=True)\n")
    updated = _clientapp_job(tmp_path, channel, "c", pythonpath)
    assert updated["pid"] != first["pid"], "a trainer running the old code served the updated app's job"
    assert updated["starts"] == 2 and not ProcessRef.from_json(first).alive()
    old, new = first["code"]["package_sha256"], updated["code"]["package_sha256"]
    assert old != new
    assert updated["reason"] == (f"restart: trainer pid {first['pid']} is gone "
                                 f"(code changed: fedagent_flwr's .py files {old!r} -> {new!r})")
    assert (channel / "server.log").read_text().count(MARKER) == 1  # the new trainer imported the new code
    assert updated["code"]["pythonpath"].split(os.pathsep)[0] == str(app)  # trainer_environment(): the copy first
    assert updated["code"]["executable"] == sys.executable

    # Another PYTHONPATH (other modules may be found through it) is other code too.
    extra = tmp_path / "extra"
    extra.mkdir()
    moved = _clientapp_job(tmp_path, channel, "d", pythonpath + os.pathsep + str(extra))
    assert moved["pid"] != updated["pid"] and moved["starts"] == 3
    assert moved["reason"].startswith(f"restart: trainer pid {updated['pid']} is gone (code changed: PYTHONPATH ")
    history = [json.loads(line) for line in (channel / "starts.jsonl").read_text().splitlines()]
    assert [h["pid"] for h in history] == [first["pid"], updated["pid"], moved["pid"]]


def test_a_same_version_reinstall_of_other_files_gets_a_new_trainer(tmp_path: Path, channel: Path) -> None:
    """verl rebuilt locally and pip-installed over the same version: the running trainer imported
    the old files, so the next job gets a new trainer; the same files reinstalled keep it."""
    site_dir = tmp_path / "site"
    pip_install(build_wheel(tmp_path / "build1", "verl", "0.9.1", "ANSWER = 1\n"), site_dir)
    pythonpath = os.pathsep.join([str(REPO_ROOT), str(site_dir)])
    first = _clientapp_job(tmp_path, channel, "a", pythonpath)
    assert first["code"]["dist:verl"] == "0.9.1"
    pip_install(build_wheel(tmp_path / "build2", "verl", "0.9.1", "ANSWER = 1\n"), site_dir)  # same files
    assert _clientapp_job(tmp_path, channel, "b", pythonpath)["pid"] == first["pid"]

    pip_install(build_wheel(tmp_path / "build3", "verl", "0.9.1", "ANSWER = 2\n"), site_dir)
    rebuilt = _clientapp_job(tmp_path, channel, "c", pythonpath)
    assert rebuilt["pid"] != first["pid"] and rebuilt["starts"] == 2 and not ProcessRef.from_json(first).alive()
    old, new = first["code"]["files:verl"], rebuilt["code"]["files:verl"]
    assert rebuilt["reason"] == (f"restart: trainer pid {first['pid']} is gone (code changed: the installed "
                                 f"verl's files (RECORD digest) {old!r} -> {new!r}, same version '0.9.1')")


def test_the_package_digest_follows_the_code_not_its_location_or_timestamps(tmp_path: Path) -> None:
    from fedagent_flwr.code_identity import code_change, code_identity, package_digest

    copy = _copy_package(tmp_path)
    original = package_digest(copy)
    assert original == package_digest(PACKAGE_DIR)  # same code elsewhere: same digest
    module = copy / "clientapp" / "backend.py"
    text = module.read_text()
    os.utime(module, (1, 1))  # a reinstall of the same code
    (copy / "__pycache__").mkdir()
    (copy / "__pycache__" / "stale.py").write_text("x = 1\n")
    assert package_digest(copy) == original
    module.write_text(text.replace("def trainer_environment", "def trainer_environment_", 1))
    changed = package_digest(copy)
    assert changed != original
    module.write_text(text)
    assert package_digest(copy) == original
    (copy / "trainers" / "new_module.py").write_text("")
    assert package_digest(copy) not in (original, changed)

    identity = code_identity({"PYTHONPATH": "/app"})
    assert {k: v for k, v in identity.items() if not k.startswith(("dist:", "files:"))} == {
        "package_sha256": original, "executable": sys.executable, "python": sys.version, "pythonpath": "/app"}
    assert code_change(identity, identity, "the trainer") == ""
    assert code_change({**identity, "executable": "/old/python"}, identity, "the trainer") == \
        f"code changed: the Python interpreter '/old/python' -> {sys.executable!r}"
    # A trainer started before records had a code identity: what it runs is unknown, so not reused.
    assert code_change(None, identity, "the trainer").startswith("code changed: the trainer's code is unknown")
