"""tools/gpu/webshop_warm_start.sh's expert cache, on CPU with a few real expert episodes on the real
WebShop data: episodes played and saved once are reused by a later run whose key (settings, data,
code) is the same, byte for byte and without playing, and played again when the key differs or the
file no longer has the sha256 its key records, so a GPU session can skip playing them only where it
would have played the very same ones."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tools" / "gpu" / "webshop_warm_start.sh"
WEBSHOP_DATA = REPO.parent / "shared" / "data" / "webshop"
DATA_FILES = ("items_shuffle_1000.json", "items_ins_v2_1000.json")

needs_data = pytest.mark.skipif(not (WEBSHOP_DATA / DATA_FILES[0]).exists(),
                                reason=f"the WebShop data is not at {WEBSHOP_DATA}")


def script_env(cache: Path, **extra: str) -> dict[str, str]:
    """The script's environment for 1 expert episode (``extra`` overrides), without the caller's
    WARM_SCRATCH, TMPDIR or WORK."""
    env = {k: v for k, v in os.environ.items() if k not in ("WARM_SCRATCH", "TMPDIR", "WORK")}
    return {**env, "EXPERT_ONLY": "1", "EPISODES": "1", "SHARDS": "1", "PYTHON": sys.executable,
            "DATA": str(WEBSHOP_DATA), "EXPERT_CACHE": str(cache), "SAVE_EXPERT_CACHE": "0", **extra}


def run_script(out_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), str(out_dir)], env=env, capture_output=True, text=True, timeout=300)


def expert_only(work: Path, cache: Path, shards: int = 2, save: bool = False) -> str:
    """Run the script up to its 4 expert episodes; its output. Fails the test on an error."""
    done = run_script(work.parent / "unused-model", script_env(
        cache, EPISODES="4", SHARDS=str(shards), WARM_SCRATCH=str(work), SAVE_EXPERT_CACHE="1" if save else "0"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def code_digest() -> str:
    """What the script's ``find fedagent_flwr -name '*.py' | sort | xargs sha256sum | sha256sum`` prints."""
    paths = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "fedagent_flwr").rglob("*.py"))
    return sha256("".join(f"{sha256((REPO / path).read_bytes())}  {path}\n" for path in paths).encode())


@needs_data
def test_episodes_are_reused_only_under_the_same_key_and_intact(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    out = expert_only(tmp_path / "first", cache, save=True)
    assert "expert: saved to" in out and "in 2 shards" in out, out
    played = (tmp_path / "first" / "expert.jsonl").read_bytes()
    assert sorted(p.name for p in cache.iterdir()) == ["expert.jsonl.gz", "key", "wrote.log"]
    # The key: the settings, the data's content and the package's code; then the episodes' sha256.
    key, recorded = (cache / "key").read_text().splitlines()
    data = sha256(b"".join((WEBSHOP_DATA / name).read_bytes() for name in DATA_FILES))
    assert key.startswith("episodes=4 shards=2 ") and f" data={data} " in key and key.endswith(f" code={code_digest()}")
    assert recorded == f"episodes_sha256={sha256(played)}"

    # The same settings, data and code: the cached episodes, the same bytes, nothing played.
    out = expert_only(tmp_path / "again", cache)
    assert "expert: reused the episodes in" in out and "in 0 shards" in out, out
    assert "  wrote " in out  # the expert's own summary lines, from when they were played
    assert (tmp_path / "again" / "expert.jsonl").read_bytes() == played
    assert not list((tmp_path / "again").glob("expert-*.jsonl"))

    # Another setting (one shard: other first seeds) changes the key: played, the cache left as it was.
    out = expert_only(tmp_path / "other", cache, shards=1)
    assert "expert: reused" not in out and "in 1 shards" in out, out
    assert f"expert: the episodes in {cache} were played under another key (differs in: shards): playing them" in out
    assert (cache / "key").read_text().splitlines() == [key, recorded]

    # Another package (a commit after the staging) changes the key's code field, which is named.
    lines = (cache / "key").read_text().splitlines()
    (cache / "key").write_text("\n".join([lines[0].replace(" code=", " code=0"), lines[1]]) + "\n")
    out = expert_only(tmp_path / "recommitted", cache)
    assert "(differs in: code) (code: the package changed since they were played; stage them again after " \
        "the last commit): playing them" in out and "in 2 shards" in out, out
    (cache / "key").write_text("\n".join([key, recorded]) + "\n")

    # A damaged file under a matching key is played again, not trusted.
    gz = (cache / "expert.jsonl.gz").read_bytes()
    (cache / "expert.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    out = expert_only(tmp_path / "damaged", cache)
    assert "are not the ones their key records" in out and "in 2 shards" in out, out
    assert (tmp_path / "damaged" / "expert.jsonl").read_bytes() == played


def keepsake(folder: Path) -> Path:
    """A folder holding someone's file; the file."""
    folder.mkdir(parents=True)
    (folder / "thesis.tex").write_text("years of work")
    return folder / "thesis.tex"


def test_a_folder_of_someone_elses_is_refused_before_any_work(tmp_path: Path) -> None:
    """A named scratch folder that holds files or lies inside OUT_DIR, and an OUT_DIR that is not an
    earlier warm start's output (a folder of models; run records with a copy of a warm_start.json)
    are refused with a line naming them, before the recipe or the data is read; nothing is touched."""
    scratch_file = keepsake(tmp_path / "scratch")
    done = run_script(tmp_path / "model", script_env(tmp_path / "cache", WARM_SCRATCH=str(scratch_file.parent)))
    refused = f"WARM_SCRATCH {scratch_file.parent} exists and is not an empty folder"
    assert done.returncode == 2 and refused in done.stderr, done.stderr
    inside = tmp_path / "model" / "scratch"
    done = run_script(tmp_path / "model", script_env(tmp_path / "cache", WARM_SCRATCH=str(inside)))
    assert done.returncode == 2 and "is inside OUT_DIR" in done.stderr, done.stderr
    records = keepsake(tmp_path / "records")
    (records.parent / "warm_start.json").write_text("{}")
    for out_dir in (keepsake(tmp_path / "models").parent, records.parent):
        done = run_script(out_dir, script_env(tmp_path / "cache"))
        assert done.returncode == 2 and f"--out {out_dir} exists and is not empty; it is not an earlier warm " \
            "start's output" in done.stderr and "OUT_DIR refused" in done.stderr, done.stderr
    for kept in (scratch_file, records, tmp_path / "models" / "thesis.tex"):
        assert kept.read_text() == "years of work"
    assert not (tmp_path / "model").exists() and not (tmp_path / "cache").exists()


@needs_data
def test_it_neither_empties_work_nor_leaves_its_scratch_folder(tmp_path: Path) -> None:
    """WORK (many clusters export it: a user's work filesystem) is neither read nor emptied; an
    earlier warm start's output is accepted; the default scratch folder is the script's own, under
    TMPDIR, and is gone afterwards."""
    users_work, tmpdir = keepsake(tmp_path / "cluster-work"), tmp_path / "tmp"
    tmpdir.mkdir()
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    for name in ("warm_start.json", "config.json", "model.safetensors"):
        (earlier / name).write_text("{}")
    done = run_script(earlier, script_env(tmp_path / "cache", WORK=str(users_work.parent), TMPDIR=str(tmpdir)))
    assert done.returncode == 0 and "expert: 1 episodes in 1 shards" in done.stdout, done.stdout + done.stderr
    assert users_work.read_text() == "years of work" and sorted(users_work.parent.iterdir()) == [users_work]
    assert not list(tmpdir.glob("ws-warm-work*"))  # (torch leaves its own cache folder there)
