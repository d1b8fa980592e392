"""One safetensors file read with positioned reads (``os.pread``), never through a memory map.

The ``safetensors`` library maps the file and hands out tensors backed by the map. A file shortened
while it is mapped (a client re-uploading into the same path, a store's retention, a disk filling up
under a copy) then kills the reading process with SIGBUS at the next touch of a page past the new
end: the server dies before any of its checks can name the file. Read with ``pread`` into memory of
our own, the same file gives a short read, which :class:`SafetensorsFile` turns into a
:class:`.CheckpointError` naming the file and the tensor; the callers' stat checks then say what
changed (``verify_content``, the server optimiser state's ``check_unchanged``).

The format (the library's, unchanged): 8 bytes little-endian header length ``n``, ``n`` bytes of
UTF-8 JSON (each tensor's ``dtype``, ``shape`` and ``data_offsets`` into the data that follows; an
optional ``__metadata__`` of strings), then the data. The header is checked when the file is opened
as the library checks it (each tensor's byte length its shape's, the tensors covering the data
without holes or overlaps, up to the file's end), so a file damaged before it was opened is refused
there, by name.

Every read returns a tensor that owns its memory: nothing aliases the file. A read into a buffer of
another dtype (a bf16 file into the mean's fp32 buffer) goes through one bounded scratch buffer
per thread, reused, so it allocates nothing per read. Measured against the memory map:
docs/performance.md, "Safetensors files read with positioned reads".
"""

from __future__ import annotations

import json
import math
import os
import threading
import weakref
from pathlib import Path
from types import TracebackType

import torch

from fedagent_flwr.checkpoint.receipts import FileStat
from fedagent_flwr.checkpoint.ref import CheckpointError

__all__ = ["DTYPES", "MODEL_DTYPES", "SafetensorsFile"]

#: The safetensors dtype names and their torch dtypes (those this torch has; a reader may accept
#: fewer: :data:`MODEL_DTYPES`). ``F4`` (two values packed in a byte) is refused: no item size.
DTYPES: dict[str, torch.dtype] = {
    name: dtype for name, dtype in {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
        "U64": getattr(torch, "uint64", None), "U32": getattr(torch, "uint32", None),
        "U16": getattr(torch, "uint16", None), "U8": torch.uint8, "BOOL": torch.bool,
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None), "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None),
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None), "C64": torch.complex64,
    }.items() if dtype is not None
}

#: The dtypes a model's weights (a checkpoint, an adapter's factors) may have: float8, wide unsigned
#: and complex tensors are refused when a model is opened, since nothing here averages them.
MODEL_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                          torch.int16, torch.int8, torch.uint8, torch.bool})

#: The safetensors library's own bound on the header (a larger one is refused, not read).
_MAX_HEADER = 100_000_000
#: Bytes of the scratch buffer a conversion to another dtype reads through (one per thread, reused:
#: bounded memory however many files are open, and no allocation per read).
SCRATCH_BYTES = 16 << 20
_THREAD = threading.local()

_Entry = tuple[torch.dtype, tuple[int, ...], int, int]


class SafetensorsFile:
    """An open safetensors file: its keys, shapes, dtypes and metadata from the header, and its
    tensors (whole or a range of rows) read with ``pread``. CheckpointError, naming the file, for a
    file that is not a readable safetensors file, a dtype outside :data:`DTYPES`, or a read that
    finds the file shorter than when it was opened."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._closed_stat: FileStat | str | None = None
        try:
            self._fd: int | None = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{self.path} is not a readable safetensors file ({exc})") from None
        # A file never closed (a caller's bug) still gives its descriptor back when collected.
        self._finalizer = weakref.finalize(self, os.close, self._fd)
        try:
            self._entries, self._metadata = self._read_header()
        except BaseException:
            self.close()
            raise

    def _read_header(self) -> tuple[dict[str, _Entry], dict[str, str]]:
        """The tensors' (dtype, shape, first byte, end byte) by key, and the metadata; the byte
        positions are the file's (the data offsets plus the header)."""
        bad = f"{self.path} is not a readable safetensors file"
        try:
            size = os.fstat(self._open_fd("the header")).st_size
        except OSError as exc:
            raise CheckpointError(f"{bad} ({exc})") from None
        if size < 8:
            raise CheckpointError(f"{bad} (only {size} bytes)")
        length = int.from_bytes(self._header_bytes(0, 8, "the header's length"), "little")
        if length > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{bad} (a header of {length} bytes in a file of {size})")
        try:
            header = json.loads(self._header_bytes(8, length, "the header").decode("utf-8"))
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError alike
            raise CheckpointError(f"{bad} (its header is not UTF-8 JSON: {exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{bad} (its header is not a JSON object)")
        metadata = header.pop("__metadata__", None)
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CheckpointError(f"{bad} (its __metadata__ is not a map of strings)")
        start = 8 + length
        entries: dict[str, _Entry] = {}
        for key, info in header.items():
            try:
                name, shape, (first, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
                # lists of whole numbers that fit 64 bits (type(n) is int: JSON's true and false are
                # ints to isinstance), as the library requires
                if not isinstance(name, str) or type(info["shape"]) is not list or type(
                        info["data_offsets"]) is not list or not all(
                        type(n) is int and 0 <= n < 1 << 63 for n in (*shape, first, end)):
                    raise ValueError("a dtype that is not a name, or a shape or offsets that are not lists of "
                                     "whole numbers in [0, 2**63)")
            except (TypeError, KeyError, ValueError) as exc:
                raise CheckpointError(f"{bad} (the entry of '{key}' is malformed: {exc!r})") from None
            dtype = DTYPES.get(name)
            if dtype is None:
                raise CheckpointError(f"{self.path}: '{key}' has unsupported dtype {name}")
            if end - first != math.prod(shape) * dtype.itemsize:
                raise CheckpointError(f"{bad} ('{key}' of shape {list(shape)} {name} is given bytes {first}:{end})")
            entries[key] = (dtype, shape, start + first, start + end)
        # The data as the library requires it: the tensors end to end from its start, up to the file's end.
        covered = start
        for key, (_, _, first, end) in sorted(entries.items(), key=lambda item: (item[1][2], item[1][3])):
            if first != covered:
                raise CheckpointError(f"{bad} ('{key}' starts at data byte {first - start}, not {covered - start}: "
                                      "the tensors leave a hole or overlap)")
            covered = end
        if covered != size:
            raise CheckpointError(f"{bad} (its tensors cover {covered - start} bytes of data, the file holds "
                                  f"{size - start})")
        return entries, metadata

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
        its memory where it is contiguous and of the stored dtype, else through this thread's scratch
        buffer, :data:`SCRATCH_BYTES` at a time."""
        dtype, shape, first, end = self._entry(key)
        if out.numel() != math.prod(shape):
            raise CheckpointError(f"{self.path}: '{key}' has shape {list(shape)}, the buffer {list(out.shape)}")
        if not out.is_contiguous() or out.device.type != "cpu" or out.dim() == 0:
            out.copy_(self._read(key, first, end - first, dtype).reshape(out.shape))
        elif out.dtype == dtype:
            self._read_exact(key, first, out.view(-1).view(torch.uint8).numpy().data)
        else:
            flat, size = out.view(-1), dtype.itemsize
            step = max(1, SCRATCH_BYTES // size)
            scratch = _scratch(min(step, flat.numel()) * size)
            for index in range(0, flat.numel(), step):
                count = min(step, flat.numel() - index)
                chunk = scratch[:count * size]
                self._read_exact(key, first + index * size, chunk.numpy().data)
                flat[index:index + count].copy_(chunk.view(dtype))

    def _entry(self, key: str) -> _Entry:
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
        done = self._fill(into, offset, f"'{key}'")
        if done < len(into):
            raise CheckpointError(
                f"{self.path}: '{key}' ends at byte {offset + len(into)}, the file now ends at byte "
                f"{offset + done}: it was shortened after it was opened. Something else writes this "
                "file: stop it and restore the file")

    def _header_bytes(self, offset: int, nbytes: int, what: str) -> bytes:
        """``nbytes`` of the header from ``offset`` (CheckpointError when the file ends first)."""
        data = bytearray(nbytes)
        if self._fill(memoryview(data), offset, what) < nbytes:
            raise CheckpointError(f"{self.path} is not a readable safetensors file (it ends inside {what})")
        return bytes(data)

    def _fill(self, into: memoryview, offset: int, what: str) -> int:
        """Read into ``into`` from ``offset`` until it is full or the file ends; the bytes read."""
        fd = self._open_fd(what)
        done = 0
        while done < len(into):
            try:
                got = os.preadv(fd, [into[done:]], offset + done)
            except OSError as exc:
                raise CheckpointError(f"{self.path}: cannot read {what} ({exc})") from None
            if got == 0:
                break
            done += got
        return done

    def _open_fd(self, what: str) -> int:
        if self._fd is None:
            raise CheckpointError(f"{self.path} is closed; {what} cannot be read")
        return self._fd

    def held_stat(self) -> FileStat | str:
        """The stat of the file read, through the descriptor it is read from (as it was when closed,
        once closed): what a check after the reads compares with the stat its digest was taken at.
        ``"unreadable (<reason>)"`` where the descriptor cannot be stat'ed (which no stat equals)."""
        if self._fd is None:
            return self._closed_stat if self._closed_stat is not None else "unreadable (closed before its stat)"
        try:
            return FileStat.of(os.fstat(self._fd))
        except OSError as exc:
            return f"unreadable ({exc.strerror})"

    def close(self) -> None:
        """Release the file (again: nothing); its stat is kept for :meth:`held_stat`."""
        if self._fd is None:
            return
        try:
            self._closed_stat = self.held_stat()
        finally:
            self._fd = None
            try:
                self._finalizer()  # closes the descriptor, once
            except OSError:  # (EIO on NFS, say) the descriptor is released all the same
                pass

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def _scratch(nbytes: int) -> torch.Tensor:
    """This thread's scratch buffer, at least ``nbytes`` long (grown as needed, up to
    :data:`SCRATCH_BYTES`: the callers never ask for more)."""
    buffer: torch.Tensor | None = getattr(_THREAD, "scratch", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _THREAD.scratch = torch.empty(nbytes, dtype=torch.uint8)
    return buffer
