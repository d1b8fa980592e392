"""Read a Hugging Face model directory (one or several ``*.safetensors`` files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fedagent_flwr.checkpoint.reader import CheckpointReader, check_out_buffer, check_rows
from fedagent_flwr.checkpoint.receipts import FileStat
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef
from fedagent_flwr.checkpoint.safetensors_file import DTYPES, MODEL_DTYPES, SafetensorsFile

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


class SafetensorsReader(CheckpointReader):
    """Reads a Hugging Face model directory (one or several ``*.safetensors`` files), each with
    positioned reads (:class:`.SafetensorsFile`: a file shortened while it is read is an error
    naming it, not a SIGBUS)."""

    def __init__(self, ref: CheckpointRef, directory: Path, files: list[Path] | None = None) -> None:
        super().__init__(ref, directory)
        self._handles: list[SafetensorsFile] = []
        self._where: dict[str, SafetensorsFile] = {}
        for path in files or safetensors_files(directory):
            try:
                handle = SafetensorsFile(path)
                self._handles.append(handle)
                for key in handle.keys():
                    if key in self._where:
                        raise CheckpointError(f"'{key}' appears in both {self._where[key].path} and {path}")
                    if handle.dtype(key) not in MODEL_DTYPES:
                        raise CheckpointError(f"{path}: '{key}' has unsupported dtype "
                                              f"{next(n for n, d in DTYPES.items() if d == handle.dtype(key))}")
                    self._where[key] = handle
            except BaseException:  # every file opened so far is released
                self.close()
                raise

    def keys(self) -> list[str]:
        return list(self._where)

    def _key_set(self) -> dict[str, Any]:
        return self._where

    def shape(self, key: str) -> tuple[int, ...]:
        self._require(key)
        return self._where[key].shape(key)

    def dtype(self, key: str) -> torch.dtype:
        self._require(key)
        return self._where[key].dtype(key)

    def read_into(self, key: str, out: torch.Tensor) -> None:
        self._require(key)
        check_out_buffer(self, key, self.shape(key), out)
        self._where[key].read_into(key, out)
        self.bytes_read += out.numel() * self.dtype(key).itemsize

    def read_rows(self, key: str, start: int, stop: int, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Rows ``start:stop`` of ``key``: only their bytes are read from the file."""
        self._require(key)
        check_rows(self, key, self.shape(key), start, stop)
        rows = self._where[key].read_rows(key, start, stop)
        self.bytes_read += rows.numel() * rows.element_size()
        return rows if dtype is None or dtype == rows.dtype else rows.to(dtype)

    def _held_stat(self, name: str) -> FileStat | str | None:
        """The stat of safetensors file ``name`` through the descriptor it is read from."""
        return next((handle.held_stat() for handle in self._handles if handle.path.name == name), None)

    def huggingface_dir(self) -> Path | None:
        return self.directory

    def close(self) -> None:
        for handle in self._handles:  # kept: their stat at closing stays readable (_held_stat)
            handle.close()
