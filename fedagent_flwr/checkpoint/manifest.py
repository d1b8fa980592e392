"""Which files of a checkpoint directory travel between machines, and their per-file hashes.

A checkpoint sent through a store is described by a :class:`Manifest`: every file a reader needs
(weights, configs, tokenizer files, verl's ``huggingface/`` subfolder) with its size and sha256.
verl's optimiser and extra-state shards stay behind: they are never averaged and are about twice
the model. Both ends check every file against the manifest, and the directory as a whole against
the reference's content hash (:func:`~fedagent_flwr.checkpoint.ref.hash_checkpoint_dir`).

File names are the one piece of a transfer a peer chooses, so :func:`check_file_name` admits only
plain names (one optional ``huggingface/`` level): no ``..``, no absolute paths, no path
separators, no control characters, no hidden names. Spaces and other printable characters are
fine (a hub snapshot may hold ``"Model Card.md"``): a name is always one path component joined
under its directory, and travels as an encoded query parameter, never inside a URL path.

Hidden files and folders (``.gitattributes``, ``.gitignore``, ``.git/``, the hub's ``.cache/``)
are not model files: every hub snapshot and git clone holds some, no loader reads them, so they
stay behind (and out of the content hash, :func:`~fedagent_flwr.checkpoint.ref.hashed_files`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedagent_flwr.checkpoint.ref import CheckpointError, is_hidden, is_sha256, update_from_file

HF_SUBDIR = "huggingface"
MAX_FILES = 4096  # a verl checkpoint of 1024 ranks plus configs fits; more is not a checkpoint
MAX_NAME_CHARS = 200
_FORBIDDEN_CHARS = frozenset("/\\")  # separators: a name is always one path component
_SKIPPED_PREFIXES = ("optim_", "extra_state_")


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its relative POSIX name, size in bytes and sha256 (hex)."""

    name: str
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class Manifest:
    """The files of one checkpoint directory, sorted by name."""

    files: tuple[FileEntry, ...]

    def to_json(self) -> list[dict[str, Any]]:
        return [f.to_json() for f in self.files]

    @classmethod
    def from_json(cls, payload: Any, max_file_bytes: int | None = None) -> Manifest:
        """Parse and check a manifest received from a peer; CheckpointError names the problem."""
        if not isinstance(payload, list):
            raise CheckpointError(f"manifest must be a list of files, got {type(payload).__name__}")
        if not payload:
            raise CheckpointError("manifest lists no files")
        if len(payload) > MAX_FILES:
            raise CheckpointError(f"manifest lists {len(payload)} files, more than {MAX_FILES}")
        entries = []
        for item in payload:
            if not isinstance(item, dict) or set(item) != {"name", "size", "sha256"}:
                raise CheckpointError(f"manifest entry {item!r} must have exactly name, size and sha256")
            name, size, digest = item["name"], item["size"], item["sha256"]
            check_file_name(name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise CheckpointError(f"manifest entry {name!r}: size {size!r} is not a byte count")
            if max_file_bytes is not None and size > max_file_bytes:
                raise CheckpointError(f"manifest entry {name!r}: {size} bytes exceeds the limit of {max_file_bytes}")
            check_sha256(digest, f"manifest entry {name!r}")
            entries.append(FileEntry(name, size, digest))
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise CheckpointError("manifest lists a file twice")
        listed = set(names)
        for name in names:
            folder = name.rpartition("/")[0]
            if folder in listed:
                raise CheckpointError(f"manifest lists {folder!r} both as a file and as the folder of {name!r}; "
                                      "a checkpoint cannot have a file and a folder of the same name")
        return cls(tuple(sorted(entries, key=lambda e: e.name)))

    def entry(self, name: str) -> FileEntry:
        for file in self.files:
            if file.name == name:
                return file
        raise CheckpointError(f"{name!r} is not in the manifest")


def check_sha256(value: Any, what: str) -> str:
    """``value`` if it is a lowercase hex sha256 digest, else CheckpointError naming ``what``."""
    if not is_sha256(value):
        raise CheckpointError(f"{what}: {str(value)[:80]!r} is not a sha256 hex digest")
    return value


def check_file_name(name: Any) -> str:
    """A checkpoint file name a peer may use: ``file`` or ``huggingface/file``.

    Each part is one path component: printable characters (spaces included), no ``/`` or
    ``\\``, not hidden (so never ``.`` or ``..``), no leading or trailing whitespace, at most
    ``MAX_NAME_CHARS`` characters. So a name can never address a path outside its directory,
    whatever the peer sends.
    """
    if not isinstance(name, str):
        raise CheckpointError(f"file name {name!r} is not a string")
    parts = name.split("/")
    shape_ok = len(parts) == 1 or (len(parts) == 2 and parts[0] == HF_SUBDIR)
    problem = "" if shape_ok else f"at most one '{HF_SUBDIR}/' folder level is allowed"
    for part in parts if shape_ok else ():
        problem = _name_part_problem(part)
        if problem:
            break
    if problem:
        raise CheckpointError(f"file name {name[:120]!r} is not allowed: {problem}")
    return name


def _name_part_problem(part: str) -> str:
    """Why ``part`` cannot be one component of a transferred file name ("" if it can)."""
    if not part:
        return "empty name or folder"
    if len(part) > MAX_NAME_CHARS:
        return f"longer than {MAX_NAME_CHARS} characters"
    if part.startswith("."):
        return "hidden names (and '.', '..') are not model files"
    if part != part.strip():
        return "leading or trailing whitespace"
    if not part.isprintable() or any(ch in _FORBIDDEN_CHARS for ch in part):
        return "control characters, '/' and '\\' are not allowed"
    return ""


def transfer_files(directory: str | os.PathLike[str]) -> list[str]:
    """Relative names of the files of ``directory`` that a store transfers, sorted.

    Top-level regular files except optimiser and extra-state shards and hidden files, plus the
    non-hidden files of ``huggingface/``. Anything with a name a peer would refuse is refused
    here already, naming the file.
    """
    root = Path(directory)
    names = []
    for path in sorted(root.iterdir()):
        if is_hidden(path.name):
            continue
        if path.is_file() and not path.name.startswith(_SKIPPED_PREFIXES):
            names.append(path.name)
        elif path.is_dir() and path.name == HF_SUBDIR:
            names += [f"{HF_SUBDIR}/{p.name}" for p in sorted(path.iterdir()) if p.is_file() and not is_hidden(p.name)]
    for name in names:
        try:
            check_file_name(name)
        except CheckpointError as exc:
            raise CheckpointError(f"{root / name} cannot be transferred: {exc}; rename or remove it") from None
    if not names:
        raise CheckpointError(f"{root} holds no file to transfer")
    return names


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of one file (hex), streamed."""
    return str(update_from_file(hashlib.sha256(), path).hexdigest())


def build_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Describe the transferable files of ``directory`` (one read of each file)."""
    root = Path(directory)
    return Manifest(tuple(
        FileEntry(name, (root / name).stat().st_size, file_sha256(root / name)) for name in transfer_files(root)
    ))
