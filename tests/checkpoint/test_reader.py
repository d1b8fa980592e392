"""The checkpoint reader rebuilds exact full tensors from real FSDP2 rank files and HF dirs."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from fedagent_flwr.checkpoint import (
    CheckpointRef,
    FsdpShardReader,
    SafetensorsReader,
    open_checkpoint,
)
from fedagent_flwr.checkpoint.receipts import FileStat
from fedagent_flwr.checkpoint.shard_file import ShardFile
from testkit.ckpt_factory import (
    ModelSpec,
    Suite,
    same_size_impostor,
    write_hf_checkpoint,
)


def _fsdp_ref(path: Path) -> CheckpointRef:
    return CheckpointRef.for_directory(path, fmt="fsdp-shards")


@pytest.mark.parametrize("io", ["pread", "mmap"])
@pytest.mark.parametrize(
    ("name", "world_size"),
    [("qwen_a", 1), ("qwen_plain", 1), ("llama_tied_a", 1), ("qwen_b", 2), ("llama_tied_b", 2)],
)
def test_fsdp_reader_rebuilds_exact_state_dict(suite: Suite, name: str, world_size: int, io: str) -> None:
    expected = suite.expected(name)
    ref = _fsdp_ref(suite.ckpt(name))
    assert ref.world_size == world_size and ref.sha256
    with open_checkpoint(ref, root=suite.root, io=io) as reader:  # type: ignore[arg-type]
        assert isinstance(reader, FsdpShardReader) and reader.io == io
        assert set(reader.keys()) == set(expected)  # lm_head.weight included when tied
        for key, value in expected.items():
            assert reader.shape(key) == tuple(value.shape), key
            got = reader.read(key)
            assert got.dtype == torch.float32 and got.is_contiguous()
            assert torch.equal(got, value), key
        assert reader.huggingface_dir() == suite.ckpt(name) / "huggingface"
        assert reader.num_params() == sum(v.numel() for v in expected.values())


def test_uneven_blocks_are_placed_in_rank_order(suite: Suite) -> None:
    # vocab 257 and intermediate 99 over 2 ranks: blocks of 129/128 and 50/49 rows.
    reader = open_checkpoint(_fsdp_ref(suite.ckpt("qwen_b")))
    rank1 = torch.load(
        suite.ckpt("qwen_b") / "model_world_size_2_rank_1.pt", map_location="meta", weights_only=True
    )
    local = rank1["model.embed_tokens.weight"]._local_tensor
    assert tuple(local.shape) == (128, 64)
    assert reader.shape("model.embed_tokens.weight") == (257, 64)
    assert reader.shape("model.layers.0.mlp.up_proj.weight") == (99, 64)
    reader.close()


def test_empty_blocks_integer_buffers_and_sharded_tensor(suite: Suite) -> None:
    expected = suite.expected("odd_shapes")
    with open_checkpoint(_fsdp_ref(suite.ckpt("odd_shapes"))) as reader:
        assert reader.shape("tiny") == (1, 3)  # rank 1's block is empty
        assert torch.equal(reader.read("tiny"), expected["tiny"])
        assert torch.equal(reader.read("odd"), expected["odd"])
        assert reader.dtype("steps") == torch.int64
        assert torch.equal(reader.read("steps", dtype=None), expected["steps"])
        assert reader.shape("columns") == (3, 5)  # Shard(1): blocks of 3 and 2 columns
        assert torch.equal(reader.read("columns"), expected["columns"])
        assert torch.equal(reader.read("replicated"), expected["replicated"])
    expected = suite.expected("sharded_tensor")
    with open_checkpoint(_fsdp_ref(suite.ckpt("sharded_tensor"))) as reader:
        assert reader.keys() == ["weight"] and reader.shape("weight") == (7, 3)
        assert torch.equal(reader.read("weight"), expected["weight"])


@pytest.mark.parametrize("name", ["hsdp_2x1", "hsdp_1x2"])
def test_hsdp_mesh(suite: Suite, name: str) -> None:
    expected = suite.expected(name)
    with open_checkpoint(_fsdp_ref(suite.ckpt(name))) as reader:
        for key, value in expected.items():
            assert reader.shape(key) == tuple(value.shape)
            assert torch.equal(reader.read(key), value), key


def test_reads_are_lazy_one_key_at_a_time(suite: Suite) -> None:
    reader = open_checkpoint(_fsdp_ref(suite.ckpt("qwen_b")))
    assert reader.bytes_read == 0  # opening reads structure only, no tensor data
    reader.read("model.norm.weight")
    assert reader.bytes_read == 64 * 4
    reader.read("lm_head.weight")
    assert reader.bytes_read == 64 * 4 + 257 * 64 * 4
    reader.close()


def test_safetensors_reader_with_index_and_bf16(tmp_path: Path) -> None:
    spec = ModelSpec("hf", "qwen2", seed=21)
    expected = write_hf_checkpoint(spec, tmp_path / "multi", max_shard_size="40KB")
    assert (tmp_path / "multi" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "multi").glob("*.safetensors"))) > 1
    with open_checkpoint(CheckpointRef.for_directory(tmp_path / "multi"), root=tmp_path) as reader:
        assert isinstance(reader, SafetensorsReader)
        assert set(reader.keys()) == set(expected)
        for key, value in expected.items():
            assert reader.shape(key) == tuple(value.shape)
            assert torch.equal(reader.read(key), value)
        assert reader.huggingface_dir() == tmp_path / "multi"

    expected_bf16 = write_hf_checkpoint(spec, tmp_path / "bf16", dtype=torch.bfloat16)
    with open_checkpoint(CheckpointRef.for_directory(tmp_path / "bf16")) as reader:
        key = "model.embed_tokens.weight"
        assert reader.dtype(key) == torch.bfloat16
        got = reader.read(key)
        assert got.dtype == torch.float32
        assert torch.equal(got, expected_bf16[key].float())


def test_reference_roundtrip_through_config(suite: Suite) -> None:
    ref = _fsdp_ref(suite.ckpt("qwen_b"))
    again = CheckpointRef.from_config(ref.to_config("actor"), "actor")
    assert again == ref
    open_checkpoint(again, root=suite.root, check_hash=True).close()


@pytest.mark.parametrize("io", ["pread", "mmap"])
def test_a_rank_file_reads_the_file_it_opened_after_its_path_is_swapped(
        suite: Suite, tmp_path: Path, io: str) -> None:
    """A rank file's blocks and its digest come from the file opened, not from whatever its path
    leads to later: the mmap mode maps the opened file (through /proc/self/fd or /dev/fd), not the path."""
    directory = suite.copy("qwen_plain", tmp_path)
    path = directory / "model_world_size_1_rank_0.pt"
    original = torch.load(path, weights_only=True)
    original_digest = hashlib.sha256(path.read_bytes()).digest()
    other = tmp_path / "other" / path.name  # same name: torch.save names the zip's records after it
    other.parent.mkdir()
    same_size_impostor(path, other)
    shard = ShardFile(path, io=io)  # type: ignore[arg-type]
    try:
        assert shard.io == io
        assert shard.opened_stat == FileStat.of(path.stat())
        os.replace(other, path)  # the path now leads to the other file; the opened one lives on
        assert FileStat.of(path.stat()) != shard.opened_stat
        floats = [k for k, v in original.items() if v.is_floating_point()]
        assert floats
        for key in floats:
            assert torch.equal(shard.read_piece(key, 0), original[key]), key
        assert shard.content_digest() == original_digest
    finally:
        shard.close()
