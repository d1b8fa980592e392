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
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.checkpoint.verify import main as verify
from fedagent_flwr.serverapp.strategy import FedAdamFSDP, FedAvgFSDP
from testkit.ckpt_factory import Suite
from testkit.near_one import near_one, small_change_round
from testkit.round_harness import train_round
from testkit.strategy_setup import connected_strategy, initial_checkpoint, suite_ppo_reply

MODEL = "model.safetensors"
ADVICE = "so it cannot be checked; pass --allow-unhashed if the run predates content hashes"


def _run(tmp_path: Path, cls: type[FedAvgFSDP], rounds: int = 1, **settings: float) -> Path:
    """``rounds`` rounds of two clients (HF checkpoints) by ``cls``: the run root."""
    strategy, run_root = connected_strategy(tmp_path, near_one(tmp_path, 5), cls, clients=2, **settings)
    for server_round in range(1, rounds + 1):
        small_change_round(strategy, run_root, server_round, 30 + server_round)
    return run_root


def _edit_summary(run_root: Path, change: dict[str, object], entry: dict[str, object] | None = None,
                  server_round: int = 1) -> None:
    path = run_root / "federated_summary.json"
    summary = {**json.loads(path.read_text()), **change}
    summary["rounds"][server_round - 1].update(entry or {})
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


def _ppo_run(suite: Suite, tmp_path: Path) -> Path:
    """Two FedAdam PPO rounds of two clients: round 1's critic is FedAvg's mean, round 2's steps
    from it (the run root)."""
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), FedAdamFSDP, clients=2,
                                            eta=1e-2, beta_1=0.9, beta_2=0.99)
    for server_round in (1, 2):
        train_round(strategy, server_round, [suite_ppo_reply(run_root, suite, client, server_round)
                                             for client in (0, 1)])
    return run_root


def _set_previous_hash(run_root: Path, sha256: str) -> Path:
    """Round 2's critic recording ``sha256`` as the hash of its previous critic, recommitted in the
    run record; the previous critic's directory."""
    model = run_root / "round_2" / "global_critic" / MODEL
    with safe_open(str(model), framework="pt") as handle:
        metadata = handle.metadata() or {}
    previous = json.loads(metadata["fedagent.previous_global"])
    metadata["fedagent.previous_global"] = json.dumps({**previous, "sha256": sha256})
    save_file(load_file(str(model)), str(model), metadata)
    _edit_summary(run_root, {}, {"aggregated_critic_sha256": CheckpointRef.for_directory(model.parent).sha256}, 2)
    return Path(previous["path"])


def _one_ulp(model_dir: Path) -> None:
    """One element of ``model_dir``'s first float tensor moved by one ulp (its header kept)."""
    model = model_dir / MODEL
    with safe_open(str(model), framework="pt") as handle:
        metadata = handle.metadata() or {}
    tensors = load_file(str(model))
    key = next(k for k in sorted(tensors) if tensors[k].is_floating_point())
    flat = tensors[key].view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
    save_file(tensors, str(model), metadata)


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


@pytest.mark.parametrize("cls", [FedAvgFSDP, FedAdamFSDP], ids=["fedavg", "fedadam"])
def test_an_empty_committed_hash_fails_unless_allow_unhashed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cls: type[FedAvgFSDP],
) -> None:
    """Every round's global model is checked against the run record's hash of it (a server
    optimiser's is an input of the next round, and a mean changed below the tolerance would pass
    its recomputation), so one not recorded fails."""
    run_root = _run(tmp_path, cls)
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


def test_an_empty_previous_global_hash_fails_an_optimiser_round_unless_allow_unhashed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Round 2's header recording round 1's global model (its ``x``) with an empty hash, the changed
    header recommitted in the run record: the hash of ``x`` cannot be compared."""
    run_root = _run(tmp_path, FedAdamFSDP, 2)
    model = run_root / "round_2" / "global" / MODEL
    with safe_open(str(model), framework="pt") as handle:
        metadata = handle.metadata() or {}
    metadata["fedagent.previous_global"] = json.dumps({**json.loads(metadata["fedagent.previous_global"]),
                                                       "sha256": ""})
    save_file(load_file(str(model)), str(model), metadata)
    _edit_summary(run_root, {}, {"aggregated_sha256": CheckpointRef.for_directory(model.parent).sha256}, 2)
    what = f"{model} records no content hash of its previous global model {run_root / 'round_1' / 'global'}"
    status, lines = _audit(run_root, capsys)
    assert status == 1 and len(lines) == 2 and lines[0].endswith(" ok"), lines
    assert lines[1] == f"round 2: cannot verify: {what}, {ADVICE}", lines
    status, lines = _audit(run_root, capsys, "--allow-unhashed")
    assert status == 0 and len(lines) == 2 and lines[1].endswith(f" ok; {what}: not checked"), lines


def test_an_empty_committed_hash_of_the_mean_an_optimiser_round_stepped_from_fails_unless_allow_unhashed(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """PPO's first global critic is FedAvg's mean and round 2's critic steps from it: the run
    record's empty hash of it can be compared neither with the critic (round 1's commit) nor with
    the hash of ``x`` that round 2's header records, so both critics fail (they were skipped)."""
    run_root = _ppo_run(suite, tmp_path)
    assert _audit(run_root, capsys)[0] == 0
    _edit_summary(run_root, {}, {"aggregated_critic_sha256": ""})
    critic = run_root / "round_1" / "global_critic"
    what = f"the run record has no content hash of {critic} (the commit of the model this round stepped from)"
    own = f"the run record has no content hash of {critic} (the round's commit)"  # round 1's critic's own audit
    status, lines = _audit(run_root, capsys)
    assert status == 1 and len(lines) == 4 and lines[0].endswith(" ok") and lines[2].endswith(" ok"), lines
    assert lines[1] == f"round 1 critic: cannot verify: {own}, {ADVICE}", lines
    assert lines[3] == f"round 2 critic: cannot verify: {what}, {ADVICE}", lines
    status, lines = _audit(run_root, capsys, "--allow-unhashed")
    assert status == 0 and len(lines) == 4 and lines[1].endswith(f" ok; {own}: not checked"), lines
    assert lines[3].endswith(f" ok; {what}: not checked"), lines


def test_the_previous_models_commit_is_compared_even_when_its_header_hash_is_empty(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Round 2's critic recording no hash of round 1's critic (its ``x``), the header recommitted,
    and round 1's critic then moved by one ulp: ``--allow-unhashed`` lets the empty header hash
    through, but the run record committed round 1's critic, so its content is still compared."""
    run_root = _ppo_run(suite, tmp_path)
    critic = _set_previous_hash(run_root, "")
    committed = json.loads((run_root / "federated_summary.json").read_text())["rounds"][0]["aggregated_critic_sha256"]
    _one_ulp(critic)
    actual = CheckpointRef.for_directory(critic).sha256
    status, lines = _audit(run_root, capsys, "--allow-unhashed")
    assert status == 1 and len(lines) == 4, lines
    assert lines[3] == (f"round 2 critic: cannot verify: previous global model {critic} has content hash "
                        f"{actual[:12]}..., the run record committed {committed[:12]}... for it: it was replaced "
                        "after its commit"), lines


def test_a_previous_model_replaced_after_its_commit_is_named_with_both_hashes(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Round 1's critic moved by one ulp and round 2's critic recording the moved file's hash (as if
    it had stepped from it): the header and the file agree, the run record's commit does not."""
    run_root = _ppo_run(suite, tmp_path)
    critic = run_root / "round_1" / "global_critic"
    committed = json.loads((run_root / "federated_summary.json").read_text())["rounds"][0]["aggregated_critic_sha256"]
    _one_ulp(critic)
    actual = CheckpointRef.for_directory(critic).sha256
    _set_previous_hash(run_root, actual)
    status, lines = _audit(run_root, capsys)
    assert status == 1 and len(lines) == 4, lines
    assert lines[3] == (f"round 2 critic: cannot verify: previous global model {critic} has content hash "
                        f"{actual[:12]}..., the run record committed {committed[:12]}... for it: it was replaced "
                        "after its commit and before this round stepped from it"), lines


@pytest.mark.parametrize("clients_removed", [False, True], ids=["clients-kept", "clients-removed"])
def test_a_mean_changed_below_the_tolerance_fails_its_commit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clients_removed: bool,
) -> None:
    """FedAvg's round 1 global model moved by one ulp (1.2e-7 near 1, below the 1e-6 tolerance):
    its recomputation would pass, its content hash is not the one the round committed. The commit
    is checked when the run removed its client checkpoints too (the default,
    storage.keep_client_checkpoints=false), where nothing can be recomputed."""
    run_root = _run(tmp_path, FedAvgFSDP)
    if clients_removed:
        _edit_summary(run_root, {}, {"removed": {"client_checkpoints": 1}})
        status, lines = _audit(run_root, capsys)
        assert (status, lines) == (0, ["round 1: content hash as committed; client checkpoints removed by the run "
                                       "after the round was committed (storage.keep_client_checkpoints=false); "
                                       "recomputation not checked"]), lines
    _one_ulp(run_root / "round_1" / "global")
    status, lines = _audit(run_root, capsys)
    assert (status, lines) == (1, [f"round 1: cannot verify: {run_root / 'round_1' / 'global'} changed since its "
                                   "round was committed (content hash differs from the run record)"]), lines


def test_the_help_of_allow_unhashed_lists_every_hash_it_lets_through(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        verify(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for case in ("content hash v1 or without content_hash", "a source's empty sha256", "an empty committed hash",
                 "an empty previous-global hash", "a missing base_model_sha256",
                 "a missing or empty optimiser state hash"):
        assert case in text, (case, text)
