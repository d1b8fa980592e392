"""The checkpoint reader imports ``torch.distributed.tensor`` only for rank files that hold DTensors.

That import (DTensor's sharding rules) costs ~1.4 s of CPU, and every ServerApp process paid it at
start, through the reader's module, although the reference trainer's rank files hold plain tensors.
Each case runs in a fresh interpreter, where nothing else has imported it yet.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testkit.ckpt_factory import Suite

REPO = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
import torch
import fedagent_flwr.serverapp.app  # what a ServerApp process loads first
from fedagent_flwr.checkpoint import CheckpointRef, open_checkpoint

root = sys.argv[1]
loaded = {"at_start": "torch.distributed.tensor" in sys.modules}
for name in sys.argv[2:]:
    expected = torch.load(f"{root}/{name}.expected.pt", weights_only=True)
    ref = CheckpointRef.for_directory(f"{root}/{name}", fmt="fsdp-shards")
    with open_checkpoint(ref, root=root) as reader:
        assert set(reader.keys()) == set(expected), name
        assert all(torch.equal(reader.read(key), value) for key, value in expected.items()), name
        kinds = sorted({entry.kind for shard in reader._files for entry in shard.entries.values()})
    loaded[name] = {"kinds": kinds, "imported": "torch.distributed.tensor" in sys.modules}
print(json.dumps(loaded))
"""


def _probe(suite: Suite, *names: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(suite.root), *names],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_server_reads_plain_rank_files_without_importing_dtensor_support(suite: Suite) -> None:
    assert _probe(suite, "qwen_plain") == {"at_start": False, "qwen_plain": {"kinds": ["plain"], "imported": False}}


def test_a_dtensor_rank_file_imports_it_when_opened_and_reads_exactly(suite: Suite) -> None:
    # After a plain file, a world-size-2 DTensor checkpoint in the same process: its blocks are
    # still recognised as DTensor blocks and rebuilt exactly.
    assert _probe(suite, "qwen_plain", "qwen_b") == {
        "at_start": False,
        "qwen_plain": {"kinds": ["plain"], "imported": False},
        "qwen_b": {"kinds": ["dtensor"], "imported": True},
    }
