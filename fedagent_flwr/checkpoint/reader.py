"""The reader interface: one model checkpoint, key by key, as full fp32 tensors.

The server aggregates checkpoints written by clients with any FSDP world size, or plain
Hugging Face safetensors directories. :class:`CheckpointReader` hides the on-disk layout:
``keys()``, ``shape(key)`` (the global shape) and ``read(key)`` (the full tensor, rebuilt from the
ranks' blocks). Only one tensor is materialised per ``read`` call, so memory is bounded by the
largest tensor, not by the model; ``read_rows(key, start, stop)`` reads a range of rows, for a
caller that must bound it by less than one tensor (the audit of :mod:`.verify_optimizer`). The
layouts live in :mod:`.fsdp_reader` and :mod:`.safetensors_reader` (and :mod:`.lora_reader` reads a
LoRA adapter as the full model it stands for);
:func:`~fedagent_flwr.checkpoint.open_ref.open_checkpoint` checks a reference and picks one.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from fedagent_flwr.checkpoint.receipts import FileStat, changed_while_read
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef

__all__ = ["CheckpointReader", "check_out_buffer", "check_rows"]


class CheckpointReader(ABC):
    """Key-by-key access to one model checkpoint, whatever its layout on disk."""

    #: The full model this checkpoint is read on top of (a LoRA adapter's base, :mod:`.lora_reader`);
    #: None for a checkpoint that is a full model by itself.
    base_ref: CheckpointRef | None = None

    def __init__(self, ref: CheckpointRef, directory: Path) -> None:
        self.ref = ref
        self.directory = directory
        self.bytes_read = 0  # bytes of tensor data read so far (for throughput reports)
        # files whose content was checked at opening (hashed, or a digest trusted), with the stat their
        # digest was taken at: verify_content checks each again (watch_unchanged)
        self._watched: dict[str, FileStat] = {}

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

    def read_rows(self, key: str, start: int, stop: int, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Rows ``start:stop`` of ``key`` (along its first dimension) as a new contiguous CPU tensor.

        For a caller whose memory must stay below one chunk of a large tensor (a 7B model's
        embedding is 545M elements). This default reads the whole tensor and copies the rows out,
        so it bounds nothing; the safetensors and FSDP readers override it to read only what the
        rows need. CheckpointError for a 0-d tensor or rows outside the tensor.
        """
        self._require(key)
        check_rows(self, key, self.shape(key), start, stop)
        return self.read(key, dtype)[start:stop].clone()

    @abstractmethod
    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Fill ``out`` (the key's global shape, any dtype) with the full tensor for ``key``.

        Lets a caller reuse one buffer for many keys: a fresh allocation per key costs a page
        fault per 4 KiB, which is a large share of the time when streaming a whole model.
        """

    def read_into_deferred(self, key: str, out: torch.Tensor) -> Callable[[], None]:
        """:meth:`read_into`, except that work on ``out``'s bytes that does not change them (the
        content hash of a reader checked while reading) may still be running on return.

        The returned callable waits for that work (and raises its error); until it has returned,
        ``out`` may be read but neither modified nor reused. It lets a read-ahead thread start
        the next read while the hash of the last one finishes. Default: all done on return.
        """
        self.read_into(key, out)
        return _nothing_pending

    @abstractmethod
    def huggingface_dir(self) -> Path | None:
        """Directory holding ``config.json`` and tokenizer files for this checkpoint, if any."""

    def verify_content(self) -> None:
        """Complete a content-hash check deferred to reading (``open_checkpoint(...,
        check_hash="while-reading")``); CheckpointError naming the directory on a mismatch. And
        check again the stat of each file whose content was checked at opening, hashed or from a
        trusted digest (:meth:`watch_unchanged`): CheckpointError naming a file that changed since.

        Values read before this returns are not trusted yet: a caller commits nothing built from
        them until it has returned. A no-op for readers not checked at all.
        """
        self.check_unchanged()

    def watch_unchanged(self, stats: Mapping[str, FileStat]) -> None:
        """The files of :attr:`directory` (by name) whose content :func:`.open_ref.open_checkpoint`
        checked at opening, hashed or from trusted digests (a store's receipts, the audit's own), or
        (a round's global model, :func:`.open_ref.open_global_model`) every file its check hashed or
        trusted, each with the stat its digest was taken at: :meth:`verify_content` checks that stat
        again, so a file rewritten between that check and the end of the reads is not read changed
        unnoticed."""
        self._watched = dict(stats)

    def check_unchanged(self) -> None:
        """CheckpointError naming the first watched file (:meth:`watch_unchanged`) whose stat,
        taken through a descriptor opened now (:func:`.receipts.stat_now`), or that of the file
        the reader holds open (:meth:`_held_stat`), is not the one its digest was trusted at. One
        ``open`` and ``fstat`` per file."""
        for name, trusted in self._watched.items():
            changed = changed_while_read(self.directory / name, trusted, self._held_stat(name))
            if changed is not None:
                raise CheckpointError(changed)

    def _held_stat(self, name: str) -> FileStat | str | None:
        """The stat, through the reader's own descriptor, of the file ``name`` it read (a string
        naming why where it cannot be taken, which no stat equals); None where the reader holds no
        descriptor of that file."""
        return None

    def close(self) -> None:  # noqa: B027 -- optional hook, no-op by default
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

def _nothing_pending() -> None:
    """What :meth:`CheckpointReader.read_into_deferred` returns when nothing is left to wait for."""


def check_out_buffer(reader: CheckpointReader, key: str, shape: tuple[int, ...], out: torch.Tensor) -> None:
    if tuple(out.shape) != shape:
        raise CheckpointError(
            f"{reader.describe()}: '{key}' has shape {shape}, the buffer has {tuple(out.shape)}"
        )
    if not out.is_contiguous():
        raise CheckpointError(f"read_into needs a contiguous buffer for '{key}'")


def check_rows(reader: CheckpointReader, key: str, shape: tuple[int, ...], start: int, stop: int) -> None:
    """CheckpointError unless ``start:stop`` is a range of rows of a tensor of ``shape``."""
    if not shape:
        raise CheckpointError(f"{reader.describe()}: '{key}' is 0-d and has no rows to read")
    if not 0 <= start <= stop <= shape[0]:
        raise CheckpointError(f"{reader.describe()}: rows {start}:{stop} of '{key}' lie outside its {shape[0]} rows")
