"""The staging folder of one upload slot of the http store (:mod:`.http_server`), on disk.

``<run root>/round_<r>/client_<c>/.upload-<kind>/`` holds ``files/`` (each file as ``<name>.part``
while it arrives, under its own name once its bytes match their sha256) and ``received.json``
(``{name: {"size", "sha256"}}`` of the complete files). The http store's routes hold the slot's
lock around every call here.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from fedagent_flwr.atomic import fsync_file
from fedagent_flwr.checkpoint.manifest import HF_SUBDIR, FileEntry, file_sha256
from fedagent_flwr.checkpoint.receipts import FileStat, wait_for_tick
from fedagent_flwr.checkpoint.ref import CheckpointError, hash_checkpoint_dir

#: ``{name: (sha256 hex, stat it was hashed under or None)}`` of the files one pass checked
#: (:func:`check_in_place`): what a receipt, or the node cache's content hash, is built from.
CheckedFiles = dict[str, tuple[str, FileStat | None]]

RECEIVED = "received.json"
FILES = "files"
PART = ".part"


def received(staging: Path) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "sha256"}}`` of the files the slot holds complete and verified."""
    try:
        return dict(json.loads((staging / RECEIVED).read_text()))
    except FileNotFoundError:
        return {}


def partial(staging: Path) -> dict[str, int]:
    """``{name: bytes held}`` of the files still arriving."""
    files = staging / FILES
    if not files.is_dir():
        return {}
    return {p.relative_to(files).as_posix()[: -len(PART)]: p.stat().st_size for p in files.rglob(f"*{PART}")}


def held_files(staging: Path) -> int:
    """Files an upload's staging folder holds, complete or partial (each counts once)."""
    count = 0
    for folder in (staging / FILES, staging / FILES / HF_SUBDIR):
        try:
            with os.scandir(folder) as entries:
                count += sum(1 for entry in entries if entry.is_file(follow_symlinks=False))
        except FileNotFoundError:
            continue
    return count


def name_conflict(staging: Path, name: str) -> str:
    """Why file ``name`` (checked by :func:`~.manifest.check_file_name`) cannot be stored beside
    what the slot already holds ("" if it can): a file and a folder of the same name.

    ``huggingface/x`` needs ``huggingface`` to be a folder, so a file ``huggingface`` (complete or
    still arriving) excludes it, and the other way round.
    """
    files = staging / FILES
    folder, _, _ = name.rpartition("/")
    if folder and ((files / folder).is_file() or (files / (folder + PART)).exists()):
        return (f"{name!r} needs '{folder}' to be a folder, but this upload already holds a file "
                f"'{folder}'; a checkpoint cannot have a file and a folder of the same name")
    if (files / name).is_dir():
        return (f"{name!r} is a folder of this upload (it holds '{name}/...' files); a checkpoint "
                "cannot have a file and a folder of the same name")
    return ""


def hash_and_sync(path: Path) -> tuple[str, FileStat | None]:
    """The sha256 (hex) of the received file, and its stat from before it was hashed if nothing
    can have changed it since without changing that stat (else None). The http store calls it on
    receipt, the s3 store after each download of an upload (the stat goes into their receipts).

    The filesystem's clock is let tick past the file's ``ctime`` before hashing starts (as
    :func:`~.receipts.write_receipt` does for its stamp), so a write during the hashing or after it
    gives the file a later ``ctime``, even one that puts the size and mtime back; a write before
    the stat went into the bytes hashed.
    """
    fsync_file(path)  # a crash must not leave a short "complete" file
    before = FileStat.of(os.stat(path))
    ticked = wait_for_tick(path.parent, before.ctime_ns)
    digest = file_sha256(path)
    after = FileStat.of(os.stat(path))
    return digest, before if ticked and after == before else None


def check_in_place(final: Path, entry: FileEntry, checked: CheckedFiles, what: str) -> None:
    """Hash the downloaded file ``final`` (already under its own name, fsynced first) against
    ``entry``: noted in ``checked`` with its stat (:func:`hash_and_sync`) when it matches, else
    deleted and CheckpointError naming ``what`` (where it came from).

    The s3 store's download of an upload and the node's download of a global model (http, s3)
    check each file this way, once, so that the folder's content hash can be combined from these
    digests while each file's stat is still the one it was hashed under, instead of reading the
    folder again. A file under its own name may predate a crash between its rename and this
    check, so a caller checks a file it finds there again rather than trusting it.
    """
    actual, stat = hash_and_sync(final)
    if actual != entry.sha256:
        final.unlink()
        raise CheckpointError(f"{what}: {entry.name} has sha256 {actual[:16]}..., which differs from the "
                              f"manifest's {entry.sha256[:16]}...; refused and discarded")
    checked[entry.name] = (actual, stat)


def recheck_leftover(final: Path, entry: FileEntry, checked: CheckedFiles, what: str) -> bool:
    """True when ``final`` is already there and matches ``entry`` (checked again, noted in
    ``checked``: an interrupted pass may have left it between its rename and its check); False
    when the caller must download it (absent, or found wrong and deleted)."""
    if not final.is_file():
        return False
    try:
        check_in_place(final, entry, checked, what)
    except CheckpointError:
        return False  # deleted by the check
    return True


def checked_content_hash(staging: Path, checked: CheckedFiles) -> str:
    """The content hash of the downloaded folder ``staging``, reading only what it must: files the
    manifest does not list are removed first, each ``checked`` file whose stat is unchanged since
    its check contributes its digest, and any other file is hashed. The node's fetch of a global
    model (:func:`.node_cache.fill_cache`) and the s3 store's download of an upload both end here."""
    _drop_unlisted(staging, checked)
    return hash_checkpoint_dir(staging, known=_still_checked(staging, checked))


def _drop_unlisted(staging: Path, checked: CheckedFiles) -> None:
    """Remove from ``staging`` every file and folder the download did not check against the
    manifest: the content hash covers weights and configs only, so a leftover of an interrupted
    fetch whose manifest listed other files (a tokenizer, a ``.part``, a clock probe) would
    otherwise enter the cache unchecked beside this model."""
    listed = {Path(name) for name in checked}
    parents = {parent for name in listed for parent in name.parents}
    for path in sorted(staging.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        relative = path.relative_to(staging)
        if relative in listed or (relative in parents and path.is_dir() and not path.is_symlink()):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def _still_checked(staging: Path, checked: CheckedFiles) -> dict[str, tuple[int, bytes]]:
    """``{name: (size, raw sha256)}`` of the ``checked`` files whose stat is still the one they
    were hashed under (all five fields): the content hash takes their digests without reading
    them. A file without a trustworthy stat (it may have changed while hashed), one changed or
    gone since, is left out, so it is hashed (or missed) like any file nobody checked."""
    known: dict[str, tuple[int, bytes]] = {}
    for name, (sha256, stat) in checked.items():
        try:
            now = FileStat.of(os.stat(staging / name))
        except FileNotFoundError:
            continue
        if stat is not None and now == stat:
            known[name] = (stat.size, bytes.fromhex(sha256))
    return known


def write_through(handle: Any, chunk: bytes) -> None:
    # Flushed per chunk: the size on disk is what the status endpoint reports, and what survives a dropped link.
    handle.write(chunk)
    handle.flush()
