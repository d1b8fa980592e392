"""Receipts: the record of the file digests a store verified on upload (http, s3), trusted while
the files' stat data is unchanged, so the aggregation need not hash those bytes a second time.

The store's server half hashes every uploaded file once it has it on disk and keeps it only when
the digest matches the one the client declared (:mod:`.http_server` on receipt, :mod:`.s3_store`
after each download, both through :func:`~.upload_staging.hash_and_sync`). At commit (s3: once the
downloaded folder is in place) it writes a receipt
beside the checkpoint directory (:func:`receipt_path`): per file its sha256 and its stat data
(size, ``st_mtime_ns``, ``st_ctime_ns``, ``st_ino``, ``st_dev``), authenticated with an HMAC keyed
by the store's per-run secret. When the aggregation opens the checkpoint
(:func:`~fedagent_flwr.checkpoint.open_ref.open_checkpoint` with a :class:`ReceiptCheck`), a file
whose current stat equals its receipt's exactly takes the recorded digest instead of being hashed;
any other file is hashed while read, as without receipts. The stat is taken by path here, so the
reader also compares the receipt with the ``fstat`` of the file it opened and reads only through
that descriptor (:class:`~.shard_file.ShardFile`): a file whose opened stat differs is hashed
while read instead, so a path swapped to another file around the open cannot pass. The
reference's content hash is still checked, from the per-file digests
(:func:`~.content_hash.combine_file_digests`), so a receipt of other content can never pass, and
the stat is checked again after the reads, so a file changed while it was read is refused.

What this guards against (docs/performance.md, "Trusting the store's receipts"): any change to a
file after receipt through the filesystem API, including one that restores the mtime with
``utime`` (the kernel sets ``ctime`` on every change and offers no call to set it), a file
replaced by another (inode), and a receipt edited or forged without the key (HMAC). Not: a writer
who can forge ``ctime`` (root changing the clock or editing the filesystem), or bits that rot on
disk without the filesystem noticing; the shared-fs store writes no receipts and hashes on every
read. Like git's index, a file whose ``ctime`` is not strictly older than the receipt could still
change within the same timestamp tick ("racily clean"), so it is never trusted; the writer waits
for the clock to pass the files' ticks before it stamps the receipt.

Every failure (no receipt, unreadable, wrong key, other version, stat differs) means "hash it",
never "trust it".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fedagent_flwr.atomic import atomic_path

__all__ = [
    "RECEIPT_VERSION",
    "FileStat",
    "ReceiptCheck",
    "TrustedDigests",
    "TrustedFile",
    "changed_while_read",
    "fresh_stat",
    "stat_now",
    "receipt_key",
    "receipt_path",
    "wait_for_tick",
    "write_receipt",
]

RECEIPT_VERSION = 1
_STAMP_WAIT_S = 0.002  # between checks of the filesystem clock while waiting for it to tick
_STAMP_TRIES = 500  # a coarse clock ticks every few ms; 1 s without a tick means something else is wrong


@dataclass(frozen=True)
class FileStat:
    """The stat data a receipt records of one file; any change of the file changes one of them."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int

    @classmethod
    def of(cls, result: os.stat_result) -> FileStat:
        return cls(result.st_size, result.st_mtime_ns, result.st_ctime_ns, result.st_ino, result.st_dev)


def fresh_stat(path: str | os.PathLike[str]) -> FileStat:
    """The stat of ``path`` through a descriptor opened for it: on NFS a stat by name may answer
    from the client's attribute cache (up to ``acregmax``, 60 s by default) and miss a change made
    from another host, while an open revalidates the attributes (close-to-open consistency)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return FileStat.of(os.fstat(fd))
    finally:
        os.close(fd)


def stat_now(path: str | os.PathLike[str]) -> FileStat | str:
    """:func:`fresh_stat` of ``path``, or ``"unreadable (<reason>)"`` where it cannot be opened: what
    a check that a file is unchanged since its hash compares with the stat it kept (and names)."""
    try:
        return fresh_stat(path)
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def changed_while_read(path: str | os.PathLike[str], trusted: FileStat, held: FileStat | str | None) -> str | None:
    """None while the file at ``path`` is still the one whose digest was taken at stat ``trusted``:
    its stat now (:func:`stat_now`) and ``held``, the stat through the descriptor it was read from
    (None: no descriptor held), both equal it. Otherwise the message naming the file and the stats,
    which a reader (:meth:`.CheckpointReader.check_unchanged`) and the audit
    (:meth:`.AuditDigests.check_read`) raise once their reads are done."""
    now = stat_now(path)
    if now == trusted and (held is None or held == trusted):
        return None
    through = f", {held} of the file read" if held is not None else ""
    return (f"{path} changed while it was read (its stat no longer matches the one its digest was taken at: "
            f"{trusted} then{through}, {now} at its path now)")


@dataclass(frozen=True)
class TrustedFile:
    """A file whose digest is taken from a receipt: valid while its stat equals ``stat``."""

    digest: bytes  # raw sha256 of the file, as the content hash uses it
    stat: FileStat


class TrustedDigests(Protocol):
    """What vouches for files' digests when a checkpoint is opened
    (:func:`~fedagent_flwr.checkpoint.open_ref.open_checkpoint`'s ``receipts``): a store's receipts
    (:class:`ReceiptCheck`), or the digests the audit computed already (:mod:`.audit_digests`)."""

    def trusted(self, directory: str | os.PathLike[str]) -> dict[str, TrustedFile]:
        """The files of ``directory`` whose digest is vouched for, by name, each valid while its
        stat equals the one recorded."""
        ...


def receipt_key(secret: bytes, run_key: str) -> bytes:
    """The key that authenticates a store's receipts, derived from its random per-run ``secret``:
    a receipt of another run, or one written by anything but that store, is not trusted."""
    return hmac.new(secret, f"{run_key}:receipt".encode(), hashlib.sha256).digest()


def receipt_path(directory: str | os.PathLike[str]) -> Path:
    """Where the receipt of checkpoint ``directory`` lives: ``<parent>/.receipt-<name>.json``,
    beside it (outside the directory, so it is neither hashed nor read as a checkpoint file)."""
    path = Path(directory)
    return path.parent / f".receipt-{path.name}.json"


def wait_for_tick(directory: str | os.PathLike[str], after_ns: int) -> bool:
    """Wait until the filesystem's clock in ``directory`` (the one ``ctime`` comes from) reads
    later than ``after_ns``; False if it did not within about a second (a clock that does not move
    means something else is wrong: the caller then trusts nothing). A hidden probe file is
    created and removed again."""
    fd, name = tempfile.mkstemp(prefix=".clock-", dir=directory)
    os.close(fd)
    probe = Path(name)
    try:
        for _ in range(_STAMP_TRIES):
            if os.stat(probe).st_mtime_ns > after_ns:
                return True
            time.sleep(_STAMP_WAIT_S)
            os.utime(probe)
        return os.stat(probe).st_mtime_ns > after_ns
    finally:
        probe.unlink(missing_ok=True)


def _checkpoint_name(directory: str | os.PathLike[str]) -> str:
    # Signed with the files: a receipt names the checkpoint it was written for, so it cannot be
    # copied beside another one.
    return str(Path(directory).resolve())


def _mac(key: bytes, body: Mapping[str, Any]) -> str:
    return hmac.new(key, json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()


def write_receipt(directory: str | os.PathLike[str], verified: Mapping[str, tuple[str, FileStat]],
                  key: bytes) -> list[str]:
    """Record the files of ``directory`` whose digest the caller verified on receipt.

    ``verified`` maps a file name (relative, posix) to its sha256 (hex) and its stat taken before
    those bytes were hashed (with the clock let tick past its ``ctime``, :func:`wait_for_tick`); a
    file whose stat is not exactly that any more is left out. The receipt names ``directory``,
    is written under a temporary name and renamed into place; its stamp (the filesystem's clock
    when it was written) is strictly later than every recorded ``ctime`` (the writer waits for the
    clock to tick when needed), else the file is left out. Returns the names recorded.
    """
    root = Path(directory)
    files: dict[str, dict[str, Any]] = {}
    for name, (sha256, checked) in sorted(verified.items()):
        try:
            now = FileStat.of(os.stat(root / name, follow_symlinks=False))
        except OSError:
            continue
        if now == checked:  # nothing changed since it was hashed: a change would have moved ctime
            files[name] = {"sha256": sha256, **now.__dict__}
    target = receipt_path(root)
    with atomic_path(target) as tmp:
        newest = max((f["ctime_ns"] for f in files.values()), default=0)
        tmp.write_bytes(b"")
        stamp = os.stat(tmp).st_mtime_ns
        for _ in range(_STAMP_TRIES):
            if stamp > newest:
                break
            time.sleep(_STAMP_WAIT_S)
            os.utime(tmp)  # the filesystem's own clock, the one ctime comes from
            stamp = os.stat(tmp).st_mtime_ns
        files = {name: entry for name, entry in files.items() if entry["ctime_ns"] < stamp}
        body = {"version": RECEIPT_VERSION, "checkpoint": _checkpoint_name(root), "stamp_ns": stamp, "files": files}
        tmp.write_text(json.dumps({**body, "hmac": _mac(key, body)}, sort_keys=True))
    return sorted(files)


class ReceiptCheck:
    """Reads receipts written with ``key`` (the store's secret) for the aggregation."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def trusted(self, directory: str | os.PathLike[str]) -> dict[str, TrustedFile]:
        """The files of ``directory`` whose receipt holds and whose stat now equals it exactly.

        An absent, unreadable or unauthenticated receipt gives nothing (every file is hashed);
        so does any file whose stat differs or whose ``ctime`` is not older than the receipt.
        """
        try:
            data = json.loads(receipt_path(directory).read_text())
            body = {k: data[k] for k in ("version", "checkpoint", "stamp_ns", "files")}
            mac = data["hmac"]
            if not (isinstance(mac, str) and hmac.compare_digest(mac, _mac(self._key, body))):
                return {}
            if body["checkpoint"] != _checkpoint_name(directory):
                return {}
            if body["version"] != RECEIPT_VERSION:
                return {}
            stamp = int(body["stamp_ns"])
            entries = dict(body["files"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}
        trusted: dict[str, TrustedFile] = {}
        root = Path(directory)
        for name, entry in entries.items():
            try:
                recorded = FileStat(**{f: int(entry[f]) for f in ("size", "mtime_ns", "ctime_ns", "ino", "dev")})
                digest = bytes.fromhex(str(entry["sha256"]))
                now = FileStat.of(os.stat(root / name, follow_symlinks=False))
            except (OSError, ValueError, TypeError, KeyError):
                continue
            if now == recorded and recorded.ctime_ns < stamp and len(digest) == hashlib.sha256().digest_size:
                trusted[name] = TrustedFile(digest, recorded)
        return trusted
