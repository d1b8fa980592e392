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

pytestmark = pytest.mark.skipif(not (WEBSHOP_DATA / DATA_FILES[0]).exists(),
                                reason=f"the WebShop data is not at {WEBSHOP_DATA}")


def expert_only(work: Path, cache: Path, shards: int = 2, save: bool = False) -> str:
    """Run the script up to its 4 expert episodes; its output. Fails the test on an error."""
    env = {**os.environ, "EXPERT_ONLY": "1", "EPISODES": "4", "SHARDS": str(shards), "PYTHON": sys.executable,
           "DATA": str(WEBSHOP_DATA), "WORK": str(work), "EXPERT_CACHE": str(cache),
           "SAVE_EXPERT_CACHE": "1" if save else "0"}
    done = subprocess.run(["bash", str(SCRIPT), str(work.parent / "unused-model")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def code_digest() -> str:
    """What the script's ``find fedagent_flwr -name '*.py' | sort | xargs sha256sum | sha256sum`` prints."""
    paths = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "fedagent_flwr").rglob("*.py"))
    return sha256("".join(f"{sha256((REPO / path).read_bytes())}  {path}\n" for path in paths).encode())


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
    assert (cache / "key").read_text().splitlines() == [key, recorded]

    # A damaged file under a matching key is played again, not trusted.
    gz = (cache / "expert.jsonl.gz").read_bytes()
    (cache / "expert.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    out = expert_only(tmp_path / "damaged", cache)
    assert "are not the ones their key records" in out and "in 2 shards" in out, out
    assert (tmp_path / "damaged" / "expert.jsonl").read_bytes() == played
