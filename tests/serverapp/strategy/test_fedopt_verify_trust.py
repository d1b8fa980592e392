"""The server-optimiser audit judged fairly and trusting only what the run recorded, on real
checkpoints aggregated by the real strategies: a correct round whose change is far below ``tau``
(an LLM's 1e-5 on weights near 1) passes although fp32 rounding times the step's gain puts it well
above the flat 1e-6 tolerance, and is reported with its worst ratio to the per-element bound; a
previous global model that is missing fails the audit unless the run record says retention
removed it; a header that records no hash of its previous global model, or names one outside the
run that is not its base model, fails it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.checkpoint.verify import main as verify
from fedagent_flwr.checkpoint.verify_step import worst_ratio
from fedagent_flwr.serverapp.strategy import FedAdagradFSDP, FedAdamFSDP, FedAvgFSDP, FedAvgMFSDP, FedYogiFSDP
from testkit.ckpt_factory import Suite
from testkit.near_one import near_one, small_change_round
from testkit.round_harness import train_round
from testkit.strategy_setup import connected_strategy, initial_checkpoint, suite_replies

MODEL = "model.safetensors"

# Flower's defaults (no settings), and FedAvgM with momentum
RULES: list[tuple[type[FedAvgFSDP], dict[str, float]]] = [
    (FedAdamFSDP, {}), (FedYogiFSDP, {}), (FedAdagradFSDP, {}), (FedAvgMFSDP, {"server_momentum": 0.9})]
ROUNDS = [(("qwen_a", "qwen_b"), (4, 12)), (("qwen_b", "qwen_c"), (6, 6))]
ADAM = {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99}


@pytest.mark.parametrize(("cls", "settings"), RULES, ids=[cls.__name__ for cls, _ in RULES])
def test_a_change_far_below_tau_on_weights_near_one_passes_within_its_fp32_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cls: type[FedAvgFSDP], settings: dict[str, float],
) -> None:
    strategy, run_root = connected_strategy(tmp_path, near_one(tmp_path, 3), cls, clients=2, **settings)
    for server_round in (1, 2):
        small_change_round(strategy, run_root, server_round, 10 + server_round)
    capsys.readouterr()
    status = verify([str(run_root)])
    lines = capsys.readouterr().out.splitlines()
    print("\n".join(lines))  # the measured errors and ratios (pytest -s shows them)
    assert status == 0 and len(lines) == 2 and all(line.endswith(" ok") for line in lines), lines
    found = [re.search(r"max abs error (\S+) .*\(worst (\S+) of it\)", line) for line in lines]
    errors, ratios = [float(m.group(1)) for m in found if m], [float(m.group(2)) for m in found if m]
    assert len(ratios) == 2 and max(ratios) <= 1.0, lines
    if cls is FedAdagradFSDP:  # gain eta / tau = 100: fp32's rounding alone is far above the flat tolerance
        assert max(errors) > 1e-6, lines


def _two_fedadam_rounds(suite: Suite, tmp_path: Path) -> tuple[CheckpointRef, Path]:
    """Two FedAdam rounds of :data:`ROUNDS` by the real strategy: the base model and the run root."""
    initial = initial_checkpoint(tmp_path)
    strategy, run_root = connected_strategy(tmp_path, initial, FedAdamFSDP, clients=2, **ADAM)
    for server_round in (1, 2):
        train_round(strategy, server_round, suite_replies(run_root, suite, *ROUNDS[server_round - 1], server_round))
    return initial, run_root


def test_a_missing_previous_global_model_fails_unless_the_run_removed_it(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    initial, run_root = _two_fedadam_rounds(suite, tmp_path)
    shutil.move(initial.path, tmp_path / "moved-away")  # retention never removes the base model
    capsys.readouterr()
    assert verify([str(run_root)]) == 1
    out = capsys.readouterr().out
    assert f"round 1: cannot verify: previous global model {initial.path} is missing" in out, out
    shutil.move(tmp_path / "moved-away", initial.path)

    # round 1's global model removed as storage.keep_last_k removes it, noted in the run record
    summary_path = run_root / "federated_summary.json"
    summary = json.loads(summary_path.read_text())
    shutil.move(run_root / "round_1" / "global", tmp_path / "round-1-global")
    assert verify([str(run_root)]) == 1  # not noted: missing
    out = capsys.readouterr().out
    assert f"round 2: cannot verify: previous global model {run_root / 'round_1' / 'global'} is missing" in out, out
    summary["rounds"][0]["removed"] = {"global_model": 1}
    summary_path.write_text(json.dumps(summary))
    assert verify([str(run_root)]) == 0
    out = capsys.readouterr().out
    assert "round 2: previous global model" in out and "removed by the run" in out and "not checked" in out, out


def _set_previous(run_root: Path, server_round: int, **changes: str) -> None:
    """Change round ``server_round``'s recorded previous global model, and commit the changed model
    in the run record (as a run that wrote it so would have)."""
    model = run_root / f"round_{server_round}" / "global" / MODEL
    with safe_open(str(model), framework="pt") as handle:
        metadata = handle.metadata() or {}
    metadata["fedagent.previous_global"] = json.dumps({**json.loads(metadata["fedagent.previous_global"]), **changes})
    save_file(load_file(str(model)), str(model), metadata)
    summary_path = run_root / "federated_summary.json"
    summary = json.loads(summary_path.read_text())
    entry = summary["rounds"][server_round - 1]
    entry["aggregated_sha256"] = CheckpointRef.for_directory(model.parent).sha256
    summary_path.write_text(json.dumps(summary))


def test_a_previous_global_model_without_a_hash_or_outside_the_run_fails(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    initial, run_root = _two_fedadam_rounds(suite, tmp_path)
    capsys.readouterr()
    _set_previous(run_root, 2, sha256="")
    assert verify([str(run_root)]) == 1
    out = capsys.readouterr().out
    assert "round 2: cannot verify:" in out and "records no content hash of its previous global model" in out, out

    # the same content, copied outside the run: not the run's base model, so not opened
    elsewhere = shutil.copytree(run_root / "round_1" / "global", tmp_path / "elsewhere")
    _set_previous(run_root, 2, path=str(elsewhere), sha256=CheckpointRef.for_directory(elsewhere).sha256)
    assert verify([str(run_root)]) == 1
    out = capsys.readouterr().out
    assert f"round 2: cannot verify: previous global model {elsewhere} is neither inside the run" in out, out


def test_a_round_must_step_from_the_run_records_previous_model(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Round 2 claiming to step from the base model (a trusted directory, with its right hash) is not
    the run's chain: round 1's aggregate is what round 2 started from."""
    initial, run_root = _two_fedadam_rounds(suite, tmp_path)
    _set_previous(run_root, 2, path=initial.path, sha256=initial.sha256)
    capsys.readouterr()
    assert verify([str(run_root)]) == 1
    out = capsys.readouterr().out
    assert (f"round 2: cannot verify: {run_root / 'round_2' / 'global' / MODEL} steps from {initial.path}, but the "
            f"run record's previous global model is {run_root / 'round_1' / 'global'}") in out, out


def test_a_state_buffer_off_by_less_than_the_tolerance_still_fails(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """The buffers are held to their fp32 bound alone: round 2's ``m`` moved by half the tolerance
    (which would move round 3's step) fails the recomputation, hashes off as in a v1 run audited with
    ``--allow-unhashed``."""
    _, run_root = _two_fedadam_rounds(suite, tmp_path)
    state = run_root / "round_2" / "server_optimizer" / "global.safetensors"
    tensors = load_file(str(state))
    with safe_open(str(state), framework="pt") as handle:
        metadata = handle.metadata() or {}
    key = next(k for k in sorted(tensors) if k.startswith("m/"))
    tensors[key] = tensors[key] + 5e-7  # below --tolerance 1e-6
    save_file(tensors, str(state), metadata)
    summary_path = run_root / "federated_summary.json"
    summary_path.write_text(json.dumps({**json.loads(summary_path.read_text()), "content_hash": "v1"}))
    capsys.readouterr()
    assert verify([str(run_root), "--allow-unhashed"]) == 1
    out = capsys.readouterr().out
    assert "round 2: clients [0, 1] fedadam step 2" in out and "ABOVE TOLERANCE" in out, out


def test_the_tolerance_is_checked_and_an_exact_zero_is_judged_not_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    """A negative --tolerance is refused; where an element's allowed error is 0 (x and every source
    exactly 0, --tolerance 0) a nonzero error is infinitely over it, not a NaN that max() passes over."""
    with pytest.raises(SystemExit):
        verify(["anywhere", "--tolerance", "-1"])
    assert "--tolerance must be >= 0, got -1.0" in capsys.readouterr().err
    error, allowed = torch.tensor([0.0, 0.0, 1e-9]), torch.tensor([0.0, 1e-6, 0.0])
    assert worst_ratio(error, allowed) == float("inf")
    assert worst_ratio(error[:2], allowed[:2]) == 0.0
