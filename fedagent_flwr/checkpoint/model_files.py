"""The global model's own files come from the run's base model, never from a client.

A global model directory holds, besides the averaged ``model.safetensors``, the files that say
how to build and drive the model: ``config.json``, ``generation_config.json``, the tokenizer
files and the chat template. The server takes them from the base model of the run (the trusted
*model files* directory), so a client cannot change the architecture, untie ``lm_head`` or
rewrite the chat template of the global model.

A client's checkpoint still carries its own ``config.json``. :func:`check_model_config` compares
it with the base model's and refuses a client whose weights were built for another model (other
architecture, shapes, ``tie_word_embeddings``, rope, norms...). Fields that trainers legitimately
rewrite are ignored: the dtype (verl and the reference trainer keep fp32 master weights), the
token ids verl copies from the tokenizer, attention implementation, caching and output flags,
dropouts, transformers' own bookkeeping and, for a critic, the value-head fields verl sets
(``architectures``, ``num_labels``, labels).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from fedagent_flwr.checkpoint.config_answers import answer_file, keep_answer, quiet_transformers, read_answer
from fedagent_flwr.checkpoint.ref import CheckpointError

__all__ = [
    "CRITIC_IGNORED_CONFIG_KEYS",
    "IGNORED_CONFIG_KEYS",
    "check_model_config",
    "config_differences",
    "model_files_dir",
]

_log = logging.getLogger(__name__)

# Keys of config.json (at any nesting level) that do not change what the weights mean.
IGNORED_CONFIG_KEYS = frozenset({
    "torch_dtype", "dtype",  # fp32 master weights (verl, reference trainer) vs the base model's bf16
    "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id",  # verl sets them from the tokenizer
    "attn_implementation",  # verl's model.override_config.attn_implementation
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
})
# verl loads a PPO critic as a token-classification model with one label; the critic of round 1
# starts from the base model, a causal LM.
CRITIC_IGNORED_CONFIG_KEYS = frozenset({"architectures", "num_labels", "id2label", "label2id", "problem_type"})


def model_files_dir(directory: str | os.PathLike[str] | None) -> Path | None:
    """The directory holding ``config.json`` of a model directory: itself (HF layout) or its
    ``huggingface/`` (verl's FSDP layout); None when there is none."""
    if directory is None:
        return None
    for candidate in (Path(directory), Path(directory) / "huggingface"):
        if (candidate / "config.json").is_file():
            return candidate
    return None


def _ignored(key: str, kind: str) -> bool:
    if kind == "critic" and key in CRITIC_IGNORED_CONFIG_KEYS:
        return True
    # "_name_or_path", "_commit_hash", "_attn_implementation...": transformers' bookkeeping.
    return key.startswith("_") or key in IGNORED_CONFIG_KEYS or "dropout" in key or key.endswith("_pdrop")


def config_differences(candidate: dict[str, Any], trusted: dict[str, Any], kind: str = "actor",
                       prefix: str = "") -> list[str]:
    """``key: value (base model: value)`` for every field of ``candidate`` that matters and differs
    from ``trusted`` (both full config dicts, defaults included), nested configs included."""
    found = []
    for key in sorted(set(candidate) | set(trusted), key=str):
        if _ignored(str(key), kind):
            continue
        mine, theirs = candidate.get(key, "<absent>"), trusted.get(key, "<absent>")
        if key == "architectures" and mine in (None, "<absent>"):
            continue  # a config saved from the config object alone names no class (model_type still does)
        if isinstance(mine, dict) and isinstance(theirs, dict):
            found += config_differences(mine, theirs, kind, f"{prefix}{key}.")
        elif mine != theirs:
            found.append(f"{prefix}{key}: {_short(mine)} (base model: {_short(theirs)})")
    return found


def check_model_config(checkpoint_files: Path | None, trusted_files: Path, kind: str = "actor",
                       who: str = "the checkpoint") -> None:
    """Raise CheckpointError when ``config.json`` in ``checkpoint_files`` differs from the one in
    ``trusted_files`` (the base model's) in a field that matters; a checkpoint without a
    ``config.json`` is not refused here (its keys and shapes are still checked)."""
    found = model_files_dir(checkpoint_files)
    if found is None:
        return
    differences = config_differences(_full_config(found / "config.json", who),
                                     _full_config(trusted_files / "config.json", "the base model"), kind)
    if differences:
        more = f" and {len(differences) - 3} more" if len(differences) > 3 else ""
        raise CheckpointError(
            f"{who}'s config.json ({found / 'config.json'}) differs from the base model's in "
            f"{'; '.join(differences[:3])}{more}: its weights belong to another model"
        )


def _full_config(path: Path, who: str) -> dict[str, Any]:
    """``path`` as the config class of its ``model_type`` reads it (class defaults filled in, so a
    field one writer left at its default and another wrote out is no difference); the raw JSON
    when transformers does not know the model type."""
    try:
        text = path.read_bytes()
        raw = json.loads(text)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{who}'s {path} is unreadable: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{who}'s {path} is not a JSON object")
    known = answer_file("full-config", text, raw)  # transformers' answer, kept by an earlier process
    cached = read_answer(known)
    # Used by a trust check (a client may not change the architecture): only an entry of this
    # config's model type counts (not an empty or foreign one); anything else is asked again. Not a
    # key-by-key check: transformers renames and drops keys (rope_scaling, torch_dtype) in its form.
    if isinstance(cached, dict) and cached.get("model_type") == raw.get("model_type"):
        return cached
    try:
        from transformers import AutoConfig

        with quiet_transformers():
            config_class = AutoConfig.for_model(str(raw.get("model_type", ""))).__class__
            # As JSON reads it back (id2label's int keys become strings...), computed or kept alike,
            # so a config compared with one from the cache is compared like for like.
            full = json.loads(json.dumps(dict(config_class.from_dict(raw).to_dict()), default=str))
            keep_answer(known, full)
            return dict(full)
    except Exception as exc:  # unknown or remote-code model type: compare the files as written
        _log.debug("config class for %s not available (%s); comparing raw JSON", path, exc)
        return raw


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
