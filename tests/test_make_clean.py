"""`make clean` removes this checkout's venv and Flower state and nothing outside the checkout:
FLWR_HOME or VENV exported for other work (docs/deployment.md sets FLWR_HOME=$HOME/.flwr) points at
someone's Flower configuration or environment. Run on a copy of the real Makefile in a scratch
checkout, so the repository's own .venv is never at stake."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def scratch_checkout(root: Path) -> Path:
    """A folder holding a copy of the real Makefile."""
    root.mkdir()
    shutil.copy(REPO / "Makefile", root / "Makefile")
    return root


def make_clean(checkout: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``make -s -C checkout clean ARGS`` without the caller's FLWR_HOME, VENV or make flags (`make
    test` exports FLWR_HOME to the tests), ``env`` added (make found on the caller's PATH)."""
    make = shutil.which("make")
    assert make is not None
    base = {k: v for k, v in os.environ.items() if k not in ("FLWR_HOME", "VENV", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    return subprocess.run([make, "-s", "-C", str(checkout), "clean", *args], capture_output=True, text=True,
                          timeout=60, env={**base, **env})


def test_clean_leaves_what_lies_outside_the_checkout(tmp_path: Path) -> None:
    checkout = scratch_checkout(tmp_path / "my checkout")  # a space: every path is quoted
    for inside in (checkout / ".venv", checkout / ".flwr"):
        (inside / "state").mkdir(parents=True)
    users_flwr = tmp_path / "home" / ".flwr"
    users_flwr.mkdir(parents=True)
    (users_flwr / "config.toml").write_text("[superlink.cluster]\n")

    done = make_clean(checkout, f"FLWR_HOME={users_flwr}")
    assert done.returncode == 0, done.stderr
    assert f"make clean: left {users_flwr} alone: it is outside this checkout" in done.stdout
    assert (users_flwr / "config.toml").read_text() == "[superlink.cluster]\n"
    assert not (checkout / ".venv").exists() and (checkout / ".flwr" / "state").is_dir()

    # The defaults (both inside the checkout) are removed; the checkout itself stays.
    assert make_clean(checkout).returncode == 0
    assert sorted(p.name for p in checkout.iterdir()) == ["Makefile"]
    assert make_clean(checkout, "VENV=.").returncode == 0
    assert (checkout / "Makefile").exists()


def test_clean_needs_only_posix_tools(tmp_path: Path) -> None:
    """Without GNU ``realpath`` (macOS without coreutils) clean still tells inside from outside,
    following links: a venv linked to a folder outside the checkout is left alone."""
    checkout = scratch_checkout(tmp_path / "checkout")
    (checkout / ".flwr" / "state").mkdir(parents=True)
    elsewhere = tmp_path / "shared-venv"
    (elsewhere / "bin").mkdir(parents=True)
    (checkout / ".venv").symlink_to(elsewhere)
    tools = tmp_path / "bin"  # sh and the POSIX tools the recipe calls; no realpath
    tools.mkdir()
    for name in ("sh", "rm", "dirname", "basename"):
        found = shutil.which(name)
        assert found is not None
        (tools / name).symlink_to(found)
    done = make_clean(checkout, PATH=str(tools))
    assert done.returncode == 0, done.stderr
    assert "make clean: left .venv alone: it is outside this checkout" in done.stdout
    assert (elsewhere / "bin").is_dir() and (checkout / ".venv").is_symlink()
    assert not (checkout / ".flwr").exists()

    # a caller's CDPATH holding a folder of the same name as the (relative) VENV: cd must not go there
    (checkout / ".venv").unlink()
    (checkout / ".venv" / "bin").mkdir(parents=True)
    decoy = tmp_path / "cdpath"
    (decoy / ".venv" / "bin").mkdir(parents=True)
    done = make_clean(checkout, PATH=str(tools), CDPATH=str(decoy))
    assert done.returncode == 0, done.stderr
    assert not (checkout / ".venv").exists() and (decoy / ".venv" / "bin").is_dir()
