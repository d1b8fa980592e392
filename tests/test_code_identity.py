"""The code identity follows in-place upgrades of the distributions a trainer or service imports.

A ``pip install -U torch`` (or transformers, verl, vllm, flwr) in the venv of a persistent trainer
or an env service changes neither this package's files, nor the interpreter, nor PYTHONPATH; the
identity used to stay the same, so a trainer or service kept running on the old library. Real
distribution metadata in real folders, read by :mod:`importlib.metadata`; nothing is mocked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fedagent_flwr.code_identity import ABSENT, DISTRIBUTIONS, code_change, code_identity, installed_versions


def install(site_dir: Path, name: str, version: str) -> None:
    """Install (metadata only) ``name`` ``version`` in ``site_dir`` as pip does, replacing another version."""
    for old in site_dir.glob(f"{name}-*.dist-info"):
        for file in old.iterdir():
            file.unlink()
        old.rmdir()
    info = site_dir / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


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
        "dist:vllm": "0.24.0", "dist:no-such-distribution": ABSENT}


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
