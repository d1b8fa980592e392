"""Checkpoint references and the streamed aggregation of client checkpoints.

``ref`` defines what travels in Flower messages (:class:`CheckpointRef`); ``open_ref`` checks a
reference and opens it with a ``reader`` (``fsdp_reader`` for FSDP rank files, parsed by
``shard_file``; ``safetensors_reader`` for HF safetensors; ``lora_reader`` for a peft LoRA adapter, read as the global
model plus its low-rank update) that reads full tensors key by key;
``content_hash`` defines the content hash and checks it while the tensors are read;
``aggregate`` computes the fp32 weighted mean (or any per-key rule, ``aggregate_by_key``) into a
new HF model directory (``hf_files``: config, tokenizer, tied keys; ``key_checks``: the
shared checks and the float64 audit), measuring the clients' updates on the way (``update_stats``: norms, cosines);
``safetensors_writer`` streams that file to disk one tensor at a time. ``store`` moves
references between machines (a shared filesystem, or the ServerApp's HTTP store in
``http_server``/``http_client``, with per-file ``manifest`` hashes).

Only ``ref`` (torch-free) is imported with the package; the names from the torch-based modules
load on first use (:func:`__getattr__`), so a process that needs only references and stores, the
ClientApp above all (one fresh ``flwr-clientapp`` per message in a deployment, one Ray actor per
simulated node), does not import torch (about 5-8 CPU-seconds) to start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fedagent_flwr.checkpoint.ref import (
    CheckpointError,
    CheckpointFormat,
    CheckpointKind,
    CheckpointRef,
    hash_checkpoint_dir,
    hashed_files,
    resolve_inside,
)

if TYPE_CHECKING:
    from fedagent_flwr.checkpoint.aggregate import (
        AggregateReport,
        KeyRule,
        aggregate_by_key,
        aggregation_entries,
        check_compatible,
        normalise_weights,
        tied_weight_keys,
        verify_mean,
        weighted_mean,
    )
    from fedagent_flwr.checkpoint.fsdp_reader import FsdpShardReader
    from fedagent_flwr.checkpoint.lora_reader import LoraAdapterReader
    from fedagent_flwr.checkpoint.open_ref import open_checkpoint
    from fedagent_flwr.checkpoint.reader import CheckpointReader
    from fedagent_flwr.checkpoint.safetensors_reader import SafetensorsReader
    from fedagent_flwr.checkpoint.safetensors_writer import SafetensorsStreamWriter
    from fedagent_flwr.checkpoint.update_stats import UpdateStats

#: name -> the submodule (torch-based) that defines it, imported when the name is first used
_LAZY = {
    **dict.fromkeys(("AggregateReport", "KeyRule", "aggregate_by_key", "aggregation_entries", "check_compatible",
                     "normalise_weights", "tied_weight_keys", "verify_mean", "weighted_mean"), "aggregate"),
    "FsdpShardReader": "fsdp_reader",
    "LoraAdapterReader": "lora_reader",
    "open_checkpoint": "open_ref",
    "CheckpointReader": "reader",
    "SafetensorsReader": "safetensors_reader",
    "SafetensorsStreamWriter": "safetensors_writer",
    "UpdateStats": "update_stats",
}


def __getattr__(name: str) -> Any:
    """Import a torch-based name's module on first use (PEP 562) and cache the name here."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


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
    "LoraAdapterReader",
    "SafetensorsReader",
    "SafetensorsStreamWriter",
    "aggregate_by_key",
    "aggregation_entries",
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
