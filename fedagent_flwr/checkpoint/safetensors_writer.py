"""Write a ``.safetensors`` file one tensor at a time.

``safetensors.torch.save_file`` wants the whole state dict in memory; an aggregated model is
produced key by key, so this writer takes the list of (key, shape[, dtype]) up front, writes the
header (which fixes every tensor's byte range) and then accepts the tensors in that order. Memory
is one tensor. The file is written under a temporary name, fsynced and renamed, so a reader never
sees a partial file under the final name. Every ``FLUSH_EVERY`` bytes a helper thread starts
``fdatasync`` on what was written so far, so the disk writes it while the next tensors are being
computed, and the fsync in :meth:`SafetensorsStreamWriter.close` has little left to wait for.

**Late metadata.** A header entry whose value is known only once every tensor is written (the
content hash of a file written alongside: a server optimiser's state, recorded in the global
model's header) is declared up front with its length (:class:`LateMetadata`); the header holds a
placeholder of that length and :meth:`SafetensorsStreamWriter.close` overwrites it in place before
the file is flushed and renamed, so no byte offset moves and no reader ever sees the placeholder.

**Streamed sha256.** With ``sha256=True`` the writer hashes every byte it writes, in file order
(length prefix, header with its padding, each tensor), as it writes it, so
:meth:`SafetensorsStreamWriter.digest` gives the file's sha256 without reading the file back (a
server optimiser's state: ~56 GB for a 7B model with Adam, once a round). Nothing else changes the
file: tensors are appended back to back, nothing is preallocated or seeked over. The hash runs
inline, before each tensor's write (hashing on a helper thread during the write measured no
faster on a 2-core machine, within noise, so the simpler way stayed). A file with late metadata
cannot be hashed this way: sha256 is sequential and the header, which comes first, changes at
close; its digest is read back from the file instead.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length, a JSON
header ``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` padded
with spaces to a multiple of 8, then the raw little-endian tensor bytes back to back.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import torch

from fedagent_flwr.atomic import fsync_dir
from fedagent_flwr.checkpoint.content_hash import file_digest
from fedagent_flwr.checkpoint.ref import CheckpointError

__all__ = ["SAFETENSORS_DTYPE_NAMES", "LateMetadata", "SafetensorsStreamWriter"]

SAFETENSORS_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

TensorSpec = tuple[str, Sequence[int]] | tuple[str, Sequence[int], torch.dtype]

#: Bytes written between two background ``fdatasync`` calls (one in flight at a time).
FLUSH_EVERY = 64 * 1024 * 1024


@dataclass(frozen=True)
class LateMetadata:
    """Header entries filled in when the file is closed (module docstring).

    ``lengths`` maps each key to the exact length of its value (the header keeps its size);
    ``values`` is called once by :meth:`SafetensorsStreamWriter.close`, after the last tensor and
    before the flush and rename, and returns every key's value: printable ASCII without ``"`` or
    ``\\`` (JSON would escape those and change the length), e.g. a hex digest. A failure in it, or a
    value of another length, aborts the file.
    """

    lengths: Mapping[str, int]
    values: Callable[[], Mapping[str, str]]


class SafetensorsStreamWriter:
    """Streams tensors into a safetensors file whose header is written first.

    Usage::

        with SafetensorsStreamWriter(path, [("a", (2, 3)), ("b", (4,))]) as writer:
            writer.write("a", tensor_a)
            writer.write("b", tensor_b)
        # the file appears at ``path`` only if every tensor was written and no error occurred

    Entries default to fp32; a third item gives another dtype (e.g. an integer buffer).
    ``sha256=True`` hashes the bytes as they are written (module docstring, "Streamed sha256"):
    :meth:`digest` after :meth:`close`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        entries: Sequence[TensorSpec],
        metadata: Mapping[str, str] | None = None,
        late: LateMetadata | None = None,
        sha256: bool = False,
    ) -> None:
        if sys.byteorder != "little":  # safetensors is little-endian; tensors are written raw
            raise CheckpointError("the streaming safetensors writer needs a little-endian host")
        self.path = Path(path)
        self._tmp = self.path.with_name(f".{self.path.name}.partial-{os.getpid()}")
        self._order: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []
        fields = dict(metadata or {"format": "pt"})
        self._late = late
        for key, length in (late.lengths.items() if late is not None else ()):
            if key in fields or length < 1:
                raise CheckpointError(f"late metadata '{key}' of {self.path} is also given a value, or has no length")
            fields[key] = "0" * length  # the placeholder close() overwrites
        header: dict[str, object] = {"__metadata__": fields}
        offset = 0
        for entry in entries:
            key, shape = entry[0], tuple(int(s) for s in entry[1])
            dtype = entry[2] if len(entry) > 2 else torch.float32  # type: ignore[misc]
            if key in header:
                raise CheckpointError(f"duplicate tensor name '{key}' for {self.path}")
            if dtype not in SAFETENSORS_DTYPE_NAMES:
                raise CheckpointError(f"dtype {dtype} of '{key}' cannot be written to safetensors")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[key] = {
                "dtype": SAFETENSORS_DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._order.append((key, shape, dtype, nbytes))
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
        # Where each late value's placeholder sits in the file: '"key":"' cannot occur inside another
        # string of the header (JSON escapes a quote there), so the first match is the entry itself.
        self._late_at: dict[str, int] = {}
        for key, length in (late.lengths.items() if late is not None else ()):
            placed = (json.dumps(key) + ":" + json.dumps("0" * length)).encode()
            self._late_at[key] = 8 + encoded.index(placed) + len(placed) - 1 - length
        self._next = 0
        self._unflushed = 0  # bytes written since the last background fdatasync began
        self._flusher: ThreadPoolExecutor | None = None
        self._flushing: Future[None] | None = None
        # Streamed only when the header is final now: late metadata changes it at close (digest()).
        self._hashing: Any = hashlib.sha256() if sha256 and late is None else None
        self._sha256: bytes | None = None  # the file's digest, once closed and asked for or streamed
        self._closed = False
        self._file: BinaryIO | None = open(self._tmp, "wb")
        try:
            prefix = struct.pack("<Q", len(encoded)) + encoded
            self._file.write(prefix)
            if self._hashing is not None:
                self._hashing.update(prefix)
        except BaseException:
            self.abort()
            raise

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Append the next tensor; it must be the next key in order, with its shape and dtype."""
        if self._file is None:
            raise CheckpointError(f"writer for {self.path} is closed")
        if self._next >= len(self._order):
            raise CheckpointError(f"'{key}' is one tensor too many for {self.path}")
        want_key, shape, dtype, nbytes = self._order[self._next]
        if key != want_key:
            raise CheckpointError(f"expected tensor '{want_key}' next in {self.path}, got '{key}'")
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointError(
                f"'{key}' has shape {tuple(tensor.shape)} / {tensor.dtype}, the header promises "
                f"{shape} / {dtype}"
            )
        data = tensor.detach().to("cpu").contiguous()
        if nbytes:
            view = memoryview(data.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer
            try:
                if self._hashing is not None:  # the bytes the file gets, in its order (module docstring)
                    self._hashing.update(view)
                self._file.write(view)
                self._unflushed += nbytes
                if self._unflushed >= FLUSH_EVERY:
                    self._flush_in_background()
            except BaseException:
                # Part of the tensor may be in the file and all of it in the hash: a retried write
                # would leave a corrupt file whose digest is not its sha256, so the writer ends here.
                self.abort()
                raise
        self._next += 1

    def _flush_in_background(self) -> None:
        """Start writing what the page cache holds of the file to disk, unless a flush is still
        running (the next write tries again): the writes overlap the computation instead of
        piling up for the final fsync."""
        if self._file is None or (self._flushing is not None and not self._flushing.done()):
            return
        if self._flushing is not None:
            self._flushed()  # a failed flush is raised here
        self._file.flush()  # Python's buffer into the kernel's (the header; tensors go direct)
        if self._flusher is None:
            self._flusher = ThreadPoolExecutor(1, thread_name_prefix="safetensors-flush")
        self._flushing = self._flusher.submit(os.fdatasync, self._file.fileno())
        self._unflushed = 0

    def _flushed(self) -> None:
        """Wait for the background flush; its failure is raised naming the file written."""
        assert self._flushing is not None
        try:
            self._flushing.result()
        except OSError as exc:
            raise OSError(exc.errno, f"{self._tmp}: background fdatasync failed: {exc.strerror or exc}") from exc

    def _stop_flushing(self) -> None:
        """Wait for the background flush (it uses the descriptor) and end its thread; its error,
        if any, is raised."""
        try:
            if self._flushing is not None:
                self._flushed()
        finally:
            self._flushing = None
            if self._flusher is not None:
                self._flusher.shutdown()
                self._flusher = None

    def close(self) -> Path:
        """Check every tensor was written, flush to disk and move the file into place."""
        if self._file is None:
            raise CheckpointError(f"writer for {self.path} is already closed")
        if self._next != len(self._order):
            missing = self._order[self._next][0]
            self.abort()
            raise CheckpointError(
                f"{self.path}: only {self._next} of {len(self._order)} tensors written "
                f"(next was '{missing}')"
            )
        try:
            self._fill_late_metadata()
            self._stop_flushing()
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        fsync_dir(self.path.parent)
        self._closed = True
        if self._hashing is not None:
            self._sha256 = bytes(self._hashing.digest())
            self._hashing = None
        return self.path

    def digest(self) -> bytes:
        """sha256 (raw digest) of the file as :meth:`close` left it under :attr:`path`.

        Streamed with ``sha256=True`` (no read of the file: a change to the file after close is
        not seen here, which is the point: it is the digest of what this writer wrote); otherwise,
        and for a file with late metadata, the file is read once, on the first call."""
        if not self._closed:
            raise CheckpointError(f"writer for {self.path} has not closed the file (its digest is not final)")
        if self._sha256 is None:
            self._sha256 = file_digest(self.path)
        return self._sha256

    def _fill_late_metadata(self) -> None:
        """Overwrite the late entries' placeholders with their values (LateMetadata)."""
        if self._late is None or self._file is None:
            return
        values = dict(self._late.values())
        if set(values) != set(self._late_at):
            raise CheckpointError(f"late metadata of {self.path}: got {sorted(values)}, "
                                  f"declared {sorted(self._late_at)}")
        self._file.flush()  # the buffered bytes go first: the overwrite must not be overwritten
        for key, value in values.items():
            length = self._late.lengths[key]
            if len(value) != length or not all(32 <= ord(ch) < 127 and ch not in '"\\' for ch in value):
                raise CheckpointError(f"late metadata '{key}' of {self.path} must be {length} printable ASCII "
                                      f"characters without quotes or backslashes, got {value[:80]!r}")
            os.pwrite(self._file.fileno(), value.encode(), self._late_at[key])

    def abort(self) -> None:
        """Drop the partial file."""
        try:
            self._stop_flushing()
        except OSError:  # the file is dropped anyway
            pass
        if self._file is not None:
            file, self._file = self._file, None  # closed for good even if close() fails below
            try:
                file.close()
            except OSError:  # e.g. the descriptor already failed: the file is dropped anyway
                pass
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsStreamWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif self._file is not None:
            self.close()
