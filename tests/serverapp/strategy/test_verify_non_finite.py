"""A NaN or Inf in an input of an audited round fails the round, on real checkpoints aggregated by
the real strategies: NaN compares false with every bound and Python's ``max()`` passes over it, so
a non-finite value in a client's checkpoint or in the previous optimiser state, which makes the
recomputed error NaN, would otherwise let the round pass. Each case is one line naming the round,
the key and the file that held it. The files are changed after their round was committed; the
run's hashes are either recommitted (so that no hash check is what catches the change) or not
compared (a v1 run audited with ``--allow-unhashed``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedagent_flwr.checkpoint import CheckpointRef, audit_rows
from fedagent_flwr.checkpoint.audit_rows import row_chunks
from fedagent_flwr.checkpoint.verify import main as verify
from fedagent_flwr.serverapp.strategy import FedAdamFSDP, FedAvgFSDP
from testkit.ckpt_factory import ModelSpec, Suite, write_hf_checkpoint
from testkit.near_one import near_one, recommit_source, small_change_round
from testkit.round_harness import train_round
from testkit.strategy_setup import connected_strategy, initial_checkpoint, suite_replies

MODEL = "model.safetensors"
KEY = "model.embed_tokens.weight"
ROUNDS = [(("qwen_a", "qwen_b"), (4, 12)), (("qwen_b", "qwen_c"), (6, 6))]
SMALL_CHUNK = 200  # 3 rows of the 64-wide keys
# the audit's wording: not the strategy's advice (lower the learning rate), what it means in a finished run
CHANGED = ("which the round could not have aggregated or written (it refuses them): the file changed after the round, "
           "so the recomputed round cannot be compared with it")


def _poke(path: Path, key: str, value: float, index: tuple[int, int] = (5, 3)) -> None:
    """Set one element of tensor ``key`` of the safetensors file ``path``, its header kept."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    tensors = load_file(str(path))
    tensors[key][index] = value
    save_file(tensors, str(path), metadata)


def _recommit(run_root: Path, global_dir: Path, server_round: int) -> None:
    """The run record committing ``global_dir`` as it now is (round ``server_round``'s global model)."""
    summary_path = run_root / "federated_summary.json"
    summary = json.loads(summary_path.read_text())
    summary["rounds"][server_round - 1]["aggregated_sha256"] = CheckpointRef.for_directory(global_dir).sha256
    summary_path.write_text(json.dumps(summary))


def _unhashed(run_root: Path) -> None:
    """The run record as a v1 run's: its hashes are not compared (``--allow-unhashed``)."""
    summary_path = run_root / "federated_summary.json"
    summary_path.write_text(json.dumps({**json.loads(summary_path.read_text()), "content_hash": "v1"}))


def _audit(run_root: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    status = verify([str(run_root), *flags])
    return status, capsys.readouterr().out.splitlines()


def _run(tmp_path: Path, cls: type[FedAvgFSDP], rounds: int, tie: bool = False, **settings: float) -> Path:
    """``rounds`` rounds of two clients returning the global model plus a small seeded change (HF
    safetensors checkpoints, so that a test can write into a client's file); ``tie``: a llama base
    with tied embeddings, else a qwen2 one with weights near 1."""
    if tie:
        write_hf_checkpoint(ModelSpec("global", "llama", seed=11, tie=True), tmp_path / "base")
        base = CheckpointRef.for_directory(tmp_path / "base")
    else:
        base = near_one(tmp_path, 4)
    strategy, run_root = connected_strategy(tmp_path, base, cls, clients=2, **settings)
    for server_round in range(1, rounds + 1):
        small_change_round(strategy, run_root, server_round, 20 + server_round)
    return run_root


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("strategy", ["fedadam", "fedavg"])
def test_a_non_finite_value_in_a_clients_checkpoint_fails_the_round(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: float, strategy: str,
) -> None:
    """The optimiser's audit names the source, the tensor and the first bad element. The mean's
    audit counts a source's non-finite values over the key's chunks and names the source (its index
    and directory) and the tensor; the element is not named (the count is what does not depend on
    the chunks)."""
    if strategy == "fedadam":
        run_root = _run(tmp_path, FedAdamFSDP, 1, eta=1e-2, beta_1=0.9, beta_2=0.99)
    else:
        run_root = _run(tmp_path, FedAvgFSDP, 1)
    assert _audit(run_root, capsys)[0] == 0
    source = run_root / "round_1" / "client_1" / "model"
    _poke(source / MODEL, KEY, value)
    recommit_source(run_root, 1)
    status, lines = _audit(run_root, capsys)
    expected = (f"'{KEY}' holds a non-finite value ({value} at [5, 3], the first), so the recomputed round cannot be "
                "compared with what was written" if strategy == "fedadam" else
                f"'{KEY}' holds 1 non-finite value(s) (NaN or Inf), {CHANGED}")
    assert status == 1 and lines == [f"round 1: cannot verify: source 1 {source}: {expected}"], lines


def test_a_non_finite_buffer_in_the_previous_state_fails_both_rounds_that_read_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Round 1's ``v`` holding a NaN: round 1 wrote it (its new state), round 2 stepped from it."""
    run_root = _run(tmp_path, FedAdamFSDP, 2, eta=1e-2, beta_1=0.9, beta_2=0.99)
    state = run_root / "round_1" / "server_optimizer" / "global.safetensors"
    _poke(state, f"v/{KEY}", float("nan"))
    _unhashed(run_root)
    status, lines = _audit(run_root, capsys, "--allow-unhashed")
    assert status == 1 and lines[1:] == [
        f"round 1: cannot verify: optimiser state {state}: 'v/{KEY}' holds a non-finite value (nan at [5, 3], the "
        "first), so the recomputed round cannot be compared with what was written",
        f"round 2: cannot verify: previous optimiser state {state}: 'v/{KEY}' holds a non-finite value (nan at [5, "
        "3], the first), so the recomputed round cannot be compared with what was written"], lines
    assert lines[0].startswith("note: this run recorded checkpoint content hashes v1"), lines


TIED: list[tuple[type[FedAvgFSDP], dict[str, float]]] = [
    (FedAvgFSDP, {}), (FedAdamFSDP, {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99})]


@pytest.mark.parametrize(("cls", "settings"), TIED, ids=["fedavg", "fedadam"])
@pytest.mark.parametrize("change", ["nan", "moved"])
def test_a_tied_copy_in_a_clients_checkpoint_is_checked_against_its_partner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cls: type[FedAvgFSDP], settings: dict[str, float],
    change: str,
) -> None:
    """A client's checkpoint holding a tied copy (``lm_head.weight``, which the file of a model with
    tied embeddings leaves out: it is rebuilt from its partner on load), by the mean's audit and by
    the server optimiser's: a NaN in it fails the round naming the element (the copy's difference
    from its partner would be NaN), a copy 1e-3 off its partner is a 1e-3 error, above the tolerance."""
    run_root = _run(tmp_path, cls, 1, tie=True, **settings)
    assert _audit(run_root, capsys)[0] == 0
    source = run_root / "round_1" / "client_1" / "model"
    config = json.loads((source / "config.json").read_text())
    assert config.get("tie_word_embeddings"), config  # the spec this test relies on
    with safe_open(str(source / MODEL), framework="pt") as handle:
        metadata = handle.metadata() or {}
    tensors = load_file(str(source / MODEL))
    tensors["lm_head.weight"] = tensors[KEY].clone()
    tensors["lm_head.weight"][7, 2] = float("nan") if change == "nan" else tensors[KEY][7, 2] + 1e-3
    save_file(tensors, str(source / MODEL), metadata)
    _unhashed(run_root)
    status, lines = _audit(run_root, capsys, "--allow-unhashed")
    assert status == 1 and len(lines) == 2, lines
    if change == "nan":
        assert lines[1] == (f"round 1: cannot verify: source 1 {source}: 'lm_head.weight' holds a non-finite value "
                            "(nan at [7, 2], the first), so the recomputed round cannot be compared with what was "
                            "written"), lines
    else:
        assert "max abs error 1.000e-03 " in lines[1] and "ABOVE TOLERANCE" in lines[1], lines


def test_finite_inputs_pass_as_before(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The checks refuse nothing finite: an honest two-round run of each path passes."""
    for cls, settings in ((FedAvgFSDP, {}), (FedAdamFSDP, {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99})):
        (tmp_path / cls.__name__).mkdir()
        run_root = _run(tmp_path / cls.__name__, cls, 2, **settings)
        status, lines = _audit(run_root, capsys)
        assert status == 0 and len(lines) == 2 and all(line.endswith(" ok") for line in lines), lines


def test_the_mean_audited_in_many_chunks_reports_what_the_whole_key_does(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FedAvg's audit on real FSDP checkpoints (qwen_b's embedding in blocks of 129 and 128 rows),
    every key in chunks of 3 rows: the same lines and status as every key whole, for a passing run,
    a written model moved by 1e-3 in one element, and one with a NaN and an Inf in two chunks of a
    key (counted together)."""
    assert len(list(row_chunks((257, 64), SMALL_CHUNK))) == 86
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), FedAvgFSDP, clients=2)
    for server_round in (1, 2):
        train_round(strategy, server_round, suite_replies(run_root, suite, *ROUNDS[server_round - 1], server_round))
    written = run_root / "round_2" / "global" / MODEL
    results = []
    for change in ("none", "moved", "non-finite"):
        if change == "moved":
            _poke(written, KEY, float(load_file(str(written))[KEY][200, 5]) + 1e-3, (200, 5))
        elif change == "non-finite":
            _poke(written, KEY, float("nan"), (3, 0))
            _poke(written, KEY, float("inf"), (250, 1))
        if change != "none":  # recommitted, as if the round had written it so: the recomputation judges it
            _recommit(run_root, written.parent, 2)
        whole = _audit(run_root, capsys)  # every key of these models is one chunk
        monkeypatch.setattr(audit_rows, "CHUNK_ELEMENTS", SMALL_CHUNK)
        assert _audit(run_root, capsys) == whole, change
        monkeypatch.undo()
        results.append(whole)
    (status, lines), (moved_status, moved), (bad_status, bad) = results
    assert status == 0 and len(lines) == 2 and all(line.endswith(" ok") for line in lines), lines
    assert moved_status == 1 and moved[1].startswith("round 2: clients [0, 1] max abs error 1.000e-03"), moved
    assert bad_status == 1 and bad[1] == (f"round 2: cannot verify: {written}: '{KEY}' holds 2 non-finite value(s) "
                                          f"(NaN or Inf), {CHANGED}"), bad
