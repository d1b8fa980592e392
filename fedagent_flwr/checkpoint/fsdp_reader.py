"""Read verl FSDP checkpoints (``model_world_size_W_rank_R.pt``) of any world size.

Each rank file is parsed by :class:`~fedagent_flwr.checkpoint.shard_file.ShardFile`; this module
plans, per key, where every rank's block goes in the full tensor (DTensor ``Shard``/``Replicate``,
plain replicated tensors, ShardedTensor offsets) and rebuilds it on ``read_into``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path

import torch

from fedagent_flwr.checkpoint.content_hash import combine_file_digests, file_digest, hashed_files
from fedagent_flwr.checkpoint.reader import CheckpointReader, check_out_buffer, check_rows
from fedagent_flwr.checkpoint.receipts import FileStat, TrustedFile, changed_while_read
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef, content_mismatch
from fedagent_flwr.checkpoint.shard_file import Entry, IoMode, ShardFile, wait_hashed

__all__ = ["FsdpShardReader", "fsdp_shard_paths"]

_SHARD_NAME = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")

def fsdp_shard_paths(directory: Path, world_size: int) -> list[Path]:
    found: dict[tuple[int, int], Path] = {}
    for path in directory.iterdir():
        match = _SHARD_NAME.match(path.name)
        if match:
            found[(int(match.group(1)), int(match.group(2)))] = path
    sizes = sorted({w for w, _ in found})
    if not found:
        raise CheckpointError(f"{directory} holds no model_world_size_*_rank_*.pt file")
    if sizes != [world_size]:
        raise CheckpointError(
            f"{directory} holds rank files for world size(s) {sizes}, the reference says "
            f"{world_size}"
        )
    config_path = directory / "fsdp_config.json"
    if config_path.is_file():
        try:
            declared = int(json.loads(config_path.read_text())["world_size"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{config_path} is malformed ({exc})") from None
        if declared != world_size:
            raise CheckpointError(
                f"{config_path} declares world size {declared}, the reference says {world_size}"
            )
    paths = []
    for rank in range(world_size):
        rank_file = found.get((world_size, rank))
        if rank_file is None or not rank_file.is_file():
            raise CheckpointError(
                f"{directory} is missing rank file model_world_size_{world_size}_rank_{rank}.pt"
            )
        paths.append(rank_file)
    extra = sorted(r for w, r in found if r >= world_size)
    if extra:
        raise CheckpointError(f"{directory} holds rank files for ranks {extra} >= world size {world_size}")
    return paths


class _Block:
    """Where one stored block goes in the full tensor: (rank, piece index, slices)."""

    __slots__ = ("rank", "index", "slices")

    def __init__(self, rank: int, index: int, offsets: tuple[int, ...], shape: tuple[int, ...]):
        self.rank = rank
        self.index = index
        self.slices = tuple(slice(o, o + s) for o, s in zip(offsets, shape))


class _Layout:
    """How to rebuild one key: global shape, dtype, blocks, and ranks that must be identical."""

    __slots__ = ("shape", "dtype", "blocks", "replicas")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape = shape
        self.dtype = dtype
        self.blocks: list[_Block] = []
        self.replicas: list[int] = []  # ranks of a plain tensor that must equal rank 0's copy


class FsdpShardReader(CheckpointReader):
    """Reads verl FSDP checkpoints (``model_world_size_W_rank_R.pt``), any world size.

    DTensor ``Shard(d)`` blocks are placed along ``d`` in mesh order (uneven last blocks
    included), ``Replicate`` dimensions use the first replica, plain tensors are taken from
    rank 0 (and must be identical on every rank), ShardedTensor blocks go where their metadata
    says. Every rebuilt tensor is checked to cover exactly its declared global shape.

    With ``expected_sha256`` the content hash is checked while reading (one pass over the files):
    each rank file hashes the blocks it reads, and :meth:`verify_content` adds what was not read
    and compares. Until then nothing read may be trusted; the aggregation calls it before it
    commits its output.
    """

    def __init__(
        self,
        ref: CheckpointRef,
        directory: Path,
        shard_paths: list[Path] | None = None,
        io: IoMode = "auto",
        expected_sha256: str | None = None,
        trusted: Mapping[str, TrustedFile] | None = None,
    ) -> None:
        super().__init__(ref, directory)
        paths = shard_paths or fsdp_shard_paths(directory, ref.world_size)
        self._expected_sha256 = expected_sha256
        self._verified = expected_sha256 is None
        # The file list is fixed now: a file added or removed before the check is a mismatch.
        self._hashed_names = [p.name for p in hashed_files(directory)] if expected_sha256 else []
        # Files whose digest a receipt of the store vouches for (.receipts): not hashed while read.
        # The receipt was checked by path; the file opened must be the one it describes (its path
        # may lead elsewhere by the time it is opened), and its stat is checked again in
        # verify_content. A file whose opened stat differs (swapped, or only touched: a chmod, a
        # new hard link) loses the receipt's trust and is hashed while read instead, as every
        # failed receipt check is: the content hash then accepts the original and refuses another.
        self._trusted = {name: t for name, t in (trusted or {}).items() if name in self._hashed_names}
        self._files: list[ShardFile] = []
        # read_rows: the blocks of one key read whole, kept while later rows may still need them
        self._row_blocks: dict[tuple[str, int], torch.Tensor] = {}
        self._row_keys: list[str] = []  # the keys whose blocks _row_blocks may hold, the last read last
        try:
            for path in paths:
                hash_it = expected_sha256 is not None and path.name not in self._trusted
                file = ShardFile(path, io=io, hash_while_reading=hash_it)
                receipt = self._trusted.get(path.name)
                self._files.append(file)
                if receipt is not None and file.opened_stat != receipt.stat:
                    del self._trusted[path.name]
                    file.start_hashing()  # nothing has been read from it yet
            self._layouts = self._plan()
        except BaseException:
            self.close()
            raise

    @property
    def io(self) -> str:
        """How rank files are read: ``pread`` (bounded memory) or ``mmap`` (fallback)."""
        return self._files[0].io

    def keys(self) -> list[str]:
        return list(self._layouts)

    def _key_set(self) -> dict[str, _Layout]:
        return self._layouts

    def shape(self, key: str) -> tuple[int, ...]:
        self._require(key)
        return self._layouts[key].shape

    def dtype(self, key: str) -> torch.dtype:
        self._require(key)
        return self._layouts[key].dtype

    def read_into(self, key: str, out: torch.Tensor) -> None:
        self.read_into_deferred(key, out)()

    def read_into_deferred(self, key: str, out: torch.Tensor) -> Callable[[], None]:
        self._require(key)
        layout = self._layouts[key]
        check_out_buffer(self, key, layout.shape, out)
        # Per rank file, the hashing of the blocks just read (FsdpShardReader with a deferred
        # content check); the caller waits for it before it touches ``out`` again.
        pending: dict[int, list[Future[None]]] = {}
        try:
            for block in layout.blocks:
                self._files[block.rank].read_piece_into(
                    key, block.index, out[block.slices], pending.setdefault(block.rank, [])
                )
            self._check_replicas(key, layout, out)
        except BaseException:
            for futures in pending.values():  # nothing may still read ``out`` once we raise
                for future in futures:
                    future.exception()
            raise
        self.bytes_read = sum(f.bytes_read for f in self._files)
        paths = {rank: self._files[rank].path for rank in pending}

        def wait() -> None:
            for rank, futures in pending.items():
                wait_hashed(futures, paths[rank])

        return wait

    def read_rows(self, key: str, start: int, stop: int, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Rows ``start:stop`` of ``key`` from the blocks they overlap.

        A block is read whole (a rank file stores it as one piece) and kept until a call for the
        same key asks for rows past its end, so that rows read in increasing order read every
        block once: memory is the rows plus the blocks they overlap (one rank's share of the
        tensor under FSDP's ``Shard(0)``; every block under ``Shard(1)``, whose blocks all span
        every row). The blocks of the one other key read last are kept too, so a caller that
        walks two keys side by side (a tied copy against its partner) still reads each block
        once, not once a chunk."""
        self._require(key)
        layout = self._layouts[key]
        check_rows(self, key, layout.shape, start, stop)
        other = next((k for k in reversed(self._row_keys) if k != key), None)
        self._row_keys = [k for k in (other, key) if k is not None]
        self._row_blocks = {(k, n): t for (k, n), t in self._row_blocks.items()
                            if k == other or (k == key and layout.blocks[n].slices[0].stop > start)}
        out = torch.empty((stop - start, *layout.shape[1:]), dtype=dtype or layout.dtype)
        for number, block in enumerate(layout.blocks):
            rows = block.slices[0]
            low, high = max(start, rows.start), min(stop, rows.stop)
            if low >= high:
                continue
            piece = self._row_blocks.get((key, number))
            if piece is None:
                piece = self._files[block.rank].read_piece(key, block.index)
                self._check_replicas(key, layout, piece)  # plain tensors: every rank's copy equal
                self._row_blocks[(key, number)] = piece
            out[(slice(low - start, high - start), *block.slices[1:])] = piece[low - rows.start:high - rows.start]
        self.bytes_read = sum(f.bytes_read for f in self._files)
        return out

    def _check_replicas(self, key: str, layout: _Layout, out: torch.Tensor) -> None:
        for rank in layout.replicas:
            other = self._files[rank].read_piece(key, 0)
            if not torch.equal(other.to(out.dtype), out):
                raise CheckpointError(
                    f"{self._files[rank].path}: plain tensor '{key}' differs from rank 0's copy "
                    "(a sharded tensor saved without DTensor metadata?)"
                )

    def verify_content(self) -> None:
        """Finish the content-hash check begun while reading; CheckpointError naming the directory
        if the files do not hash to the reference's sha256. Idempotent; a no-op without a check.
        Files trusted at opening (hashed there, not while read: :meth:`watch_unchanged`) have their
        stat checked again first."""
        self.check_unchanged()
        if self._verified or self._expected_sha256 is None:
            return
        streamed = {file.path.name: file for file in self._files}
        listed = hashed_files(self.directory)
        if [p.name for p in listed] != self._hashed_names:
            raise CheckpointError(f"the files of {self.directory} changed while it was read "
                                  f"({self._hashed_names} at opening, {[p.name for p in listed]} now)")
        digests = []
        for path in listed:
            file = streamed.get(path.name)
            receipt = self._trusted.get(path.name)
            if receipt is not None:
                # Both the file read (still open, or as it was closed) and what the path leads to
                # now must be the file the receipt describes, unchanged since the opening.
                changed = changed_while_read(path, receipt.stat, self._held_stat(path.name))
                if changed is not None:
                    raise CheckpointError(f"{changed}; the round leaves this checkpoint out")
                digests.append((path.name, receipt.stat.size, receipt.digest))
            elif file is not None:
                # The size now: a file that grew since opening must not match.
                digests.append((path.name, path.stat().st_size, file.content_digest()))
            else:  # a JSON config: a few hundred bytes
                digests.append((path.name, path.stat().st_size, file_digest(path)))
        actual = combine_file_digests(digests)
        if actual != self._expected_sha256:
            raise content_mismatch(self.directory, actual, self._expected_sha256)
        self._verified = True

    def _held_stat(self, name: str) -> FileStat | None:
        """The stat of rank file ``name`` through the descriptor it is read from (as closed, once closed)."""
        return next((file.held_stat() for file in self._files if file.path.name == name), None)

    @property
    def receipt_files(self) -> list[str]:
        """Names of the files whose digest came from the store's receipt (not hashed here)."""
        return sorted(self._trusted)

    @property
    def hash_gap_bytes(self) -> int:
        """Bytes read only to complete the content hash (headers, unread tensors, tails)."""
        return sum(f.hash_stream.gap_bytes for f in self._files if f.hash_stream is not None)

    def huggingface_dir(self) -> Path | None:
        hf = self.directory / "huggingface"
        return hf if hf.is_dir() else None

    def close(self) -> None:
        self._row_blocks = {}
        for file in self._files:
            file.close()

    # -- planning -------------------------------------------------------------------------------
    def _plan(self) -> dict[str, _Layout]:
        first = self._files[0]
        expected = set(first.entries)
        for file in self._files[1:]:
            keys = set(file.entries)
            if keys != expected:
                diff = sorted(keys ^ expected)[:5]
                raise CheckpointError(
                    f"{file.path} and {first.path} hold different keys (e.g. {diff})"
                )
        layouts: dict[str, _Layout] = {}
        for key in first.entries:
            entries = [f.entries[key] for f in self._files]
            kinds = {e.kind for e in entries}
            if len(kinds) != 1:
                raise CheckpointError(
                    f"'{key}' is stored as {sorted(kinds)} across ranks of {self.directory}"
                )
            shapes = {e.global_shape for e in entries}
            if len(shapes) != 1:
                raise CheckpointError(
                    f"'{key}' has global shapes {sorted(shapes)} across ranks of {self.directory}"
                )
            kind = entries[0].kind
            if kind == "plain":
                layouts[key] = self._plan_plain(key, entries)
            elif kind == "dtensor":
                layouts[key] = self._plan_dtensor(key, entries)
            else:
                layouts[key] = self._plan_sharded(key, entries)
        return layouts

    def _plan_plain(self, key: str, entries: list[Entry]) -> _Layout:
        layout = _Layout(entries[0].global_shape, entries[0].dtype)
        layout.blocks.append(_Block(0, 0, (0,) * len(layout.shape), layout.shape))
        layout.replicas = list(range(1, len(entries)))
        return layout

    def _plan_dtensor(self, key: str, entries: list[Entry]) -> _Layout:
        head = entries[0]
        for rank, entry in enumerate(entries):
            if entry.placements != head.placements or entry.mesh_shape != head.mesh_shape:
                raise CheckpointError(
                    f"{self._files[rank].path}: '{key}' has placements {entry.placements} on mesh "
                    f"{entry.mesh_shape}, rank 0 has {head.placements} on {head.mesh_shape}"
                )
        shape = head.global_shape
        sharded_dims = [d for kind, d in head.placements if kind == "shard"]
        if len(sharded_dims) != len(set(sharded_dims)):
            raise CheckpointError(
                f"'{key}' in {self.directory} shards one tensor dimension over several mesh "
                "dimensions; not supported"
            )
        # Keep one copy per distinct block: the ranks at coordinate 0 on every Replicate mesh dim.
        replicate_axes = [i for i, (kind, _) in enumerate(head.placements) if kind == "replicate"]
        shard_axes = [(i, d) for i, (kind, d) in enumerate(head.placements) if kind == "shard"]
        keep: dict[tuple[int, ...], int] = {}
        for rank, entry in enumerate(entries):
            if any(entry.coordinate[i] != 0 for i in replicate_axes):
                continue
            block_id = tuple(entry.coordinate[i] for i, _ in shard_axes)
            if block_id in keep:
                raise CheckpointError(f"'{key}': ranks {keep[block_id]} and {rank} claim the same block")
            keep[block_id] = rank
        expected_blocks = math.prod(head.mesh_shape[i] for i, _ in shard_axes)
        if len(keep) != expected_blocks:
            raise CheckpointError(
                f"'{key}' in {self.directory}: found {len(keep)} of {expected_blocks} blocks "
                f"(mesh {head.mesh_shape}, placements {head.placements})"
            )
        # Block sizes along each sharded dim, indexed by mesh coordinate -> cumulative offsets.
        starts: dict[int, list[int]] = {}
        for axis_pos, (mesh_dim, tensor_dim) in enumerate(shard_axes):
            sizes: dict[int, int] = {}
            for block_id, rank in keep.items():
                size = entries[rank].pieces[0].shape[tensor_dim]
                previous = sizes.setdefault(block_id[axis_pos], size)
                if previous != size:
                    raise CheckpointError(f"'{key}': inconsistent block sizes along dim {tensor_dim}")
            ordered = [sizes[j] for j in range(head.mesh_shape[mesh_dim])]
            if sum(ordered) != shape[tensor_dim]:
                raise CheckpointError(
                    f"'{key}' in {self.directory}: blocks along dim {tensor_dim} add up to "
                    f"{sum(ordered)}, the global shape {shape} needs {shape[tensor_dim]}"
                )
            starts[tensor_dim] = [sum(ordered[:j]) for j in range(len(ordered))]
        layout = _Layout(shape, head.dtype)
        for block_id, rank in sorted(keep.items(), key=lambda item: item[1]):
            piece = entries[rank].pieces[0]
            offsets = [0] * len(shape)
            for axis_pos, (_, tensor_dim) in enumerate(shard_axes):
                offsets[tensor_dim] = starts[tensor_dim][block_id[axis_pos]]
            for dim, size in enumerate(piece.shape):
                if dim not in starts and size != shape[dim]:
                    raise CheckpointError(
                        f"{self._files[rank].path}: block of '{key}' has shape {piece.shape}, "
                        f"which does not fit global shape {shape}"
                    )
            layout.blocks.append(_Block(rank, 0, tuple(offsets), piece.shape))
        return layout

    def _plan_sharded(self, key: str, entries: list[Entry]) -> _Layout:
        shape = entries[0].global_shape
        layout = _Layout(shape, entries[0].dtype)
        covered = 0
        for rank, entry in enumerate(entries):
            for index, piece in enumerate(entry.pieces):
                if len(piece.offsets) != len(shape) or any(
                    o < 0 or o + s > g for o, s, g in zip(piece.offsets, piece.shape, shape)
                ):
                    raise CheckpointError(
                        f"{self._files[rank].path}: shard of '{key}' at {piece.offsets} size "
                        f"{piece.shape} lies outside global shape {shape}"
                    )
                covered += math.prod(piece.shape)
                layout.blocks.append(_Block(rank, index, piece.offsets, piece.shape))
        if covered != math.prod(shape):
            raise CheckpointError(
                f"'{key}' in {self.directory}: shards cover {covered} elements, global shape "
                f"{shape} has {math.prod(shape)}"
            )
        return layout
