"""The audit of a weighted mean (FedAvg's rounds: :func:`verify_mean`, for tests and the ``verify``
audit), in float64 and in chunks of rows.

Independent of :func:`.aggregate.weighted_mean`'s accumulation and writer: the written file is read
with safetensors slices, each source with :meth:`.CheckpointReader.read_rows`, and the mean summed
in float64, one chunk of at most :data:`.audit_rows.CHUNK_ELEMENTS` elements of a key at a
time (whole rows), so the audit holds a few float64 copies of a chunk, not of the model (it loaded
the whole written file plus whole float64 tensors before: about 2.5x the model's fp32 size). The
mean is element-wise, so the max abs error is the whole key's whatever the chunks, and so are the
refusals (their counts are summed over the chunks and raised after the last one; a tied copy's
first bad element is named by its index in the whole tensor).

Every value read is checked for NaN and Inf, including a tied copy that the sources hold and the
written file leaves out: NaN compares false with the tolerance and ``max()`` passes over it, so a
non-finite input would otherwise let the round pass.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from fedagent_flwr.checkpoint.audit_digests import AuditDigests
from fedagent_flwr.checkpoint.audit_rows import handle_rows, reader_rows, row_chunks, tie_error
from fedagent_flwr.checkpoint.hf_files import MODEL_FILE, tied_weight_keys
from fedagent_flwr.checkpoint.key_checks import count_non_finite, effective_keys, normalise_weights
from fedagent_flwr.checkpoint.reader import CheckpointReader
from fedagent_flwr.checkpoint.ref import CheckpointError
from fedagent_flwr.checkpoint.safetensors_file import SafetensorsFile
from fedagent_flwr.checkpoint.verify_step import max_of, non_finite_in_audit

__all__ = ["verify_mean"]


def verify_mean(sources: Sequence[tuple[CheckpointReader, float]], out_dir: str | os.PathLike[str],
                digests: AuditDigests | None = None) -> float:
    """The max abs error of the mean written in ``out_dir`` against the sources' float64 weighted
    mean (module docstring). CheckpointError when the written keys or shapes are not the sources',
    an integer tensor differs, a float tensor is not float32, a value read is NaN or Inf, or a
    source fails :meth:`.CheckpointReader.verify_content` once read (a file whose content was
    checked at opening, hashed or from a trusted digest, changed while it was read; a hash deferred
    to reading that does not match). With the audit's ``digests``, the written file too must still
    be the file their hash was taken of, if they hashed it (:meth:`.AuditDigests.check_read`)."""
    out_dir = Path(out_dir)
    readers = [reader for reader, _ in sources]
    weights = normalise_weights([weight for _, weight in sources])
    ties = tied_weight_keys(out_dir)
    expected_keys = set(effective_keys(readers[0], ties))
    worst = 0.0
    with SafetensorsFile(out_dir / MODEL_FILE) as written:
        if set(written.keys()) != expected_keys:
            raise CheckpointError(
                f"{out_dir} holds keys {sorted(set(written.keys()) ^ expected_keys)[:5]} that differ from the sources"
            )
        for key in sorted(expected_keys):
            worst = max(worst, _key_error(readers, weights, written, key, out_dir))
        if digests is not None:
            digests.check_read(written.path, written.held_stat())
    worst = max(worst, tie_error(readers, ties))
    for reader in readers:  # what was read is trusted only now: a file trusted at opening is unchanged since
        reader.verify_content()
    return worst


def _key_error(readers: list[CheckpointReader], weights: list[float], written: SafetensorsFile, key: str,
               out_dir: Path) -> float:
    """The max abs error of ``key``, chunk by chunk; the refusals of :func:`verify_mean`."""
    reference = readers[0]
    shape = reference.shape(key)
    for where, got in [(out_dir / MODEL_FILE, written.shape(key))] + [
            (reader.directory, reader.shape(key)) for reader in readers[1:]]:
        if got != shape:
            # both files named: which of the two is off (the written one, or the first source) shows
            raise CheckpointError(f"{where}: '{key}' has shape {got}, the first source {reference.directory} has "
                                  f"{shape}")
    floating = reference.dtype(key).is_floating_point
    bad_written, bad_sources = 0, [0] * len(readers)  # non-finite values, summed over the chunks
    worst = 0.0
    for rows in row_chunks(shape):
        actual = handle_rows(written, key, rows)
        if not floating:
            if not torch.equal(actual, reader_rows(reference, key, rows, dtype=None)):
                raise CheckpointError(f"{out_dir}: integer tensor '{key}' differs from the sources")
            continue
        if actual.dtype != torch.float32:
            raise CheckpointError(f"{out_dir}: '{key}' is {actual.dtype}, expected float32")
        bad_written += count_non_finite(actual)
        expected = torch.zeros(actual.shape, dtype=torch.float64)
        for index, (reader, weight) in enumerate(zip(readers, weights)):
            value = reader_rows(reader, key, rows)
            bad_sources[index] += count_non_finite(value)
            expected += weight * value.double()
        if not bad_written and not any(bad_sources):  # once one is found, the key is only counted
            worst = max(worst, max_of((actual.double() - expected).abs()))
    if bad_written:
        raise non_finite_in_audit(key, bad_written, str(out_dir / MODEL_FILE))
    for index, bad in enumerate(bad_sources):
        if bad:
            raise non_finite_in_audit(key, bad, f"source {index} {readers[index].directory}")
    return worst
