"""Typed checkpoint references: what travels in Flower messages instead of weights.

A reference says where a checkpoint lives, what it is (actor or critic), how it is laid out on
disk, how many ranks wrote it and a content hash over its files. The server resolves references
against the run's checkpoint root and refuses anything outside it, missing or altered.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

CheckpointKind = Literal["actor", "critic"]
CheckpointFormat = Literal["fsdp-shards", "hf-safetensors"]
KINDS: tuple[str, ...] = ("actor", "critic")
# verl's per-rank model files (FSDP layout); the aggregator reads exactly these.
SHARD_GLOB = "model_world_size_*_rank_*.pt"
FORMATS: tuple[str, ...] = ("fsdp-shards", "hf-safetensors")

# Files that carry the model weights, plus the small JSON configs so that a swapped config
# (another architecture) is caught as well. verl's optimizer and extra-state shards
# (optim_*.pt, extra_state_*.pt; about twice the model) are left out: they are never averaged,
# and hashing them would triple the bytes the server reads. Tokenizer files and logs likewise.
_HASHED_SUFFIXES = (".safetensors", ".json")
_HASH_BLOCK = 8 * 1024 * 1024
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux; a longer "path" is not one
MAX_WORLD_SIZE = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint reference that cannot be used: outside the root, missing, corrupt, mismatched."""


@dataclass(frozen=True)
class CheckpointRef:
    """A reference to one model checkpoint directory.

    ``path`` is an absolute path (or, later, an fsspec URI) to the directory holding the weights:
    for ``fsdp-shards`` the verl ``.../global_step_N/actor`` directory with
    ``model_world_size_W_rank_R.pt`` files; for ``hf-safetensors`` a Hugging Face model directory.
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
    ) -> CheckpointRef:
        """Describe an existing checkpoint directory: detect format and world size, hash it."""
        directory = Path(path).resolve()
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint directory {directory} does not exist")
        shards = sorted(directory.glob(SHARD_GLOB))
        detected: CheckpointFormat = "fsdp-shards" if shards else "hf-safetensors"
        fmt = fmt or detected
        world_size = 1
        if fmt == "fsdp-shards":
            if not shards:
                raise CheckpointError(f"{directory} holds no model_world_size_*_rank_*.pt shard")
            world_size = int(shards[0].name.split("_")[3])
        elif not any(directory.glob("*.safetensors")):
            raise CheckpointError(f"{directory} holds no *.safetensors file")
        return cls(
            path=str(directory),
            kind=kind,
            format=fmt,
            world_size=world_size,
            sha256=hash_checkpoint_dir(directory),
        )


def is_sha256(value: Any) -> bool:
    """Whether ``value`` is a lowercase hex sha256 digest (what every hash here is written as)."""
    return isinstance(value, str) and len(value) == 64 and all(ch in "0123456789abcdef" for ch in value)


def is_hidden(name: str) -> bool:
    """Whether a file name is hidden (``.gitattributes``, ``.cache``): not a model file.

    Hub snapshots and git clones hold such files; they are neither hashed nor transferred.
    """
    return name.startswith(".")


def hashed_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The files covered by the content hash, in a stable order (top level only, not hidden:
    exactly what a store would transfer of them)."""
    root = Path(directory)
    return sorted(
        p
        for p in root.iterdir()
        if p.is_file() and not is_hidden(p.name)
        and (p.name.endswith(_HASHED_SUFFIXES) or (p.name.startswith("model_") and p.name.endswith(".pt")))
    )


def hash_checkpoint_dir(directory: str | os.PathLike[str]) -> str:
    """sha256 over (name, size, bytes) of every hashed file, streamed in 8 MiB blocks."""
    digest = hashlib.sha256()
    for file in hashed_files(directory):
        digest.update(file.name.encode())
        digest.update(str(file.stat().st_size).encode())
        update_from_file(digest, file)
    return digest.hexdigest()


def update_from_file(digest: Any, path: str | os.PathLike[str]) -> Any:
    """Feed a file's bytes into ``digest`` (a hashlib object) in 8 MiB blocks; return it."""
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest


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
