"""Hashes the run did not record are never skipped silently, on real runs of the real strategies: a
client's hash that the global model records as an empty string (FedAvg's and a server optimiser's
rounds), a round's committed content hash that is empty, and a run record without
``base_model_sha256`` (the base model a server optimiser's first round stepped from) each fail the
round with one line naming what is missing, unless ``--allow-unhashed``, which notes it on the
round's line and recomputes the round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.checkpoint.verify import main as verify
from fedagent_flwr.serverapp.strategy import FedAdamFSDP, FedAvgFSDP
from testkit.near_one import near_one, small_change_round
from testkit.strategy_setup import connected_strategy

MODEL = "model.safetensors"
ADVICE = "so it cannot be checked; pass --allow-unhashed if the run predates content hashes"


def _run(tmp_path: Path, cls: type[FedAvgFSDP], **settings: float) -> Path:
    """One round of two clients (HF checkpoints) by ``cls``: the run root."""
    strategy, run_root = connected_strategy(tmp_path, near_one(tmp_path, 5), cls, clients=2, **settings)
    small_change_round(strategy, run_root, 1, 31)
    return run_root


def _edit_summary(run_root: Path, change: dict[str, object], entry: dict[str, object] | None = None) -> None:
    path = run_root / "federated_summary.json"
    summary = {**json.loads(path.read_text()), **change}
    summary["rounds"][0].update(entry or {})
    path.write_text(json.dumps(summary))


def _blank_source_hash(run_root: Path) -> Path:
    """Round 1's global model recording client 1's hash as "", recommitted in the run record."""
    model = run_root / "round_1" / "global" / MODEL
    with safe_open(str(model), framework="pt") as handle:
        metadata = handle.metadata() or {}
    sources = json.loads(metadata["fedagent.sources"])
    sources[1]["sha256"] = ""
    metadata["fedagent.sources"] = json.dumps(sources)
    save_file(load_file(str(model)), str(model), metadata)
    _edit_summary(run_root, {}, {"aggregated_sha256": CheckpointRef.for_directory(model.parent).sha256})
    return Path(sources[1]["path"])


def _audit(run_root: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    status = verify([str(run_root), *flags])
    return status, capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("cls", [FedAvgFSDP, FedAdamFSDP], ids=["fedavg", "fedadam"])
def test_an_empty_source_hash_fails_unless_allow_unhashed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cls: type[FedAvgFSDP],
) -> None:
    run_root = _run(tmp_path, cls)
    assert _audit(run_root, capsys)[0] == 0
    source = _blank_source_hash(run_root)
    what = f"{run_root / 'round_1' / 'global' / MODEL} records no content hash of its source {source}"
    assert _audit(run_root, capsys) == (1, [f"round 1: cannot verify: {what}, {ADVICE}"])
    status, lines = _audit(run_root, capsys, "--allow-unhashed")
    assert status == 0 and len(lines) == 1 and lines[0].endswith(f" ok; {what}: not checked"), lines


def test_an_empty_committed_hash_fails_an_optimiser_round_unless_allow_unhashed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A server optimiser's global model is an input of the next round (its header records the
    state's hash), so the run record's hash of it is checked."""
    run_root = _run(tmp_path, FedAdamFSDP)
    _edit_summary(run_root, {}, {"aggregated_sha256": ""})
    what = f"the run record has no content hash of {run_root / 'round_1' / 'global'} (the round's commit)"
    assert _audit(run_root, capsys) == (1, [f"round 1: cannot verify: {what}, {ADVICE}"])
    status, lines = _audit(run_root, capsys, "--allow-unhashed")
    assert status == 0 and len(lines) == 1 and lines[0].endswith(f" ok; {what}: not checked"), lines


def test_a_missing_base_model_hash_fails_a_round_stepping_from_the_base_model_unless_allow_unhashed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    run_root = _run(tmp_path, FedAdamFSDP)
    _edit_summary(run_root, {"base_model_sha256": None})
    what = "the run record has no base_model_sha256 of the base model this round stepped from"
    assert _audit(run_root, capsys) == (1, [f"round 1: cannot verify: {what}, {ADVICE}"])
    status, lines = _audit(run_root, capsys, "--allow-unhashed")
    assert status == 0 and len(lines) == 1 and lines[0].endswith(f" ok; {what}: not checked"), lines
