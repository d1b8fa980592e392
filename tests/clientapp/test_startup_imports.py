"""What a ClientApp process imports to start.

Flower loads ``fedagent_flwr.clientapp.app:app`` (pyproject's ``clientapp`` component) in every
ClientApp process: one fresh ``flwr-clientapp`` per message in a deployment, one Ray actor per
simulated node. The ClientApp only writes job files, starts trainers and moves checkpoint
references, so it must start without torch (5-8 CPU-seconds to import on a CI core); only the
per-client validation merge needs torch, and imports it when it runs. The checkpoint package
therefore loads its torch-based names on first use; every name it exports still resolves.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
import fedagent_flwr.clientapp.app
print(json.dumps({name: name in sys.modules for name in ("torch", "transformers", "safetensors")}))
"""


def test_the_clientapp_module_starts_without_torch() -> None:
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert probe.returncode == 0, probe.stderr
    loaded = json.loads(probe.stdout.strip().splitlines()[-1])
    assert loaded == {"torch": False, "transformers": False, "safetensors": False}, loaded


def test_the_reference_trainer_reads_its_job_before_torch_loads() -> None:
    # train.py checks the job before it imports torch, so bad input fails fast; its command module
    # (and the persistent session it names) must not load torch first
    probe = subprocess.run([sys.executable, "-c", _PROBE.replace("fedagent_flwr.clientapp.app",
                                                                  "fedagent_flwr.trainers.reference.cli")],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout.strip().splitlines()[-1])["torch"] is False


_HTTP_STORE_PROBE = """
import json, sys
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from fedagent_flwr.clientapp.app import shutdown
from fedagent_flwr.protocol import ShutdownInstruction, ShutdownReply

work_dir = sys.argv[1]
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1  # set by Flower in real runs
store = {"store-kind": "http", "store-url": "https://127.0.0.1:9", "store-run": "7", "store-read-token": "r"}
instruction = ShutdownInstruction(store=store)
message = Message(instruction.to_record(), dst_node_id=3, message_type=instruction.message_type)
context = Context(run_id=7, node_id=3, node_config={"partition-id": 0, "num-partitions": 1, "work-dir": work_dir},
                  state=RecordDict(), run_config={})
reply = ShutdownReply.from_record(shutdown(message, context).content)
print(json.dumps({"reply": [reply.services_stopped, reply.trainers_stopped],
                  "torch": "torch" in sys.modules}))
"""


def test_a_clientapp_on_the_http_store_answers_without_torch(tmp_path: Path) -> None:
    """Every message of a run on the http store (no shared filesystem: a fresh ``flwr-clientapp``
    per message) opens the node's http client store first; opening it must not import torch either
    (it did, through a directory fsync helper, ~2 CPU-seconds of every such message)."""
    probe = subprocess.run([sys.executable, "-c", _HTTP_STORE_PROBE, str(tmp_path / "work")],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout.strip().splitlines()[-1]) == {"reply": [0, 0], "torch": False}, probe.stdout


def test_every_exported_checkpoint_name_resolves() -> None:
    import fedagent_flwr.checkpoint as checkpoint
    from fedagent_flwr.checkpoint import aggregate, open_ref

    assert all(getattr(checkpoint, name) is not None for name in checkpoint.__all__)
    assert checkpoint.weighted_mean is aggregate.weighted_mean
    assert checkpoint.open_checkpoint is open_ref.open_checkpoint
    assert not hasattr(checkpoint, "no_such_name")
