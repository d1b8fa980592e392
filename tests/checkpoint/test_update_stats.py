"""Update statistics and the numeric guard of the streamed aggregation, on real HF checkpoints.

Clients are the reference model plus deltas chosen so that the answers are known exactly
(opposite updates cancel, a scaled copy has cosine 1), and are also recomputed independently in
float64 from the files.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedagent_flwr.checkpoint import CheckpointRef, aggregate_by_key, open_checkpoint, verify_mean, weighted_mean
from fedagent_flwr.checkpoint.ref import CheckpointError
from testkit.ckpt_factory import ModelSpec, write_hf_checkpoint


@pytest.fixture()
def base(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = tmp_path / "base"
    write_hf_checkpoint(ModelSpec("global", "qwen2", seed=9), directory)
    return directory, load_file(str(directory / "model.safetensors"))


def _client(tmp_path: Path, base_dir: Path, name: str, state: dict[str, torch.Tensor]) -> Path:
    """An HF checkpoint directory holding ``state`` with the base model's config and tokenizer."""
    directory = tmp_path / name
    shutil.copytree(base_dir, directory)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory


def _direction(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=generator) * 1e-3 for k, v in state.items()}


def _open(directory: Path):  # noqa: ANN202 - a CheckpointReader
    return open_checkpoint(CheckpointRef.for_directory(directory), root=directory.parent)


def _flat(delta: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([delta[k].double().flatten() for k in sorted(delta)])


def test_known_updates_give_known_norms_and_cosines(base, tmp_path: Path) -> None:
    base_dir, start = base
    d = _direction(start, seed=1)
    e = _direction(start, seed=2)
    deltas = [
        d,  # client 0: +d
        {k: -v for k, v in d.items()},  # client 1: -d, cancels client 0
        {k: 2 * v for k, v in d.items()},  # client 2: 2d, the same direction as client 0
        {k: e[k] - d[k] for k in d},  # client 3: something else
    ]
    dirs = [_client(tmp_path, base_dir, f"c{i}", {k: start[k] + delta[k] for k in start})
            for i, delta in enumerate(deltas)]
    weights = [1.0, 1.0, 2.0, 4.0]
    readers = [_open(p) for p in dirs]
    report = weighted_mean(list(zip(readers, weights)), tmp_path / "out", reference=_open(base_dir))
    stats = report.update_stats
    assert stats is not None and stats.mode == "full"

    # What the stored values really are (files hold fp32 sums, so recompute from the files).
    written = [load_file(str(p / "model.safetensors")) for p in dirs]
    flat = [_flat({k: w[k].double() - start[k].double() for k in start}) for w in written]
    norm_d = flat[0].norm().item()
    assert stats.client_update_norm == pytest.approx([f.norm().item() for f in flat], rel=1e-5)
    assert stats.client_update_norm[2] == pytest.approx(2 * norm_d, rel=1e-5)
    assert stats.cosine[0][1] == pytest.approx(-1.0, abs=1e-5)
    assert stats.cosine[0][2] == pytest.approx(1.0, abs=1e-5)
    assert stats.cosine[0][0] == pytest.approx(1.0, abs=1e-6)
    expected_cos03 = float(flat[0] @ flat[3] / (flat[0].norm() * flat[3].norm()))
    assert stats.cosine[0][3] == pytest.approx(expected_cos03, abs=1e-5)
    total = sum(weights)
    mean = sum((w / total) * f for w, f in zip(weights, flat))
    assert stats.mean_update_norm == pytest.approx(mean.norm().item(), rel=1e-5)
    assert stats.norm_ratio == pytest.approx(
        mean.norm().item() / sum((w / total) * f.norm().item() for w, f in zip(weights, flat)), rel=1e-5)
    assert stats.cosine_to_mean[3] == pytest.approx(float(flat[3] @ mean / (flat[3].norm() * mean.norm())), abs=1e-5)
    assert stats.num_params == sum(v.numel() for v in start.values())

    # Statistics never change the mean: bitwise the same without them, and still exact.
    plain = weighted_mean(list(zip(readers, weights)), tmp_path / "plain", update_stats=False)
    assert plain.update_stats is None
    a, b = (load_file(str(tmp_path / "out" / "model.safetensors")),
            load_file(str(tmp_path / "plain" / "model.safetensors")))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert verify_mean(list(zip(readers, weights)), tmp_path / "out") < 1e-6
    as_json = json.loads(json.dumps(report.to_dict()))
    assert as_json["update_stats"]["mean_pairwise_cosine"] == pytest.approx(stats.mean_pairwise_cosine())


def test_opposite_updates_cancel_and_the_memory_budget_keeps_exact_norms(base, tmp_path: Path) -> None:
    base_dir, start = base
    d = _direction(start, seed=3)
    plus = _client(tmp_path, base_dir, "plus", {k: start[k] + d[k] for k in start})
    minus = _client(tmp_path, base_dir, "minus", {k: start[k] - d[k] for k in start})
    sources = [(_open(plus), 1.0), (_open(minus), 1.0)]
    full = weighted_mean(sources, tmp_path / "full", reference=_open(base_dir)).update_stats
    # A budget of one byte cannot hold two clients' tensors: norms only, still exact.
    norms = weighted_mean(sources, tmp_path / "norms", reference=_open(base_dir), stats_max_bytes=1).update_stats
    assert full is not None and norms is not None
    assert norms.mode == "norms" and norms.cosine is None and norms.mean_pairwise_cosine() is None
    assert norms.client_update_norm == pytest.approx(full.client_update_norm, rel=1e-5)
    # +d and -d around the start average back to (about) the start: the federation did not move.
    assert full.mean_update_norm < 1e-4 * full.client_update_norm[0]
    assert norms.mean_update_norm == pytest.approx(full.mean_update_norm, abs=1e-5 * full.client_update_norm[0])
    assert full.norm_ratio is not None and full.norm_ratio < 1e-4
    # A client that did not move has no direction: its cosines are None, not a made-up 0.
    still = weighted_mean([(_open(base_dir), 1.0), (_open(plus), 1.0)], tmp_path / "still",
                          reference=_open(base_dir)).update_stats
    assert still is not None and still.client_update_norm[0] == 0.0 and still.cosine[0][1] is None


def test_a_per_key_rule_gets_the_same_statistics(base, tmp_path: Path) -> None:
    base_dir, start = base
    dirs = [_client(tmp_path, base_dir, f"c{i}", {k: start[k] + v for k, v in _direction(start, seed=10 + i).items()})
            for i in range(3)]
    sources = [(_open(p), 1.0) for p in dirs]
    mean = weighted_mean(sources, tmp_path / "mean", reference=_open(base_dir)).update_stats

    def median(key: str, tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        return torch.stack(tensors).median(dim=0).values

    by_key = aggregate_by_key(sources, tmp_path / "median", median, name="median",
                              reference=_open(base_dir)).update_stats
    assert by_key is not None and mean is not None
    assert by_key.client_update_norm == pytest.approx(mean.client_update_norm, rel=1e-6)
    assert by_key.cosine[0][1] == pytest.approx(mean.cosine[0][1], abs=1e-6)


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused_naming_the_source(base, tmp_path: Path, poison: float) -> None:
    base_dir, start = base
    good = _client(tmp_path, base_dir, "good", dict(start))
    state = {k: v.clone() for k, v in start.items()}
    key = sorted(state)[-1]
    state[key].view(-1)[3] = poison
    bad = _client(tmp_path, base_dir, "bad", state)
    for stats in (True, False):
        out = tmp_path / f"out-{stats}"
        with pytest.raises(CheckpointError, match=r"source 1 \(.*bad\).*non-finite"):
            weighted_mean([(_open(good), 1.0), (_open(bad), 1.0)], out, reference=_open(base_dir), update_stats=stats)
        assert not out.exists()
    with pytest.raises(CheckpointError, match="non-finite"):
        aggregate_by_key([(_open(good), 1.0), (_open(bad), 1.0)], tmp_path / "rule",
                         lambda k, t, w: t[0], name="first")
    # The audit flags a poisoned output (written by hand here, as a tampered file would be)
    # instead of passing a NaN error as "within tolerance".
    weighted_mean([(_open(good), 1.0)], tmp_path / "ok")
    tampered = load_file(str(tmp_path / "ok" / "model.safetensors"))
    tampered[key].view(-1)[0] = poison
    save_file(tampered, str(tmp_path / "ok" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="non-finite"):
        verify_mean([(_open(good), 1.0)], tmp_path / "ok")
