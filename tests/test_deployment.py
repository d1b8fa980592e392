"""End to end in Flower's deployment runtime: a real SuperLink and two real SuperNodes on
loopback, with TLS (a self-signed CA generated here) and SuperNode authentication, running the
default job with the tiny model; and a SuperNode whose key was never registered is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deployment_harness import CONNECTION, Deployment, tls_deployment

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with tls_deployment(tmp_path_factory.mktemp("deploy"), num_supernodes=2) as running:
        yield running
    # Stopped by process group: nothing started in the deployment's directories survives.
    assert running.leftovers() == []


def test_two_supernodes_with_tls_and_node_auth_run_two_rounds(
    deployment: Deployment, tmp_path: Path, tiny_model_dir: Path
) -> None:
    proc = deployment.run(
        f"model.path={tiny_model_dir} num_rounds=2 eval.num_episodes=2 trainer.max_new_tokens=8 "
        f"output_dir={tmp_path} run_name=job"
    )
    output = proc.stdout + proc.stderr
    run_dir = tmp_path / "job"
    summary_path = run_dir / "federated_summary.json"
    assert summary_path.exists(), output[-4000:] + deployment.logs()
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "completed", output[-4000:] + deployment.logs()
    assert summary["mode"] == "federated" and summary["strategy"] == "fedavg"
    assert [p["round"] for p in summary["val_curve"]] == [0, 1, 2]
    assert [entry["round"] for entry in summary["rounds"]] == [1, 2]
    previous = str(Path(tiny_model_dir).resolve())
    for entry in summary["rounds"]:
        assert entry["client_actor_ids"] == [0, 1] and not entry["rejected"]
        assert entry["started_from"] == previous
        previous = entry["aggregated_actor"]
    assert summary["final_model"] == previous
    # Each message ran in a fresh flwr-clientapp process under its SuperNode.
    for node in deployment.supernodes:
        assert "flwr-clientapp" in node.log() or "Receiving: train message" in node.log(), node.log()[-2000:]
    audit = subprocess.run([sys.executable, "-m", "fedagent_flwr.checkpoint.verify", str(run_dir)],
                           capture_output=True, text=True)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert audit.stdout.count(" ok") == 2


def test_a_supernode_with_an_unregistered_key_is_refused(deployment: Deployment) -> None:
    intruder = deployment.start_supernode(0, 2, deployment.new_node_key("intruder"), name="intruder")
    returncode = intruder.process.wait(timeout=300)  # a hang guard: refusal comes at the first contact
    log = intruder.log()
    assert returncode != 0, log
    assert "Exit Code: 305" in log and "Failed to activate SuperNode" in log, log
    nodes = deployment.flwr("supernode", "ls", CONNECTION, "--format", "json")
    assert nodes.returncode == 0, nodes.stdout + nodes.stderr
    listed = json.loads(nodes.stdout[nodes.stdout.index("{"):])["nodes"]
    # Only the two registered SuperNodes are known to the SuperLink, both online.
    registered = {line.rsplit(":", 1)[1].strip() for node in deployment.supernodes[:2]
                  for line in node.log().splitlines() if "SuperNode ID:" in line}
    assert {n["node-id"] for n in listed} == registered and len(registered) == 2, listed
    assert {n["status"] for n in listed} == {"online"}, listed
