"""Checkpoint references and the streamed aggregation of client checkpoints.

``ref`` defines what travels in Flower messages (:class:`CheckpointRef`); ``reader`` opens and
checks a reference and reads full tensors key by key from FSDP rank files or HF safetensors;
``aggregate`` computes the fp32 weighted mean (or any per-key rule, ``aggregate_by_key``) into a
new HF model directory, measuring the clients' updates on the way (``update_stats``: norms, cosines);
``safetensors_writer`` streams that file to disk one tensor at a time. ``store`` moves
references between machines (a shared filesystem, or the ServerApp's HTTP store in
``http_server``/``http_client``, with per-file ``manifest`` hashes).
"""

from fedagent_flwr.checkpoint.aggregate import (
    AggregateReport,
    KeyRule,
    aggregate_by_key,
    check_compatible,
    normalise_weights,
    tied_weight_keys,
    verify_mean,
    weighted_mean,
)
from fedagent_flwr.checkpoint.reader import (
    CheckpointReader,
    FsdpShardReader,
    SafetensorsReader,
    open_checkpoint,
)
from fedagent_flwr.checkpoint.ref import (
    CheckpointError,
    CheckpointFormat,
    CheckpointKind,
    CheckpointRef,
    hash_checkpoint_dir,
    hashed_files,
    resolve_inside,
)
from fedagent_flwr.checkpoint.safetensors_writer import SafetensorsStreamWriter
from fedagent_flwr.checkpoint.update_stats import UpdateStats

__all__ = [
    "AggregateReport",
    "UpdateStats",
    "KeyRule",
    "CheckpointError",
    "CheckpointFormat",
    "CheckpointKind",
    "CheckpointReader",
    "CheckpointRef",
    "FsdpShardReader",
    "SafetensorsReader",
    "SafetensorsStreamWriter",
    "aggregate_by_key",
    "check_compatible",
    "hash_checkpoint_dir",
    "hashed_files",
    "normalise_weights",
    "open_checkpoint",
    "resolve_inside",
    "tied_weight_keys",
    "verify_mean",
    "weighted_mean",
]
