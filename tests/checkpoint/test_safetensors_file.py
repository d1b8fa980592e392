""":class:`.SafetensorsFile`, the project's one way to read a safetensors file: the same tensors,
shapes, dtypes, metadata and keys as the ``safetensors`` library's own ``safe_open`` (the oracle),
damaged files refused by name at opening, and a file shortened after it was opened failing the read
with an error naming the file and the tensor, where a memory map would kill the process (SIGBUS)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fedagent_flwr.checkpoint import CheckpointError
from fedagent_flwr.checkpoint.safetensors_file import SafetensorsFile

TENSORS = {
    "w.f32": torch.randn(7, 5, generator=torch.Generator().manual_seed(1)),
    "w.bf16": torch.randn(6, 3, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16),
    "w.f16": torch.randn(4, generator=torch.Generator().manual_seed(3)).to(torch.float16),
    "w.f64": torch.randn(2, 2, 2, generator=torch.Generator().manual_seed(4)).double(),
    "scalar": torch.tensor(2.5),
    "steps": torch.arange(12, dtype=torch.int64).reshape(3, 4),
    "i32": torch.tensor([-3, 9], dtype=torch.int32),
    "i16": torch.tensor([7], dtype=torch.int16),
    "i8": torch.tensor([-1, 1], dtype=torch.int8),
    "u8": torch.tensor([0, 255], dtype=torch.uint8),
    "mask": torch.tensor([True, False, True]),
    "empty": torch.empty(0, 4),
}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, str(path), metadata={"fedagent.step": "3", "note": "x"})
    return path


def test_every_tensor_its_shape_dtype_keys_and_metadata_are_the_librarys(model: Path) -> None:
    with safe_open(str(model), framework="pt") as oracle, SafetensorsFile(model) as file:
        assert file.keys() == oracle.keys()
        assert file.metadata() == oracle.metadata()
        for key in oracle.keys():
            expected = oracle.get_tensor(key)
            got = file.get_tensor(key)
            assert got.dtype == expected.dtype and got.shape == expected.shape and file.shape(key) == tuple(
                expected.shape) and file.dtype(key) == expected.dtype, key
            assert torch.equal(got, expected), key
            if expected.dim():
                for start, stop in ((0, 1), (1, 3), (2, 99), (5, 2)):
                    assert torch.equal(file.read_rows(key, start, stop),
                                       oracle.get_slice(key)[start:stop]), (key, start, stop)


def test_read_into_fills_a_buffer_of_the_stored_or_another_dtype(model: Path) -> None:
    with SafetensorsFile(model) as file:
        same = torch.full((6, 3), -1.0, dtype=torch.bfloat16)
        file.read_into("w.bf16", same)  # straight into its memory
        assert torch.equal(same, TENSORS["w.bf16"])
        wider = torch.zeros(18)
        file.read_into("w.bf16", wider)  # through one buffer, converted
        assert torch.equal(wider, TENSORS["w.bf16"].float().reshape(-1))
        strided = torch.zeros(5, 7).t()  # not contiguous
        file.read_into("w.f32", strided)
        assert torch.equal(strided, TENSORS["w.f32"])
        scalar = torch.zeros(())
        file.read_into("scalar", scalar)
        assert scalar.item() == 2.5
        with pytest.raises(CheckpointError, match=r"'w.f32' has shape \[7, 5\], the buffer \[5\]"):
            file.read_into("w.f32", torch.zeros(5))


def test_a_tensor_owns_its_memory(model: Path) -> None:
    with SafetensorsFile(model) as file:
        tensor = file.get_tensor("w.f32")
    tensor.add_(1.0)  # closed and changed: nothing refers to the file
    assert torch.equal(tensor, TENSORS["w.f32"] + 1.0)


def test_an_unknown_key_and_a_closed_file_are_named(model: Path) -> None:
    file = SafetensorsFile(model)
    with pytest.raises(CheckpointError, match=f"{model} holds no tensor 'missing'"):
        file.get_tensor("missing")
    with pytest.raises(CheckpointError, match="is a scalar; it has no rows"):
        file.read_rows("scalar", 0, 1)
    file.close()
    file.close()  # again: nothing
    with pytest.raises(CheckpointError, match=f"{model} is closed; 'w.f32' cannot be read"):
        file.get_tensor("w.f32")


def _header_end(path: Path) -> int:
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + length


def _rewrite_header(path: Path, change: dict) -> None:
    """The file with its header's entries updated by ``change`` (padded as the format allows)."""
    data = path.read_bytes()
    end = _header_end(path)
    header = json.loads(data[8:end])
    header.update(change)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[end:])


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: p.write_bytes(b"\x01\x00"), "only 2 bytes"),
    (lambda p: p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}"), "a header of 1099511627776 bytes in a file of 10"),
    (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"{{{{"), "its header is not UTF-8 JSON"),
    (lambda p: p.write_bytes(struct.pack("<Q", 2) + b"[]"), "its header is not a JSON object"),
    (lambda p: os.truncate(p, p.stat().st_size - 1), "its tensors cover 365 bytes of data, the file holds 364"),
    (lambda p: _rewrite_header(p, {"w.f32": {"dtype": "F32", "shape": [7, 5], "data_offsets": [0, 4]}}),
     r"'w.f32' of shape \[7, 5\] F32 is given bytes 0:4"),
    (lambda p: _rewrite_header(p, {"w.f32": {"dtype": "F32", "shape": [-7, 5], "data_offsets": [0, 4]}}),
     "the entry of 'w.f32' is malformed"),
    (lambda p: _rewrite_header(p, {"w.f32": {"dtype": "F32"}}), "the entry of 'w.f32' is malformed"),
    (lambda p: _rewrite_header(p, {"__metadata__": {"step": 3}}), "its __metadata__ is not a map of strings"),
    (lambda p: _rewrite_header(p, {"i8": {"dtype": "F2", "shape": [2], "data_offsets": [0, 2]}}),
     "'i8' has unsupported dtype F2"),
], ids=["too-short", "header-past-the-end", "not-json", "not-an-object", "truncated", "wrong-length",
        "negative-shape", "no-offsets", "metadata-not-strings", "unsupported-dtype"])
def test_a_damaged_file_is_refused_at_opening_naming_it(model: Path, damage, message: str) -> None:
    damage(model)
    with pytest.raises(CheckpointError, match=message) as raised:
        SafetensorsFile(model)
    assert str(model) in str(raised.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'gone.safetensors'} is not a readable safetensors file"):
        SafetensorsFile(tmp_path / "gone.safetensors")


def test_a_file_shortened_after_opening_fails_the_read_naming_file_and_tensor(model: Path) -> None:
    """Through ``safe_open`` the same read touches memory-mapped pages past the new end of the file:
    SIGBUS, the process gone."""
    with SafetensorsFile(model) as file:
        kept = file.get_tensor("empty")  # before: fine
        os.truncate(model, _header_end(model) + 4)
        with pytest.raises(CheckpointError,
                           match=f"{model}: 'w.f32' ends at byte \\d+, the file now ends at byte \\d+: it was "
                                 "shortened after it was opened"):
            file.get_tensor("w.f32")
        with pytest.raises(CheckpointError, match="shortened after it was opened"):
            file.read_rows("w.f32", 1, 2)
        with pytest.raises(CheckpointError, match="shortened after it was opened"):
            file.read_into("w.f32", torch.zeros(7, 5))
    assert kept.numel() == 0


def test_the_held_stat_is_the_open_files_and_is_kept_once_closed(model: Path) -> None:
    """What a check after the reads compares (``CheckpointReader._held_stat``): the descriptor's file,
    not whatever the path names now."""
    from fedagent_flwr.checkpoint.receipts import fresh_stat

    file = SafetensorsFile(model)
    opened = fresh_stat(model)
    assert file.held_stat() == opened
    moved = model.with_suffix(".old")
    model.rename(moved)  # (a rename moves the file's ctime)
    save_file({"other": torch.zeros(1)}, str(model))  # another file at the path
    assert file.held_stat() == fresh_stat(moved) != fresh_stat(model)
    os.truncate(moved, 8)  # the held file itself changes
    changed = file.held_stat()
    assert changed == fresh_stat(moved) and changed.size == 8
    file.close()
    assert file.held_stat() == changed


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as handle:
        handle.write(data)


def _shift_first_tensor(path: Path, by: int) -> None:
    """Move the data offsets of the tensor that starts the data by ``by`` bytes (a hole or an overlap)."""
    data = path.read_bytes()
    header = json.loads(data[8:_header_end(path)])
    key = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    first, end = header[key]["data_offsets"]
    _rewrite_header(path, {key: {**header[key], "data_offsets": [first + by, end + by]}})


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: _append(p, b"\0" * 8), "its tensors cover \\d+ bytes of data, the file holds \\d+"),
    (lambda p: _shift_first_tensor(p, 8), "starts at data byte 8, not 0: the tensors leave a hole or overlap"),
    (lambda p: _rewrite_header(p, {"__metadata__": []}), "its __metadata__ is not a map of strings"),
    (lambda p: _rewrite_header(p, {"i8": {"dtype": ["I8"], "shape": [2], "data_offsets": [0, 2]}}),
     "the entry of 'i8' is malformed"),
    (lambda p: _rewrite_header(p, {"i8": {"dtype": "I8", "shape": [True, 2], "data_offsets": [0, 2]}}),
     "the entry of 'i8' is malformed"),
    (lambda p: p.write_bytes(struct.pack("<Q", 4) + "{}".encode("utf-16-le")), "its header is not UTF-8 JSON"),
    (lambda p: _rewrite_header(p, {"i8": {"dtype": "I8", "shape": {}, "data_offsets": [0, 2]}}),
     "the entry of 'i8' is malformed"),
    (lambda p: _rewrite_header(p, {"empty": {"dtype": "F32", "shape": [0, 10**30], "data_offsets": [0, 0]}}),
     "the entry of 'empty' is malformed"),
], ids=["trailing-bytes", "hole", "metadata-a-list", "dtype-a-list", "shape-a-boolean", "utf-16-header",
        "shape-an-object", "shape-past-64-bits"])
def test_a_file_the_library_refuses_is_refused_too(model: Path, damage, message: str) -> None:
    """Each of these the ``safetensors`` library refuses as well (checked beside it: the oracle)."""
    damage(model)
    with pytest.raises(CheckpointError, match=message):
        SafetensorsFile(model)
    with pytest.raises(Exception):  # noqa: B017 - the library's own error types vary
        with safe_open(str(model), framework="pt") as handle:
            handle.keys()


def test_a_conversion_reads_through_a_bounded_scratch_buffer(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 into fp32, a few elements at a time (the chunk smaller than the tensor): the same values."""
    from fedagent_flwr.checkpoint import safetensors_file

    monkeypatch.setattr(safetensors_file, "SCRATCH_BYTES", 10)  # 5 bf16 values a chunk
    monkeypatch.setattr(safetensors_file._THREAD, "scratch", None, raising=False)
    with SafetensorsFile(model) as file:
        wider = torch.full((18,), float("nan"))
        file.read_into("w.bf16", wider)
        assert torch.equal(wider, TENSORS["w.bf16"].float().reshape(-1))
        assert safetensors_file._THREAD.scratch.numel() == 10
        counts = torch.zeros(12, dtype=torch.float64)
        file.read_into("steps", counts)  # int64 into float64: one value a chunk
        assert torch.equal(counts, TENSORS["steps"].double().reshape(-1))


def test_other_dtypes_the_library_reads_are_read_and_a_model_reader_still_refuses_them(tmp_path: Path) -> None:
    from fedagent_flwr.checkpoint import CheckpointRef, open_checkpoint

    values = torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn)
    save_file({"w": values}, str(tmp_path / "model.safetensors"))
    with SafetensorsFile(tmp_path / "model.safetensors") as file:
        assert file.dtype("w") == torch.float8_e4m3fn
        assert torch.equal(file.get_tensor("w").view(torch.uint8), values.view(torch.uint8))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="'w' has unsupported dtype F8_E4M3"):
        open_checkpoint(CheckpointRef.for_directory(tmp_path), check_hash=False)


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_model_reader_whose_second_file_is_damaged_releases_the_first(tmp_path: Path) -> None:
    from fedagent_flwr.checkpoint import CheckpointRef
    from fedagent_flwr.checkpoint.safetensors_reader import SafetensorsReader

    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-1.safetensors"))
    save_file({"b": torch.zeros(2)}, str(tmp_path / "model-2.safetensors"))
    _rewrite_header(tmp_path / "model-2.safetensors",
                    {"b": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}})
    before = _open_descriptors()
    with pytest.raises(CheckpointError, match="model-2.safetensors is not a readable safetensors file"):
        SafetensorsReader(CheckpointRef(path=str(tmp_path)), tmp_path)
    assert _open_descriptors() == before


def test_a_file_never_closed_gives_its_descriptor_back_when_collected(model: Path) -> None:
    import gc

    before = _open_descriptors()
    file = SafetensorsFile(model)
    assert _open_descriptors() == before + 1
    del file
    gc.collect()
    assert _open_descriptors() == before
