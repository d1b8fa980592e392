"""FedAvgFSDP over clients that upload LoRA adapters: each adapter is read on top of the round's
global model, a bad one is refused by name and the others averaged again on the same base, and the
new global model is the exact mean of the clients' full models; the audit recomputes such rounds,
FedAvg's and a server optimiser's, on the base model the header records for each adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.serverapp.strategy import FedAdamFSDP, FedAvgFSDP
from testkit.ckpt_factory import ModelSpec, write_hf_checkpoint
from testkit.client_replies import train_reply
from testkit.hash_count import count_hashed_files
from testkit.lora_adapters import adapter_oracle, record_base, write_adapter
from testkit.round_harness import train_round
from testkit.strategy_setup import client_slot, connected_strategy


def test_adapters_are_averaged_as_full_models_and_a_nan_one_is_dropped(tmp_path: Path) -> None:
    write_hf_checkpoint(ModelSpec("global", "llama", seed=9, tie=True), tmp_path / "base")
    initial = CheckpointRef.for_directory(tmp_path / "base")
    strategy, run_root = connected_strategy(tmp_path, initial, clients=3)
    refs = {}
    for client in range(3):
        adapter = write_adapter(tmp_path / "base", client_slot(run_root, client) / "actor", seed=client)
        if client == 2:  # NaN in one factor: found while streaming, after the others were read
            factors = load_file(str(adapter / "adapter_model.safetensors"))
            factors[sorted(factors)[-1]].view(-1)[0] = float("nan")
            record_base(adapter, tmp_path / "base", factors)
        refs[client] = CheckpointRef.for_directory(adapter)
        assert refs[client].format == "peft-lora"
    episodes = {0: 2, 1: 6, 2: 4}
    entry = train_round(strategy, 1, [train_reply(c, refs[c], episodes[c]) for c in refs])
    assert entry is not None and entry["client_actor_ids"] == [0, 1], entry
    assert "non-finite" in entry["rejected"]["2"] and "client_2" in entry["rejected"]["2"]
    written = load_file(str(Path(strategy.global_model.path) / "model.safetensors"))
    oracles = [adapter_oracle(tmp_path / "base", Path(refs[c].path))[0] for c in (0, 1)]
    assert set(written) == set(oracles[0])
    for key, value in written.items():
        torch.testing.assert_close(value.double(), 0.25 * oracles[0][key] + 0.75 * oracles[1][key],
                                   rtol=1e-6, atol=1e-7)
    # the clients' updates were measured against the global model, as for full checkpoints
    assert entry["update_stats"]["clients"] == [0, 1] and min(entry["update_stats"]["client_update_norm"]) > 0


def _lora_rounds(tmp_path: Path, cls: type[FedAvgFSDP] = FedAvgFSDP, **kwargs: float) -> tuple[FedAvgFSDP, Path]:
    """Two rounds of two LoRA clients from a tiny tied Llama in ``tmp_path/base``; the strategy and its run dir."""
    write_hf_checkpoint(ModelSpec("global", "llama", seed=9, tie=True), tmp_path / "base")
    strategy, run_root = connected_strategy(tmp_path, CheckpointRef.for_directory(tmp_path / "base"), cls=cls,
                                            clients=2, **kwargs)
    for server_round in (1, 2):  # each round's adapters are trained on the global model it sent
        start = Path(strategy.global_model.path)
        replies = [train_reply(c, CheckpointRef.for_directory(write_adapter(
            start, client_slot(run_root, c, server_round) / "actor", seed=10 * server_round + c)), 2 + c)
            for c in (0, 1)]
        entry = train_round(strategy, server_round, replies)
        assert entry is not None and entry["client_actor_ids"] == [0, 1], entry
    return strategy, run_root


@pytest.mark.parametrize(("cls", "kwargs"), [(FedAvgFSDP, {}),
                                             (FedAdamFSDP, {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3})])
def test_the_audit_recomputes_lora_rounds_on_their_recorded_base(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], cls: type[FedAvgFSDP], kwargs: dict[str, float]) -> None:
    from fedagent_flwr.checkpoint.verify import main as verify

    _, run_root = _lora_rounds(tmp_path, cls, **kwargs)
    capsys.readouterr()
    assert verify([str(run_root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.endswith(" ok") for line in lines), lines
    # the base model round 1's adapters were read on changed afterwards: their round no longer checks out
    weights = tmp_path / "base" / "model.safetensors"
    state = load_file(str(weights))
    state["model.norm.weight"] += 1.0
    save_file(state, str(weights), metadata={"format": "pt"})
    assert verify([str(run_root)]) == 1
    out = capsys.readouterr().out
    assert f"round 1: cannot verify: {tmp_path / 'base'} changed since it was aggregated" in out, out


def test_a_lora_round_whose_base_the_run_removed_is_not_checked_and_one_deleted_by_hand_fails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """storage.keep_last_k=1 with the client checkpoints kept: round 2's adapters stay, their base (round 1's
    global model) goes. The run says so: round 2 is reported as not checked, as a server optimiser's round
    is. Gone without the run's word (deleted by hand): the round fails naming the missing base."""
    from fedagent_flwr.checkpoint.verify import main as verify
    from fedagent_flwr.serverapp.retention import Retention
    from testkit.round_harness import recorder_of

    strategy, run_root = _lora_rounds(tmp_path)
    round_1 = run_root / "round_1" / "global"
    kept = tmp_path / "round-1-global"
    shutil.copytree(round_1, kept)  # for the second half: put back, then deleted by hand
    Retention(run_root, keep_client_checkpoints=True, keep_last_k=1).after_commit(recorder_of(strategy), 2)
    assert not round_1.exists() and (run_root / "round_2" / "client_0" / "actor").is_dir()
    capsys.readouterr()
    assert verify([str(run_root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "round 1: global model removed by the run (storage.keep_last_k); not checked", lines
    assert lines[1].startswith(f"round 2: the base model {round_1} of the LoRA source ") and lines[1].endswith(
        "removed by the run (storage.keep_last_k); not checked"), lines

    # the same files, but the run record says nothing of a removal: deleted by hand
    summary_path = run_root / "federated_summary.json"
    summary = json.loads(summary_path.read_text())
    for entry in summary["rounds"]:
        entry.pop("removed", None)
        entry.pop("removing", None)
    summary_path.write_text(json.dumps(summary))
    assert verify([str(run_root)]) == 1
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("round 2:")][0]
    assert line.startswith(f"round 2: cannot verify: the base model {round_1} of the LoRA source ") and line.endswith(
        "is missing (no removal by the run accounts for it)"), line
    assert "keep_last_k" not in line
    # put back, the round checks out again
    shutil.copytree(kept, round_1)
    assert verify([str(run_root)]) == 0


def test_the_audit_fails_a_lora_round_read_on_another_model_than_the_round_started_from(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Round 2's adapters are read on the base model instead of round 1's global model (a mis-wired
    strategy): the header names that base and the mean recomputed on it matches, but the run record's
    starting model of round 2 is round 1's global model, so the round fails."""
    from fedagent_flwr.checkpoint.verify import main as verify

    write_hf_checkpoint(ModelSpec("global", "llama", seed=9, tie=True), tmp_path / "base")
    initial = CheckpointRef.for_directory(tmp_path / "base")
    strategy, run_root = connected_strategy(tmp_path, initial, clients=2)
    for server_round in (1, 2):
        strategy.global_model = initial  # every round reads (and trains) on the base model
        replies = [train_reply(c, CheckpointRef.for_directory(write_adapter(
            tmp_path / "base", client_slot(run_root, c, server_round) / "actor", seed=10 * server_round + c)), 2)
            for c in (0, 1)]
        train_round(strategy, server_round, replies)
    capsys.readouterr()
    assert verify([str(run_root)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("round 1: ") and lines[0].endswith(" ok"), lines  # round 1 did start from the base
    assert lines[1].startswith("round 2: cannot verify: ") and lines[1].endswith(
        f"on {tmp_path / 'base'}, but the run record's starting model of the round is "
        f"{run_root / 'round_1' / 'global'}"), lines


def test_the_audit_does_not_open_a_lora_base_outside_the_run(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A header edited to read round 1's adapters on a copy of the base model elsewhere (same bytes, so
    the mean would recompute): the audit does not follow it, as it does not follow a server optimiser's
    previous global model outside the run."""
    from safetensors import safe_open

    from fedagent_flwr.checkpoint.verify import main as verify

    _, run_root = _lora_rounds(tmp_path)
    elsewhere = shutil.copytree(tmp_path / "base", tmp_path / "elsewhere")
    model = run_root / "round_1" / "global" / "model.safetensors"
    with safe_open(str(model), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
    sources = [{**source, "base": str(elsewhere)} for source in json.loads(metadata["fedagent.sources"])]
    save_file(load_file(str(model)), str(model), {**metadata, "fedagent.sources": json.dumps(sources)})
    summary_path = run_root / "federated_summary.json"
    summary = json.loads(summary_path.read_text())  # committed so, as a run that wrote it would have
    summary["rounds"][0]["aggregated_sha256"] = CheckpointRef.for_directory(model.parent).sha256
    summary_path.write_text(json.dumps(summary))
    capsys.readouterr()
    assert verify([str(run_root)]) == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(f"round 1: cannot verify: the base model {elsewhere} of the LoRA source ") and line.endswith(
        f"is neither inside the run {run_root} nor its base model {tmp_path / 'base'}: not opened"), line


def test_a_round_whose_global_model_changed_on_disk_refuses_every_adapter_and_stops_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 1's global model is written, the clients train round 2's adapters on it, then one byte of it
    changes on disk before round 2 is aggregated: read on it, every adapter would stand for another model
    than the one it was trained on. Each is refused naming the global model, so the run stops; the model
    was hashed once for the round, not once per client."""

    from fedagent_flwr.checkpoint import audit_digests
    from fedagent_flwr.serverapp.failures import RunFailedError
    from testkit.file_change import flip_byte

    write_hf_checkpoint(ModelSpec("global", "llama", seed=9, tie=True), tmp_path / "base")
    strategy, run_root = connected_strategy(tmp_path, CheckpointRef.for_directory(tmp_path / "base"), clients=3)
    train_round(strategy, 1, [train_reply(c, CheckpointRef.for_directory(write_adapter(
        tmp_path / "base", client_slot(run_root, c) / "actor", seed=c)), 2) for c in range(3)])
    global_1 = Path(strategy.global_model.path)
    replies = [train_reply(c, CheckpointRef.for_directory(write_adapter(
        global_1, client_slot(run_root, c, 2) / "actor", seed=10 + c)), 2) for c in range(3)]
    flip_byte(global_1 / "model.safetensors", restore_mtime=True, at=-1)
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)  # round 1's model was written a moment ago
    hashed = count_hashed_files(monkeypatch, Path.resolve)
    with pytest.raises(RunFailedError) as stopped:
        train_round(strategy, 2, replies)
    assert f"{global_1}, the round's global model, has content hash" in str(stopped.value)
    assert hashed[(global_1 / "model.safetensors").resolve()] == 1
    assert strategy.global_model.path == str(global_1)  # nothing was aggregated on it
