"""transformers' answers about a base model's config are asked once, then kept in the user cache.

A ServerApp asks two at its first aggregation, on round 1's critical path: the config as its
config class reads it (to compare a client's config with the base model's) and the weights the model
ties. Asking imports transformers' model classes (~3 s of CPU). An answer is a function of the
config file and the transformers version, so it is kept under that key and a later process (every
ServerApp is a fresh one) reads it. Each case is a fresh interpreter with a cache directory of its
own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# What the first aggregation asks: the client's config against the base model's, then the ties.
_PROBE = """
import json, sys
from pathlib import Path
from fedagent_flwr.checkpoint.hf_files import tied_weight_keys
from fedagent_flwr.checkpoint.model_files import check_model_config
base, client = Path(sys.argv[1]), Path(sys.argv[2])
try:
    check_model_config(client, base)
    refused = ""
except Exception as exc:
    refused = str(exc)
print(json.dumps({"refused": refused, "ties": tied_weight_keys(base), "transformers": "transformers" in sys.modules}))
"""
TIED = {"lm_head.weight": "model.embed_tokens.weight"}  # the tiny Qwen2 ties its embeddings


def _ask(base: Path, client: Path, cache: Path) -> dict:
    env = dict(os.environ, FEDAGENT_CACHE_DIR=str(cache))
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(base), str(client)], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _client_copy(tiny_model_dir: Path, target: Path, **changes: object) -> Path:
    shutil.copytree(tiny_model_dir, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def test_a_second_process_answers_without_importing_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The client's config differs from the base model's only in a field trainers rewrite (dtype).
    client = _client_copy(tiny_model_dir, tmp_path / "client", dtype="bfloat16")
    cache = tmp_path / "cache"
    assert _ask(tiny_model_dir, client, cache) == {"refused": "", "ties": TIED, "transformers": True}
    assert _ask(tiny_model_dir, client, cache) == {"refused": "", "ties": TIED, "transformers": False}
    # An unreadable entry is not trusted: transformers is asked again, and the entry rewritten.
    entries = sorted((cache / "config-answers").glob("*.json"))
    assert [p.name.split("-")[0] for p in entries] == ["full", "full", "tied"]  # two configs, one base
    for entry in entries:
        entry.write_text("{")
    assert _ask(tiny_model_dir, client, cache) == {"refused": "", "ties": TIED, "transformers": True}
    assert json.loads(entries[-1].read_text()) == {"answer": [list(pair) for pair in TIED.items()]}


def test_a_kept_answer_refuses_a_client_of_another_model_as_transformers_does(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A client's config that differs in a field that matters is refused alike with a cold and a
    warm cache; its config is another entry, never answered from the base model's."""
    client = _client_copy(tiny_model_dir, tmp_path / "client", hidden_size=32)
    cold = _ask(tiny_model_dir, client, tmp_path / "cache")
    warm = _ask(tiny_model_dir, client, tmp_path / "cache")
    assert "hidden_size: 32 (base model: 64)" in cold["refused"] and cold["transformers"] is True
    assert warm == dict(cold, transformers=False)


def test_a_kept_answer_without_the_shape_of_one_is_asked_again(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Readable entries that are not this config's answer (an empty config, whose comparison would
    find no difference; a tie list of the wrong shape) are not trusted: transformers is asked again
    and the client of another model is still refused."""
    client = _client_copy(tiny_model_dir, tmp_path / "client", hidden_size=32)
    cache = tmp_path / "cache"
    cold = _ask(tiny_model_dir, client, cache)
    for entry in (cache / "config-answers").glob("*.json"):
        entry.write_text(json.dumps({"answer": {} if entry.name.startswith("full") else [["lm_head.weight"]]}))
    again = _ask(tiny_model_dir, client, cache)
    assert again == dict(cold, transformers=True) and "hidden_size: 32 (base model: 64)" in again["refused"]
