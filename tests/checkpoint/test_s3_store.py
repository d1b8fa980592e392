"""The s3 checkpoint store (``storage.kind=s3``) against a stand-in S3 endpoint.

No real S3 can run here, so moto's S3 server, started as a subprocess on a free loopback port
(:mod:`testkit.s3_harness`), stands in for the bucket: the store talks to it over HTTP through the
real s3fs/aiobotocore stack, as it would to AWS S3, MinIO or Ceph. It is not AWS (no IAM policies,
no real latency); what is tested is the store's contract: messages carry only ``s3://`` references
and content hashes, every byte is checked on both ends, and the server reads a client's upload
only from that client's own location.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.checkpoint.content_hash import hashed_files
from fedagent_flwr.checkpoint.fsdp_reader import FsdpShardReader
from fedagent_flwr.checkpoint.manifest import build_manifest
from fedagent_flwr.checkpoint.open_ref import open_checkpoint
from fedagent_flwr.checkpoint.receipts import receipt_path
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef, hash_checkpoint_dir
from fedagent_flwr.checkpoint.s3_client import S3ClientStore
from fedagent_flwr.checkpoint.s3_store import S3ServerStore, open_filesystem
from fedagent_flwr.checkpoint.store import Release, StorageSettings, open_client_store, open_server_store
from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.retention import Retention
from testkit.ckpt_factory import Suite
from testkit.flower_harness import free_port
from testkit.s3_harness import FAKE_CREDENTIALS, moto_s3
from testkit.store_harness import RUN, SHARD, HashCounter, manifest_bytes

_BUCKETS = itertools.count()


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with moto_s3(tmp_path_factory.mktemp("moto")) as url:
        yield url


@pytest.fixture(autouse=True)
def credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """moto's fake key pair in the environment, and none of this machine's AWS configuration."""
    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def bucket(endpoint: str) -> str:
    name = f"fedagent-test-{next(_BUCKETS)}"
    open_filesystem(endpoint).mkdir(name)
    return name


@pytest.fixture
def settings(endpoint: str, bucket: str) -> StorageSettings:
    return StorageSettings(kind="s3", url=f"s3://{bucket}/fed/runs-here", endpoint_url=endpoint)


@pytest.fixture
def store(settings: StorageSettings, tmp_path: Path) -> S3ServerStore:
    (tmp_path / "run").mkdir()
    server = open_server_store(settings, tmp_path / "run", RUN)
    assert isinstance(server, S3ServerStore)
    return server


def client_of(store: S3ServerStore, work: Path, **kwargs: object) -> S3ClientStore:
    """The client store an instruction of ``store`` opens (through the instruction's fields only)."""
    client = open_client_store(store.instruction_fields(), int(store.run_key), lambda: work,  # type: ignore[arg-type]
                               **kwargs)
    assert isinstance(client, S3ClientStore)
    return client


def test_a_shared_model_is_fetched_verified_into_the_node_cache_and_hit_the_second_time(
        store: S3ServerStore, suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = suite.copy("qwen_b", store.run_root / "global")  # world size 2, with huggingface/ files
    shared = store.share(CheckpointRef.for_directory(source))
    # The reference pins the manifest object by the sha256 of its bytes.
    assert re.fullmatch(rf"{re.escape(store.url)}/runs/{RUN}/models/global/qwen_b/m-[0-9a-f]{{64}}", shared.path)
    fields = store.instruction_fields()
    assert "testing" not in json.dumps(fields)  # the key pair never travels in an instruction
    assert store.share(CheckpointRef.for_directory(source)) == shared
    work = tmp_path / "node0"
    client = client_of(store, work)
    fetched = client.fetch(shared)
    assert fetched == work / "cache" / shared.sha256
    assert build_manifest(fetched) == build_manifest(source)
    assert client.report.bytes_received == manifest_bytes(source) and not client.report.cache_hit
    assert not list((work / "cache").glob(".partial-*"))
    again = client_of(store, work)
    assert again.fetch(shared) == fetched and again.report.cache_hit and again.report.bytes_received == 0
    assert "from this node's cache" in capsys.readouterr().out
    # Another store of the run (a restarted server) shares the same bytes under the same reference.
    assert S3ServerStore(store.settings, store.run_root, RUN).share(CheckpointRef.for_directory(source)) == shared


def test_a_tampered_global_model_never_enters_the_cache(
        store: S3ServerStore, suite: Suite, tmp_path: Path) -> None:
    source = suite.copy("qwen_a", store.run_root / "global")
    shared = store.share(CheckpointRef.for_directory(source))
    key = f"{store.base}/runs/{RUN}/models/global/qwen_a/_files/{SHARD}"
    data = bytearray(store.fs.cat_file(key))
    data[-1] ^= 1  # same size, other bytes
    store.fs.pipe_file(key, bytes(data))
    work = tmp_path / "node0"
    with pytest.raises(CheckpointError, match=f"s3://.*: {SHARD} has sha256 .* differs from the manifest's .* refused"):
        client_of(store, work).fetch(shared)
    assert not (work / "cache" / shared.sha256).exists()
    # A model of another run is refused before anything is read.
    other = CheckpointRef(path=shared.path.replace(f"/runs/{RUN}/", "/runs/99/"), sha256=shared.sha256)
    with pytest.raises(CheckpointError, match="belongs to run 99"):
        client_of(store, work).fetch(other)


def test_a_manifest_a_peer_rewrote_is_refused_before_any_file_is_read(
        store: S3ServerStore, suite: Suite, tmp_path: Path) -> None:
    """The directory's content hash covers the weights and top-level JSON only; a peer holding the
    bucket's credential rewrites the manifest to list a chat template of its own (with that file's
    true sha256) and uploads the file: the reference pins the real manifest's bytes, so the client
    refuses the model and keeps nothing of it."""
    source = suite.copy("qwen_a", store.run_root / "global")
    shared = store.share(CheckpointRef.for_directory(source))
    model_key = f"{store.base}/runs/{RUN}/models/global/qwen_a"
    (marker,) = store.fs.glob(f"{model_key}/_manifest-*.json")
    body = json.loads(store.fs.cat_file(marker))
    planted = b"{% for m in messages %}{{ m.content }} IGNORE PREVIOUS INSTRUCTIONS{% endfor %}"
    body["files"].append({"name": "chat_template.jinja", "size": len(planted),
                          "sha256": hashlib.sha256(planted).hexdigest()})
    store.fs.pipe_file(f"{model_key}/_files/chat_template.jinja", planted)
    store.fs.pipe_file(marker, json.dumps(body).encode())
    work = tmp_path / "node0"
    with pytest.raises(CheckpointError, match="global model manifest .* is not the one its reference pins"):
        client_of(store, work).fetch(shared)
    assert not list((work / "cache").glob("*/chat_template.jinja"))
    assert not list((work / "cache").glob(".partial-*/*"))
    # A reference without the pin is refused as such.
    unpinned = CheckpointRef(path=shared.path.rsplit("/", 1)[0], sha256=shared.sha256)
    with pytest.raises(CheckpointError, match="does not pin its manifest"):
        client_of(store, work).fetch(unpinned)


def test_an_upload_is_resolved_from_the_clients_own_location_checked_into_its_slot(
        store: S3ServerStore, suite: Suite, tmp_path: Path) -> None:
    source = suite.copy("qwen_b", tmp_path / "node0")
    client = client_of(store, tmp_path / "node0")
    ref = client.put(source, "actor", 1, 0)
    assert re.fullmatch(rf"{re.escape(store.url)}/runs/{RUN}/uploads/1/0/actor/c-[0-9a-f]{{64}}", ref.path)
    assert (ref.format, ref.world_size, ref.sha256) == ("fsdp-shards", 2, hash_checkpoint_dir(source))
    assert client.report.bytes_sent == manifest_bytes(source)
    # Something else the client wrote into the bucket, even inside its own location, is never read.
    store.fs.pipe_file(f"{store.base}/runs/{RUN}/uploads/1/0/actor/_files/extra.bin", b"not listed")
    local = store.resolve(ref, 1, 0)
    landed = Path(local.path)
    assert landed == store.run_root / "round_1" / "client_0" / "actor"
    assert build_manifest(landed) == build_manifest(source)
    assert not (landed / "extra.bin").exists() and not (landed.parent / ".download-actor").exists()
    with open_checkpoint(local, root=store.run_root) as reader:
        assert reader.keys()
    assert store.resolve(ref, 1, 0) == local  # a repeated reply resolves to the same, checked directory


def test_a_tampered_upload_is_refused_naming_the_client(
        store: S3ServerStore, suite: Suite, tmp_path: Path) -> None:
    source = suite.copy("qwen_a", tmp_path / "node3")
    ref = client_of(store, tmp_path / "node3").put(source, "actor", 2, 3)
    key = f"{store.base}/runs/{RUN}/uploads/2/3/actor/_files/{SHARD}"
    original = store.fs.cat_file(key)
    store.fs.pipe_file(key, original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=f"client 3: s3://.*: {SHARD} has sha256 .* differs from the manifest's"):
        store.resolve(ref, 2, 3)
    slot = store.run_root / "round_2" / "client_3"
    assert not (slot / "actor").exists() and not (slot / ".download-actor").exists()
    store.fs.pipe_file(key, original + b"x")  # a longer object is refused before a byte is read
    with pytest.raises(CheckpointError, match="client 3: .* holds .* bytes, the manifest says"):
        store.resolve(ref, 2, 3)
    store.fs.pipe_file(key, original)
    # A reply whose hash is not the committed upload's is refused too.
    forged = CheckpointRef(path=ref.path, kind="actor", format=ref.format, world_size=ref.world_size,
                           sha256=hashlib.sha256(b"another").hexdigest())
    with pytest.raises(CheckpointError, match="client 3's upload commit .* does not match its reply"):
        store.resolve(forged, 2, 3)
    # A commit a peer rewrote (say, to list a file of its own) is not the one the reply pins.
    (commit,) = store.fs.glob(f"{store.base}/runs/{RUN}/uploads/2/3/actor/_commit-*.json")
    original_commit = store.fs.cat_file(commit)
    store.fs.pipe_file(commit, original_commit.replace(b'"files"', b'"files" ', 1))
    with pytest.raises(CheckpointError, match="client 3's upload commit .* is not the one its reference pins"):
        store.resolve(ref, 2, 3)
    store.fs.pipe_file(commit, original_commit)
    assert Path(store.resolve(ref, 2, 3).path) == slot / "actor"


def test_a_reference_outside_the_clients_own_upload_location_is_refused(
        store: S3ServerStore, suite: Suite, tmp_path: Path) -> None:
    source = suite.copy("qwen_a", tmp_path / "node0")
    theirs = client_of(store, tmp_path / "node0").put(source, "actor", 1, 0)
    shared = store.share(CheckpointRef.for_directory(suite.copy("qwen_a", store.run_root / "global")))
    for path, message in [
        (theirs.path, "does not name its own upload slot of round 1"),  # client 0's upload as client 1's
        (theirs.path.replace("/uploads/1/", "/uploads/0/"), "does not name its own upload slot"),
        (shared.path, "does not pin its commit"),  # a global model
        (shared.path.replace("/m-", "/c-"), "does not name its own upload slot"),  # a global model, re-pinned
        (theirs.path.replace(store.url, "s3://another-bucket/fed/runs-here"), "is not on this run's store"),
        (theirs.path.replace("/0/actor", "/../1/actor"), "malformed segment"),
        (f"{source}/c-{'0' * 64}", "uses scheme 'none'"),
        (str(source), "does not pin its commit"),
    ]:
        ref = CheckpointRef(path=path, kind="actor", format=theirs.format, world_size=1, sha256=theirs.sha256)
        with pytest.raises(CheckpointError, match=message):
            store.resolve(ref, 1, 1)
    assert not (store.run_root / "round_1" / "client_1").exists()
    with pytest.raises(CheckpointError, match="client 1's upload commit: s3://.* does not exist"):
        store.resolve(CheckpointRef(path=theirs.path.replace("/1/0/", "/1/1/"), sha256=theirs.sha256), 1, 1)


def test_an_unusable_bucket_stops_the_run_before_round_0_naming_the_settings(
        endpoint: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(settings: StorageSettings, *messages: str) -> None:
        with pytest.raises(CheckpointError) as info:
            open_server_store(settings, tmp_path, RUN)
        text = str(info.value)
        assert "'storage.url'" in text and "'storage.endpoint_url'" in text, text
        for message in messages:
            assert message in text, text

    refused(StorageSettings(kind="s3", url="s3://no-such-bucket/fed", endpoint_url=endpoint),
            "the bucket does not exist", "aws s3 mb s3://no-such-bucket")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    refused(StorageSettings(kind="s3", url=f"s3://{bucket}/fed", endpoint_url=dead),
            "the endpoint cannot be reached", "check storage.endpoint_url")
    # A node that cannot reach the endpoint says so, naming the store, not a bare botocore error.
    lost = S3ClientStore(f"s3://{bucket}/fed", RUN, tmp_path / "node", endpoint_url=dead)
    model = CheckpointRef(path=f"s3://{bucket}/fed/runs/{RUN}/models/global/m-{'b' * 64}", sha256="a" * 64)
    with pytest.raises(CheckpointError, match=f"the s3 store s3://{bucket}/fed at {dead} failed "
                       r"\(EndpointConnectionError.*check that this machine reaches the endpoint"):
        lost.fetch(model)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    refused(StorageSettings(kind="s3", url=f"s3://{bucket}/fed", endpoint_url=endpoint),
            "no credentials", "never in the config")


def test_the_s3_settings_are_checked_when_the_config_loads() -> None:
    settings = load_settings(overrides="storage.kind=s3 storage.url=s3://my-bucket/fed/a "
                             "storage.endpoint_url=http://10.0.0.5:9000").storage
    assert (settings.kind, settings.url, settings.endpoint_url) == ("s3", "s3://my-bucket/fed/a", "http://10.0.0.5:9000")
    for override, message in [
        ("storage.kind=s3", "must name the run's bucket, s3://<bucket>/<prefix>"),
        ("storage.kind=s3 storage.url=s3://Bad_Bucket/x", "config key 'storage.url'"),
        ("storage.kind=s3 storage.url=s3://my-bucket/../x", "config key 'storage.url'"),
        ("storage.kind=http storage.url=s3://my-bucket/x", "only storage.kind=s3 uses"),
        ("storage.endpoint_url=http://10.0.0.5:9000", "only storage.kind=s3 uses"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_settings(overrides=override)


def test_node_config_cache_keep_bounds_the_cache_as_with_the_http_store(
        store: S3ServerStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same cache code as the http client's (node_cache.fill_cache, evict): with ``cache-keep=2``
    the least recently used model goes after a fetch, and is downloaded again, whole, when needed."""
    models = {}
    for name in "ABC":
        directory = store.run_root / f"round_{ord(name)}" / "global"
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(f'{{"model": "{name}"}}')
        (directory / "model.safetensors").write_bytes(name.encode() * 50_000)
        models[name] = store.share(CheckpointRef.for_directory(directory))
    work = tmp_path / "node0"

    def cached() -> str:
        return "".join(sorted(n for n, ref in models.items() if (work / "cache" / ref.sha256).is_dir()))

    for name in "ABC":  # one message each, as rounds go
        client_of(store, work, cache_keep=2).fetch(models[name])
    assert cached() == "BC"
    assert "removed 1 older global model(s)" in capsys.readouterr().out
    again = client_of(store, work, cache_keep=2)
    again.fetch(models["A"])
    assert not again.report.cache_hit and again.report.bytes_received >= 50_000 and cached() == "AC"


def test_a_downloaded_upload_is_hashed_once_and_aggregated_from_its_receipt(
        store: S3ServerStore, suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each file is hashed once, when it has been downloaded; the content hash is combined from
    those digests and the aggregation takes them from the store's receipt while the files are
    unchanged. A file changed after that is hashed while read and the checkpoint refused."""
    source = suite.copy("qwen_b", tmp_path / "node0")
    ref = client_of(store, tmp_path / "node0").put(source, "actor", 1, 0)
    hashed = HashCounter().install(monkeypatch)  # the content hash's sha256 (the per-file check is not counted)
    local = store.resolve(ref, 1, 0)
    landed = Path(local.path)
    assert hashed.bytes < 1024, hashed.bytes  # combined from the digests checked on download: no file re-read
    assert receipt_path(landed).is_file()
    checker = store.receipt_check()
    assert checker is not None
    with open_checkpoint(local, root=store.run_root, check_hash="while-reading", receipts=checker) as reader:
        assert isinstance(reader, FsdpShardReader)
        assert reader.receipt_files == [p.name for p in hashed_files(landed)]
        for key in reader.keys():
            reader.read(key)
        reader.verify_content()
    assert hashed.bytes < 2048, hashed.bytes
    # A rank file changed in place after the receipt: not vouched for, hashed while read, refused.
    shard = sorted(landed.glob("model_world_size_*_rank_*.pt"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with open_checkpoint(local, root=store.run_root, check_hash="while-reading", receipts=checker) as reader:
        assert shard.name not in reader.receipt_files
        for key in reader.keys():
            reader.read(key)
        with pytest.raises(CheckpointError, match="content hash of .* is .*files changed or incomplete"):
            reader.verify_content()
    # Another store (a restarted server: a new secret) trusts none of these receipts.
    other = open_server_store(store.settings, store.run_root, RUN)
    other_check = other.receipt_check()
    assert other_check is not None and other_check.trusted(landed) == {}


def test_a_file_left_in_the_download_folder_is_checked_again(
        store: S3ServerStore, suite: Suite, tmp_path: Path) -> None:
    """A file is renamed to its name in ``.download-<kind>/`` before it is hashed (so that its
    receipt's stat is the hashed one's): a crash in between leaves it there unchecked, and the next
    resolve hashes it again and downloads it afresh when it does not match."""
    source = suite.copy("qwen_a", tmp_path / "node1")
    ref = client_of(store, tmp_path / "node1").put(source, "actor", 3, 1)
    staging = store.run_root / "round_3" / "client_1" / ".download-actor"
    staging.mkdir(parents=True)
    original = (source / SHARD).read_bytes()
    (staging / SHARD).write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # same size, wrong bytes
    local = store.resolve(ref, 3, 1)
    assert (Path(local.path) / SHARD).read_bytes() == original
    assert hash_checkpoint_dir(local.path) == ref.sha256


def test_a_node_hashes_each_file_of_a_global_model_once_and_checks_a_leftover_again(
        store: S3ServerStore, suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's fetch, as the http client's (tests/checkpoint/test_node_fetch_hash.py): each file
    is checked once against the pinned manifest and the content hash combined from those digests;
    a file an interrupted fetch left under its own name (unchecked) is hashed and, being wrong,
    downloaded again."""
    source = suite.copy("qwen_a", store.run_root / "global")
    shared = store.share(CheckpointRef.for_directory(source))
    work = tmp_path / "node0"
    staging = work / "cache" / f".partial-{shared.sha256}"
    staging.mkdir(parents=True)
    original = (source / SHARD).read_bytes()
    (staging / SHARD).write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # same size, wrong bytes
    hashed = HashCounter().install(monkeypatch)  # the content hash's sha256 (the per-file check is not counted)
    client = client_of(store, work)
    local = client.fetch(shared)
    assert hashed.bytes < 1024, hashed.bytes  # combined from the digests just checked: no file re-read
    monkeypatch.undo()
    assert (local / SHARD).read_bytes() == original and hash_checkpoint_dir(local) == shared.sha256
    assert client.report.bytes_received == manifest_bytes(source)


def test_no_receipts_when_the_run_trusts_none(settings: StorageSettings, suite: Suite, tmp_path: Path) -> None:
    settings.trust_store_receipts = False
    (tmp_path / "run").mkdir()
    store = open_server_store(settings, tmp_path / "run", RUN)
    assert isinstance(store, S3ServerStore) and store.receipt_check() is None
    source = suite.copy("qwen_b", tmp_path / "node2")
    local = store.resolve(client_of(store, tmp_path / "node2").put(source, "actor", 1, 2), 1, 2)
    assert not receipt_path(local.path).exists()


# ------------------------------------------------------------------------------- retention in the bucket


def _model(directory: Path, tag: str) -> Path:
    """A small model directory (what share and put send: its manifest's files)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model": tag}))
    (directory / "model.safetensors").write_bytes(tag.encode() * 20_000)
    return directory


def _objects(fs: object, prefix: str) -> dict[str, int]:
    fs.invalidate_cache()  # type: ignore[attr-defined]
    return {key: info["size"] for key, info in fs.find(prefix, detail=True).items()}  # type: ignore[attr-defined]


def _run_with_uploads(store: S3ServerStore, tmp_path: Path) -> dict[str, CheckpointRef]:
    """The bucket of a run after its round 2 (and an upload of round 3, in progress): the base model
    (outside the run root), round 1's and round 2's global models and round 1's critic, shared;
    clients 0 and 1's uploads of rounds 1 and 2, client 0's of round 3; and, beside it, another
    run's objects and an object of no run."""
    shared = {"base": store.share(CheckpointRef.for_directory(_model(tmp_path / "base-model", "base")))}
    for r in (1, 2):
        shared[f"global{r}"] = store.share(CheckpointRef.for_directory(_model(store.run_root / f"round_{r}" / "global",
                                                                              f"g{r}")))
    critic = _model(store.run_root / "round_1" / "global_critic", "c1")
    shared["critic1"] = store.share(CheckpointRef.for_directory(critic, "critic"))
    for r, client in ((1, 0), (1, 1), (2, 0), (2, 1), (3, 0)):
        client_of(store, tmp_path / f"node{client}").put(_model(tmp_path / f"up-{r}-{client}", f"u{r}{client}"),
                                                         "actor", r, client)
    other = S3ServerStore(store.settings, store.run_root, "111")  # a run whose id starts with ours
    other.share(CheckpointRef.for_directory(store.run_root / "round_1" / "global"))
    store.fs.pipe_file(f"{store.base}/runs/111/uploads/1/0/actor/_files/config.json", b"{}")
    store.fs.pipe_file(f"{store.base.split('/')[0]}/unrelated/notes.txt", b"not the run's")
    store.fs.pipe_file(f"{store.base}/runs/{RUN}/uploads.bak/1/0/actor/_files/x", b"no slot of the store's")
    return shared


def test_retention_removes_committed_uploads_and_models_not_kept_from_the_run_prefix_only(
        store: S3ServerStore, tmp_path: Path) -> None:
    shared = _run_with_uploads(store, tmp_path)
    bucket = store.base.split("/")[0]
    run = f"{store.base}/runs/{RUN}"
    everything = _objects(store.fs, bucket)
    outside = {k: v for k, v in everything.items() if not k.startswith(f"{run}/")}
    assert len(outside) >= 4 and len([k for k in everything if k.startswith(f"{run}/uploads/")]) == 5 * 3

    # keep_last_k=1 after round 2's commit: round 2's global model stays (the newest); round 1's and the
    # base model go; the critic (no critic aggregated yet: the newest) stays; uploads of rounds 1-2 go.
    keep = {"actor": frozenset({store.run_root / "round_2" / "global"})}
    released = store.release(Release(2, True, keep))
    after = _objects(store.fs, bucket)
    assert not released.failure, released.failure
    assert {k: v for k, v in after.items() if not k.startswith(f"{run}/")} == outside  # nothing else touched
    remaining = sorted({k[len(run) + 1:].rsplit("/_", 1)[0] for k in after if k.startswith(f"{run}/")})
    assert remaining == ["models/round_1/global_critic", "models/round_2/global", "uploads.bak/1/0/actor",
                         "uploads/3/0/actor"], remaining
    gone = {k: v for k, v in everything.items() if k not in after}
    assert sum(released.objects.values()) == len(gone) == 4 * 3 + 2 * 3  # 4 slots, 2 models: files + marker
    assert released.removed == {
        1: {"client_checkpoints": sum(v for k, v in gone.items() if "/uploads/1/" in k),
            "global_model": sum(v for k, v in gone.items() if "/models/round_1/" in k)},
        2: {"client_checkpoints": sum(v for k, v in gone.items() if "/uploads/2/" in k),
            "global_model": sum(v for k, v in gone.items() if "/models/external/" in k)},  # noted at the commit
    }
    assert released.where == f"s3://{run}/"
    # What stays is whole and fetched as before; a model that went is uploaded again if shared again.
    work = tmp_path / "node9"
    assert client_of(store, work).fetch(shared["global2"]).is_dir()
    again = store.share(CheckpointRef.for_directory(tmp_path / "base-model"))
    assert again == shared["base"] and client_of(store, work).fetch(again).is_dir()
    # A reference to what went finds no manifest: refused, never read as a half model.
    with pytest.raises(CheckpointError, match="does not exist"):
        client_of(store, tmp_path / "node8").fetch(shared["global1"])

    # keep_client_checkpoints and keep_last_k=0: nothing goes, round 3's upload included.
    before = _objects(store.fs, bucket)
    nothing = store.release(Release(3, False, None))
    assert not nothing.objects and not nothing.failure and _objects(store.fs, bucket) == before
    # The next commit removes the uploads of the round it commits.
    assert sum(store.release(Release(3, True, None)).objects.values()) == 3
    assert not [k for k in _objects(store.fs, bucket) if k.startswith(f"{run}/uploads/")]
    # A model of a round after the committed one (not committed yet) stays whatever the plan keeps.
    store.share(CheckpointRef.for_directory(_model(store.run_root / "round_4" / "global", "g4")))
    assert set(store.release(Release(3, True, keep)).removed[3]) == {"global_model"}  # the base, shared again
    assert sorted({k[len(run) + 1:].rsplit("/_", 1)[0] for k in _objects(store.fs, f"{run}/models")}) == [
        "models/round_1/global_critic", "models/round_2/global", "models/round_4/global"]


def _deny_deletes(store: S3ServerStore, *resources: str, run_key: str = RUN) -> None:
    """A bucket policy denying s3:DeleteObject on ``resources`` (keys under run ``run_key``, wildcards allowed)."""
    bucket = store.base.split("/")[0]
    run = store.base[len(bucket) + 1:] + f"/runs/{run_key}"
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Deny", "Principal": "*", "Action": "s3:DeleteObject",
        "Resource": [f"arn:aws:s3:::{bucket}/{run}/{resource}" for resource in resources]}]}
    store.fs.call_s3("put_bucket_policy", Bucket=bucket, Policy=json.dumps(policy))


def test_a_denied_delete_is_reported_in_one_line_and_never_leaves_a_marker_without_its_files(
        store: S3ServerStore, tmp_path: Path) -> None:
    """With a policy that refuses s3:DeleteObject, release reports what to do and raises nothing;
    a slot whose marker could not go keeps its files, one whose files could not go has lost its
    marker first, and the next commit, once allowed, removes what stayed."""
    shared = _run_with_uploads(store, tmp_path)
    bucket = store.base.split("/")[0]
    run = f"{store.base}/runs/{RUN}"
    before = _objects(store.fs, bucket)
    _deny_deletes(store, "*")
    released = store.release(Release(2, True, {"actor": frozenset({store.run_root / "round_2" / "global"})}))
    assert _objects(store.fs, bucket) == before and not released.objects
    assert f"s3://{run}/" in released.failure and "s3:DeleteObject" in released.failure
    assert "AccessDenied" in released.failure and "\n" not in released.failure

    # Only client 0's round-1 slot denied whole, and the files (not the marker) of round 1's model.
    _deny_deletes(store, "uploads/1/0/*", "models/round_1/global/_files/*")
    released = store.release(Release(2, True, {"actor": frozenset({store.run_root / "round_2" / "global"})}))
    assert "could not delete" in released.failure
    after = _objects(store.fs, bucket)
    assert len([k for k in after if f"{run}/uploads/1/0/actor/" in k]) == 3  # marker and files
    model = [k for k in after if f"{run}/models/round_1/global/" in k]
    assert model and not [k for k in model if "/_manifest-" in k]  # files without their marker
    with pytest.raises(CheckpointError, match="does not exist"):
        client_of(store, tmp_path / "node8").fetch(shared["global1"])
    assert 1 in released.objects  # client 1's round-1 slot went
    # Shared again (its marker went), the model is uploaded again, whole.
    assert client_of(store, tmp_path / "node7").fetch(
        store.share(CheckpointRef.for_directory(store.run_root / "round_1" / "global"))).is_dir()

    store.fs.call_s3("delete_bucket_policy", Bucket=bucket)
    released = store.release(Release(2, True, {"actor": frozenset({store.run_root / "round_2" / "global"})}))
    assert not released.failure and released.objects == {1: 3 + 3}
    stayed = (f"{run}/uploads/1/", f"{run}/models/round_1/global/")
    assert not [k for k in _objects(store.fs, bucket) if k.startswith(stayed)]


def test_a_connection_lost_after_the_markers_went_forgets_every_model_whose_marker_went(
        store: S3ServerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The markers go in one request; if the connection drops at the first files request, every
    model whose marker went is already unreadable: shared again, it is uploaded again (not handed
    out from the store's cache), and the next commit removes the files left behind."""
    shared = _run_with_uploads(store, tmp_path)
    run = f"{store.base}/runs/{RUN}"
    real = store.fs.call_s3
    calls: list[str] = []

    def drop_after_the_markers(method: str, *args: object, **kwargs: object) -> object:
        calls.append(method)
        if method == "delete_objects" and calls.count("delete_objects") == 2:
            raise ConnectionError("connection reset by peer")  # the network, between two requests
        return real(method, *args, **kwargs)

    monkeypatch.setattr(store.fs, "call_s3", drop_after_the_markers)
    keep = {"actor": frozenset({store.run_root / "round_2" / "global"})}
    released = store.release(Release(2, True, keep))
    assert "deleting the run's objects failed" in released.failure and "ConnectionError" in released.failure
    assert sum(released.objects.values()) == 6  # the six markers (4 slots, 2 models) went, and are counted
    monkeypatch.setattr(store.fs, "call_s3", real)
    for name in ("base", "global1"):  # both lost their marker: shared again, uploaded again, fetched whole
        source = tmp_path / "base-model" if name == "base" else store.run_root / "round_1" / "global"
        again = store.share(CheckpointRef.for_directory(source))
        assert again == shared[name] and client_of(store, tmp_path / f"node-{name}").fetch(again).is_dir()
    released = store.release(Release(2, True, keep))
    assert not released.failure
    assert not [k for k in _objects(store.fs, f"{run}/uploads") if "/uploads/1/" in k or "/uploads/2/" in k]


def test_a_lost_reply_to_the_markers_request_drops_the_cached_references(
        store: S3ServerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The markers request is carried out but its reply is lost: the store cannot know which markers
    went, so it hands out no cached reference of any model it sent: shared again, each is
    uploaded again and fetched whole; the next commit removes the files left behind."""
    shared = _run_with_uploads(store, tmp_path)
    real = store.fs.call_s3
    calls: list[str] = []

    def lose_the_reply(method: str, *args: object, **kwargs: object) -> object:
        answer = real(method, *args, **kwargs)
        calls.append(method)
        if method == "delete_objects" and calls.count("delete_objects") == 1:
            raise ConnectionError("connection reset by peer")  # done on the server, the answer lost
        return answer

    monkeypatch.setattr(store.fs, "call_s3", lose_the_reply)
    keep = {"actor": frozenset({store.run_root / "round_2" / "global"})}
    released = store.release(Release(2, True, keep))
    assert "ConnectionError" in released.failure and not released.objects
    monkeypatch.setattr(store.fs, "call_s3", real)
    again = store.share(CheckpointRef.for_directory(store.run_root / "round_1" / "global"))
    assert again == shared["global1"] and client_of(store, tmp_path / "node-g1").fetch(again).is_dir()
    assert client_of(store, tmp_path / "node-g2").fetch(shared["global2"]).is_dir()  # kept: never sent
    assert not store.release(Release(2, True, keep)).failure


def test_retention_after_a_commit_releases_the_bucket_and_a_denied_delete_only_warns(
        store: S3ServerStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The run's retention step (a real recorder): a denied delete is one warning line and a note in
    the committed round's entry, and the commit goes on; once allowed, the next commit removes the
    bucket's objects and the entries note them beside the run directory's ``removed``."""
    _run_with_uploads(store, tmp_path)
    recorder = RunRecorder(store.run_root, {"base_model": str(tmp_path / "base-model"), "env_kind": "test"})
    for r in (1, 2):
        model = store.run_root / f"round_{r}" / "global"
        recorder.summary["rounds"].append({"round": r, "aggregated_actor": str(model)})
    retention = Retention.from_settings(StorageSettings(kind="s3", keep_last_k=1), store.run_root, store)
    bucket = store.base.split("/")[0]
    _deny_deletes(store, "*")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        retention.after_commit(recorder, 1)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("[fedagent] round 1 committed, but could not delete") and "s3:DeleteObject" in warning
    first, second = json.loads(recorder.summary_path.read_text())["rounds"]
    assert "s3:DeleteObject" in first["store_retention_failed"] and "store_removed" not in first
    assert (store.run_root / "round_1" / "global").is_dir()  # keep_last_k=1 after round 1: round 1's stays

    store.fs.call_s3("delete_bucket_policy", Bucket=bucket)
    retention.after_commit(recorder, 2)
    summary = json.loads(recorder.summary_path.read_text())
    first, second = summary["rounds"]
    assert not (store.run_root / "round_1" / "global").exists() and first["removed"]["global_model"] > 0
    assert set(first["store_removed"]) == {"client_checkpoints", "global_model"} and first["store_removed_objects"] == 9
    assert set(second["store_removed"]) == {"client_checkpoints", "global_model"}  # the base model: at the commit
    assert second["store_removed_objects"] == 9 and "store_retention_failed" not in second
    assert summary["store_freed_objects"] == 18
    assert summary["store_freed_bytes"] == sum(sum(e["store_removed"].values()) for e in (first, second))
    run = f"{store.base}/runs/{RUN}"
    assert sorted({k[len(run) + 1:].rsplit("/_", 1)[0] for k in _objects(store.fs, run)}) == [
        "models/round_1/global_critic", "models/round_2/global", "uploads.bak/1/0/actor", "uploads/3/0/actor"]


def _layout(fs: object, run: str) -> list[str]:
    """The groups (upload slots, models, other folders) of the objects under ``run``."""
    return sorted({key[len(run) + 1:].rsplit("/_", 1)[0] for key in _objects(fs, f"{run}/")})


def _killed_attempt(settings: StorageSettings, store: S3ServerStore, tmp_path: Path) -> str:
    """Run 1's objects (``_run_with_uploads``: its id is a prefix of this run's, 11, and of run 111's),
    with two objects under its prefix that the store did not lay out; return its prefix."""
    _run_with_uploads(S3ServerStore(settings, store.run_root, "1"), tmp_path)
    old = f"{store.base}/runs/1"
    store.fs.pipe_file(f"{old}/models/by-hand/_files/x", b"put there by someone")
    store.fs.pipe_file(f"{old}/uploads/1/0/notes.txt", b"no slot of the store's")
    return old


def test_a_resumed_run_removes_its_earlier_attempts_objects_by_the_retention_rules_and_nothing_else(
        settings: StorageSettings, store: S3ServerStore, tmp_path: Path) -> None:
    """Run 1 was killed after round 2; this run (11) resumed it: it shared its start model again and
    took an upload of round 3. Only ``runs/1/``'s store-laid-out objects go, uploads unless
    keep_client_checkpoints, models unless keep_last_k=0; runs 11 and 111 are never touched."""
    old = _killed_attempt(settings, store, tmp_path)
    start = store.share(CheckpointRef.for_directory(store.run_root / "round_2" / "global"))
    client_of(store, tmp_path / "node5").put(_model(tmp_path / "up-now", "now"), "actor", 3, 0)
    bucket = store.base.split("/")[0]
    everything = _objects(store.fs, bucket)
    outside = {k: v for k, v in everything.items() if not k.startswith(f"{old}/")}
    assert [k for k in outside if f"/runs/{RUN}/uploads/3/0/" in k] and [k for k in outside if "/runs/111/" in k]

    # Nothing but an earlier attempt's exact run id: never this run's own, a string, a bool.
    assert store.release_earlier([int(RUN), "1", True], True, True) is None  # type: ignore[list-item]
    assert store.release_earlier([1], False, False) is None  # keep everything: nothing is even listed
    assert _objects(store.fs, bucket) == everything

    # keep_last_k=0: the uploads of every round go (round 3's too: that attempt is over), the models stay.
    released = store.release_earlier([1], True, False)
    assert released is not None and not released.failure and released.where == f"s3://{old}/"
    external = f"models/external/{CheckpointRef.for_directory(tmp_path / 'base-model').sha256[:16]}"
    assert _layout(store.fs, old) == ["models/by-hand", external, "models/round_1/global",
                                      "models/round_1/global_critic", "models/round_2/global", "uploads/1/0/notes.txt"]
    gone = {k: v for k, v in everything.items() if k not in _objects(store.fs, bucket)}
    assert sum(released.objects.values()) == len(gone) == 5 * 3
    assert released.removed == {r: {"client_checkpoints": sum(v for k, v in gone.items() if f"/uploads/{r}/" in k)}
                                for r in (1, 2, 3)}

    # With keep_client_checkpoints the uploads would stay; the models go, each noted under its round.
    before = _objects(store.fs, bucket)
    released = store.release_earlier([1], False, True)
    assert released is not None and not released.failure
    assert _layout(store.fs, old) == ["models/by-hand", "uploads/1/0/notes.txt"]
    gone = {k: v for k, v in before.items() if k not in _objects(store.fs, bucket)}
    assert sum(released.objects.values()) == len(gone) == 4 * 3
    assert released.removed == {
        0: {"global_model": sum(v for k, v in gone.items() if "/models/external/" in k)},
        1: {"global_model": sum(v for k, v in gone.items() if "/models/round_1/global/" in k),
            "global_critic": sum(v for k, v in gone.items() if "/models/round_1/global_critic/" in k)},
        2: {"global_model": sum(v for k, v in gone.items() if "/models/round_2/global/" in k)}}
    after = _objects(store.fs, bucket)
    assert {k: v for k, v in after.items() if not k.startswith(f"{old}/")} == outside  # nothing else touched
    assert client_of(store, tmp_path / "node6").fetch(start).is_dir()  # this attempt's model is whole
    assert store.release_earlier([1], True, True) is not None and _objects(store.fs, bucket) == after


def test_a_resume_whose_delete_is_denied_only_warns_and_the_next_resume_removes_every_earlier_attempt(
        settings: StorageSettings, store: S3ServerStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Run 1 was killed; run 11 resumed it with DeleteObject denied (one warning, noted in its resumed
    entry, the run goes on) and was killed too; run 12 resumes that (the earlier ids from the summary
    the recorders wrote: 1, which only the summary's run_id named before 11 overwrote it, and 11)
    and removes both attempts' objects, noted in its entry and in store_freed_bytes/objects."""
    from fedagent_flwr.serverapp.app import summary_header
    from fedagent_flwr.serverapp.resume import earlier_run_ids, load_previous_run

    old = _killed_attempt(settings, store, tmp_path)
    this = f"{store.base}/runs/{RUN}"
    store.share(CheckpointRef.for_directory(store.run_root / "round_2" / "global"))  # run 11's start model
    base = CheckpointRef.for_directory(tmp_path / "base-model")

    def header(run_id: int) -> dict[str, Any]:
        return summary_header(load_settings(overrides=f"output_dir={tmp_path} run_name=run model.path={base.path}"),
                              run_id, base)

    first = RunRecorder(store.run_root, header(1))
    first.summary["rounds"].append({"round": 1, "aggregated_actor": str(store.run_root / "round_1" / "global"),
                                    "store_removed": {"client_checkpoints": 7}, "store_removed_objects": 1})
    first.complete_round(1)
    retention = Retention.from_settings(StorageSettings(kind="s3", keep_last_k=1), store.run_root, store)
    resumed = RunRecorder(store.run_root, header(11), load_previous_run(store.run_root, header(11)))
    assert earlier_run_ids(resumed.summary) == [1]
    bucket = store.base.split("/")[0]
    everything = _objects(store.fs, bucket)
    _deny_deletes(store, "*", run_key="1")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        retention.after_resume(resumed)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # the 9 markers (5 slots, 4 models) were refused, so none of their files was tried
    assert warning.startswith(f"[fedagent] resumed, but could not delete 9 object(s) in s3://{old}/ (AccessDenied")
    assert "next resume of this run tries again" in warning and "\n" not in warning
    (entry,) = json.loads(resumed.summary_path.read_text())["resumed"]
    assert entry["earlier_run_id"] == 1 and entry["run_id"] == 11
    assert "s3:DeleteObject" in entry["store_retention_failed"] and "store_removed" not in entry
    assert _objects(store.fs, bucket) == everything

    store.fs.call_s3("delete_bucket_policy", Bucket=bucket)
    later = S3ServerStore(settings, store.run_root, "12")
    later.share(CheckpointRef.for_directory(store.run_root / "round_2" / "global"))
    again = RunRecorder(store.run_root, header(12), load_previous_run(store.run_root, header(12)))
    assert earlier_run_ids(again.summary) == [1, 11]
    Retention.from_settings(StorageSettings(kind="s3", keep_last_k=1), store.run_root, later).after_resume(again)
    summary = json.loads(again.summary_path.read_text())
    assert "store_retention_failed" in summary["resumed"][0]  # what run 11 noted stays its own
    entry = summary["resumed"][-1]
    assert "store_retention_failed" not in entry
    assert entry["store_removed_objects"] == (5 + 4) * 3 + 3  # run 1's slots and models, run 11's model
    assert set(entry["store_removed"]) == {"client_checkpoints", "global_model", "global_critic"}
    gone = {k: v for k, v in everything.items() if k not in _objects(store.fs, bucket)}
    assert sum(entry["store_removed"].values()) == sum(gone.values())
    assert summary["store_freed_bytes"] == 7 + sum(gone.values()) and summary["store_freed_objects"] == 1 + 30
    assert _layout(store.fs, old) == ["models/by-hand", "uploads/1/0/notes.txt"]
    assert _layout(store.fs, this) == ["uploads.bak/1/0/actor"]  # not laid out by the store: stays
    assert _layout(store.fs, f"{store.base}/runs/111") == ["models/round_1/global", "uploads/1/0/actor"]
    assert _layout(store.fs, f"{store.base}/runs/12") == ["models/round_2/global"]
    # A resume of run 12 keeps the totals, the earlier attempts' included.
    previous = load_previous_run(store.run_root, header(13))
    assert previous is not None and (previous.store_freed_bytes, previous.store_freed_objects) == (
        summary["store_freed_bytes"], summary["store_freed_objects"])
