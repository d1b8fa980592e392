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
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedagent_flwr.checkpoint.content_hash import hashed_files
from fedagent_flwr.checkpoint.fsdp_reader import FsdpShardReader
from fedagent_flwr.checkpoint.manifest import build_manifest
from fedagent_flwr.checkpoint.open_ref import open_checkpoint
from fedagent_flwr.checkpoint.receipts import receipt_path
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef, hash_checkpoint_dir
from fedagent_flwr.checkpoint.s3_client import S3ClientStore
from fedagent_flwr.checkpoint.s3_store import S3ServerStore, open_filesystem
from fedagent_flwr.checkpoint.store import StorageSettings, open_client_store, open_server_store
from fedagent_flwr.config import ConfigError, load_settings
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
    client = open_client_store(store.instruction_fields(), int(RUN), lambda: work, **kwargs)  # type: ignore[arg-type]
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


def test_no_receipts_when_the_run_trusts_none(settings: StorageSettings, suite: Suite, tmp_path: Path) -> None:
    settings.trust_store_receipts = False
    (tmp_path / "run").mkdir()
    store = open_server_store(settings, tmp_path / "run", RUN)
    assert isinstance(store, S3ServerStore) and store.receipt_check() is None
    source = suite.copy("qwen_b", tmp_path / "node2")
    local = store.resolve(client_of(store, tmp_path / "node2").put(source, "actor", 1, 2), 1, 2)
    assert not receipt_path(local.path).exists()
