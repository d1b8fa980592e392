"""The server-optimiser audit in chunks, and hashes it must skip only when told to, on real FSDP
checkpoints aggregated by the real strategies: recomputing every key a few rows at a time (many
chunks, cutting across the FSDP blocks of uneven size) reports exactly what the whole-key
recomputation reports, for a passing run, a run with a changed state and non-finite values written
in two chunks of one key; the readers' row reads equal the full tensors' rows and read only the
blocks the rows overlap; an optimiser state whose global model records no hash of it fails the
audit unless ``--allow-unhashed``, which notes it and recomputes the round."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedagent_flwr.checkpoint import CheckpointRef, audit_rows, open_checkpoint
from fedagent_flwr.checkpoint.audit_rows import row_chunks
from fedagent_flwr.checkpoint.ref import CheckpointError
from fedagent_flwr.checkpoint.verify import main as verify
from fedagent_flwr.checkpoint.verify_optimizer import verify_optimizer_round
from fedagent_flwr.serverapp.strategy import FedAdagradFSDP, FedAdamFSDP, FedAvgFSDP, FedAvgMFSDP, FedYogiFSDP
from testkit.ckpt_factory import ModelSpec, Suite, write_hf_checkpoint
from testkit.round_harness import train_round
from testkit.strategy_setup import connected_strategy, initial_checkpoint, suite_replies

MODEL = "model.safetensors"
STATE_SHA256 = "fedagent.state_sha256"
ROUNDS = [(("qwen_a", "qwen_b"), (4, 12)), (("qwen_b", "qwen_c"), (6, 6))]
CASES: list[tuple[type[FedAvgFSDP], dict[str, float]]] = [
    (FedAvgMFSDP, {"server_learning_rate": 0.7, "server_momentum": 0.9}),
    (FedAdamFSDP, {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}),
    (FedYogiFSDP, {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}),
    (FedAdagradFSDP, {"eta": 1e-2, "tau": 1e-3}),
]
# 3 rows of the 64-wide keys: the 257-row embedding is 86 chunks, one of which straddles qwen_b's
# FSDP blocks of 129 and 128 rows
SMALL_CHUNK = 200


def _run(suite: Suite, tmp_path: Path, cls: type[FedAvgFSDP], **settings: float) -> Path:
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), cls, clients=2, **settings)
    for server_round in (1, 2):
        train_round(strategy, server_round, suite_replies(run_root, suite, *ROUNDS[server_round - 1], server_round))
    return run_root


def _audits(run_root: Path, **options: Any) -> list[dict[str, Any] | str]:
    """Each round's audit by verify_optimizer_round, as a dict (or its CheckpointError's text)."""
    summary = json.loads((run_root / "federated_summary.json").read_text())
    found: list[dict[str, Any] | str] = []
    for server_round in (1, 2):
        try:
            audit = verify_optimizer_round(run_root / f"round_{server_round}" / "global", run_root, server_round,
                                           base_model=summary["base_model"],
                                           base_model_sha256=summary["base_model_sha256"], **options)
            found.append(asdict(audit))
        except CheckpointError as exc:
            found.append(str(exc))
    return found


def _cli(run_root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    status = verify([str(run_root)])
    return status, capsys.readouterr().out


def _bump_state(run_root: Path) -> None:
    """Round 1's state: one element of ``v`` (or ``momentum``) moved by 1e-3, its header kept."""
    state = run_root / "round_1" / "server_optimizer" / "global.safetensors"
    with safe_open(str(state), framework="pt") as handle:
        metadata = handle.metadata() or {}
    tensors = load_file(str(state))
    key = sorted(k for k in tensors if k.endswith("embed_tokens.weight"))[-1]
    tensors[key][200, 5] += 1e-3
    save_file(tensors, str(state), metadata)


@pytest.mark.parametrize(("cls", "settings"), CASES, ids=[cls.__name__ for cls, _ in CASES])
def test_a_key_audited_in_many_chunks_reports_what_the_whole_key_does(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    cls: type[FedAvgFSDP], settings: dict[str, float],
) -> None:
    assert len(list(row_chunks((257, 64), SMALL_CHUNK))) == 86
    run_root = _run(suite, tmp_path, cls, **settings)
    results = []
    for state in ("as written", "changed"):
        if state == "changed":
            _bump_state(run_root)
        whole = _audits(run_root), _cli(run_root, capsys)  # every key of these models is one chunk
        monkeypatch.setattr(audit_rows, "CHUNK_ELEMENTS", SMALL_CHUNK)
        assert (_audits(run_root), _cli(run_root, capsys)) == whole, state
        monkeypatch.undo()
        results.append(whole)
    (passing, (status, _)), (changed, (changed_status, out)) = results
    assert status == 0 and all(isinstance(a, dict) and a["ratio"] <= 1.0 for a in passing), passing
    # the change is found, with the same worst ratio whatever the chunks
    assert changed_status == 1 and "ABOVE TOLERANCE" in out, out
    assert isinstance(changed[0], dict) and changed[0]["ratio"] > 1.0, changed


def test_non_finite_values_in_two_chunks_of_a_key_are_counted_together(
    suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_root = _run(suite, tmp_path, FedAdamFSDP, eta=1e-2, beta_1=0.9, beta_2=0.99)
    model = run_root / "round_2" / "global" / MODEL
    with safe_open(str(model), framework="pt") as handle:
        metadata = handle.metadata() or {}
    tensors = load_file(str(model))
    tensors["model.embed_tokens.weight"][3, 0] = float("nan")
    tensors["model.embed_tokens.weight"][250, 1] = float("inf")
    save_file(tensors, str(model), metadata)
    whole = _audits(run_root)
    assert str(whole[1]) == (f"{model}: 'model.embed_tokens.weight' holds 2 non-finite value(s) (NaN or Inf), which "
                             "the round could not have aggregated or written (it refuses them): the file changed "
                             "after the round, so the recomputed round cannot be compared with it"), whole
    monkeypatch.setattr(audit_rows, "CHUNK_ELEMENTS", SMALL_CHUNK)
    assert _audits(run_root) == whole


def _rows_match(reader: Any, key: str, bounds: list[tuple[int, int]]) -> None:
    full = reader.read(key, dtype=None)
    for start, stop in bounds:
        rows = reader.read_rows(key, start, stop, dtype=None)
        assert rows.dtype == full.dtype and torch.equal(rows, full[start:stop]), (key, start, stop)


@pytest.mark.parametrize("name", ["qwen_b", "qwen_plain", "odd_shapes", "sharded_tensor", "hsdp_2x1", "hsdp_1x2"])
def test_fsdp_row_reads_equal_the_full_tensors_rows(suite: Suite, name: str) -> None:
    """Every layout (Shard(0) blocks of uneven size, an empty block, Shard(1), Replicate, HSDP,
    ShardedTensor, plain tensors, an int64 buffer): rows in increasing order, then out of order."""
    with open_checkpoint(CheckpointRef.for_directory(suite.ckpt(name), fmt="fsdp-shards")) as reader:
        for key in reader.keys():
            rows = reader.shape(key)[0]
            _rows_match(reader, key, [b for b in row_chunks(reader.shape(key), 2 * 64) if b is not None])
            _rows_match(reader, key, [(rows // 2, rows), (0, rows // 2 + 1), (0, 0), (rows, rows)])
        with pytest.raises(CheckpointError, match="lie outside"):
            reader.read_rows(reader.keys()[0], 0, reader.shape(reader.keys()[0])[0] + 1)


def test_row_reads_read_only_what_the_rows_need(suite: Suite, tmp_path: Path) -> None:
    """FSDP: the blocks the rows overlap (qwen_b's embedding is blocks of 129 and 128 rows), each
    once while rows are read in order; safetensors: the rows' bytes."""
    key, row_bytes = "model.embed_tokens.weight", 64 * 4
    with open_checkpoint(CheckpointRef.for_directory(suite.ckpt("qwen_b"), fmt="fsdp-shards")) as reader:
        reader.read_rows(key, 0, 3)
        assert reader.bytes_read == 129 * row_bytes  # block 0 only
        reader.read_rows(key, 3, 130)
        assert reader.bytes_read == 257 * row_bytes  # block 1 added, block 0 kept
        reader.read_rows(key, 130, 257)
        assert reader.bytes_read == 257 * row_bytes  # block 1 kept
    write_hf_checkpoint(ModelSpec("hf", "qwen2", seed=5), tmp_path / "hf")
    with open_checkpoint(CheckpointRef.for_directory(tmp_path / "hf")) as reader:
        _rows_match(reader, key, [(0, 3), (100, 257), (5, 5)])
        before = reader.bytes_read
        reader.read_rows(key, 10, 13)
        assert reader.bytes_read - before == 3 * row_bytes



def test_two_keys_read_side_by_side_read_each_block_once(suite: Suite) -> None:
    """A tied copy audited against its partner chunk by chunk (lm_head, then the embedding, then
    lm_head ...): each key's blocks stay while the other is read, so at world size 1 each tensor is
    read once, not once a chunk (which made the FedAvg audit's tie check quadratic in the key)."""
    with open_checkpoint(CheckpointRef.for_directory(suite.ckpt("llama_tied_a"), fmt="fsdp-shards")) as reader:
        pair = ("lm_head.weight", "model.embed_tokens.weight")
        whole = {key: reader.read(key, dtype=None) for key in pair}
        once = reader.bytes_read
        before = reader.bytes_read
        for bounds in row_chunks(reader.shape(pair[0]), 3 * reader.shape(pair[0])[1]):
            assert bounds is not None
            for key in pair:
                assert torch.equal(reader.read_rows(key, *bounds, dtype=None), whole[key][bounds[0]:bounds[1]])
        assert reader.bytes_read - before == once, (reader.bytes_read - before, once)


def _drop_state_hash(run_root: Path, how: str) -> None:
    """Round 1's global model as an older fedagent-flwr wrote it (no hash of its optimiser state:
    ``how`` "missing" or "empty"), and the run as it would then have recorded it: round 2 steps from
    that model (its hash), and both aggregates' content hashes are the run record's."""
    summary_path = run_root / "federated_summary.json"
    summary = json.loads(summary_path.read_text())
    for server_round in (1, 2):
        model = run_root / f"round_{server_round}" / "global" / MODEL
        with safe_open(str(model), framework="pt") as handle:
            metadata = handle.metadata() or {}
        if server_round == 1:
            if how == "missing":
                del metadata[STATE_SHA256]
            else:
                metadata[STATE_SHA256] = ""
        else:
            previous = json.loads(metadata["fedagent.previous_global"])
            previous["sha256"] = summary["rounds"][0]["aggregated_sha256"]
            metadata["fedagent.previous_global"] = json.dumps(previous)
        save_file(load_file(str(model)), str(model), metadata)
        summary["rounds"][server_round - 1]["aggregated_sha256"] = CheckpointRef.for_directory(model.parent).sha256
    summary_path.write_text(json.dumps(summary))


@pytest.mark.parametrize("how", ["missing", "empty"])
def test_a_state_without_a_recorded_hash_fails_unless_allow_unhashed(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str,
) -> None:
    """An empty ``fedagent.state_sha256`` is no hash, as a missing one is (not a hash that differs)."""
    run_root = _run(suite, tmp_path, FedAdamFSDP, eta=1e-2, beta_1=0.9, beta_2=0.99)
    _drop_state_hash(run_root, how)
    state = run_root / "round_1" / "server_optimizer" / "global.safetensors"
    first = f"{run_root / 'round_1' / 'global' / MODEL} records no content hash of its optimiser state {state} " \
            f"({STATE_SHA256})"
    second = f"previous optimiser state {state} has no content hash recorded in " \
             f"{run_root / 'round_1' / 'global' / MODEL} ({STATE_SHA256})"
    advice = "so it cannot be checked; pass --allow-unhashed if the run predates content hashes"
    status, out = _cli(run_root, capsys)
    assert status == 1 and out.splitlines() == [f"round 1: cannot verify: {first}, {advice}",
                                                f"round 2: cannot verify: {second}, {advice}"], out
    assert verify([str(run_root), "--allow-unhashed"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(" ok; " in line for line in lines), lines
    assert lines[0].endswith(f"ok; {first}: not checked"), lines
    assert lines[1].endswith(f"ok; {second}: not checked"), lines


def test_a_client_checkpoint_with_more_rows_than_the_first_is_refused_not_read_in_part(
    suite: Suite, tmp_path: Path,
) -> None:
    import shutil

    run_root = _run(suite, tmp_path, FedAdamFSDP, eta=1e-2, beta_1=0.9, beta_2=0.99)
    with safe_open(str(run_root / "round_2" / "global" / MODEL), framework="pt") as handle:
        second = Path(json.loads((handle.metadata() or {})["fedagent.sources"])[1]["path"])
    with open_checkpoint(CheckpointRef.for_directory(second)) as reader:
        tensors = {key: reader.read(key, dtype=None).contiguous() for key in reader.keys()}
        config = (reader.huggingface_dir() or second) / "config.json"
        config_text = config.read_text() if config.is_file() else None
    embedding = tensors["model.embed_tokens.weight"]
    # 5 rows more, far off: rows 0..n-1 still match, so reading only the first source's rows would pass
    tensors["model.embed_tokens.weight"] = torch.cat([embedding, torch.full((5, embedding.shape[1]), 123.0)])
    shutil.rmtree(second)
    second.mkdir()
    save_file(tensors, str(second / MODEL), {"format": "pt"})
    if config_text is not None:
        (second / "config.json").write_text(config_text)
    # The hashes would catch the rewrite first; without them the shape check must.
    round_2 = _audits(run_root, check_hashes=False, allow_unhashed=True)[1]
    assert isinstance(round_2, str) and "'model.embed_tokens.weight' has shape" in round_2, round_2
    assert str(second) in round_2, round_2
