"""Reading a key in chunks of whole rows, shared by the audits (:mod:`.mean_audit`,
:mod:`.verify_optimizer`), and the check of the sources' tied copies that both make.

Each audit recomputes a key :data:`CHUNK_ELEMENTS` elements at a time, reading only those rows of
each file (:meth:`.CheckpointReader.read_rows`, safetensors slices); every operation is
element-wise, so the results are the whole key's whatever the chunks. Held here, below both audits,
so that neither imports the other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from fedagent_flwr.checkpoint.reader import CheckpointReader
from fedagent_flwr.checkpoint.ref import CheckpointError
from fedagent_flwr.checkpoint.safetensors_file import SafetensorsFile
from fedagent_flwr.checkpoint.verify_step import max_of, require_finite

__all__ = ["CHUNK_ELEMENTS", "handle_rows", "reader_rows", "row_chunks", "tie_error"]

#: How many elements of one key are recomputed at once (whole rows: a row longer than this is a
#: chunk alone). The audit holds a few dozen float64 copies of a chunk (the clients' mean, ``x``,
#: the buffers, their bounds, the step's temporaries, the errors): ~100 MB at 256k elements whatever
#: the key's size, where a 7B model's embedding (545M elements) held whole would take tens of GB.
#: Smaller chunks were also faster (they stay in the CPU's caches): benchmarks/verify_memory.py.
#: The results do not depend on it (every operation is element-wise, :mod:`.verify_step`); tests
#: set it small (here: :func:`row_chunks` reads it at each call).
CHUNK_ELEMENTS = 1 << 18


def row_chunks(shape: tuple[int, ...], limit: int | None = None) -> Iterator[tuple[int, int] | None]:
    """The ``(start, stop)`` ranges of rows of a tensor of ``shape`` holding at most ``limit``
    elements each (None: :data:`CHUNK_ELEMENTS`; one row where a row is longer); None once for a
    0-d tensor (read whole)."""
    if not shape:
        yield None
        return
    limit = CHUNK_ELEMENTS if limit is None else limit
    rows = max(1, limit // max(1, math.prod(shape[1:])))
    for start in range(0, shape[0], rows):
        yield start, min(shape[0], start + rows)


def reader_rows(reader: CheckpointReader, key: str, rows: tuple[int, int] | None,
                dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """Rows ``rows`` of ``key`` from ``reader`` (None: the whole tensor), as ``dtype``."""
    return reader.read(key, dtype) if rows is None else reader.read_rows(key, *rows, dtype=dtype)


def handle_rows(handle: SafetensorsFile, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
    """Rows of tensor ``name`` of an open safetensors file (only their bytes are read)."""
    return handle.get_tensor(name) if rows is None else handle.read_rows(name, *rows)


def tie_error(readers: Sequence[CheckpointReader], ties: dict[str, str]) -> float:
    """The max abs difference of the sources' tied copies from their partners (``ties``: copy ->
    partner), chunk by chunk; CheckpointError naming the source, the tensor and its first bad element
    for a NaN or Inf in either. A tied copy left out of the written file is rebuilt from its partner
    on load; that is only right if every source really held the same values in both (both audits
    check them)."""
    worst = 0.0
    for index, reader in enumerate(readers):
        present = set(reader.keys())
        for target, source in ties.items():
            if target in present and source in present:
                worst = max(worst, _tie_error(reader, f"source {index} {reader.directory}", target, source))
    return worst


def _tie_error(reader: CheckpointReader, name: str, target: str, source: str) -> float:
    """The max abs difference of a source's tied copy ``target`` from its partner ``source``."""
    shape = reader.shape(source)
    if reader.shape(target) != shape:
        raise CheckpointError(f"{name}: tied '{target}' has shape {reader.shape(target)}, its partner '{source}' "
                              f"{shape}")
    worst = 0.0
    for rows in row_chunks(shape):
        copy, partner = reader_rows(reader, target, rows), reader_rows(reader, source, rows)
        require_finite(copy, target, name, rows)
        require_finite(partner, source, name, rows)
        worst = max(worst, max_of((copy - partner).abs()))
    return worst
