"""Read a Hugging Face model directory (one or several ``*.safetensors`` files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fedagent_flwr.checkpoint.reader import CheckpointReader, check_out_buffer, check_rows
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef

__all__ = ["SafetensorsReader", "safetensors_files"]

_SAFETENSORS_INDEX = "model.safetensors.index.json"

def safetensors_files(directory: Path) -> list[Path]:
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
        for path in files or safetensors_files(directory):
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
        check_out_buffer(self, key, self._shapes[key], out)
        handle, path = self._where[key]
        try:
            tensor = handle.get_tensor(key)
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read '{key}' ({exc})") from None
        self.bytes_read += tensor.numel() * tensor.element_size()
        out.copy_(tensor)  # never hand out memory that may alias the file mapping

    def read_rows(self, key: str, start: int, stop: int, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Rows ``start:stop`` of ``key``: only their bytes are read from the file."""
        self._require(key)
        check_rows(self, key, self._shapes[key], start, stop)
        handle, path = self._where[key]
        try:
            rows = handle.get_slice(key)[start:stop]
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read rows {start}:{stop} of '{key}' ({exc})") from None
        self.bytes_read += rows.numel() * rows.element_size()
        out = torch.empty(tuple(rows.shape), dtype=dtype or self._dtypes[key])
        out.copy_(rows)  # a copy of our own, in the dtype asked for
        return out

    def huggingface_dir(self) -> Path | None:
        return self.directory

    def close(self) -> None:
        for handle in self._handles:
            try:
                handle.__exit__(None, None, None)
            except Exception:  # closing twice or a handle that failed half-way: nothing to free
                pass
        self._handles = []
