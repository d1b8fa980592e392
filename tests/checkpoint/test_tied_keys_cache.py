"""transformers' tied weight keys for a base model are asked once, then kept in the user cache.

A ServerApp asks them at its first aggregation (which keys the averaged model may leave out), and
asking imports transformers' model classes (~2.5 s of CPU) on the round's critical path. The answer
is a function of the config file and the transformers version, so it is kept under that key and a
later run (a fresh process, as every ServerApp is) reads it. Each case is a fresh interpreter with
a cache directory of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
from pathlib import Path
from fedagent_flwr.checkpoint.hf_files import tied_weight_keys
ties = tied_weight_keys(Path(sys.argv[1]))
print(json.dumps({"ties": ties, "transformers": "transformers" in sys.modules}))
"""


def _ask(model_dir: Path, cache: Path) -> dict:
    env = dict(os.environ, FEDAGENT_CACHE_DIR=str(cache))
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(model_dir)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_the_tied_keys_without_importing_transformers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tied = {"lm_head.weight": "model.embed_tokens.weight"}  # the tiny Qwen2 ties its embeddings
    assert _ask(tiny_model_dir, tmp_path / "cache") == {"ties": tied, "transformers": True}
    assert _ask(tiny_model_dir, tmp_path / "cache") == {"ties": tied, "transformers": False}
    # An unreadable entry is not trusted: transformers is asked again, and the entry rewritten.
    (entry,) = (tmp_path / "cache" / "tied-weight-keys").glob("*.json")
    entry.write_text("{")
    assert _ask(tiny_model_dir, tmp_path / "cache") == {"ties": tied, "transformers": True}
    assert json.loads(entry.read_text()) == {"ties": [list(pair) for pair in tied.items()]}


def test_another_config_is_another_entry(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A config that differs in any byte is asked of transformers again, never answered from the
    other config's entry."""
    assert _ask(tiny_model_dir, tmp_path / "cache")["transformers"] is True
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["use_cache"] = not config.get("use_cache", True)
    (other / "config.json").write_text(json.dumps(config))
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    assert _ask(other, tmp_path / "cache") == {"ties": tied, "transformers": True}
    assert len(list((tmp_path / "cache" / "tied-weight-keys").glob("*.json"))) == 2
    assert _ask(other, tmp_path / "cache") == {"ties": tied, "transformers": False}
