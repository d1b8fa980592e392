"""The code identity follows in-place upgrades and same-version reinstalls of the distributions a
trainer or service imports, and says so when it cannot tell.

A ``pip install -U torch`` (or transformers, verl, vllm, flwr) in the venv of a persistent trainer
or an env service changes neither this package's files, nor the interpreter, nor PYTHONPATH; the
identity used to stay the same, so a trainer or service kept running on the old library. A locally
built wheel installed over one of the same version went unseen the same way. An env's interpreter
that could not say where its packages are read as one with nothing installed, so a healthy service
looked out of date. Real distribution metadata in real folders, real pip installs, real
interpreters (and scripts standing in for one that cannot answer); nothing is mocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedagent_flwr import code_identity as code_identity_module
from fedagent_flwr.code_identity import (
    ABSENT,
    DISTRIBUTIONS,
    NO_RECORD,
    UNKNOWN,
    code_change,
    code_identity,
    installed_versions,
    package_digest,
    versions_unknown,
)
from testkit.installs import BROKEN, build_wheel, install, make_interpreter, pip_install

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_an_in_place_upgrade_changes_the_identity_and_is_named(tmp_path: Path) -> None:
    site_dir = tmp_path / "site"
    install(site_dir, "torch", "2.11.0")
    env = {"PYTHONPATH": str(site_dir)}  # found first, as the process started with it would
    before = code_identity(env)
    assert code_change(before, code_identity(env), "the trainer") == ""  # nothing changed: reused

    install(site_dir, "torch", "2.12.1")  # pip install -U torch
    after = code_identity(env)
    assert after != before, "an in-place upgrade of torch left the code identity unchanged"
    assert {f"dist:{name}" for name in DISTRIBUTIONS} <= set(before)
    assert code_change(before, after, "the trainer") == "code changed: the installed torch '2.11.0' -> '2.12.1'"

    # a distribution installed where there was none (vllm on a CPU node), and one removed
    install(site_dir, "vllm", "0.24.0")
    installed = code_identity(env)
    assert code_change(after, installed, "the service") == (
        f"code changed: the installed vllm {after['dist:vllm']!r} -> '0.24.0'")
    assert installed_versions([str(site_dir)], ["vllm", "no-such-distribution"]) == {
        "dist:vllm": "0.24.0", "files:vllm": NO_RECORD,  # installed without a RECORD: its version tells
        "dist:no-such-distribution": ABSENT, "files:no-such-distribution": ABSENT}


def test_another_interpreter_is_read_from_its_own_site_packages(tmp_path: Path) -> None:
    """An env's own venv (ALFWorld's service) is identified by what that venv has installed."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site_dir = Path(subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    install(site_dir, "textworld", "1.6.0")
    identity = code_identity({}, executable=python)
    install(site_dir, "textworld", "1.7.0")
    assert code_identity({}, executable=python) != identity, "an upgrade in the env's venv went unseen"
    install(site_dir, "textworld", "1.6.0")
    assert identity["dist:textworld"] == "1.6.0"
    assert identity["dist:torch"] == ABSENT  # this venv's torch is not that one's
    assert code_identity({})["dist:textworld"] != "1.6.0"
    install(site_dir, "textworld", "1.7.0")
    assert code_change(identity, code_identity({}, executable=python), "the service") == (
        "code changed: the installed textworld '1.6.0' -> '1.7.0'")


def test_a_reinstall_of_other_files_under_the_same_version_is_other_code(tmp_path: Path) -> None:
    """A locally built verl wheel installed over one of the same version: only its files tell."""
    target = tmp_path / "site"
    pip_install(build_wheel(tmp_path / "build1", "verl", "0.9.1", "ANSWER = 1\n"), target)
    env = {"PYTHONPATH": str(target)}  # found first, as the process started with it would
    before = code_identity(env)
    assert before["dist:verl"] == "0.9.1" and before["files:verl"] not in (ABSENT, NO_RECORD, UNKNOWN)
    record = (target / "verl-0.9.1.dist-info" / "RECORD").read_text()

    # The same files again, from a wheel built elsewhere: pip's RECORD differs (the wheel's path in
    # direct_url.json), the code does not, and a trainer must not be restarted for it.
    pip_install(build_wheel(tmp_path / "build2", "verl", "0.9.1", "ANSWER = 1\n"), target)
    assert (target / "verl-0.9.1.dist-info" / "RECORD").read_text() != record
    assert code_change(before, code_identity(env), "the trainer") == ""

    pip_install(build_wheel(tmp_path / "build3", "verl", "0.9.1", "ANSWER = 2\n"), target)
    after = code_identity(env)
    assert after["dist:verl"] == "0.9.1"
    assert code_change(before, after, "the trainer") == (
        f"code changed: the installed verl's files (RECORD digest) {before['files:verl']!r} -> "
        f"{after['files:verl']!r}, same version '0.9.1'")

    # An upgrade changes the files too; the version says it.
    pip_install(build_wheel(tmp_path / "build4", "verl", "0.9.2", "ANSWER = 2\n"), target)
    upgraded = code_identity(env)
    assert code_change(after, upgraded, "the trainer") == "code changed: the installed verl '0.9.1' -> '0.9.2'"


# As each ClientApp message computes the identity: in a process of its own (what another
# interpreter answered is kept for the rest of a process).
_IDENTITY = ("import json, sys; from fedagent_flwr.code_identity import code_identity; "
             "print(json.dumps(code_identity({}, executable=sys.argv[1])))")


def identity_in_a_new_process(python: Path) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", _IDENTITY, str(python)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, check=True, timeout=120)
    return dict(json.loads(done.stdout))


def test_an_interpreter_that_cannot_answer_leaves_the_versions_unknown_not_absent(tmp_path: Path) -> None:
    """The env's interpreter (a real venv, named by a wrapper as a launch may name it) breaks after
    its service started: what it would import now is unknown, which is no reason to replace the
    service; once it answers again, a service recorded with unknown versions is replaced once."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    real = venv / "bin" / "python"
    site_dir = Path(subprocess.run([str(real), "-c", "import site; print(site.getsitepackages()[0])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    install(site_dir, "textworld", "1.6.0")
    python = make_interpreter(tmp_path / "env-python", f'exec {real} "$@"')
    recorded = identity_in_a_new_process(python)
    assert recorded["dist:textworld"] == "1.6.0" and versions_unknown(recorded) == ""

    make_interpreter(python, BROKEN)
    now = identity_in_a_new_process(python)
    assert {now[f"{kind}:{name}"] for name in DISTRIBUTIONS for kind in ("dist", "files")} == {UNKNOWN}
    assert versions_unknown(now) == (
        f"the installed library versions are unknown: {python} failed to say where its packages are "
        "(exit status 1: Fatal Python error: init_import_site: Failed to import the site module)")
    assert code_change(recorded, now, "the service") == ""  # no evidence the running service is out of date
    assert code_change(now, now, "the service") == ""

    make_interpreter(python, f'exec {real} "$@"')
    healed = identity_in_a_new_process(python)
    assert code_change(recorded, healed, "the service") == ""
    # A process that recorded unknown versions never said what it imported: replaced once.
    assert code_change(now, healed, "the service") == (
        "code changed: the library versions the service imported are unknown (when it started: "
        f"{python} failed to say where its packages are (exit status 1: Fatal Python error: init_import_site: "
        "Failed to import the site module))")


def test_a_hung_or_missing_interpreter_leaves_the_versions_unknown(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(code_identity_module, "SITE_QUERY_TIMEOUT_S", 1.0)
    hung = make_interpreter(tmp_path / "hung-python", "exec sleep 60")
    identity = code_identity({}, executable=str(hung))
    assert identity["dist:torch"] == identity["files:numpy"] == UNKNOWN
    assert versions_unknown(identity) == (
        f"the installed library versions are unknown: {hung} did not say where its packages are within 1 s")
    missing = tmp_path / "no-such-venv" / "bin" / "python"
    identity = code_identity({}, executable=str(missing))
    assert identity["dist:torch"] == UNKNOWN
    assert versions_unknown(identity).startswith(
        f"the installed library versions are unknown: {missing} could not be run: [Errno 2] No such file")
    # This interpreter always knows its own packages.
    assert versions_unknown(code_identity({})) == "" and code_identity({})["dist:torch"] != UNKNOWN


def test_a_py_file_that_cannot_be_read_does_not_break_the_digest(tmp_path: Path) -> None:
    """A dangling symlink among the package's files (a checkout's link to a removed module) made
    every trainer and service start fail; it is no code anyone can import."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("x = 1\n")
    original = package_digest(package)
    (package / "gone.py").symlink_to(tmp_path / "removed.py")
    dangling = package_digest(package)
    assert dangling != original
    (tmp_path / "removed.py").write_text("")
    assert package_digest(package) not in (original, dangling)
    (package / "gone.py").unlink()
    assert package_digest(package) == original


def base_interpreter_with_a_user_site(tmp_path: Path) -> Path:
    """The interpreter this venv was made from, if it enables a user site (else the test skips)."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    if not base.is_file():  # checked first: running a missing interpreter raises instead of skipping
        pytest.skip(f"no base interpreter at {base}")
    user_site = subprocess.run([str(base), "-c", "import site; print(site.ENABLE_USER_SITE)"],
                               capture_output=True, text=True, env={**os.environ, "PYTHONUSERBASE": str(tmp_path)})
    if user_site.stdout.strip() != "True":
        pytest.skip(f"the base interpreter at {base} has no user site")
    return base


def test_another_interpreter_is_asked_with_the_environment_its_process_gets(tmp_path: Path) -> None:
    """Where an interpreter outside any venv finds packages depends on the environment it is
    started with (its user site: ``PYTHONUSERBASE``, ``PYTHONNOUSERSITE``); it used to be asked with
    this process's environment, and once per interpreter whatever the environment."""
    base = base_interpreter_with_a_user_site(tmp_path)
    site_dir = tmp_path / "user" / "lib" / base.name / "site-packages"
    install(site_dir, "textworld", "1.6.0")
    env = {**os.environ, "PYTHONUSERBASE": str(tmp_path / "user")}
    assert code_identity(env, executable=str(base))["dist:textworld"] == "1.6.0"
    assert code_identity({**env, "PYTHONNOUSERSITE": "1"}, executable=str(base))["dist:textworld"] == ABSENT
    assert code_identity({**env, "PYTHONUSERBASE": str(tmp_path / "other")}, executable=str(base))[
        "dist:textworld"] == ABSENT


def test_a_distribution_found_through_a_pth_file_is_identified(tmp_path: Path) -> None:
    """A legacy editable install (``setup.py develop``) in an env's venv: ``easy-install.pth`` names
    the checkout, whose ``.egg-info`` holds the version; it used to read as not installed."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site_dir = Path(subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    checkout = tmp_path / "textworld-checkout"
    pkg_info = checkout / "textworld.egg-info" / "PKG-INFO"
    pkg_info.parent.mkdir(parents=True)
    pkg_info.write_text("Metadata-Version: 1.2\nName: textworld\nVersion: 1.7.0.dev0\n")
    (site_dir / "easy-install.pth").write_text(f"import sys; sys.__plen = len(sys.path)\n# a comment\n{checkout}\n"
                                               f"{tmp_path / 'removed-checkout'}\n")
    seen = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('textworld'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert seen == "1.7.0.dev0"  # what that venv's processes import
    identity = code_identity({}, executable=python)
    assert identity["dist:textworld"] == "1.7.0.dev0" and identity["files:textworld"] == NO_RECORD
    pkg_info.write_text("Metadata-Version: 1.2\nName: textworld\nVersion: 1.8.0\n")
    assert code_change(identity, code_identity({}, executable=python), "the service") == (
        "code changed: the installed textworld '1.7.0.dev0' -> '1.8.0'")


def test_another_build_of_python_behind_the_same_interpreter_path_is_other_code(tmp_path: Path) -> None:
    """A venv's ``bin/python`` links to a base interpreter; a patch release installed in place
    (here: the link pointed at another build of this Python version) leaves the path, the
    site-packages and every distribution as they were, and changes the standard library."""
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    others = [path for path in (Path("/usr/bin") / minor, Path("/usr/local/bin") / minor) if path.is_file()
              and subprocess.run([str(path), "-c", "import sys; print(sys.version)"], capture_output=True,
                                 text=True).stdout.strip() != sys.version]
    if not others:
        pytest.skip(f"no other build of {minor} on this machine")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    recorded = identity_in_a_new_process(python)
    assert recorded["python"] != UNKNOWN
    python.unlink()
    python.symlink_to(others[0])
    now = identity_in_a_new_process(python)
    assert {k: v for k, v in now.items() if k != "python"} == {k: v for k, v in recorded.items() if k != "python"}
    assert code_change(recorded, now, "the service") == (
        f"code changed: the Python version {recorded['python']!r} -> {now['python']!r}")


def test_a_user_site_is_searched_before_the_system_site_packages(tmp_path: Path) -> None:
    """:mod:`site` puts the user site on ``sys.path`` before the system's site-packages, so a
    library installed in both (``pip install --user numpy`` over a system numpy) is imported from
    the user site. The identity listed the user site last and read the system's copy: an upgrade
    with ``pip install --user`` went unseen."""
    base = base_interpreter_with_a_user_site(tmp_path)
    user_site = tmp_path / "user" / "lib" / base.name / "site-packages"
    install(user_site, "numpy", "99.0")
    env = {**os.environ, "PYTHONUSERBASE": str(tmp_path / "user")}
    env.pop("PYTHONPATH", None)
    asked = ("import json, sys\nfrom importlib.metadata import PackageNotFoundError, version\n"
             "try:\n    found = version('numpy')\nexcept PackageNotFoundError:\n    found = None\n"
             "print(json.dumps([sys.path, found]))")
    done = subprocess.run([str(base), "-c", asked], capture_output=True, text=True, env=env, check=True, timeout=60)
    path, imported = json.loads(done.stdout)
    _, dirs = code_identity_module.interpreter_site(str(base), env)
    assert str(user_site) in dirs and str(user_site) in path
    # the folders in the order that interpreter searches them, the user site first
    assert [d for d in dirs if d in path] == [d for d in path if d in dirs]
    assert dirs[0] == str(user_site)
    assert imported == "99.0" and code_identity(env, executable=str(base))["dist:numpy"] == "99.0"
