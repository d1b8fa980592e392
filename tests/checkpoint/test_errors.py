"""Bad checkpoints and bad inputs are refused with a message naming the culprit, and a failed
aggregation never leaves a partial output directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from fedagent_flwr.checkpoint import (
    CheckpointError,
    CheckpointRef,
    check_compatible,
    open_checkpoint,
    weighted_mean,
)
from fedagent_flwr.checkpoint.key_checks import check_finite
from testkit.ckpt_factory import ModelSpec, Suite, write_hf_checkpoint


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# -- where the reference points ---------------------------------------------------------------


def test_reference_outside_root_is_refused(suite: Suite, tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    outside = suite.copy("qwen_a", tmp_path)  # a valid checkpoint, but not under the run root
    ref = CheckpointRef.for_directory(outside)
    with pytest.raises(CheckpointError, match="outside the run root"):
        open_checkpoint(ref, root=root)

    link = root / "client_3"
    link.symlink_to(outside, target_is_directory=True)  # looks inside, resolves outside
    with pytest.raises(CheckpointError, match="outside the run root") as info:
        open_checkpoint(CheckpointRef(str(link), format="fsdp-shards", world_size=1), root=root)
    assert "client_3" in str(info.value)

    dotdot = f"{root}/../{outside.name}"
    with pytest.raises(CheckpointError, match=r"outside the run root") as info:
        open_checkpoint(CheckpointRef(dotdot, format="fsdp-shards", world_size=1), root=root)
    assert ".." in str(info.value)

    inside = suite.copy("qwen_b", root)
    shard = inside / "model_world_size_2_rank_1.pt"
    shard.unlink()
    shard.symlink_to(outside / "model_world_size_1_rank_0.pt")  # a shard that leaves the root
    with pytest.raises(CheckpointError, match="model_world_size_2_rank_1.pt links to .*outside the run root"):
        open_checkpoint(CheckpointRef(str(inside), format="fsdp-shards", world_size=2), root=root)

    with pytest.raises(CheckpointError, match="scheme"):
        open_checkpoint(CheckpointRef("s3://bucket/ckpt", format="fsdp-shards"), root=root)
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(CheckpointRef(str(root / "nope"), format="fsdp-shards"), root=root)


# -- what the directory holds -------------------------------------------------------------------


def test_missing_shard_is_named(suite: Suite, tmp_path: Path) -> None:
    ckpt = suite.copy("qwen_b", tmp_path)
    ref = CheckpointRef.for_directory(ckpt)
    (ckpt / "model_world_size_2_rank_1.pt").unlink()
    with pytest.raises(CheckpointError, match="missing rank file model_world_size_2_rank_1.pt"):
        open_checkpoint(ref, root=tmp_path)


def test_world_size_disagreement_is_refused(suite: Suite, tmp_path: Path) -> None:
    ckpt = suite.copy("qwen_b", tmp_path)
    with pytest.raises(CheckpointError, match=r"world size\(s\) \[2\], the reference says 4"):
        open_checkpoint(CheckpointRef(str(ckpt), format="fsdp-shards", world_size=4))
    (ckpt / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 3}')
    with pytest.raises(CheckpointError, match="fsdp_config.json declares world size 3"):
        open_checkpoint(CheckpointRef(str(ckpt), format="fsdp-shards", world_size=2))


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.0])
def test_truncated_shard_is_named_not_a_raw_traceback(suite: Suite, tmp_path: Path, keep: float) -> None:
    ckpt = suite.copy("qwen_b", tmp_path)
    ref = CheckpointRef.for_directory(ckpt)
    shard = ckpt / "model_world_size_2_rank_1.pt"
    os.truncate(shard, int(shard.stat().st_size * keep))
    with pytest.raises(CheckpointError, match="content hash"):  # the hash catches it first ...
        open_checkpoint(ref, root=tmp_path)
    with pytest.raises(CheckpointError) as info:  # ... and without a hash, the loader does
        open_checkpoint(ref, root=tmp_path, check_hash=False)
    assert "model_world_size_2_rank_1.pt" in str(info.value)
    assert "truncated or corrupt" in str(info.value)


def test_garbage_shard_is_named(suite: Suite, tmp_path: Path) -> None:
    ckpt = suite.copy("qwen_a", tmp_path)
    shard = ckpt / "model_world_size_1_rank_0.pt"
    shard.write_bytes(b"\x00not a zip\x00" * 100)
    with pytest.raises(CheckpointError, match="model_world_size_1_rank_0.pt is not a readable"):
        open_checkpoint(CheckpointRef.for_directory(ckpt))


def test_wrong_hash_is_refused(suite: Suite, tmp_path: Path) -> None:
    ckpt = suite.copy("qwen_a", tmp_path)
    ref = CheckpointRef.for_directory(ckpt)
    forged = CheckpointRef(ref.path, ref.kind, ref.format, ref.world_size, "0" * 64)
    with pytest.raises(CheckpointError, match=f"content hash of {ckpt}"):
        open_checkpoint(forged, root=tmp_path)
    # Same size, one byte flipped in the middle of the tensor data.
    shard = ckpt / "model_world_size_1_rank_0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="files changed or incomplete"):
        open_checkpoint(ref, root=tmp_path)


def test_truncated_safetensors_is_named(tmp_path: Path) -> None:
    write_hf_checkpoint(ModelSpec("hf", "qwen2", seed=41), tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        open_checkpoint(CheckpointRef.for_directory(tmp_path / "hf"))


# -- what the aggregation is given ---------------------------------------------------------------


def test_mismatched_shapes_vs_reference(suite: Suite, tmp_path: Path) -> None:
    wider = ModelSpec("wider", "qwen2", seed=2, overrides=(("intermediate_size", 100),))
    write_hf_checkpoint(wider, tmp_path / "wider")
    reference = open_checkpoint(CheckpointRef.for_directory(suite.ckpt("qwen_a")))
    good = open_checkpoint(CheckpointRef.for_directory(suite.ckpt("qwen_b")))
    bad = open_checkpoint(CheckpointRef.for_directory(tmp_path / "wider"))
    check_compatible(good, reference)
    with pytest.raises(CheckpointError,
                       match=r"'model.layers.0.mlp.\w+_proj.weight' has shape \((100, 64|64, 100)\)") as info:
        check_compatible(bad, reference)
    assert str(tmp_path / "wider") in str(info.value)

    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"source 1 \(.*wider\)"):
        weighted_mean([(good, 1.0), (bad, 1.0)], out)
    with pytest.raises(CheckpointError, match="reference"):
        weighted_mean([(bad, 1.0)], out, reference=reference)
    assert not out.exists() and _leftovers(tmp_path) == []

    llama = open_checkpoint(CheckpointRef.for_directory(suite.ckpt("llama_tied_a")))
    with pytest.raises(CheckpointError, match="different keys"):
        check_compatible(llama, reference)  # no q/k/v biases, different key set


@pytest.mark.parametrize("weights", [(1.0, 0.0), (1.0, -2.0), (float("nan"), 1.0), (float("inf"), 1.0)])
def test_bad_weights_are_refused(suite: Suite, tmp_path: Path, weights: tuple[float, float]) -> None:
    a = open_checkpoint(CheckpointRef.for_directory(suite.ckpt("qwen_a")))
    b = open_checkpoint(CheckpointRef.for_directory(suite.ckpt("qwen_b")))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"weight .* of source \d .* finite numbers > 0"):
        weighted_mean([(a, weights[0]), (b, weights[1])], out)
    with pytest.raises(CheckpointError, match="no sources"):
        weighted_mean([], out)
    assert not out.exists() and _leftovers(tmp_path) == []


def test_existing_output_is_never_overwritten(suite: Suite, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous round")
    a = open_checkpoint(CheckpointRef.for_directory(suite.ckpt("qwen_a")))
    with pytest.raises(CheckpointError, match="already exists"):
        weighted_mean([(a, 1.0)], out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_failure_mid_aggregation_leaves_nothing(suite: Suite, tmp_path: Path) -> None:
    # The shard passes every check at open time and is damaged afterwards, so the error
    # surfaces only while tensors are being streamed into the output.
    ckpt = suite.copy("qwen_b", tmp_path)
    a = open_checkpoint(CheckpointRef.for_directory(suite.ckpt("qwen_a")))
    b = open_checkpoint(CheckpointRef.for_directory(ckpt), root=tmp_path)
    shard = ckpt / "model_world_size_2_rank_1.pt"
    os.truncate(shard, shard.stat().st_size // 2)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="model_world_size_2_rank_1.pt is truncated"):
        weighted_mean([(a, 1.0), (b, 1.0)], out)
    assert not out.exists()
    assert _leftovers(tmp_path) == []
    shutil.rmtree(ckpt)


def test_plain_tensors_that_differ_across_ranks_are_refused(suite: Suite, tmp_path: Path) -> None:
    # Local blocks saved without DTensor metadata look like replicated tensors; they are not.
    ckpt = tmp_path / "fake_w2"
    ckpt.mkdir()
    full = suite.expected("qwen_a")
    keys = ["model.norm.weight", "model.layers.0.self_attn.q_proj.weight"]  # even first dims
    for rank in range(2):
        torch.save({k: full[k].chunk(2)[rank].clone() for k in keys}, ckpt / f"model_world_size_2_rank_{rank}.pt")
    reader = open_checkpoint(CheckpointRef.for_directory(ckpt))
    assert reader.shape("model.norm.weight") == (32,)  # the local shape: nothing says otherwise
    with pytest.raises(CheckpointError, match="model_world_size_2_rank_1.pt: plain tensor 'model.norm.weight'"):
        reader.read("model.norm.weight")


def test_the_finite_check_tells_overflowing_sums_from_bad_values() -> None:
    # Large finite fp16 values sum to Inf: the fast path must fall back, not refuse them.
    check_finite("k", torch.full((10,), 60000.0, dtype=torch.float16), "source 0 (big)")
    check_finite("k", torch.arange(5), "source 0 (integers)")
    for bad in (torch.tensor([1.0, float("nan")], dtype=torch.bfloat16),
                torch.tensor([1.0, float("-inf")]),
                torch.tensor([complex(1.0, float("nan"))])):
        with pytest.raises(CheckpointError, match=r"source 1 \(bad\): tensor 'k' holds 1 non-finite"):
            check_finite("k", bad, "source 1 (bad)")
