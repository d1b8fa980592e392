"""SafetensorsStreamWriter's streamed sha256 (``sha256=True``) on real files: it equals
hashlib.sha256 of the file written, for several shapes and dtypes (empty, scalar, integer, bool,
half precision, tensors of several MB, more than a background flush apart) and for headers with
and without padding; it is the digest of what was written, not a read of the file afterwards; a file
with late metadata (its header changes at close) and a writer without ``sha256`` give the file's
digest by reading it; there is no digest before a successful close."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedagent_flwr.checkpoint import safetensors_writer
from fedagent_flwr.checkpoint.ref import CheckpointError
from fedagent_flwr.checkpoint.safetensors_writer import LateMetadata, SafetensorsStreamWriter

SEED = 20261205


def _tensors(case: str) -> dict[str, torch.Tensor]:
    """One named set of tensors (seeded)."""
    generator = torch.Generator().manual_seed(SEED)
    if case == "mixed":
        return {
            "w": torch.randn(3, 5, generator=generator),
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 4),
            "ids": torch.arange(7, dtype=torch.int64),
            "mask": torch.rand(9, generator=generator) > 0.5,
            "half": torch.randn(4, 3, generator=generator).to(torch.float16),
            "bf16": torch.randn(2, 2, 3, generator=generator).to(torch.bfloat16),
            "small_int": torch.arange(-3, 3, dtype=torch.int8),
        }
    if case == "large":  # several MB, odd sizes
        big = 1024 * 1024 + 12345
        return {"a": torch.randn(big, generator=generator), "tiny": torch.randn(3, generator=generator),
                "b": torch.randn(big // 7, 7, generator=generator).to(torch.float64)}
    raise AssertionError(case)


def _write(path: Path, tensors: dict[str, torch.Tensor], *, sha256: bool = True,
           late: LateMetadata | None = None) -> SafetensorsStreamWriter:
    entries = [(key, tuple(value.shape), value.dtype) for key, value in tensors.items()]
    with SafetensorsStreamWriter(path, entries, {"format": "pt"}, late, sha256=sha256) as writer:
        for key, value in tensors.items():
            writer.write(key, value)
    return writer


@pytest.mark.parametrize("case", ["mixed", "large"])
def test_the_streamed_digest_is_the_written_files_sha256(tmp_path: Path, case: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # background fdatasyncs between the writes (they flush Python's buffer: the header) change nothing
    monkeypatch.setattr(safetensors_writer, "FLUSH_EVERY", 1024 * 1024)
    tensors = _tensors(case)
    path = tmp_path / "state.safetensors"
    writer = _write(path, tensors)
    assert writer.digest() == hashlib.sha256(path.read_bytes()).digest()
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())  # the file itself is intact


def test_headers_with_and_without_padding_are_hashed_as_written(tmp_path: Path) -> None:
    # The header is padded with spaces to a multiple of 8: key names of eight lengths give every
    # amount of padding, none included.
    paddings = set()
    for length in range(1, 9):
        path = tmp_path / f"k{length}.safetensors"
        writer = _write(path, {"k" * length: torch.arange(6, dtype=torch.float32)})
        data = path.read_bytes()
        header = data[8:8 + int.from_bytes(data[:8], "little")]
        paddings.add(len(header) - len(header.rstrip(b" ")))
        assert writer.digest() == hashlib.sha256(data).digest(), length
    assert 0 in paddings and len(paddings) == 8, paddings


def test_the_digest_is_of_the_bytes_written_not_a_later_read(tmp_path: Path) -> None:
    tensors = _tensors("mixed")
    path = tmp_path / "state.safetensors"
    writer = _write(path, tensors)
    written = hashlib.sha256(path.read_bytes()).digest()
    path.write_bytes(b"something else")  # replaced after close: the streamed digest does not read it
    assert writer.digest() == written


def test_late_metadata_or_no_streaming_read_the_final_file(tmp_path: Path) -> None:
    tensors = _tensors("large")
    late_path = tmp_path / "late.safetensors"
    late = LateMetadata({"fedagent.late": 64}, lambda: {"fedagent.late": "cd" * 32})
    writer = _write(late_path, tensors, late=late)  # the header changed at close: hashed after it
    assert b"cd" * 32 in late_path.read_bytes()[:4096]
    assert writer.digest() == hashlib.sha256(late_path.read_bytes()).digest()
    plain_path = tmp_path / "plain.safetensors"
    plain = _write(plain_path, tensors, sha256=False)
    assert plain.digest() == hashlib.sha256(plain_path.read_bytes()).digest()


def test_no_digest_before_close_or_after_an_abort(tmp_path: Path) -> None:
    path = tmp_path / "state.safetensors"
    writer = SafetensorsStreamWriter(path, [("x", (2,))], sha256=True)
    writer.write("x", torch.zeros(2))
    with pytest.raises(CheckpointError, match="has not closed"):
        writer.digest()
    writer.abort()
    with pytest.raises(CheckpointError, match="has not closed"):
        writer.digest()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_ends_the_writer_so_no_retry_can_write_a_file_its_digest_does_not_describe(
    tmp_path: Path,
) -> None:
    import os

    path = tmp_path / "state.safetensors"
    big = 1 << 20  # past Python's file buffer, so the write reaches the descriptor at once
    writer = SafetensorsStreamWriter(path, [("x", (big,)), ("y", (2,))], sha256=True)
    assert writer._file is not None
    writer._file.flush()
    os.close(writer._file.fileno())  # the descriptor goes away under the writer: its next write fails (EBADF)
    with pytest.raises(OSError):
        writer.write("x", torch.ones(big))
    with pytest.raises(CheckpointError, match="is closed"):  # a retry is refused, not appended
        writer.write("x", torch.ones(big))
    assert list(tmp_path.iterdir()) == []  # the partial file is gone
