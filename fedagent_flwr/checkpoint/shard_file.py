"""One verl/FSDP rank file (``model_world_size_W_rank_R.pt``): its structure and its bytes.

A rank file is a ``torch.save`` zip of a state dict whose values are DTensors (FSDP2, and FSDP1
as verl configures it), plain tensors (world size 1, replicated buffers) or, in older FSDP1
set-ups, ``ShardedTensor``s. The aggregation must read many such files without holding a model
in memory, so a rank file is opened in two steps:

1. the pickle is loaded with ``map_location="meta"`` and ``weights_only=True``: this yields the
   full structure (global shapes, placements, mesh coordinates, shard offsets) and, per storage,
   its byte offset inside the zip, while reading no tensor data;
2. the bytes of one local block are read on demand with plain positioned reads into freshly
   allocated memory, which is freed once the caller is done with it.

Reading with ``read()`` rather than through an ``mmap`` keeps the resident set bounded: touched
pages of a file mapping count towards RSS until the mapping goes away, so streaming a 2 GB set of
shards through ``mmap`` shows up as a 2 GB process. It also turns a file truncated after opening
into a clean error instead of a SIGBUS. If a torch version stops exposing the storage offsets the
file falls back to ``torch.load(mmap=True)`` (same results, higher RSS).

The file is opened once; its structure, blocks and digest come from that open file, never from the
path again, and :attr:`ShardFile.opened_stat` (its fstat) is what a store's receipt must match.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import zipfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from fedagent_flwr.checkpoint.content_hash import FileHashStream, file_digest
from fedagent_flwr.checkpoint.receipts import FileStat
from fedagent_flwr.checkpoint.ref import CheckpointError
from fedagent_flwr.checkpoint.sharded_stub import SHARDED_TENSOR_GLOBALS, ShardedTensorStub

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

IoMode = Literal["auto", "pread", "mmap"]
PieceKind = Literal["plain", "dtensor", "sharded"]

_READ_CHUNK = 64 * 1024 * 1024
#: Smaller chunks when hashing while reading, so that reading and hashing overlap.
_HASHED_READ_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class Piece:
    """A block of a global tensor stored in one rank file, and where it sits in the full tensor."""

    offsets: tuple[int, ...]  # start index of the block along every dimension of the global tensor
    shape: tuple[int, ...]
    tensor: torch.Tensor  # meta (pread mode) or memory-mapped (mmap mode) view of the stored block


@dataclass(frozen=True)
class Entry:
    """What one rank file stores for one state-dict key.

    ``kind`` says how the rank's data relates to the global tensor:
    ``plain`` - the whole tensor (world size 1 or replicated);
    ``dtensor`` - one block of a DTensor; ``placements`` has one item per mesh dimension, either
    ``("shard", tensor_dim)`` or ``("replicate", -1)``; ``coordinate`` is the saving rank's position
    in the mesh; the block's offsets are only known once all ranks are seen;
    ``sharded`` - a ShardedTensor, whose local shards carry their own offsets.
    """

    key: str
    kind: PieceKind
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
    placements: tuple[tuple[str, int], ...] = ()
    mesh_shape: tuple[int, ...] = ()
    coordinate: tuple[int, ...] = ()


class ShardFile:
    """Structure and lazy block reads of one ``model_world_size_W_rank_R.pt`` file."""

    def __init__(self, path: str | os.PathLike[str], io: IoMode = "auto", hash_while_reading: bool = False) -> None:
        """Parse the file's structure; with ``hash_while_reading`` its sha256 is computed from the
        blocks read (:meth:`content_digest`) rather than by a separate read of the file."""
        self.path = Path(path)
        self.bytes_read = 0
        self._mmapped: dict[str, Entry] | None = None
        self.hash_stream: FileHashStream | None = None
        self._hash_pool: ThreadPoolExecutor | None = None
        self._closed_stat: FileStat | None = None
        self._handle: Any = open(self.path, "rb")
        try:
            self._open(io, hash_while_reading)
        except BaseException:
            self.close()
            raise

    def _open(self, io: IoMode, hash_while_reading: bool) -> None:
        #: The stat of the file opened (not of whatever the path leads to later).
        self.opened_stat = FileStat.of(os.fstat(self._handle.fileno()))
        self._size = self.opened_stat.size
        self._check_zip()
        self._handle.seek(0)
        state = _load_state(self._handle, self.path, map_location="meta")
        self.entries: dict[str, Entry] = {}
        self.skipped: list[str] = []  # non-tensor values (e.g. ``_extra_state``); never averaged
        for key, value in state.items():
            entry = _parse_entry(self.path, key, value)
            if entry is None:
                self.skipped.append(key)
            else:
                self.entries[key] = entry
        has_offsets = all(
            getattr(p.tensor.untyped_storage(), "_checkpoint_offset", None) is not None
            for e in self.entries.values()
            for p in e.pieces
        )
        if io == "pread" and not has_offsets:
            raise CheckpointError(
                f"{self.path}: this torch version does not expose storage offsets; use io='mmap'"
            )
        self.io: Literal["pread", "mmap"] = "pread" if io in ("auto", "pread") and has_offsets else "mmap"
        if hash_while_reading:
            self.start_hashing()

    def start_hashing(self) -> None:
        """Hash the file from the blocks read (pread mode, before the first read; mmap mode hashes
        the whole open file in :meth:`content_digest`), e.g. when a receipt no longer vouches for it."""
        if self.io == "pread" and self.hash_stream is None:
            self.hash_stream = FileHashStream(self._handle.fileno(), self._size)

    # -- reading --------------------------------------------------------------------------------
    def read_piece(self, key: str, index: int) -> torch.Tensor:
        """Return block ``index`` of ``key`` as a new CPU tensor in its stored dtype."""
        piece = self.entries[key].pieces[index]
        if self.io == "mmap":
            data = self._mmap_piece(key, index).clone(memory_format=torch.contiguous_format)
            self.bytes_read += data.numel() * data.element_size()
            return data
        meta = piece.tensor
        out = torch.empty(meta.shape, dtype=meta.dtype)
        if meta.numel() == 0:
            return out
        if meta.is_contiguous():
            self._pread_into(meta, out)
            return out
        # A non-contiguous view: read the span of storage it covers, then gather through strides.
        span = 1 + sum((s - 1) * st for s, st in zip(meta.shape, meta.stride()))
        flat = torch.empty(span, dtype=meta.dtype)
        self._pread_into(meta, flat, span_elements=span)
        base = flat.as_strided(meta.shape, meta.stride(), 0)
        out.copy_(base)
        return out

    def read_piece_into(
        self, key: str, index: int, out: torch.Tensor, pending: list[Future[None]] | None = None
    ) -> None:
        """Write block ``index`` of ``key`` into ``out`` (same shape; dtype converted if needed).

        When the stored block is contiguous, has ``out``'s dtype and ``out`` is contiguous, the
        bytes go straight from the file into ``out``: no intermediate copy. Then, with a
        ``pending`` list, the hashing of those bytes (when the file is hashed while read) may still
        be running on return: its futures are appended to ``pending``, and ``out`` must be neither
        modified nor reused before :func:`wait_hashed` has returned for them. Without ``pending``
        (and on the converting paths, whose temporary buffer would otherwise be hashed after it
        is gone) every byte is hashed before this returns.
        """
        piece = self.entries[key].pieces[index]
        if tuple(out.shape) != piece.shape:
            raise CheckpointError(
                f"{self.path}: block of '{key}' has shape {piece.shape}, expected {tuple(out.shape)}"
            )
        meta = piece.tensor
        if self.io == "mmap":
            source = self._mmap_piece(key, index)
            out.copy_(source)
            self.bytes_read += source.numel() * source.element_size()
            return
        if (
            meta.numel() > 0
            and meta.is_contiguous()
            and meta.dtype == out.dtype
            and out.is_contiguous()
        ):
            futures = self._pread_into(meta, out, defer=pending is not None)
            if pending is not None:
                pending.extend(futures)
            return
        out.copy_(self.read_piece(key, index))

    def _pread_into(
        self, meta: torch.Tensor, out: torch.Tensor, span_elements: int | None = None, defer: bool = False
    ) -> list[Future[None]]:
        """Read ``meta``'s bytes into ``out``; with ``defer``, return the hashing still in flight
        (else wait for it and return nothing pending)."""
        storage = meta.untyped_storage()
        itemsize = meta.element_size()
        count = meta.numel() if span_elements is None else span_elements
        nbytes = count * itemsize
        first = meta.storage_offset() * itemsize
        if first + nbytes > storage.nbytes():
            raise CheckpointError(f"{self.path}: a tensor view runs past the end of its storage")
        start = storage._checkpoint_offset + first  # type: ignore[attr-defined,operator]  # set on every storage we map
        if start + nbytes > self._size:
            raise CheckpointError(
                f"{self.path} is truncated: a tensor needs bytes up to {start + nbytes}, "
                f"the file has {self._size}"
            )
        target = memoryview(out.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer
        if len(target) < nbytes:  # defensive: the caller sized ``out`` from ``meta``
            raise CheckpointError(f"{self.path}: destination too small for a tensor block")
        handle = self._handle
        handle.seek(start)
        # With the hash on, a helper thread hashes each chunk while the next one is read (both
        # release the GIL), so on a cold cache the hash hides behind the disk; one worker keeps
        # the chunks in file order. Unless deferred, every chunk is hashed before ``out`` is
        # handed back; deferred, the caller waits (``wait_hashed``) before reusing ``out``.
        stream = self.hash_stream
        chunk = _HASHED_READ_CHUNK if stream is not None else _READ_CHUNK
        pending: list[Future[None]] = []
        done = 0
        try:
            while done < nbytes:
                got = handle.readinto(target[done : min(nbytes, done + chunk)])
                if not got:
                    raise CheckpointError(f"{self.path} is truncated (short read at byte {start + done})")
                if stream is not None:
                    pending.append(self._hasher().submit(stream.feed, int(start) + done, target[done : done + got]))
                done += got
        except BaseException:
            # The chunks in flight still read ``out``: wait for them before the error leaves (it
            # stays the one raised, not a hashing error behind it).
            for future in pending:
                future.exception()
            raise
        self.bytes_read += nbytes
        if defer:
            return pending
        wait_hashed(pending, self.path)
        return []

    def _hasher(self) -> ThreadPoolExecutor:
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")
        return self._hash_pool

    def content_digest(self) -> bytes:
        """sha256 of the file opened: the blocks read plus the bytes they left out when hashed while
        reading, else the whole open file (mmap mode); after close, the file at the path."""
        if self._handle is None:
            return file_digest(self.path)
        if self.hash_stream is not None:
            # Through the hashing thread: after every chunk still queued, in file order.
            return self._hasher().submit(self.hash_stream.finish).result()
        # From the open descriptor, not the path: the path may lead to another file by now.
        return FileHashStream(self._handle.fileno(), self._size).finish()

    def held_stat(self) -> FileStat:
        """The open file's stat now (or when closed): a receipt must still match it after the reads."""
        if self._handle is None:
            assert self._closed_stat is not None  # set by close()
            return self._closed_stat
        return FileStat.of(os.fstat(self._handle.fileno()))

    def _reopen_path(self) -> Path:
        """A path that opens the file already open, for ``torch.load(mmap=True)`` (which takes only a
        path): ``/proc/self/fd/<fd>`` (Linux) or ``/dev/fd/<fd>`` (macOS) opens the very inode held
        even if the path was swapped or removed since, so the mapping shows the bytes whose stat
        :attr:`opened_stat` recorded. Elsewhere the path is the fallback, and a swap of the path
        between the open and the first read goes unnoticed there."""
        fd = self._handle.fileno()
        return next((p for p in (Path(f"/proc/self/fd/{fd}"), Path(f"/dev/fd/{fd}")) if p.exists()), self.path)

    def _mmap_piece(self, key: str, index: int) -> torch.Tensor:
        if self._mmapped is None:
            state = _load_state(self._reopen_path(), self.path, map_location="cpu", mmap=True)
            self._mmapped = {}
            for k, v in state.items():
                entry = _parse_entry(self.path, k, v)
                if entry is not None:
                    self._mmapped[k] = entry
        return self._mmapped[key].pieces[index].tensor

    def close(self) -> None:
        """Release the file handle and any memory mapping."""
        if self._hash_pool is not None:  # first: no hashing task may outlive the descriptor
            self._hash_pool.shutdown()
            self._hash_pool = None
        if self._handle is not None:
            try:
                self._closed_stat = FileStat.of(os.fstat(self._handle.fileno()))
            finally:
                self._handle.close()
                self._handle = None
        self._mmapped = None

    # -- validation -----------------------------------------------------------------------------
    def _check_zip(self) -> None:
        # torch.load reports a truncated or foreign file with a raw zip/pickle error: name the file.
        try:
            with zipfile.ZipFile(self._handle) as archive:  # the open file; closing leaves it open
                for info in archive.infolist():
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise CheckpointError(f"{self.path}: record {info.filename} is compressed")
                    if info.filename.endswith("/byteorder") or info.filename == "byteorder":
                        order = archive.read(info).decode(errors="replace")
                        if order != "little":
                            raise CheckpointError(f"{self.path}: byte order '{order}' is not supported")
                    # weights_only loads DTensors once torch.distributed.tensor is imported (~1.4 s of CPU):
                    # only for a pickle that names torch.distributed classes (plain tensors never do).
                    if info.filename.rsplit("/", 1)[-1] == "data.pkl" and b"torch.distributed" in archive.read(info):
                        importlib.import_module("torch.distributed.tensor")
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise CheckpointError(
                f"{self.path} is not a readable torch checkpoint (truncated or corrupt: {exc})"
            ) from None


def wait_hashed(pending: list[Future[None]], path: Path) -> None:
    """Wait for hashing work returned by a deferred read; CheckpointError naming ``path`` if any
    of it failed (the first error)."""
    errors = [future.exception() for future in pending]
    failure = next((e for e in errors if e is not None), None)
    if failure is not None:
        raise CheckpointError(f"{path}: hashing while reading failed: {failure}") from failure


# ---------------------------------------------------------------------------------------------
# Loading and parsing


def _load_state(source: Path | Any, path: Path, map_location: str, mmap: bool = False) -> dict[str, Any]:
    """Unpickle the state dict of ``source`` (an open binary file, or a path when ``mmap``);
    errors name ``path``."""
    try:
        with _quiet_device_mesh(), torch.serialization.safe_globals(SHARDED_TENSOR_GLOBALS):
            state = torch.load(source, map_location=map_location, mmap=mmap, weights_only=True)
    except CheckpointError:
        raise
    except Exception as exc:  # pickle, zip, runtime errors from a damaged or foreign file
        raise CheckpointError(f"{path} cannot be loaded: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a state dict (found {type(state).__name__})")
    return state


@contextmanager
def _quiet_device_mesh() -> Iterator[None]:
    # Unpickling a DeviceMesh without process groups logs a torch.compile warning per tensor;
    # it is harmless here (nothing is compiled) and would flood the server log.
    logger = logging.getLogger("torch.distributed.device_mesh")
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def _parse_entry(path: Path, key: str, value: Any) -> Entry | None:
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor was loaded
    if dtensor is not None and isinstance(value, dtensor.DTensor):
        return _parse_dtensor(path, key, value)
    if isinstance(value, ShardedTensorStub):
        return _parse_sharded(path, key, value)
    if isinstance(value, torch.Tensor):
        shape = tuple(value.shape)
        return Entry(key, "plain", shape, value.dtype, (Piece((0,) * len(shape), shape, value),))
    return None


def _parse_dtensor(path: Path, key: str, value: DTensor) -> Entry:
    from torch.distributed.tensor import Replicate, Shard

    local = value._local_tensor
    mesh = value.device_mesh
    placements: list[tuple[str, int]] = []
    for placement in value.placements:
        # Exact type checks: _StridedShard subclasses Shard but interleaves, which a plain
        # concatenation would silently get wrong.
        if type(placement) is Shard:
            placements.append(("shard", placement.dim % max(1, value.ndim)))
        elif type(placement) is Replicate:
            placements.append(("replicate", -1))
        else:
            raise CheckpointError(
                f"{path}: '{key}' has placement {placement!r}; only Shard and Replicate are supported"
            )
    # The mesh pickles the saving rank's coordinate; get_coordinate() returns it without any
    # process group, which is what locates this block among the ranks.
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise CheckpointError(f"{path}: '{key}' was saved by a rank outside its device mesh")
    return Entry(
        key=key,
        kind="dtensor",
        global_shape=tuple(value.shape),
        dtype=local.dtype,
        pieces=(Piece((0,) * local.ndim, tuple(local.shape), local),),
        placements=tuple(placements),
        mesh_shape=tuple(mesh.shape),
        coordinate=tuple(int(c) for c in coordinate),
    )


def _parse_sharded(path: Path, key: str, value: ShardedTensorStub) -> Entry:
    try:
        local_shards, metadata = value.st_state[0], value.st_state[1]
        global_shape = tuple(int(s) for s in metadata.size)
        pieces = []
        for shard in local_shards:
            offsets = tuple(int(o) for o in shard.metadata.shard_offsets)
            sizes = tuple(int(s) for s in shard.metadata.shard_sizes)
            if tuple(shard.tensor.shape) != sizes:
                raise CheckpointError(
                    f"{path}: a shard of '{key}' has shape {tuple(shard.tensor.shape)}, "
                    f"its metadata says {sizes}"
                )
            pieces.append(Piece(offsets, sizes, shard.tensor))
    except (AttributeError, IndexError, TypeError) as exc:
        raise CheckpointError(f"{path}: ShardedTensor '{key}' has an unexpected layout ({exc})") from None
    dtype = pieces[0].tensor.dtype if pieces else torch.float32
    return Entry(key, "sharded", global_shape, dtype, tuple(pieces))
