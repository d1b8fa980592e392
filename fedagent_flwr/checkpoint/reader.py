"""Open a checkpoint reference and read its tensors one at a time, as full fp32 tensors.

The server aggregates checkpoints written by clients with any FSDP world size, or plain
Hugging Face safetensors directories. ``open_checkpoint`` checks a reference before anything is
averaged (inside the run root, present, complete, unaltered, loadable) and returns a
:class:`CheckpointReader` that hides the on-disk layout: ``keys()``, ``shape(key)`` (the global
shape) and ``read(key)`` (the full tensor, rebuilt from the ranks' blocks). Only one tensor is
materialised per ``read`` call, so memory is bounded by the largest tensor, not by the model.
"""

from __future__ import annotations

import json
import math
import os
import re
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from fedagent_flwr.checkpoint.ref import (
    CheckpointError,
    CheckpointRef,
    hash_checkpoint_dir,
    resolve_inside,
)
from fedagent_flwr.checkpoint.shard_file import Entry, IoMode, ShardFile

__all__ = [
    "CheckpointReader",
    "FsdpShardReader",
    "SafetensorsReader",
    "open_checkpoint",
]

_SHARD_NAME = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
_SAFETENSORS_INDEX = "model.safetensors.index.json"


class CheckpointReader(ABC):
    """Key-by-key access to one model checkpoint, whatever its layout on disk."""

    def __init__(self, ref: CheckpointRef, directory: Path) -> None:
        self.ref = ref
        self.directory = directory
        self.bytes_read = 0  # bytes of tensor data read so far (for throughput reports)

    @abstractmethod
    def keys(self) -> list[str]:
        """State-dict keys holding tensors, in the order the checkpoint stores them."""

    @abstractmethod
    def shape(self, key: str) -> tuple[int, ...]:
        """Global shape of ``key`` (the full tensor, not one rank's block)."""

    @abstractmethod
    def dtype(self, key: str) -> torch.dtype:
        """dtype ``key`` is stored in (``read`` converts to fp32 unless told otherwise)."""

    def read(self, key: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Return the full tensor for ``key`` as a new contiguous CPU tensor.

        ``dtype=None`` keeps the stored dtype (used for integer buffers, which are copied rather
        than averaged).
        """
        out = torch.empty(self.shape(key), dtype=dtype or self.dtype(key))
        self.read_into(key, out)
        return out

    @abstractmethod
    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Fill ``out`` (the key's global shape, any dtype) with the full tensor for ``key``.

        Lets a caller reuse one buffer for many keys: a fresh allocation per key costs a page
        fault per 4 KiB, which is a large share of the time when streaming a whole model.
        """

    @abstractmethod
    def huggingface_dir(self) -> Path | None:
        """Directory holding ``config.json`` and tokenizer files for this checkpoint, if any."""

    def close(self) -> None:
        """Release open files."""

    def num_params(self) -> int:
        """Total number of elements over all keys."""
        return sum(math.prod(self.shape(k)) for k in self.keys())

    def describe(self) -> str:
        """Short human name for error messages."""
        return f"{self.ref.format} checkpoint {self.directory}"

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _require(self, key: str) -> None:
        if key not in self._key_set():
            raise CheckpointError(f"{self.describe()} has no tensor '{key}'")

    @abstractmethod
    def _key_set(self) -> set[str] | dict[str, Any]:
        ...


def open_checkpoint(
    ref: CheckpointRef,
    root: str | os.PathLike[str] | None = None,
    check_hash: bool = True,
    io: IoMode = "auto",
) -> CheckpointReader:
    """Check a reference and open it for reading.

    Refuses (with :class:`CheckpointError` naming the culprit) a reference outside ``root``
    (``..`` and symlinks resolved, weight files included), a missing directory, a missing or extra rank file, a world
    size that disagrees with the files, a content hash that does not match ``ref.sha256`` (when
    ``check_hash`` and the reference carries one) and files that cannot be parsed.
    ``io`` is for tests and unusual torch versions: how FSDP rank files are read.
    """
    ref.check_fields()
    if root is not None:
        directory = resolve_inside(ref, root)
    else:
        if "://" in ref.path:
            raise CheckpointError(f"reference {ref.path!r} uses a scheme this run cannot read")
        directory = Path(ref.path)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")

    # Layout checks come before the hash so that a missing shard is reported as such rather
    # than as an opaque hash mismatch.
    if ref.format == "fsdp-shards":
        data_files = _fsdp_shard_paths(directory, ref.world_size)
    else:
        data_files = _safetensors_files(directory)
    if root is not None:
        # The directory is inside the root; its weight files must be too (a symlinked shard
        # could otherwise make the server read any file it can open).
        root_path = Path(root).resolve()
        for path in data_files:
            if root_path not in path.resolve().parents:
                raise CheckpointError(f"{path} links to {path.resolve()}, outside the run root {root_path}")

    if check_hash and ref.sha256:
        actual = hash_checkpoint_dir(directory)
        if actual != ref.sha256:
            raise CheckpointError(
                f"content hash of {directory} is {actual[:16]}..., the reference says "
                f"{ref.sha256[:16]}... (files changed or incomplete)"
            )

    if ref.format == "fsdp-shards":
        return FsdpShardReader(ref, directory, data_files, io=io)
    return SafetensorsReader(ref, directory, data_files)


def _check_out(reader: CheckpointReader, key: str, shape: tuple[int, ...], out: torch.Tensor) -> None:
    if tuple(out.shape) != shape:
        raise CheckpointError(
            f"{reader.describe()}: '{key}' has shape {shape}, the buffer has {tuple(out.shape)}"
        )
    if not out.is_contiguous():
        raise CheckpointError(f"read_into needs a contiguous buffer for '{key}'")


# ---------------------------------------------------------------------------------------------
# FSDP rank files


def _fsdp_shard_paths(directory: Path, world_size: int) -> list[Path]:
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
        path = found.get((world_size, rank))
        if path is None or not path.is_file():
            raise CheckpointError(
                f"{directory} is missing rank file model_world_size_{world_size}_rank_{rank}.pt"
            )
        paths.append(path)
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
    """

    def __init__(
        self,
        ref: CheckpointRef,
        directory: Path,
        shard_paths: list[Path] | None = None,
        io: IoMode = "auto",
    ) -> None:
        super().__init__(ref, directory)
        paths = shard_paths or _fsdp_shard_paths(directory, ref.world_size)
        self._files: list[ShardFile] = []
        try:
            for path in paths:
                self._files.append(ShardFile(path, io=io))
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
        self._require(key)
        layout = self._layouts[key]
        _check_out(self, key, layout.shape, out)
        for block in layout.blocks:
            self._files[block.rank].read_piece_into(key, block.index, out[block.slices])
        for rank in layout.replicas:
            other = self._files[rank].read_piece(key, 0)
            if not torch.equal(other.to(out.dtype), out):
                raise CheckpointError(
                    f"{self._files[rank].path}: plain tensor '{key}' differs from rank 0's copy "
                    "(a sharded tensor saved without DTensor metadata?)"
                )
        self.bytes_read = sum(f.bytes_read for f in self._files)

    def huggingface_dir(self) -> Path | None:
        hf = self.directory / "huggingface"
        return hf if hf.is_dir() else None

    def close(self) -> None:
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


# ---------------------------------------------------------------------------------------------
# Hugging Face safetensors


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / _SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is malformed ({exc})") from None
        files = []
        for name in names:
            path = directory / name
            if Path(name).name != name or not path.is_file():
                raise CheckpointError(f"{index} names {name!r}, which is not a file in {directory}")
            files.append(path)
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} holds no *.safetensors file")
    return files


_SAFETENSORS_DTYPES = {
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


class SafetensorsReader(CheckpointReader):
    """Reads a Hugging Face model directory (one or several ``*.safetensors`` files)."""

    def __init__(self, ref: CheckpointRef, directory: Path, files: list[Path] | None = None) -> None:
        super().__init__(ref, directory)
        from safetensors import safe_open

        self._handles: list[Any] = []
        self._where: dict[str, tuple[Any, Path]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        for path in files or _safetensors_files(directory):
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
                handle.__enter__()
            except Exception as exc:  # SafetensorError, OSError: truncated or not safetensors
                self.close()
                raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
            self._handles.append(handle)
            for key in handle.keys():
                if key in self._where:
                    self.close()
                    raise CheckpointError(f"'{key}' appears in both {self._where[key][1]} and {path}")
                info = handle.get_slice(key)
                dtype = _SAFETENSORS_DTYPES.get(info.get_dtype())
                if dtype is None:
                    self.close()
                    raise CheckpointError(f"{path}: '{key}' has unsupported dtype {info.get_dtype()}")
                self._where[key] = (handle, path)
                self._shapes[key] = tuple(int(s) for s in info.get_shape())
                self._dtypes[key] = dtype

    def keys(self) -> list[str]:
        return list(self._where)

    def _key_set(self) -> dict[str, Any]:
        return self._where

    def shape(self, key: str) -> tuple[int, ...]:
        self._require(key)
        return self._shapes[key]

    def dtype(self, key: str) -> torch.dtype:
        self._require(key)
        return self._dtypes[key]

    def read_into(self, key: str, out: torch.Tensor) -> None:
        self._require(key)
        _check_out(self, key, self._shapes[key], out)
        handle, path = self._where[key]
        try:
            tensor = handle.get_tensor(key)
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read '{key}' ({exc})") from None
        self.bytes_read += tensor.numel() * tensor.element_size()
        out.copy_(tensor)  # never hand out memory that may alias the file mapping

    def huggingface_dir(self) -> Path | None:
        return self.directory

    def close(self) -> None:
        for handle in self._handles:
            try:
                handle.__exit__(None, None, None)
            except Exception:  # closing twice or a handle that failed half-way: nothing to free
                pass
        self._handles = []
