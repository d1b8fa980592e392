"""The audit's digests (:mod:`fedagent_flwr.checkpoint.audit_digests`): the same content hash as
``hash_checkpoint_dir``; a digest reused only while its file's stat is unchanged, so a file changed
in place (its mtime restored or not) or replaced by another of the same size is hashed again and
gets its new digest; nothing reused of a file younger than ``RACY_NS`` or one that changed while it
was hashed. The audit's own use, on real runs: tests/serverapp/strategy/test_verify_hash_once.py."""

from __future__ import annotations

import collections
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from fedagent_flwr.checkpoint import audit_digests, content_hash
from fedagent_flwr.checkpoint.audit_digests import AuditDigests
from fedagent_flwr.checkpoint.content_hash import hash_checkpoint_dir
from testkit.file_change import flip_byte
from testkit.hash_count import count_hashed_files


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Files hashed, by name (each still hashed from disk)."""
    return count_hashed_files(monkeypatch)


def _checkpoint(directory: Path) -> Path:
    directory.mkdir()
    for index in range(3):  # more files than one thread
        (directory / f"model-{index}.safetensors").write_bytes(bytes(range(256)) * (index + 1))
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "notes.txt").write_text("not hashed")
    return directory


def _rewrite(path: Path, restore_mtime: bool) -> None:
    """Flip the first byte in place, same size and inode; the mtime restored if told."""
    flip_byte(path, restore_mtime)


def test_the_directory_hash_is_hash_checkpoint_dirs_and_each_file_is_hashed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashed: collections.Counter[str],
) -> None:
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)
    directory = _checkpoint(tmp_path / "ckpt")
    expected = hash_checkpoint_dir(directory)
    hashed.clear()
    digests = AuditDigests()
    assert digests.directory_hash(directory) == expected == digests.directory_hash(directory)
    model = directory / "model-1.safetensors"
    assert digests.file_digest(model) == hashlib.sha256(model.read_bytes()).digest()
    assert hashed == {"model-0.safetensors": 1, "model-1.safetensors": 1, "model-2.safetensors": 1,
                      "config.json": 1}
    assert sorted(digests.trusted(directory)) == ["config.json", *(f"model-{i}.safetensors" for i in range(3))]
    assert hash_checkpoint_dir(directory, known={n: (t.stat.size, t.digest) for n, t in
                                                 digests.trusted(directory).items()}) == expected


@pytest.mark.parametrize("change", ["in-place", "in-place-mtime-restored", "replaced-mtime-restored"])
def test_a_file_changed_after_it_was_hashed_is_hashed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashed: collections.Counter[str], change: str,
) -> None:
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)
    directory = _checkpoint(tmp_path / "ckpt")
    model = directory / "model-0.safetensors"
    digests = AuditDigests()
    before = digests.directory_hash(directory)
    if change == "replaced-mtime-restored":  # another file (inode) of the same size and mtime
        stat = model.stat()
        other = directory / "other.bin"
        other.write_bytes(bytes(255 - b for b in model.read_bytes()))
        os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        other.replace(model)
    else:
        _rewrite(model, restore_mtime=change.endswith("restored"))
    assert sorted(digests.trusted(directory)) == ["config.json", "model-1.safetensors", "model-2.safetensors"]
    now = hash_checkpoint_dir(directory)
    hashed.clear()
    assert digests.directory_hash(directory) == now != before
    assert digests.file_digest(model) == hashlib.sha256(model.read_bytes()).digest()  # the new digest, kept
    assert hashed == {"model-0.safetensors": 1}, hashed


def test_a_file_younger_than_the_margin_is_hashed_at_every_use(
    tmp_path: Path, hashed: collections.Counter[str],
) -> None:
    directory = _checkpoint(tmp_path / "ckpt")  # just written: within RACY_NS
    digests = AuditDigests()
    digests.directory_hash(directory)
    digests.directory_hash(directory)
    assert digests.trusted(directory) == {} and set(hashed.values()) == {2}, hashed


def _rewrite_after_each_hash(monkeypatch: pytest.MonkeyPatch) -> Callable[[str | os.PathLike[str]], bytes]:
    """Make every file hash rewrite its file in place (mtime restored) once its bytes are read, as a write
    during the hash to bytes it had already read; returns the hasher it replaced."""
    counting = content_hash.file_digest

    def changed_after_reading(path: str | os.PathLike[str]) -> bytes:
        digest = counting(path)
        _rewrite(Path(path), restore_mtime=True)
        return digest

    monkeypatch.setattr(content_hash, "file_digest", changed_after_reading)
    return counting


def test_a_file_changed_while_it_was_hashed_is_not_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashed: collections.Counter[str],
) -> None:
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)
    model = _checkpoint(tmp_path / "ckpt") / "model-0.safetensors"
    counting = _rewrite_after_each_hash(monkeypatch)
    digests = AuditDigests()
    stale = digests.file_digest(model)
    monkeypatch.setattr(content_hash, "file_digest", counting)
    assert digests.file_digest(model) == hashlib.sha256(model.read_bytes()).digest() != stale
    assert hashed["model-0.safetensors"] == 2


def test_a_file_changed_while_it_was_hashed_is_watched_with_its_stat_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rewritten in place during its hash, in bytes the hash had already read: the digest is the old
    content's, so it can match the reference, and the stat when the hash ended is already the new one;
    watched with that, the check after the reads passed and the new bytes were used. The stat before the
    hash is given instead, which no later stat equals, so the reader's check refuses it."""
    from fedagent_flwr.checkpoint.receipts import fresh_stat

    model = _checkpoint(tmp_path / "ckpt") / "model-0.safetensors"
    before = fresh_stat(model)
    _rewrite_after_each_hash(monkeypatch)
    digests = AuditDigests()
    digests.file_digest(model)
    assert digests.hashed_stats(model.parent)[model.name] == before != fresh_stat(model)


def test_hashed_stats_gives_every_hashed_file_racy_or_trusted_and_each_stat_when_its_hash_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a round's global model is watched with (open_ref.open_global_model): every hashed file of
    the directory (not notes.txt), a file written moments ago included though its digest is never
    reused, each with its stat when its hash ended; a file changed after that keeps that stat here, so
    the reader's check refuses it."""
    from fedagent_flwr.checkpoint.receipts import fresh_stat

    directory = _checkpoint(tmp_path / "ckpt")  # just written: within RACY_NS, nothing trusted
    digests = AuditDigests()
    digests.directory_hash(directory)
    names = {"model-0.safetensors", "model-1.safetensors", "model-2.safetensors", "config.json"}
    stats = digests.hashed_stats(directory)
    assert digests.trusted(directory) == {} and set(stats) == names
    assert all(stats[name] == fresh_stat(directory / name) for name in names)
    model = directory / "model-0.safetensors"
    at_hash = stats[model.name]
    _rewrite(model, restore_mtime=True)
    assert digests.hashed_stats(directory)[model.name] == at_hash != fresh_stat(model)
    # trusted files (old enough) are given with the stat they are trusted at, the same one
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)
    trusted = AuditDigests()
    trusted.directory_hash(directory)
    assert set(trusted.trusted(directory)) == names
    assert trusted.hashed_stats(directory) == {name: entry.stat for name, entry in trusted.trusted(directory).items()}
    assert AuditDigests().hashed_stats(directory) == {}  # nothing hashed by this audit yet
