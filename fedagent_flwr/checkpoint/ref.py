"""Typed checkpoint references: what travels in Flower messages instead of weights.

A reference says where a checkpoint lives, what it is (actor or critic), how it is laid out on
disk, how many ranks wrote it and a content hash over its files. The server resolves references
against the run's checkpoint root and refuses anything outside it, missing or altered.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

# Re-exported: the content hash is part of what a reference is (see content_hash).
from fedagent_flwr.checkpoint.content_hash import (  # noqa: F401
    hash_checkpoint_dir,
    hashed_files,
    is_hidden,
    update_from_file,
)

CheckpointKind = Literal["actor", "critic"]
CheckpointFormat = Literal["fsdp-shards", "hf-safetensors", "peft-lora"]
KINDS: tuple[str, ...] = ("actor", "critic")
# verl's per-rank model files (FSDP layout); the aggregator reads exactly these.
SHARD_GLOB = "model_world_size_*_rank_*.pt"
FORMATS: tuple[str, ...] = ("fsdp-shards", "hf-safetensors", "peft-lora")
# peft's two files of a LoRA adapter (``peft-lora``): the low-rank factors and their settings.
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# The safetensors metadata entry of ADAPTER_WEIGHTS naming the content hash of the model the adapter was
# trained on (:func:`hash_checkpoint_dir`); the server reads an adapter only on that model (:mod:`.lora_reader`).
ADAPTER_BASE_SHA256 = "fedagent.base_sha256"
# Beside it, the content-hash scheme that hash was computed with (content_hash.CONTENT_HASH_VERSION): a hash of
# another scheme cannot be compared with this code's. An adapter without it is read as of this code's scheme.
ADAPTER_BASE_HASH_VERSION = "fedagent.base_sha256_version"

MAX_PATH_CHARS = 4096  # PATH_MAX on Linux; a longer "path" is not one
MAX_WORLD_SIZE = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint reference that cannot be used: outside the root, missing, corrupt, mismatched."""


@dataclass(frozen=True)
class CheckpointRef:
    """A reference to one model checkpoint directory.

    ``path`` is an absolute path (or, later, an fsspec URI) to the directory holding the weights:
    for ``fsdp-shards`` the verl ``.../global_step_N/actor`` directory with
    ``model_world_size_W_rank_R.pt`` files; for ``hf-safetensors`` a Hugging Face model directory;
    for ``peft-lora`` a peft LoRA adapter (``adapter_model.safetensors`` + ``adapter_config.json``),
    which stands for a full model only together with the model it was trained from
    (:mod:`.lora_reader`).
    """

    path: str
    kind: CheckpointKind = "actor"
    format: CheckpointFormat = "hf-safetensors"
    world_size: int = 1
    sha256: str = ""

    def to_config(self, prefix: str) -> dict[str, Any]:
        """Flatten into ConfigRecord-compatible scalars under ``prefix`` (e.g. ``actor``)."""
        return {f"{prefix}-{k.replace('_', '-')}": v for k, v in asdict(self).items()}

    @classmethod
    def from_config(cls, config: Any, prefix: str) -> CheckpointRef:
        """Rebuild a reference from a ConfigRecord (or dict) written by :meth:`to_config`.

        Raises :class:`CheckpointError` naming the missing or malformed key.
        """
        values: dict[str, Any] = {}
        for name in ("path", "kind", "format", "world_size", "sha256"):
            key = f"{prefix}-{name.replace('_', '-')}"
            if key not in config:
                raise CheckpointError(f"checkpoint reference is missing '{key}'")
            value = config[key]
            # A peer's message: a list or a float where a string or an int belongs is refused
            # rather than coerced ('[1]' is not a path, 2.7 is not a world size).
            expected = int if name == "world_size" else str
            if isinstance(value, bool) or not isinstance(value, expected):
                raise CheckpointError(
                    f"checkpoint reference field '{key}' must be {expected.__name__}, got "
                    f"{type(value).__name__} {str(value)[:80]!r}"
                )
            values[name] = value
        ref = cls(**values)
        ref.check_fields()
        return ref

    def check_fields(self) -> None:
        """Validate the scalar fields (not the files)."""
        if self.kind not in KINDS:
            raise CheckpointError(f"unknown checkpoint kind '{self.kind}' (expected one of {KINDS})")
        if self.format not in FORMATS:
            raise CheckpointError(
                f"unknown checkpoint format '{self.format}' (expected one of {FORMATS})"
            )
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise CheckpointError(f"world size must be in [1, {MAX_WORLD_SIZE}], got {self.world_size}")
        if not self.path:
            raise CheckpointError("checkpoint reference has an empty path")
        if len(self.path) > MAX_PATH_CHARS or any(ord(ch) < 32 or ord(ch) == 127 for ch in self.path):
            raise CheckpointError(
                f"checkpoint reference path {self.path[:80]!r}... is longer than {MAX_PATH_CHARS} "
                "characters or holds control characters"
            )
        if self.sha256 and not is_sha256(self.sha256):
            raise CheckpointError(f"checkpoint reference hash {self.sha256[:80]!r} is not a sha256 hex digest")

    @classmethod
    def for_directory(
        cls,
        path: str | os.PathLike[str],
        kind: CheckpointKind = "actor",
        fmt: CheckpointFormat | None = None,
        hasher: Callable[[Path], str] = hash_checkpoint_dir,
    ) -> CheckpointRef:
        """Describe an existing checkpoint directory: detect format (FSDP shards; a peft adapter by its
        ``adapter_config.json`` beside no safetensors file but ``adapter_model.safetensors``; else HF
        safetensors: a Hub repository may ship an adapter's settings beside the full, merged weights) and
        world size, hash it with ``hasher`` (the audit's passes digests it already computed:
        :mod:`.audit_digests`). Pass ``fmt`` where the directory must be a full model (the base model, a
        resumed global model): a directory holding only an adapter's weights is then refused."""
        directory = Path(path).resolve()
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint directory {directory} does not exist")
        shards = sorted(directory.glob(SHARD_GLOB))
        full_weights = [p for p in directory.glob("*.safetensors") if p.name != ADAPTER_WEIGHTS]
        adapter = (directory / ADAPTER_CONFIG).is_file() and not full_weights
        detected: CheckpointFormat = "fsdp-shards" if shards else "peft-lora" if adapter else "hf-safetensors"
        fmt = fmt or detected
        world_size = 1
        if fmt == "fsdp-shards":
            if not shards:
                raise CheckpointError(f"{directory} holds no model_world_size_*_rank_*.pt shard")
            world_size = int(shards[0].name.split("_")[3])
        elif fmt == "peft-lora":
            missing = [name for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG) if not (directory / name).is_file()]
            if missing:
                raise CheckpointError(f"{directory} holds no {missing[0]} (a peft LoRA adapter has both "
                                      f"{ADAPTER_WEIGHTS} and {ADAPTER_CONFIG})")
        elif not full_weights:
            raise CheckpointError(f"{directory} holds no *.safetensors file" + (
                f" but peft's {ADAPTER_WEIGHTS}: an adapter is not a full model"
                if (directory / ADAPTER_WEIGHTS).is_file() else ""))
        return cls(
            path=str(directory),
            kind=kind,
            format=fmt,
            world_size=world_size,
            sha256=hasher(directory),
        )


def is_sha256(value: Any) -> bool:
    """Whether ``value`` is a lowercase hex sha256 digest (what every hash here is written as)."""
    return isinstance(value, str) and len(value) == 64 and all(ch in "0123456789abcdef" for ch in value)


def content_mismatch(directory: str | os.PathLike[str], actual: str, expected: str) -> CheckpointError:
    """The error for a checkpoint whose files do not hash to its reference's content hash."""
    return CheckpointError(
        f"content hash of {directory} is {actual[:16]}..., the reference says "
        f"{expected[:16]}... (files changed or incomplete)"
    )


def resolve_inside(ref: CheckpointRef, root: str | os.PathLike[str]) -> Path:
    """Return the reference's directory if it lies inside ``root`` (symlinks resolved).

    Refuses foreign schemes, ``..`` escapes and symlinks that point outside the root.
    """
    if "://" in ref.path:
        raise CheckpointError(f"reference {ref.path!r} uses a scheme this run cannot read")
    root_path = Path(root).resolve()
    target = Path(ref.path).resolve()
    if target != root_path and root_path not in target.parents:
        raise CheckpointError(f"reference {ref.path!r} lies outside the run root {root_path}")
    return target
