"""The server optimisers' rounds audited and their state made tamper-evident, on real FSDP
checkpoints aggregated by the real strategies and recorded by the real recorder: ``checkpoint.verify``
recomputes FedAvgM, FedAdam, FedYogi and FedAdagrad rounds (global model and state) in float64 and
passes; one tensor changed in a state file or a global model (header kept) fails the audit, by the
recomputation itself where hashes are not compared; a state whose bytes changed stops the next round
and a resumed run with ServerOptimizerStateError naming the file; a state from before hashes were
recorded is loaded with a warning; the hash is recorded from the bytes written (the new state is
not read back) and checked from disk before use; retention keeps every state with the clients' checkpoints; PPO's
critics are audited like the actors."""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Message
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.checkpoint.verify import main as verify
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.retention import Retention
from fedagent_flwr.serverapp.strategy import (
    FedAdagradFSDP,
    FedAdamFSDP,
    FedAvgFSDP,
    FedAvgMFSDP,
    FedYogiFSDP,
)
from fedagent_flwr.serverapp.strategy.server_optimizer import ServerOptimizerStateError, state_file
from testkit.ckpt_factory import Suite
from testkit.round_harness import connect, train_round
from testkit.strategy_setup import connected_strategy, initial_checkpoint, suite_ppo_reply, suite_replies

# client checkpoint names and episodes of clients 0 and 1 in rounds 1, 2
ROUNDS = [(("qwen_a", "qwen_b"), (4, 12)), (("qwen_b", "qwen_c"), (6, 6))]
CASES: list[tuple[type[FedAvgFSDP], dict[str, float]]] = [
    (FedAvgMFSDP, {"server_learning_rate": 0.7, "server_momentum": 0.9}),
    (FedAvgMFSDP, {"server_learning_rate": 0.5}),  # a learning rate alone: no buffer, no state file
    (FedAdamFSDP, {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}),
    (FedYogiFSDP, {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}),
    (FedAdagradFSDP, {"eta": 1e-2, "tau": 1e-3}),
]
ADAM = {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99}
STATE_SHA256 = "fedagent.state_sha256"  # the global model's header entry (server_optimizer's docstring)


def _round(strategy: FedAvgFSDP, run_root: Path, suite: Suite, server_round: int) -> Path:
    """Round ``server_round`` of :data:`ROUNDS`, aggregated and recorded; the new global model."""
    replies = suite_replies(run_root, suite, *ROUNDS[server_round - 1], server_round)
    train_round(strategy, server_round, replies)
    assert strategy.global_model.path == str(run_root / f"round_{server_round}" / "global")
    return Path(strategy.global_model.path)


def _bump(path: Path, key: str, by: float = 1.0) -> None:
    """Add ``by`` to the first element of fp32 tensor ``key`` of a safetensors file, header kept."""
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    begin = 8 + length + json.loads(data[8:8 + length])[key]["data_offsets"][0]
    struct.pack_into("<f", data, begin, struct.unpack_from("<f", data, begin)[0] + by)
    path.write_bytes(bytes(data))


def _fresh(cls: type[FedAvgFSDP], run_root: Path, tmp_path: Path, name: str, **settings: Any) -> FedAvgFSDP:
    """A strategy as a resumed run builds it: from round 1's global model, as resume restores it."""
    restored = CheckpointRef.for_directory(run_root / "round_1" / "global")
    strategy = cls(run_root=str(run_root), initial_model=restored, num_clients=2, clients_per_round=2, **settings)
    connect(strategy, RunRecorder(tmp_path / name, {"strategy": cls.rule_name}), range(2))  # type: ignore[attr-defined]
    return strategy


@pytest.mark.parametrize(("cls", "settings"), CASES, ids=[f"{c.__name__}-{'-'.join(s)}" for c, s in CASES])
def test_verify_recomputes_every_server_optimiser_round_and_passes(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str], cls: type[FedAvgFSDP],
    settings: dict[str, float],
) -> None:
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), cls, clients=2, **settings)
    for server_round in (1, 2):
        global_dir = _round(strategy, run_root, suite, server_round)
    with safe_open(str(global_dir / "model.safetensors"), framework="pt") as handle:
        header = handle.metadata() or {}
    assert json.loads(header["fedagent.previous_global"])["path"] == str(run_root / "round_1" / "global")
    if strategy.buffers():  # type: ignore[attr-defined]
        assert header[STATE_SHA256] == hashlib.sha256(state_file(global_dir).read_bytes()).hexdigest()
    else:
        assert STATE_SHA256 not in header and not state_file(global_dir).exists()
    capsys.readouterr()
    assert verify([str(run_root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rule = cls.rule_name  # type: ignore[attr-defined]
    second = 2 if strategy.buffers() else 1  # type: ignore[attr-defined]  # no state: no step count to continue
    assert [line.split(" max abs error")[0] for line in lines] == [
        f"round 1: clients [0, 1] {rule} step 1", f"round 2: clients [0, 1] {rule} step {second}"], lines
    assert all(line.endswith(" ok") for line in lines), lines


def test_the_state_hash_is_recorded_without_reading_the_state_back_and_checked_before_use(
    suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The round that writes a state records its sha256 from the bytes it wrote (no file_digest of
    the new state file); the next round still hashes the previous state from disk before it reads
    it. file_digest is wrapped, not replaced: every call still hashes the real file; the client
    checkpoints' hashes are left out of what is checked."""
    from fedagent_flwr.checkpoint import content_hash, safetensors_writer
    from fedagent_flwr.checkpoint.content_hash import file_digest

    hashed: list[Path] = []

    def recording_digest(path: Any) -> bytes:
        hashed.append(Path(path))
        return file_digest(path)

    for module in (content_hash, safetensors_writer):  # the state check hashes through content_hash's
        monkeypatch.setattr(module, "file_digest", recording_digest)
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), FedAdamFSDP, clients=2, **ADAM)
    for server_round in (1, 2):
        global_dir = _round(strategy, run_root, suite, server_round)
        with safe_open(str(global_dir / "model.safetensors"), framework="pt") as handle:
            recorded = (handle.metadata() or {})[STATE_SHA256]
        assert recorded == hashlib.sha256(state_file(global_dir).read_bytes()).hexdigest()
        assert state_file(global_dir) not in hashed, hashed
    read = [path for path in hashed if path.parent.name == "server_optimizer"]
    assert read == [state_file(run_root / "round_1" / "global")]  # round 2's check of round 1's state


def test_a_changed_tensor_in_a_state_file_or_a_global_model_fails_the_audit(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), FedAdamFSDP, clients=2, **ADAM)
    for server_round in (1, 2):
        _round(strategy, run_root, suite, server_round)
    summary_path = run_root / "federated_summary.json"
    summary = json.loads(summary_path.read_text())
    assert verify([str(run_root)]) == 0

    # round 1's state: its v changed by 1 (the header kept). Its round's state no longer matches the
    # recomputation, and round 2 refuses to step from it (its hash differs from the recorded one).
    round_1_state = state_file(run_root / "round_1" / "global")
    original = round_1_state.read_bytes()
    _bump(round_1_state, "v/model.norm.weight")
    capsys.readouterr()
    assert verify([str(run_root)]) == 1
    out = capsys.readouterr().out
    assert "round 1: clients [0, 1] fedadam step 1 max abs error" in out and "ABOVE TOLERANCE" in out, out
    assert "differs from the hash its global model recorded" in out, out
    assert f"round 2: cannot verify: previous optimiser state {round_1_state} changed" in out, out
    # without hashes (a run recorded with another content-hash version, audited with --allow-unhashed)
    # the recomputation alone catches it
    summary_path.write_text(json.dumps({**summary, "content_hash": "v1"}))
    assert verify([str(run_root), "--allow-unhashed"]) == 1
    out = capsys.readouterr().out
    assert "round 1: clients [0, 1] fedadam step 1 max abs error 1.0" in out and "ABOVE TOLERANCE" in out, out
    round_1_state.write_bytes(original)
    summary_path.write_text(json.dumps(summary))

    # round 2's global model: one weight moved by 1e-3 (the header kept)
    model = run_root / "round_2" / "global" / "model.safetensors"
    _bump(model, "model.norm.weight", 1e-3)
    assert verify([str(run_root)]) == 1
    out = capsys.readouterr().out
    assert "round 2: cannot verify:" in out and "changed since its round was committed" in out, out
    summary_path.write_text(json.dumps({**summary, "content_hash": "v1"}))
    assert verify([str(run_root), "--allow-unhashed"]) == 1
    out = capsys.readouterr().out
    assert "round 2: clients [0, 1] fedadam step 2 max abs error 1.0" in out and "ABOVE TOLERANCE" in out, out


def test_a_changed_state_stops_the_next_round_and_a_resumed_run_naming_the_file(
    suite: Suite, tmp_path: Path,
) -> None:
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), FedAdamFSDP, clients=2, **ADAM)
    _round(strategy, run_root, suite, 1)
    round_1_state = state_file(run_root / "round_1" / "global")
    _bump(round_1_state, "m/model.norm.weight", 1e-6)  # a small change: the file still loads and fits
    for player in (strategy, _fresh(FedAdamFSDP, run_root, tmp_path, "resumed", **ADAM)):
        with pytest.raises(ServerOptimizerStateError, match=f"optimiser state {round_1_state} is not the file "
                                                            "written with .*round_1/global.*restore the file"):
            _round(player, run_root, suite, 2)
        assert not (run_root / "round_2" / "global").exists()
        assert not list((run_root / "round_2" / "server_optimizer").glob("*"))


def test_a_state_without_a_recorded_hash_is_loaded_with_a_warning(
    suite: Suite, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), FedAdamFSDP, clients=2, **ADAM)
    _round(strategy, run_root, suite, 1)
    # round 1 as an older fedagent-flwr wrote it: no state hash in the global model's header
    model = run_root / "round_1" / "global" / "model.safetensors"
    with safe_open(str(model), framework="pt") as handle:
        metadata = {k: v for k, v in (handle.metadata() or {}).items() if k != STATE_SHA256}
    save_file(load_file(str(model)), str(model), metadata)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _round(_fresh(FedAdamFSDP, run_root, tmp_path, "older", **ADAM), run_root, suite, 2)
    warned = [r.getMessage() for r in caplog.records if "records no content hash" in r.getMessage()]
    assert len(warned) == 1 and str(state_file(run_root / "round_1" / "global")) in warned[0]


def test_keeping_the_client_checkpoints_keeps_every_state_for_the_audit(suite: Suite, tmp_path: Path) -> None:
    run_root = tmp_path / "run"
    run_root.mkdir()
    initial = initial_checkpoint(tmp_path)
    recorder = RunRecorder(run_root, {"base_model": initial.path, "env_kind": "test", "mode": "federated",
                                      "strategy": "fedadam"})
    strategy = FedAdamFSDP(run_root=str(run_root), initial_model=initial, num_clients=2, clients_per_round=2, **ADAM)
    connect(strategy, recorder, range(2))
    for server_round in (1, 2):
        _round(strategy, run_root, suite, server_round)
    Retention(run_root, keep_client_checkpoints=True).after_commit(recorder, 2)
    assert state_file(run_root / "round_1" / "global").is_file()
    Retention(run_root).after_commit(recorder, 2)  # the default: only the newest state stays
    assert not state_file(run_root / "round_1" / "global").exists()
    assert state_file(run_root / "round_2" / "global").is_file()


def test_ppo_critics_are_audited_too_the_first_as_a_mean_then_as_steps(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Round 1's critic is FedAvg's mean (no global critic to step from); round 2's is the critic
    optimiser's first step (its buffers start at zero), round 3's its second."""
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), FedAdamFSDP, clients=2, **ADAM)

    def ppo_reply(client: int, server_round: int) -> Message:
        return suite_ppo_reply(run_root, suite, client, server_round)

    for server_round in (1, 2, 3):
        train_round(strategy, server_round, [ppo_reply(0, server_round), ppo_reply(1, server_round)])
    capsys.readouterr()
    assert verify([str(run_root)]) == 0
    lines = [line.split(" max abs error")[0] for line in capsys.readouterr().out.splitlines()]
    assert lines == ["round 1: clients [0, 1] fedadam step 1", "round 1 critic: critics of 2 clients",
                     "round 2: clients [0, 1] fedadam step 2", "round 2 critic: critics of 2 clients fedadam step 1",
                     "round 3: clients [0, 1] fedadam step 3", "round 3 critic: critics of 2 clients fedadam step 2"]
