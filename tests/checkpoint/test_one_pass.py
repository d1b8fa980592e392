"""The content hash checked while the tensors are read (one pass over the files): a checkpoint
whose bytes do not match its reference is refused by name before the round's mean is committed,
each byte of a rank file is read once, and the hash is the same however it is computed."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from fedagent_flwr.checkpoint import (
    CheckpointError,
    CheckpointRef,
    hash_checkpoint_dir,
    open_checkpoint,
    shard_file,
    weighted_mean,
)
from fedagent_flwr.checkpoint.content_hash import hashed_files
from fedagent_flwr.checkpoint.fsdp_reader import FsdpShardReader
from testkit.ckpt_factory import ModelSpec, Suite, write_hf_checkpoint
from testkit.file_change import flip_byte


def _flip_tensor_byte(shard: Path) -> None:
    """Flip one byte in the middle of the tensor data, keeping the size (the zip still parses)."""
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("chunk", [None, 4099], ids=["default-chunks", "many-small-chunks"])
def test_hash_is_the_same_on_one_or_several_threads_and_while_reading(
    suite: Suite, chunk: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if chunk is not None:  # every tensor read as many chunks, each hashed by the helper thread
        monkeypatch.setattr(shard_file, "_HASHED_READ_CHUNK", chunk)
    directory = suite.ckpt("qwen_b")
    expected = hash_checkpoint_dir(directory, threads=1)
    assert hash_checkpoint_dir(directory, threads=4) == expected
    ref = CheckpointRef.for_directory(directory)
    assert ref.sha256 == expected
    reader = open_checkpoint(ref, check_hash="while-reading")
    try:
        assert isinstance(reader, FsdpShardReader)
        for key in reader.keys():
            reader.read(key)
        reader.verify_content()  # raises on a mismatch
    finally:
        reader.close()


def test_each_byte_of_a_rank_file_is_read_once(suite: Suite, tmp_path: Path) -> None:
    ref = CheckpointRef.for_directory(suite.ckpt("qwen_b"))  # world size 2, DTensor blocks
    reader = open_checkpoint(ref, check_hash="while-reading")
    try:
        out = weighted_mean([(reader, 1.0)], tmp_path / "out")
        shard_bytes = sum(p.stat().st_size for p in hashed_files(ref.path) if p.suffix == ".pt")
        # Tensor bytes read for the mean plus the bytes read only for the hash (zip headers, the
        # pickle, the tail) cover every byte exactly once: nothing is read twice.
        assert isinstance(reader, FsdpShardReader)
        assert out.bytes_read + reader.hash_gap_bytes == shard_bytes
        assert reader.hash_gap_bytes < out.bytes_read
    finally:
        reader.close()


def test_corrupted_checkpoint_is_refused_by_name_and_nothing_is_committed(suite: Suite, tmp_path: Path) -> None:
    good_dir = suite.copy("qwen_a", tmp_path)
    bad_dir = suite.copy("qwen_c", tmp_path)
    good_ref, bad_ref = CheckpointRef.for_directory(good_dir), CheckpointRef.for_directory(bad_dir)
    _flip_tensor_byte(bad_dir / "model_world_size_2_rank_1.pt")
    good = open_checkpoint(good_ref, root=tmp_path, check_hash="while-reading")
    bad = open_checkpoint(bad_ref, root=tmp_path, check_hash="while-reading")  # no read yet: opens fine
    out = tmp_path / "out"
    try:
        with pytest.raises(CheckpointError, match=rf"content hash of {bad_dir} is .*\(files changed or incomplete\)"):
            weighted_mean([(good, 1.0), (bad, 3.0)], out)
        assert not out.exists()
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging left
        # The same check at opening (the default) refuses it before anything is read.
        with pytest.raises(CheckpointError, match=f"content hash of {bad_dir}"):
            open_checkpoint(bad_ref, root=tmp_path)
    finally:
        good.close()
        bad.close()


def test_a_file_added_after_opening_is_a_mismatch(suite: Suite, tmp_path: Path) -> None:
    directory = suite.copy("qwen_a", tmp_path)
    reader = open_checkpoint(CheckpointRef.for_directory(directory), check_hash="while-reading")
    try:
        (directory / "extra.json").write_text(json.dumps({"swapped": True}))
        with pytest.raises(CheckpointError, match="changed while it was read"):
            reader.verify_content()
    finally:
        reader.close()


def test_bad_check_hash_value_is_refused(suite: Suite) -> None:
    with pytest.raises(ValueError, match="check_hash"):
        open_checkpoint(CheckpointRef.for_directory(suite.ckpt("qwen_a")), check_hash="later")  # type: ignore[arg-type]


def test_one_pass_mean_equals_the_checked_at_opening_mean(suite: Suite, tmp_path: Path) -> None:
    names = ["qwen_a", "qwen_b", "qwen_plain"]
    outs = {}
    for mode in (True, "while-reading"):
        readers = [open_checkpoint(CheckpointRef.for_directory(suite.ckpt(n)), check_hash=mode) for n in names]
        try:
            out = tmp_path / f"out_{mode}"
            weighted_mean([(r, float(i + 1)) for i, r in enumerate(readers)], out)
            outs[mode] = out
        finally:
            for reader in readers:
                reader.close()
    from safetensors.torch import load_file

    first = load_file(str(outs[True] / "model.safetensors"))
    second = load_file(str(outs["while-reading"] / "model.safetensors"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)  # bitwise: the hash mode changes no number


def _rewritten_in_place(path: Path) -> str:
    flip_byte(path, restore_mtime=True, at=-1)  # a weight's last byte
    return f"{path} changed while it was read"


def _shortened(path: Path) -> str:
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    os.truncate(path, 8 + length)  # the header only
    return f"{path}: '[^']+' ends at byte .*shortened after it was opened"


@pytest.mark.parametrize("change", [_rewritten_in_place, _shortened], ids=["rewritten-in-place", "shortened"])
def test_a_safetensors_checkpoint_changed_after_its_hash_is_refused(tmp_path: Path, change) -> None:
    """A client's safetensors checkpoint (the default job's) is hashed at opening and read afterwards.
    Rewritten in place after the hash (same size, inode and mtime: only its ctime moves), it was read
    into the mean under a hash that held, and the mean committed; now the aggregation's check after
    its reads names the file (before stop 54 this mean was written). Cut short after the hash, the
    mean's read of a tensor past the new end fails naming the file and the tensor; read through a
    memory map (before stop 56) that read killed the server process (SIGBUS). Nothing is written."""
    for name, seed in (("a", 31), ("b", 32)):
        write_hf_checkpoint(ModelSpec(name, "qwen2", seed=seed), tmp_path / name)
    readers = [open_checkpoint(CheckpointRef.for_directory(tmp_path / name), root=tmp_path,
                               check_hash="while-reading") for name in ("a", "b")]
    out = tmp_path / "out"
    try:
        (changed,) = (tmp_path / "b").glob("*.safetensors")
        message = change(changed)
        with pytest.raises(CheckpointError, match=message):
            weighted_mean([(readers[0], 1.0), (readers[1], 1.0)], out)
        assert not out.exists()
    finally:
        for reader in readers:
            reader.close()


def test_a_safetensors_checkpoint_changed_while_it_is_hashed_is_refused_after_the_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write during the hash, to bytes the hash had read already: the digest is the old content's and
    matches the reference, the reads see the new bytes; the check after the reads still names the file."""
    from fedagent_flwr.checkpoint import content_hash

    write_hf_checkpoint(ModelSpec("a", "qwen2", seed=31), tmp_path / "a")
    ref = CheckpointRef.for_directory(tmp_path / "a")
    (model,) = (tmp_path / "a").glob("*.safetensors")
    digest = content_hash.file_digest

    def rewritten_as_hashed(path: Path) -> bytes:
        done = digest(path)
        if Path(path) == model:
            flip_byte(model, restore_mtime=True, at=-1)
        return done

    monkeypatch.setattr(content_hash, "file_digest", rewritten_as_hashed)
    with open_checkpoint(ref, root=tmp_path, check_hash="while-reading") as reader:  # the hash matched
        for key in reader.keys():
            reader.read(key)
        with pytest.raises(CheckpointError, match=f"{model} changed while it was read"):
            reader.verify_content()
