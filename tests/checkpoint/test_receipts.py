"""Receipts of the http store (fedagent_flwr.checkpoint.receipts), on a real uvicorn store on
loopback with real FSDP checkpoints: a checkpoint uploaded through the store aggregates without
its bytes being hashed a second time and gives the identical mean; a file changed after receipt
(also with its mtime put back) is hashed and refused with the content-hash mismatch; a receipt
that is corrupt, forged without the store's key or vouching for other content never lets a
changed file through; a rank file's path swapped to another file between the receipt check and the
reader's open (and back) is refused."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from fedagent_flwr.checkpoint import (
    CheckpointError,
    CheckpointReader,
    CheckpointRef,
    audit_digests,
    open_checkpoint,
    weighted_mean,
)
from fedagent_flwr.checkpoint.audit_digests import AuditDigests
from fedagent_flwr.checkpoint.content_hash import hashed_files
from fedagent_flwr.checkpoint.fsdp_reader import FsdpShardReader
from fedagent_flwr.checkpoint.http_server import HttpServerStore
from fedagent_flwr.checkpoint.receipts import FileStat, ReceiptCheck, receipt_path, write_receipt
from fedagent_flwr.checkpoint.safetensors_reader import SafetensorsReader
from fedagent_flwr.checkpoint.store import SharedFsServerStore, StorageSettings
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.retention import Retention
from testkit.ckpt_factory import ModelSpec, Suite, same_size_impostor, write_hf_checkpoint
from testkit.file_change import flip_byte as flip_byte_past_tick
from testkit.store_harness import RUN, SHARD, HashCounter, node

SHARD_W2 = "model_world_size_2_rank_1.pt"


def open_store(root: Path, **settings: Any) -> HttpServerStore:
    root.mkdir(exist_ok=True)
    return HttpServerStore(StorageSettings(kind="http", max_file_bytes=64 * 1024 * 1024, **settings), root, RUN)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[HttpServerStore]:
    with open_store(tmp_path / "run") as running:
        yield running


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> HashCounter:
    return HashCounter().install(monkeypatch)


def upload(store: HttpServerStore, source: Path, work: Path, client: int) -> CheckpointRef:
    """``source`` uploaded by client ``client`` in round 1, as the server's local reference."""
    ref = node(store, work, client=client).put(source, "actor", 1, client)
    return store.resolve(ref, 1, client)


def mean_of(refs: list[CheckpointRef], out: Path, root: Path, receipts: ReceiptCheck | None) -> dict[str, Any]:
    readers = [open_checkpoint(r, root=root, check_hash="while-reading", receipts=receipts) for r in refs]
    try:
        weighted_mean([(r, float(i + 1)) for i, r in enumerate(readers)], out)
        return load_file(str(out / "model.safetensors"))
    finally:
        for reader in readers:
            reader.close()


def hashed_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in hashed_files(directory))


def test_an_uploaded_checkpoint_aggregates_from_its_receipt_without_rehashing(
        store: HttpServerStore, suite: Suite, tmp_path: Path, hashed: HashCounter) -> None:
    sources = [suite.copy("qwen_b", tmp_path / "node0"), suite.copy("qwen_plain", tmp_path / "node1")]
    refs = [upload(store, s, tmp_path / f"node{i}", i) for i, s in enumerate(sources)]
    landed = [Path(r.path) for r in refs]
    assert all(receipt_path(d).is_file() for d in landed)
    checker = store.receipt_check()
    assert checker is not None
    # Every hashed file is vouched for by the receipt, and the reader hashes none of them.
    for directory, ref in zip(landed, refs):
        with open_checkpoint(ref, root=store.run_root, check_hash="while-reading", receipts=checker) as reader:
            assert isinstance(reader, FsdpShardReader)
            assert reader.receipt_files == [p.name for p in hashed_files(directory)]

    hashed.bytes = 0
    trusted = mean_of(refs, tmp_path / "trusted", store.run_root, checker)
    # Only the directory hashes' combining step (name, size, digest per file): no file's bytes.
    combine_bytes = hashed.bytes
    assert combine_bytes < 1024, combine_bytes
    # The same mean, every byte hashed (no receipts): the checkpoints' bytes go through sha256.
    hashed.bytes = 0
    rehashed = mean_of(refs, tmp_path / "rehashed", store.run_root, None)
    assert hashed.bytes >= sum(hashed_bytes(d) for d in landed)
    assert trusted.keys() == rehashed.keys()
    assert all(trusted[k].equal(rehashed[k]) for k in trusted)


def flip_byte(path: Path, restore_mtime: bool) -> None:
    """Change one byte in the middle of ``path`` in place (same size, same inode); with
    ``restore_mtime`` put its mtime back as well."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    if restore_mtime:  # what an editor covering its tracks does; ctime still moves
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = path.stat()
        assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


@pytest.mark.parametrize("restore_mtime", [False, True], ids=["mtime-moved", "mtime-restored"])
def test_a_file_changed_after_receipt_is_hashed_and_refused(
        store: HttpServerStore, suite: Suite, tmp_path: Path, hashed: HashCounter, restore_mtime: bool) -> None:
    ref = upload(store, suite.copy("qwen_b", tmp_path / "node0"), tmp_path / "node0", 0)
    shard = Path(ref.path) / SHARD_W2
    flip_byte(shard, restore_mtime)
    checker = store.receipt_check()
    assert checker is not None
    with open_checkpoint(ref, root=store.run_root, check_hash="while-reading", receipts=checker) as reader:
        assert isinstance(reader, FsdpShardReader)
        assert SHARD_W2 not in reader.receipt_files  # its stat no longer matches: hashed while read
    hashed.bytes = 0
    mismatch = rf"content hash of {Path(ref.path)} is .*\(files changed or incomplete\)"
    with pytest.raises(CheckpointError, match=mismatch):
        mean_of([ref], tmp_path / "out", store.run_root, checker)
    assert hashed.bytes >= shard.stat().st_size
    assert not (tmp_path / "out").exists()


def test_a_file_changed_while_it_is_read_is_refused(store: HttpServerStore, suite: Suite, tmp_path: Path) -> None:
    ref = upload(store, suite.copy("qwen_b", tmp_path / "node0"), tmp_path / "node0", 0)
    checker = store.receipt_check()
    with open_checkpoint(ref, root=store.run_root, check_hash="while-reading", receipts=checker) as reader:
        assert SHARD_W2 in reader.receipt_files  # trusted at opening
        flip_byte(Path(ref.path) / SHARD_W2, restore_mtime=True)
        with pytest.raises(CheckpointError, match=f"{SHARD_W2} changed while it was read"):
            reader.verify_content()


class SwapAfterCheck(ReceiptCheck):
    """The store's receipt check, followed by ``swap``: what another writer could do in the moment
    between the check and the reader's open."""

    def __init__(self, key: bytes, swap: Callable[[], None]) -> None:
        super().__init__(key)
        self._swap = swap

    def trusted(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        found = super().trusted(directory)
        self._swap()
        return found


def test_a_rank_file_swapped_between_receipt_check_and_open_is_refused(
        store: HttpServerStore, suite: Suite, tmp_path: Path) -> None:
    """The rank file's path leads to another file of the same size when the reader opens it, and to
    the original again before the content check: every stat taken by path matches the receipt, but
    the bytes read are the other file's. The reader compares the receipt with the file it opened,
    drops the receipt's trust for it and hashes it while reading, and the content hash refuses it."""
    ref = upload(store, suite.copy("qwen_plain", tmp_path / "node0"), tmp_path / "node0", 0)
    directory = Path(ref.path)
    # A folder rename leaves its files' stat alone (a file rename would move the file's ctime and
    # be caught by the stat check after the reads): swap the checkpoint folder.
    impostor, held = directory.with_name("impostor"), directory.with_name("held")
    shutil.copytree(directory, impostor)
    same_size_impostor(directory / SHARD, impostor / SHARD)
    swaps: list[str] = []

    def swap_in() -> None:
        directory.rename(held)
        impostor.rename(directory)
        swaps.append("in")

    def swap_back() -> None:
        if swaps == ["in"]:
            directory.rename(impostor)
            held.rename(directory)
            swaps.append("back")

    plain = store.receipt_check()
    assert plain is not None and SHARD in plain.trusted(directory)  # the receipt vouches for the original...
    checker = SwapAfterCheck(store.receipt_key(), swap_in)
    refused = re.escape(f"content hash of {directory} is ") + r".*\(files changed or incomplete\)"
    with pytest.raises(CheckpointError, match=refused):
        try:
            reader = open_checkpoint(ref, root=store.run_root, check_hash="while-reading", receipts=checker)
        finally:
            swap_back()  # ...which is back in place before the reads end and the content is checked
        assert isinstance(reader, FsdpShardReader) and SHARD not in reader.receipt_files  # hashed, not trusted
        with reader:
            weighted_mean([(reader, 1.0)], tmp_path / "out")
    assert swaps == ["in", "back"]
    assert not (tmp_path / "out").exists()
    # The original, left alone, still aggregates from its receipt.
    with open_checkpoint(ref, root=store.run_root, check_hash="while-reading", receipts=plain) as reader:
        assert isinstance(reader, FsdpShardReader) and SHARD in reader.receipt_files
        weighted_mean([(reader, 1.0)], tmp_path / "out")


def _rewrite_receipt(directory: Path, key: bytes | None, change: Any) -> None:
    """Edit the receipt's body with ``change`` and sign it with ``key`` (None: keep the old mac)."""
    path = receipt_path(directory)
    data = json.loads(path.read_text())
    body = {k: data[k] for k in ("version", "checkpoint", "stamp_ns", "files")}
    change(body)
    mac = data["hmac"]
    if key is not None:
        mac = hmac.new(key, json.dumps(body, sort_keys=True, separators=(",", ":")).encode(),
                              hashlib.sha256).hexdigest()
    path.write_text(json.dumps({**body, "hmac": mac}))


def _restat(directory: Path, name: str) -> Any:
    def change(body: dict[str, Any]) -> None:
        now = (directory / name).stat()
        body["files"][name].update(size=now.st_size, mtime_ns=now.st_mtime_ns, ctime_ns=now.st_ctime_ns,
                                   ino=now.st_ino, dev=now.st_dev)
        body["stamp_ns"] = now.st_ctime_ns + 1
    return change


@pytest.mark.parametrize("forgery", ["garbage", "wrong-key", "old-mac", "other-content"])
def test_a_forged_or_corrupt_receipt_falls_back_to_hashing(
        store: HttpServerStore, suite: Suite, tmp_path: Path, hashed: HashCounter, forgery: str) -> None:
    ref = upload(store, suite.copy("qwen_b", tmp_path / "node0"), tmp_path / "node0", 0)
    directory = Path(ref.path)
    shard = directory / SHARD_W2
    if forgery == "other-content":
        # Signed with the store's own key, stat matching, but the digest of other bytes: the
        # directory hash over the per-file digests catches it.
        def change(body: dict[str, Any]) -> None:
            body["files"][SHARD_W2]["sha256"] = "ab" * 32
        _rewrite_receipt(directory, store.receipt_key(), change)
        with pytest.raises(CheckpointError, match=rf"content hash of {directory} is .*\(files changed"):
            mean_of([ref], tmp_path / "out", store.run_root, store.receipt_check())
        return
    # The file is changed, and the receipt made to match its new stat (keeping the old digest).
    flip_byte(shard, restore_mtime=False)
    if forgery == "garbage":
        receipt_path(directory).write_text("{not json")
    elif forgery == "wrong-key":
        _rewrite_receipt(directory, b"not the store's key", _restat(directory, SHARD_W2))
    else:
        _rewrite_receipt(directory, None, _restat(directory, SHARD_W2))
    checker = store.receipt_check()
    assert checker is not None
    with open_checkpoint(ref, root=store.run_root, check_hash="while-reading", receipts=checker) as reader:
        assert isinstance(reader, FsdpShardReader)
        assert reader.receipt_files == []  # nothing trusted: the receipt does not authenticate
    hashed.bytes = 0
    with pytest.raises(CheckpointError, match=rf"content hash of {directory} is .*\(files changed or incomplete\)"):
        mean_of([ref], tmp_path / "out", store.run_root, checker)
    assert hashed.bytes >= hashed_bytes(directory)


def test_a_file_changed_between_upload_and_commit_is_not_vouched_for(
        store: HttpServerStore, suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file changed in the store after its upload was verified but before the checkpoint is
    committed (same size, mtime put back) is left out of the receipt, and the aggregation hashes
    it and refuses it."""
    from fedagent_flwr.checkpoint.http_client import HttpClientStore

    request = HttpClientStore._request
    changed: list[Path] = []

    def flip_before_commit(self: HttpClientStore, method: str, url: str, **kwargs: Any) -> Any:
        if method == "POST" and "/uploads/" in url and not changed:  # the commit, after every file's upload
            shard = next(store.run_root.glob(f"round_1/client_0/.upload-actor/*/{SHARD_W2}"))
            flip_byte(shard, restore_mtime=True)
            changed.append(shard)
        return request(self, method, url, **kwargs)

    monkeypatch.setattr(HttpClientStore, "_request", flip_before_commit)
    ref = upload(store, suite.copy("qwen_b", tmp_path / "node0"), tmp_path / "node0", 0)
    assert changed, "the commit request was not seen: the change was not made"
    directory = Path(ref.path)
    checker = store.receipt_check()
    assert checker is not None
    trusted = checker.trusted(directory)
    assert SHARD_W2 not in trusted and "fsdp_config.json" in trusted
    with pytest.raises(CheckpointError, match=rf"content hash of {directory} is .*\(files changed or incomplete\)"):
        mean_of([ref], tmp_path / "out", store.run_root, checker)


def test_a_receipt_copied_beside_another_checkpoint_is_not_trusted(
        store: HttpServerStore, suite: Suite, tmp_path: Path) -> None:
    ref = upload(store, suite.copy("qwen_b", tmp_path / "node0"), tmp_path / "node0", 0)
    directory = Path(ref.path)
    checker = store.receipt_check()
    assert checker is not None and checker.trusted(directory)
    copy = directory.parent / "critic"
    directory.rename(copy)  # the same files (and stat) under another checkpoint's name
    receipt_path(directory).rename(receipt_path(copy))
    assert checker.trusted(copy) == {}


def test_a_receipt_of_another_store_or_run_is_not_trusted(suite: Suite, tmp_path: Path) -> None:
    with open_store(tmp_path / "run") as first:
        ref = upload(first, suite.copy("qwen_a", tmp_path / "node0"), tmp_path / "node0", 0)
    with open_store(tmp_path / "run") as resumed:  # a restarted server: a new secret
        checker = resumed.receipt_check()
        assert checker is not None
        assert checker.trusted(Path(ref.path)) == {}


def test_receipts_can_be_turned_off_and_shared_fs_never_trusts_them(suite: Suite, tmp_path: Path) -> None:
    with open_store(tmp_path / "run", trust_store_receipts=False) as store:
        assert store.receipt_check() is None
        ref = upload(store, suite.copy("qwen_a", tmp_path / "node0"), tmp_path / "node0", 0)
        assert not receipt_path(Path(ref.path)).exists()
    assert SharedFsServerStore(tmp_path / "run").receipt_check() is None


def test_a_file_as_new_as_its_receipt_is_not_trusted(store: HttpServerStore, suite: Suite, tmp_path: Path) -> None:
    # "Racily clean" (git's term): a file whose ctime is not older than the receipt could still
    # change within the same timestamp tick without its stat showing it.
    ref = upload(store, suite.copy("qwen_b", tmp_path / "node0"), tmp_path / "node0", 0)
    directory = Path(ref.path)
    checker = store.receipt_check()
    assert checker is not None and SHARD_W2 in checker.trusted(directory)

    def same_tick(body: dict[str, Any]) -> None:
        body["stamp_ns"] = body["files"][SHARD_W2]["ctime_ns"]
    _rewrite_receipt(directory, store.receipt_key(), same_tick)
    trusted = checker.trusted(directory)
    assert SHARD_W2 not in trusted and "fsdp_config.json" in trusted  # only files older than the stamp


def test_the_writer_stamps_a_receipt_after_every_file_it_records(tmp_path: Path) -> None:
    # Written the moment before the receipt (the same clock tick, as a fast commit gives): the
    # writer waits for the filesystem clock to pass the file's ctime rather than leave it out.
    key = b"k" * 32
    names = [f"model_{i}.json" for i in range(3)]
    verified = {}
    for name in names:
        (tmp_path / name).write_text("{}")
        verified[name] = (hashlib.sha256(b"{}").hexdigest(), FileStat.of((tmp_path / name).stat()))
    assert write_receipt(tmp_path, verified, key) == names
    data = json.loads(receipt_path(tmp_path).read_text())
    assert all(entry["ctime_ns"] < data["stamp_ns"] for entry in data["files"].values())
    assert sorted(ReceiptCheck(key).trusted(tmp_path)) == names
    # A file written again after it was hashed (same size, mtime moved) is not recorded.
    (tmp_path / names[0]).write_text("[]")
    assert write_receipt(tmp_path, verified, key) == names[1:]


def test_a_committed_rounds_receipts_go_with_its_client_checkpoints(
        store: HttpServerStore, suite: Suite, tmp_path: Path) -> None:
    ref = upload(store, suite.copy("qwen_a", tmp_path / "node0"), tmp_path / "node0", 0)
    directory = Path(ref.path)
    assert receipt_path(directory).is_file()
    recorder = RunRecorder(store.run_root, {"base_model": "base", "mode": "federated"})
    # the round's entry, as every round has one: retention notes there what it removes, before it does
    recorder.record_round(server_round=1, clients=[0], started_from="base", client_actors={0: str(directory)},
                          aggregated=None, rejected={}, client_metrics={0: {"num-examples": 1}})
    Retention(store.run_root, keep_client_checkpoints=False).after_commit(recorder, 1)
    assert not directory.exists() and not receipt_path(directory).exists()


def test_a_safetensors_upload_is_checked_at_opening_from_its_receipt(
        store: HttpServerStore, tmp_path: Path, hashed: HashCounter) -> None:
    # hf-safetensors directories are hashed when opened (their files are memory-mapped): the
    # receipt stands in for that hash while the stat holds, and a changed file is hashed and refused.
    source = tmp_path / "node0" / "hf"
    write_hf_checkpoint(ModelSpec("hf", "qwen2", seed=5), source)
    ref = upload(store, source, tmp_path / "node0", 0)
    assert ref.format == "hf-safetensors"
    checker = store.receipt_check()
    hashed.bytes = 0
    open_checkpoint(ref, root=store.run_root, receipts=checker).close()
    assert hashed.bytes < 1024, hashed.bytes
    open_checkpoint(ref, root=store.run_root).close()
    assert hashed.bytes >= hashed_bytes(Path(ref.path))
    flip_byte(Path(ref.path) / "model.safetensors", restore_mtime=True)
    with pytest.raises(CheckpointError, match=f"content hash of {Path(ref.path)}"):
        open_checkpoint(ref, root=store.run_root, receipts=checker)


def _trusted_reader(mode: str, store: HttpServerStore, suite: Suite, tmp_path: Path) -> tuple[CheckpointReader, Path]:
    """A checkpoint opened with its digests taken on trust and its hash checked at opening (not
    while read), and the file of it to change: a store's receipts on an FSDP upload
    (``check_hash=True``) or a safetensors upload (``"while-reading"``, which safetensors checks at
    opening), or the audit's own digests (:class:`.AuditDigests`) on an FSDP checkpoint."""
    if mode == "audit-digests":
        source = suite.copy("qwen_b", store.run_root / "round_1" / "client_0")
        digests = AuditDigests()
        ref = CheckpointRef.for_directory(source, hasher=digests.directory_hash)  # hashed, remembered
        reader = open_checkpoint(ref, root=store.run_root, receipts=digests)
        return reader, source / SHARD_W2
    checker = store.receipt_check()
    assert checker is not None
    if mode == "receipt-safetensors":
        written = tmp_path / "node0" / "hf"
        write_hf_checkpoint(ModelSpec("hf", "qwen2", seed=5), written)
        ref = upload(store, written, tmp_path / "node0", 0)
        reader = open_checkpoint(ref, root=store.run_root, check_hash="while-reading", receipts=checker)
        assert isinstance(reader, SafetensorsReader)
        model = Path(ref.path) / "model.safetensors"
        return reader, model
    ref = upload(store, suite.copy("qwen_b", tmp_path / "node0"), tmp_path / "node0", 0)
    reader = open_checkpoint(ref, root=store.run_root, check_hash=True, receipts=checker)
    assert isinstance(reader, FsdpShardReader) and reader.receipt_files == []  # not the while-reading check
    return reader, Path(ref.path) / SHARD_W2


@pytest.mark.parametrize("mode", ["receipt-fsdp", "receipt-safetensors", "audit-digests"])
def test_a_file_trusted_at_opening_and_changed_while_it_is_read_is_refused(
        store: HttpServerStore, suite: Suite, tmp_path: Path, hashed: HashCounter,
        monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Checked at opening from trusted digests, the files were read later without their stat
    checked again: a file rewritten between the check and the end of the reads was read changed,
    unnoticed. Now verify_content (which the aggregation and the audit call once they have read)
    checks the stat of each trusted file again and names the one that changed."""
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)  # the checkpoint was written a moment ago
    reader, target = _trusted_reader(mode, store, suite, tmp_path)
    with reader:
        hashed.bytes = 0
        keys = reader.keys()
        reader.read(keys[0])
        reader.verify_content()  # unchanged: passes
        assert hashed.bytes < 1024, hashed.bytes  # trusted, not hashed: only the digests' combination
        flip_byte_past_tick(target, restore_mtime=True, at=-1)  # same size, inode and mtime: only ctime moves
        reader.read(keys[-1])
        with pytest.raises(CheckpointError, match=re.escape(f"{target} changed while it was read")):
            reader.verify_content()
