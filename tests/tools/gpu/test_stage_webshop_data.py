"""tools/gpu/stage_webshop_data.sh takes a relative SRC (and TMPDIR) from the caller's folder, as
any command would, though it moves to the repository root to do its work. Run from a scratch copy
of the script in a scratch git repository, so this checkout's own .gpu-data is never touched."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DATA_FILES = ("items_shuffle_1000.json", "items_ins_v2_1000.json")


def scratch_checkout(root: Path) -> Path:
    """A git repository that ignores /.gpu-data/ and holds the script at tools/gpu/."""
    (root / "tools" / "gpu").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "gpu" / "stage_webshop_data.sh", root / "tools" / "gpu")
    (root / ".gitignore").write_text("/.gpu-data/\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def stage(checkout: Path, args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The scratch checkout's script with ``args``, run from ``cwd``."""
    return subprocess.run(["bash", str(checkout / "tools" / "gpu" / "stage_webshop_data.sh"), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_a_relative_source_is_the_callers(tmp_path: Path) -> None:
    checkout = scratch_checkout(tmp_path / "checkout")
    caller = tmp_path / "caller"
    (caller / "my-webshop").mkdir(parents=True)
    for name in DATA_FILES:
        (caller / "my-webshop" / name).write_text(f'[{{"from": "{name}"}}]\n')
    # not the caller's TMPDIR, CDPATH or switches of the script (EXPERT would play episodes)
    env = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "CDPATH", "EXPERT", "LOOKALIKE")}
    done = stage(checkout, ["my-webshop"], caller, env)
    assert done.returncode == 0, done.stderr
    for name in DATA_FILES:
        assert (checkout / ".gpu-data" / "webshop" / name).read_text() == f'[{{"from": "{name}"}}]\n'
    assert (checkout / ".gpu-data" / "webshop" / "SHA256SUMS").is_file()

    # a source or TMPDIR that is not a folder is named, and nothing is copied
    shutil.rmtree(checkout / ".gpu-data")
    for args, extra, named in ((["no-such-folder"], {}, "no folder no-such-folder"),
                               (["my-webshop"], {"TMPDIR": "no-such-tmp"}, "TMPDIR=no-such-tmp is not a folder")):
        done = stage(checkout, args, caller, {**env, **extra})
        assert done.returncode == 1 and named in done.stderr, done.stderr
        assert not (checkout / ".gpu-data").exists()
