"""The Hugging Face side of an aggregate: where its config and tokenizer come from, tied keys.

The averaged model must load with ``AutoModelForCausalLM.from_pretrained``: config, generation
config, tokenizer and chat template are copied from a trusted directory (the run's base model
files, else the reference), ``config.json`` is marked fp32, and weight files are never copied
(they would shadow the averaged ``model.safetensors``). Tied weights are asked of transformers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from fedagent_flwr.checkpoint.reader import CheckpointReader
from fedagent_flwr.checkpoint.ref import CheckpointError

__all__ = ["MODEL_FILE", "config_dir", "copy_hf_files", "find_config_dir", "tied_weight_keys"]

MODEL_FILE = "model.safetensors"
# Weight files of the source directory are never copied next to the averaged model: they would
# shadow or contradict it when transformers looks for weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")

_log = logging.getLogger(__name__)

def find_config_dir(directory: Path | None) -> Path | None:
    if directory is not None and (directory / "config.json").is_file():
        return directory
    return None


def config_dir(source: CheckpointReader, reference: CheckpointReader | None,
                model_files: str | os.PathLike[str] | None = None) -> Path:
    """Where the output's config, tokenizer and chat template come from: the trusted
    ``model_files``, else the reference (a model the server wrote); a client's checkpoint only
    when the caller gave neither."""
    if model_files is not None:
        found = find_config_dir(Path(model_files))
        if found is None:
            raise CheckpointError(f"no config.json in the model files directory {model_files}")
        return found
    if reference is not None:
        found = find_config_dir(reference.huggingface_dir())
        if found is not None:
            return found
    found = find_config_dir(source.huggingface_dir())
    if found is None:
        raise CheckpointError(
            f"no config.json next to {source.directory} (nor in the reference): the averaged model "
            "would not be loadable"
        )
    return found


def copy_hf_files(source: Path, target: Path) -> None:
    for path in sorted(source.iterdir()):
        if not path.is_file() or path.name.startswith("."):
            continue
        if path.name.endswith(_WEIGHT_SUFFIXES) or path.name.endswith(".index.json"):
            continue
        if path.name == "config.json":
            config = json.loads(path.read_text())
            _set_fp32(config)
            (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copy2(path, target / path.name)


def _set_fp32(config: dict[str, Any]) -> None:
    # transformers 5 reads "dtype", 4.x "torch_dtype"; nested sub-configs (text_config of
    # multimodal models) carry their own.
    config["dtype"] = "float32"
    if "torch_dtype" in config:
        config["torch_dtype"] = "float32"
    for value in config.values():
        if isinstance(value, dict) and ("dtype" in value or "torch_dtype" in value):
            _set_fp32(value)


def tied_weight_keys(hf_dir: Path | None) -> dict[str, str]:
    """Map tied key -> key it is tied to (e.g. ``lm_head.weight -> model.embed_tokens.weight``).

    Asks transformers itself (the model class built on the meta device, so no memory is used),
    which honours ``tie_word_embeddings`` and per-architecture rules. Falls back to the usual
    lm_head/embedding pair when the class cannot be built (custom code).
    """
    directory = find_config_dir(hf_dir)
    if directory is None:
        return {}
    config_path = directory / "config.json"
    stat = config_path.stat()
    return dict(_tied_weight_keys_cached(str(config_path.resolve()), stat.st_mtime_ns, stat.st_size))


@lru_cache(maxsize=64)
def _tied_weight_keys_cached(config_path: str, mtime_ns: int, size: int) -> tuple[tuple[str, str], ...]:
    try:
        text = Path(config_path).read_bytes()
        raw = json.loads(text)
    except (OSError, ValueError):
        return ()
    # An explicit "no tie" settles it without importing transformers (seconds on a cold start).
    text_config = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    if raw.get("tie_word_embeddings") is False and text_config.get("tie_word_embeddings") in (None, False):
        return ()
    known = _tie_cache_file(text, raw)
    if known is not None and (cached := _read_tie_cache(known)) is not None:
        return cached
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            config = AutoConfig.from_pretrained(str(Path(config_path).parent))
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        finally:
            hf_logging.set_verbosity(verbosity)
        ties = getattr(model, "all_tied_weights_keys", None)
        if isinstance(ties, dict):
            answer = tuple(sorted((str(k), str(v)) for k, v in ties.items()))
            if known is not None:
                _write_tie_cache(known, answer)
            return answer
    except Exception as exc:  # unknown architecture, remote code, older transformers
        _log.debug("tied keys from transformers failed for %s: %s", config_path, exc)
    if raw.get("tie_word_embeddings", False):
        return (("lm_head.weight", "model.embed_tokens.weight"),)
    return ()


# transformers' answer for a config is kept in the user cache (``fedagent_flwr.cache``), keyed by the
# config file's bytes and the transformers version: asking it imports transformers and its model
# classes (~2.5 s of CPU in a process that has torch), which every ServerApp did at its first
# aggregation, on the round's critical path, for the same base model again and again.


def _tie_cache_file(config_bytes: bytes, raw: Any) -> Path | None:
    """Where transformers' tied keys for this config are kept; None when they cannot be kept: a
    config with remote code (``auto_map``: the answer depends on more than these bytes), no
    transformers installed, or no usable cache directory."""
    if not isinstance(raw, dict) or "auto_map" in raw:
        return None
    try:
        from importlib.metadata import version

        from fedagent_flwr.cache import cache_dir

        key = hashlib.sha256(b"transformers " + version("transformers").encode() + b"\n" + config_bytes)
        return cache_dir() / "tied-weight-keys" / f"{key.hexdigest()}.json"
    except Exception as exc:  # PackageNotFoundError, an unwritable home
        _log.debug("no cache for tied keys: %s", exc)
        return None


def _read_tie_cache(path: Path) -> tuple[tuple[str, str], ...] | None:
    """The kept answer, or None when there is none (or it is unreadable: asked again)."""
    try:
        pairs = json.loads(path.read_text())["ties"]
        return tuple((str(k), str(v)) for k, v in pairs)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_tie_cache(path: Path, answer: tuple[tuple[str, str], ...]) -> None:
    """Keep ``answer`` (best effort: a cache that cannot be written only costs the next run time)."""
    from fedagent_flwr.atomic import write_json_atomic

    try:
        write_json_atomic(path, {"ties": [list(pair) for pair in answer]})
    except OSError as exc:
        _log.debug("tied keys not kept at %s: %s", path, exc)
