"""tools/gpu/webshop_warm_start.sh's expert cache, on CPU with a few real expert episodes on the real
WebShop data: episodes played and saved once are reused by a later run whose key (settings, data,
code) is the same, byte for byte and without playing, and played again when the key differs, so a
GPU session can skip playing them only where it would have played the very same ones."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tools" / "gpu" / "webshop_warm_start.sh"
WEBSHOP_DATA = REPO.parent / "shared" / "data" / "webshop"


def expert_only(work: Path, cache: Path, episodes: int, save: bool = False) -> str:
    """Run the script up to its expert episodes (2 shards); its output. Fails the test on an error."""
    env = {**os.environ, "EXPERT_ONLY": "1", "EPISODES": str(episodes), "SHARDS": "2", "PYTHON": sys.executable,
           "DATA": str(WEBSHOP_DATA), "WORK": str(work), "EXPERT_CACHE": str(cache),
           "SAVE_EXPERT_CACHE": "1" if save else "0"}
    done = subprocess.run(["bash", str(SCRIPT), str(work.parent / "unused-model")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_episodes_are_reused_only_under_the_same_key(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    out = expert_only(tmp_path / "first", cache, episodes=4, save=True)
    assert "expert: saved to" in out and "in 2 shards" in out, out
    played = digest(tmp_path / "first" / "expert.jsonl")
    assert sorted(p.name for p in cache.iterdir()) == ["expert.jsonl.gz", "key", "wrote.log"]

    # The same settings, data and code: the cached episodes, the same bytes, nothing played.
    out = expert_only(tmp_path / "again", cache, episodes=4)
    assert "expert: reused the episodes in" in out and "in 0 shards" in out, out
    assert "wrote " in out  # the expert's own summary lines are shown again, from the cache
    assert digest(tmp_path / "again" / "expert.jsonl") == played
    assert not list((tmp_path / "again").glob("expert-*.jsonl"))

    # Another setting (the number of episodes) changes the key: played again, the cache left as it was.
    key = (cache / "key").read_text()
    out = expert_only(tmp_path / "other", cache, episodes=2)
    assert "expert: reused" not in out and "in 2 shards" in out, out
    assert (cache / "key").read_text() == key

    # A key that does not match (as after a change to the package's code) is not trusted either.
    (cache / "key").write_text(key.replace("code=", "code=0"))
    out = expert_only(tmp_path / "changed", cache, episodes=4)
    assert "expert: reused" not in out and "in 2 shards" in out, out
    assert digest(tmp_path / "changed" / "expert.jsonl") == played  # played anew: the same episodes
