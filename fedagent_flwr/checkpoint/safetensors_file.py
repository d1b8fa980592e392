"""One safetensors file read with positioned reads (``os.pread``), never through a memory map.

The ``safetensors`` library maps the file and hands out tensors backed by the map. A file shortened
while it is mapped (a client re-uploading into the same path, a store's retention, a disk filling up
under a copy) then kills the reading process with SIGBUS at the next touch of a page past the new
end: the server dies before any of its checks can name the file. Read with ``pread`` into memory of
our own, the same file gives a short read, which :class:`SafetensorsFile` turns into a
:class:`.CheckpointError` naming the file and the tensor; the callers' stat checks then say what
changed (``verify_content``, the server optimiser state's ``check_unchanged``).

The format (the library's, unchanged): 8 bytes little-endian header length ``n``, ``n`` bytes of
JSON (each tensor's ``dtype``, ``shape`` and ``data_offsets`` into the data that follows; an optional
``__metadata__`` of strings), then the data. The header is checked when the file is opened (offsets
inside the file, each tensor's byte length its shape's), so a file damaged before it was opened is
refused there, as ``safe_open`` refuses it.

Every read returns a tensor that owns its memory: nothing aliases the file. The cost against the
memory map is none measured (benchmarks/safetensors_read.py).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import TracebackType

import torch

from fedagent_flwr.checkpoint.receipts import FileStat
from fedagent_flwr.checkpoint.ref import CheckpointError

__all__ = ["DTYPES", "SafetensorsFile"]

#: The safetensors dtype names this project reads, and their torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

#: The safetensors library's own bound on the header (a larger one is refused, not read).
_MAX_HEADER = 100_000_000


class SafetensorsFile:
    """An open safetensors file: its keys, shapes, dtypes and metadata from the header, and its
    tensors (whole or a range of rows) read with ``pread``. CheckpointError, naming the file, for a
    file that is not a readable safetensors file, a dtype outside :data:`DTYPES`, or a read that
    finds the file shorter than when it was opened."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._closed_stat: FileStat | None = None
        try:
            self._fd: int | None = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{self.path} is not a readable safetensors file ({exc})") from None
        try:
            self._entries, self._metadata = self._read_header()
        except BaseException:
            self.close()
            raise

    def _read_header(self) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], dict[str, str]]:
        """The tensors' (dtype, shape, first byte, end byte) by key, and the metadata; the byte
        positions are the file's (the data offsets plus the header)."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        bad = f"{self.path} is not a readable safetensors file"
        if size < 8:
            raise CheckpointError(f"{bad} (only {size} bytes)")
        length = int.from_bytes(self._pread(0, 8, "the header's length"), "little")
        if length > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{bad} (a header of {length} bytes in a file of {size})")
        try:
            header = json.loads(self._pread(8, length, "the header"))
        except ValueError as exc:
            raise CheckpointError(f"{bad} (its header is not JSON: {exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{bad} (its header is not a JSON object)")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CheckpointError(f"{bad} (its __metadata__ is not a map of strings)")
        start = 8 + length
        entries = {}
        for key, info in header.items():
            try:
                name, shape, (first, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
                if not all(isinstance(n, int) and n >= 0 for n in (*shape, first, end)):
                    raise ValueError("negative or not whole numbers")
            except (TypeError, KeyError, ValueError) as exc:
                raise CheckpointError(f"{bad} (the entry of '{key}' is malformed: {exc!r})") from None
            dtype = DTYPES.get(name)
            if dtype is None:
                raise CheckpointError(f"{self.path}: '{key}' has unsupported dtype {name}")
            nbytes = math.prod(shape) * dtype.itemsize
            if end - first != nbytes or start + end > size:
                raise CheckpointError(f"{bad} ('{key}' of shape {list(shape)} {name} is given bytes {first}:{end} "
                                      f"of data that holds {size - start})")
            entries[key] = (dtype, shape, start + first, start + end)
        return entries, dict(metadata)

    def keys(self) -> list[str]:
        """The tensors' names, sorted (as ``safe_open`` lists them)."""
        return sorted(self._entries)

    def metadata(self) -> dict[str, str]:
        """The header's ``__metadata__`` ({} when it has none)."""
        return dict(self._metadata)

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of ``key``."""
        return self._entry(key)[1]

    def dtype(self, key: str) -> torch.dtype:
        """The stored dtype of ``key``."""
        return self._entry(key)[0]

    def get_tensor(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` in its stored dtype, in memory of its own."""
        dtype, shape, first, end = self._entry(key)
        return self._read(key, first, end - first, dtype).reshape(shape)

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of ``key`` along its first dimension (clipped to it, as a slice is), in
        the stored dtype: only their bytes are read."""
        dtype, shape, first, _ = self._entry(key)
        if not shape:
            raise CheckpointError(f"{self.path}: '{key}' is a scalar; it has no rows")
        start, stop, _ = slice(start, stop).indices(shape[0])
        stop = max(start, stop)
        row = math.prod(shape[1:]) * dtype.itemsize
        return self._read(key, first + start * row, (stop - start) * row, dtype).reshape((stop - start, *shape[1:]))

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Copy ``key`` into ``out`` (same number of elements, any dtype, on the CPU): straight into
        its memory where it is contiguous and of the stored dtype, else through one buffer."""
        dtype, shape, first, end = self._entry(key)
        if out.numel() != math.prod(shape):
            raise CheckpointError(f"{self.path}: '{key}' has shape {list(shape)}, the buffer {list(out.shape)}")
        if out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu" and out.dim() > 0:
            self._read_exact(key, first, out.view(-1).view(torch.uint8).numpy().data)
        else:
            out.copy_(self._read(key, first, end - first, dtype).reshape(out.shape))

    def _entry(self, key: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        try:
            return self._entries[key]
        except KeyError:
            raise CheckpointError(f"{self.path} holds no tensor '{key}'") from None

    def _read(self, key: str, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """``nbytes`` from ``offset`` as a flat tensor of ``dtype``."""
        raw = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self._read_exact(key, offset, raw.numpy().data)
        return raw.view(dtype)

    def _read_exact(self, key: str, offset: int, into: memoryview) -> None:
        """Fill ``into`` from ``offset``; CheckpointError when the file ends first."""
        if self._fd is None:
            raise CheckpointError(f"{self.path} is closed; '{key}' cannot be read")
        done = 0
        while done < len(into):
            try:
                got = os.preadv(self._fd, [into[done:]], offset + done)
            except OSError as exc:
                raise CheckpointError(f"{self.path}: cannot read '{key}' ({exc})") from None
            if got == 0:
                raise CheckpointError(
                    f"{self.path}: '{key}' ends at byte {offset + len(into)}, the file now ends at byte "
                    f"{offset + done}: it was shortened after it was opened. Something else writes this "
                    "file: stop it and restore the file")
            done += got

    def _pread(self, offset: int, nbytes: int, what: str) -> bytes:
        """``nbytes`` of the header from ``offset`` (CheckpointError when the file ends first)."""
        assert self._fd is not None
        try:
            data = os.pread(self._fd, nbytes, offset)
        except OSError as exc:
            raise CheckpointError(f"{self.path} is not a readable safetensors file ({exc})") from None
        if len(data) != nbytes:
            raise CheckpointError(f"{self.path} is not a readable safetensors file (it ends inside {what})")
        return data

    def held_stat(self) -> FileStat:
        """The stat of the file read, through the descriptor it is read from (as it was when closed,
        once closed): what a check after the reads compares with the stat its digest was taken at."""
        if self._fd is None:
            assert self._closed_stat is not None  # set by close()
            return self._closed_stat
        return FileStat.of(os.fstat(self._fd))

    def close(self) -> None:
        """Release the file (again: nothing)."""
        if self._fd is not None:
            self._closed_stat = FileStat.of(os.fstat(self._fd))
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
