"""A node's fetch of a global model hashes each downloaded file once (on a real http store on
loopback): the folder's content hash is combined from the digests just checked against the
manifest, a file changed after its check is hashed again (and the model refused), and a file an
interrupted fetch left under its own name is checked again before it is kept."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedagent_flwr.checkpoint import http_client, upload_staging
from fedagent_flwr.checkpoint.http_server import HttpServerStore
from fedagent_flwr.checkpoint.manifest import FileEntry, build_manifest
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef, hash_checkpoint_dir
from fedagent_flwr.checkpoint.store import StorageSettings
from fedagent_flwr.checkpoint.upload_staging import CheckedFiles
from testkit.store_harness import RUN, HashCounter, manifest_bytes, node

WEIGHTS = "model.safetensors"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[HttpServerStore]:
    (tmp_path / "run").mkdir()
    with HttpServerStore(StorageSettings(kind="http"), tmp_path / "run", RUN) as running:
        yield running  # type: ignore[misc]


@pytest.fixture
def shared(store: HttpServerStore) -> CheckpointRef:
    """A small global model of the run: weights, a config and a file the content hash leaves out."""
    directory = store.run_root / "round_1" / "global"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model": "m"}')
    (directory / WEIGHTS).write_bytes(bytes(range(256)) * 4000)
    (directory / "tokenizer.model").write_bytes(b"t" * 5000)
    return store.share(CheckpointRef.for_directory(directory))


def test_each_downloaded_file_is_hashed_once(
        store: HttpServerStore, shared: CheckpointRef, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checks: list[str] = []
    real_sha256 = upload_staging.file_sha256

    def counted(path: Path) -> str:
        checks.append(Path(path).name)
        return real_sha256(path)

    monkeypatch.setattr(upload_staging, "file_sha256", counted)
    hashed = HashCounter().install(monkeypatch)  # the content hash's sha256 (the per-file check is not counted)
    client = node(store, tmp_path / "node0")
    local = client.fetch(shared)
    assert sorted(checks) == sorted(entry.name for entry in build_manifest(local).files)  # once each
    assert hashed.bytes < 1024, hashed.bytes  # the content hash combined from those digests: no re-read
    monkeypatch.undo()
    assert hash_checkpoint_dir(local) == shared.sha256 and local == tmp_path / "node0" / "cache" / shared.sha256
    assert client.report.bytes_received == manifest_bytes(store.run_root / "round_1" / "global")


@pytest.mark.parametrize("put_mtime_back", [False, True])
def test_a_file_changed_after_its_check_is_hashed_again_and_the_model_refused(
        store: HttpServerStore, shared: CheckpointRef, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        put_mtime_back: bool) -> None:
    """The weights are rewritten (same size) right after their check, before the folder's content
    hash: their stat no longer matches, so they are hashed, and the model never enters the cache;
    putting the mtime back does not hide it (the change moved ``ctime``)."""
    real_check = http_client.check_in_place

    def check_then_change(final: Path, entry: FileEntry, checked: CheckedFiles, what: str) -> None:
        real_check(final, entry, checked, what)
        if entry.name == WEIGHTS:
            before = final.stat()
            data = bytearray(final.read_bytes())
            data[100] ^= 0xFF
            final.write_bytes(bytes(data))
            if put_mtime_back:
                os.utime(final, ns=(before.st_atime_ns, before.st_mtime_ns))

    monkeypatch.setattr(http_client, "check_in_place", check_then_change)
    cache = tmp_path / "node0" / "cache"
    with pytest.raises(CheckpointError, match="downloaded files hash to .*discarded"):
        node(store, tmp_path / "node0").fetch(shared)
    assert not (cache / shared.sha256).exists() and not list(cache.glob(".partial-*"))
    monkeypatch.undo()
    local = node(store, tmp_path / "node0").fetch(shared)  # the next fetch downloads it whole again
    assert hash_checkpoint_dir(local) == shared.sha256


def test_a_file_an_interrupted_fetch_left_is_checked_again(
        store: HttpServerStore, shared: CheckpointRef, tmp_path: Path) -> None:
    """A file is renamed to its name in ``.partial-<hash>/`` before its check: a crash in between
    leaves it there unchecked. The next fetch hashes it, downloads it again when it does not
    match, and keeps one that does (without downloading it)."""
    source = store.run_root / "round_1" / "global"
    staging = tmp_path / "node0" / "cache" / f".partial-{shared.sha256}"
    staging.mkdir(parents=True)
    weights = (source / WEIGHTS).read_bytes()
    (staging / WEIGHTS).write_bytes(weights[:-1] + bytes([weights[-1] ^ 1]))  # same size, wrong bytes
    (staging / "config.json").write_bytes((source / "config.json").read_bytes())  # whole and right
    client = node(store, tmp_path / "node0")
    local = client.fetch(shared)
    assert (local / WEIGHTS).read_bytes() == weights and hash_checkpoint_dir(local) == shared.sha256
    assert client.report.files_skipped == 1  # config.json kept
    assert client.report.bytes_received == manifest_bytes(source) - (source / "config.json").stat().st_size


def test_files_the_manifest_does_not_list_never_enter_the_cache(
        store: HttpServerStore, shared: CheckpointRef, tmp_path: Path) -> None:
    """The content hash covers weights and configs only: what an interrupted fetch of another
    manifest left in ``.partial-<hash>/`` (a tokenizer file this model lacks, a half download, a
    clock probe, a folder) is removed before the model is checked and renamed into the cache."""
    staging = tmp_path / "node0" / "cache" / f".partial-{shared.sha256}"
    (staging / "extra" / "deep").mkdir(parents=True)
    strays = {"merges.txt": b"a b", "merges.txt.part": b"half", ".clock-abc": b"", "extra/deep/x.bin": b"x"}
    for name, data in strays.items():
        (staging / name).write_bytes(data)
    local = node(store, tmp_path / "node0").fetch(shared)
    listed = sorted(entry.name for entry in build_manifest(store.run_root / "round_1" / "global").files)
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*")) == listed
    assert hash_checkpoint_dir(local) == shared.sha256
