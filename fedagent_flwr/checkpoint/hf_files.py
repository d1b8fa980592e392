"""The Hugging Face side of an aggregate: where its config and tokenizer come from, tied keys.

The averaged model must load with ``AutoModelForCausalLM.from_pretrained``: config, generation
config, tokenizer and chat template are copied from a trusted directory (the run's base model
files, else the reference), ``config.json`` is marked fp32, and weight files are never copied
(they would shadow the averaged ``model.safetensors``). Tied weights are asked of transformers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from fedagent_flwr.checkpoint.config_answers import answer_file, keep_answer, quiet_transformers, read_answer
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
    known = answer_file("tied-weight-keys", text, raw)  # transformers' answer, kept by an earlier process
    cached = read_answer(known)
    if isinstance(cached, list) and all(isinstance(pair, list) and len(pair) == 2
                                        and all(isinstance(k, str) for k in pair) for pair in cached):
        return tuple((k, v) for k, v in cached)
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        with quiet_transformers():
            config = AutoConfig.from_pretrained(str(Path(config_path).parent))
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        ties = getattr(model, "all_tied_weights_keys", None)
        if isinstance(ties, dict):
            answer = sorted([str(k), str(v)] for k, v in ties.items())
            keep_answer(known, answer)
            return tuple((k, v) for k, v in answer)
    except Exception as exc:  # unknown architecture, remote code, older transformers
        _log.debug("tied keys from transformers failed for %s: %s", config_path, exc)
    if raw.get("tie_word_embeddings", False):
        return (("lm_head.weight", "model.embed_tokens.weight"),)
    return ()
