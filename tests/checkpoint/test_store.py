"""The HTTP checkpoint store on a real uvicorn server on loopback (and once over TLS): uploads
checked file by file and committed atomically, an upload and a download cut off half-way and
resumed, hash mismatches and oversized or malformed requests refused, downloads cached by
content hash. Nothing is ever written outside the run root and the nodes' own directories."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import httpx
import pytest

from fedagent_flwr.checkpoint import CheckpointError, CheckpointRef, hash_checkpoint_dir, open_checkpoint
from fedagent_flwr.checkpoint.http_client import HttpClientStore
from fedagent_flwr.checkpoint.http_server import HttpServerStore, upload_url
from fedagent_flwr.checkpoint.manifest import build_manifest, file_sha256
from fedagent_flwr.checkpoint.store import StorageSettings
from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.deploy import make_tls_files
from testkit.ckpt_factory import Suite
from testkit.store_harness import RUN, SHARD, DropReplyProxy, StubGateway, auth, manifest_bytes, node, tree, wait_for


@pytest.fixture
def store(tmp_path: Path) -> Iterator[HttpServerStore]:
    (tmp_path / "run").mkdir()
    settings = StorageSettings(kind="http", max_file_bytes=64 * 1024 * 1024)
    with HttpServerStore(settings, tmp_path / "run", RUN) as running:
        yield running  # type: ignore[misc]


def put_params(name: str, data: bytes, offset: int = 0, sha: str | None = None, size: int | None = None) -> dict:
    """Query parameters of an upload of ``data`` as ``name`` (declared sha and size overridable)."""
    return {"file": name, "offset": offset, "size": len(data) if size is None else size,
            "sha256": sha or hashlib.sha256(data).hexdigest()}


# -- uploads -------------------------------------------------------------------------------------


def test_an_upload_is_checked_committed_atomically_and_resolves_to_the_same_checkpoint(
        store: HttpServerStore, suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = suite.copy("qwen_b", tmp_path / "node0")  # world size 2, with huggingface/ files
    client = node(store, tmp_path / "node0")
    before = tree(tmp_path, skip=(store.run_root, tmp_path / "node0"))
    ref = client.put(source, "actor", 1, 0)
    assert ref.path == upload_url(store.url, RUN, 1, 0, "actor")
    assert (ref.format, ref.world_size, ref.sha256) == ("fsdp-shards", 2, hash_checkpoint_dir(source))
    assert client.report.bytes_sent == manifest_bytes(source)
    # the transfer is logged with its size, time and rate
    megabytes = f"{manifest_bytes(source) / 1e6:.1f} MB in "
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[store]")]
    assert line.startswith(f"[store] client 0's actor of round 1 uploaded: {megabytes}") and "MB/s" in line, line
    local = store.resolve(ref, 1, 0)
    landed = Path(local.path)
    assert landed == store.run_root / "round_1" / "client_0" / "actor"
    assert build_manifest(landed) == build_manifest(source)  # every file, huggingface/ included
    assert not (landed.parent / ".upload-actor").exists()  # staging is gone after the rename
    with open_checkpoint(local, root=store.run_root) as reader:
        assert reader.keys()
    assert tree(tmp_path, skip=(store.run_root, tmp_path / "node0")) == before
    # A committed slot is final.
    with pytest.raises(CheckpointError, match="already committed"):
        client.put(source, "actor", 1, 0)


def test_an_upload_cut_off_mid_file_resumes_at_the_byte_the_server_holds(
        store: HttpServerStore, suite: Suite, tmp_path: Path) -> None:
    source = suite.copy("qwen_a", tmp_path / "node0")
    data = (source / SHARD).read_bytes()
    sent = len(data) // 3
    slot = upload_url(store.url, RUN, 1, 0, "actor")
    parts = urlsplit(slot)
    head = (f"PUT {parts.path}?{urlencode(put_params(SHARD, data))} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Authorization: Bearer {store.upload_token(1, 0)}\r\nContent-Length: {len(data)}\r\n\r\n")


    def partial() -> int:
        status = httpx.get(slot, headers=auth(store.upload_token(1, 0))).json()
        return int(status["partial"].get(SHARD, -1))

    # The connection drops after a third of the body: what arrived is kept for the next attempt.
    with socket.create_connection((parts.hostname, parts.port)) as raw:
        raw.sendall(head.encode() + data[:sent])
        wait_for(lambda: partial() == sent, "the server to write the first third")
    client = node(store, tmp_path / "node0")
    ref = client.put(source, "actor", 1, 0)
    assert client.report.bytes_sent == manifest_bytes(source) - sent  # the rest, not all
    landed = Path(store.resolve(ref, 1, 0).path)
    assert file_sha256(landed / SHARD) == file_sha256(source / SHARD)


def test_a_commit_whose_reply_was_lost_is_retried_and_succeeds(
        store: HttpServerStore, suite: Suite, tmp_path: Path) -> None:
    source = suite.copy("qwen_a", tmp_path / "node0")
    with DropReplyProxy(urlsplit(store.url).netloc, method=b"POST") as proxy:
        client = HttpClientStore(proxy.url, RUN, store.read_token(), tmp_path / "node0",
                                 upload_token=store.upload_token(1, 0))
        ref = client.put(source, "actor", 1, 0)
        assert proxy.dropped  # the first commit reached the server and its reply was lost
    # The retried commit of the very same checkpoint gets the reference, not "already committed".
    assert ref.path == upload_url(store.url, RUN, 1, 0, "actor") and ref.sha256 == hash_checkpoint_dir(source)
    assert build_manifest(Path(store.resolve(ref, 1, 0).path)) == build_manifest(source)
    # The slot stays final for anything else: another commit body, or another checkpoint.
    body = {"manifest": build_manifest(source).to_json(), "format": ref.format, "world_size": ref.world_size,
            "sha256": "0" * 64}
    response = httpx.post(ref.path, json=body, headers=auth(store.upload_token(1, 0)))
    assert response.status_code == 409 and "already committed" in response.json()["detail"]
    other = suite.copy("qwen_b", tmp_path / "node1")
    with pytest.raises(CheckpointError, match="already committed"):
        node(store, tmp_path / "node1").put(other, "actor", 1, 0)


def test_bytes_that_do_not_match_their_declared_hash_are_discarded(store: HttpServerStore, tmp_path: Path) -> None:
    slot = upload_url(store.url, RUN, 1, 0, "actor")
    headers = auth(store.upload_token(1, 0))
    response = httpx.put(slot, params=put_params("config.json", b"{}", sha="0" * 64), headers=headers, content=b"{}")
    assert response.status_code == 422 and "declared 0000000000000000" in response.json()["detail"]
    status = httpx.get(slot, headers=headers).json()
    assert status == {"committed": False, "complete": {}, "partial": {}}
    # A commit naming a file that never arrived whole is refused; nothing becomes a checkpoint.
    manifest = [{"name": "config.json", "size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}]
    commit = httpx.post(slot, headers=headers, json={"manifest": manifest, "format": "hf-safetensors",
                                                     "world_size": 1, "sha256": "1" * 64})
    assert commit.status_code == 409 and "has not been received completely" in commit.json()["detail"]
    assert not (store.run_root / "round_1" / "client_0" / "actor").exists()


@pytest.mark.parametrize(
    ("params", "body", "status", "message"),
    [
        (put_params("config.json", b"{}", size=10**12), b"{}", 413, "storage.max_file_bytes"),
        (put_params("config.json", b"{}", size=1), b"{}", 413, "runs past the declared 1 bytes"),
        (put_params("../escape.json", b"{}"), b"{}", 400, "is not allowed"),
        (put_params("huggingface/../../x", b"{}"), b"{}", 400, "is not allowed"),
        (put_params("/etc/passwd", b"{}"), b"{}", 400, "is not allowed"),
        (put_params(".hidden", b"{}"), b"{}", 400, "is not allowed"),
        (put_params("a/b/c.json", b"{}"), b"{}", 400, "is not allowed"),
        (put_params("config.json", b"{}", sha="not-a-hash"), b"{}", 400, "is not a sha256 hex digest"),
        (put_params("config.json", b"{}", offset=5), b"{}", 400, "offset 5 is outside"),
        ({"file": "config.json"}, b"{}", 422, "offset"),
    ],
)
def test_oversized_and_malformed_uploads_are_refused_and_leave_nothing(
        store: HttpServerStore, tmp_path: Path, params: dict, body: bytes, status: int, message: str) -> None:
    before = tree(tmp_path)
    response = httpx.put(upload_url(store.url, RUN, 1, 0, "actor"), params=params, content=body,
                         headers=auth(store.upload_token(1, 0)))
    assert response.status_code == status, response.text
    assert message in response.text
    after = tree(tmp_path)
    # At most the (empty) staging folders of the slot; no file anywhere.
    assert all(k.startswith("run") and (tmp_path / k).is_dir() for k in set(after) - set(before))


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"not json", 400, "is not JSON"),
        (b"[]", 400, "must be a JSON object"),
        (b"x" * (1024 * 1024 + 10), 413, "exceeds"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "nests JSON deeper than 32 levels"),  # RecursionError
        (json.dumps({"manifest": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]], "format": "x",
                     "world_size": 1, "sha256": "0" * 64}).encode(), 400, "nests JSON deeper than 32 levels"),
        (b'{"world_size": ' + b"9" * 5000 + b"}", 400, "holds a number of 5000 digits"),
        (json.dumps({"manifest": [{"name": "../x", "size": 1, "sha256": "0" * 64}], "format": "hf-safetensors",
                     "world_size": 1, "sha256": "0" * 64}).encode(), 400, "is not allowed"),
        (json.dumps({"manifest": [], "format": "hf-safetensors", "world_size": 1, "sha256": "0" * 64}).encode(),
         400, "lists no files"),
        (json.dumps({"manifest": [{"name": "a.json", "size": 1, "sha256": "0" * 64}], "format": "zip",
                     "world_size": 1, "sha256": "0" * 64}).encode(), 400, "unknown checkpoint format"),
    ],
)
def test_malformed_commits_are_refused(store: HttpServerStore, body: bytes, status: int, message: str) -> None:
    response = httpx.post(upload_url(store.url, RUN, 1, 0, "actor"), content=body,
                          headers=auth(store.upload_token(1, 0)))
    assert response.status_code == status and message in response.text, response.text
    assert not (store.run_root / "round_1" / "client_0" / "actor").exists()


@pytest.mark.parametrize(("body", "content_type", "shown"), [
    (b'["maintenance", "retry later"]', "application/json", '["maintenance", "retry later"]'),
    (b'"down for maintenance"', "application/json", '"down for maintenance"'),
    (b"null", "application/json", "null"),
    (b'{"detail": ["not", "a", "string"]}', "application/json", '{"detail": ["not", "a", "string"]}'),
    (b"<html><body>502 Bad Gateway</body></html>", "text/html", "<html><body>502 Bad Gateway</body></html>"),
    (b"", "text/plain", "(empty body)"),
])
def test_an_error_body_that_is_not_a_json_object_is_reported_as_text(
        suite: Suite, tmp_path: Path, body: bytes, content_type: str, shown: str) -> None:
    """A gateway in front of the store answers for it: whatever its error body, the client's error
    is a CheckpointError quoting it (an AttributeError on .get of a list or string before)."""
    source = suite.copy("qwen_a", tmp_path / "node0")
    reply = (503, body, content_type)
    with StubGateway({"GET": reply, "PUT": reply, "POST": reply}) as gateway:
        client = HttpClientStore(gateway.url, RUN, "read", tmp_path / "node0", upload_token="up", retries=0)
        model = CheckpointRef(path=f"{gateway.url}/runs/{RUN}/models/round_0/global", sha256="0" * 64)
        attempts: list[tuple[str, Callable[[], object]]] = [
            (f"GET {model.path}", lambda: client.fetch(model)),
            (f"upload status of {upload_url(gateway.url, RUN, 1, 0, 'actor')}",
             lambda: client.put(source, "actor", 1, 0)),
            ("progress report to", lambda: client.send_progress(b"{}", 1, 0)),
        ]
        for what, attempt in attempts:
            with pytest.raises(CheckpointError) as refused:
                attempt()
            assert f"checkpoint store refused the {what}" in str(refused.value)
            assert str(refused.value).endswith(f"(HTTP 503): {shown}"), refused.value


@pytest.mark.parametrize(("status", "body", "content_type", "message"), [
    (408, b'["stalled"]', "application/json", 'failed after 1 attempts: HTTP 408: ["stalled"]'),
    (409, b"<html>conflict</html>", "text/html", "refused the upload of config.json (HTTP 409): <html>conflict</html>"),
])
def test_an_upload_refused_with_a_body_that_is_not_a_json_object_is_reported_as_text(
        tmp_path: Path, status: int, body: bytes, content_type: str, message: str) -> None:
    source = tmp_path / "node0" / "model"
    source.mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"")
    empty_slot = json.dumps({"committed": False, "complete": {}, "partial": {}}).encode()
    with StubGateway({"GET": (200, empty_slot, "application/json"), "PUT": (status, body, content_type)}) as gateway:
        client = HttpClientStore(gateway.url, RUN, "read", tmp_path / "node0", upload_token="up", retries=0)
        with pytest.raises(CheckpointError) as refused:
            client.put(source, "actor", 1, 0)
        assert message in str(refused.value)
        assert "PUT" in gateway.requests


def read_response(raw: socket.socket) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 response (with a Content-Length) read from ``raw``."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += raw.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    length = next(int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length:"))
    while len(body) < length:
        body += raw.recv(65536)
    return int(lines[0].split()[1]), body


@pytest.fixture
def strict_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HttpServerStore]:
    """A store with the settings of the test's ``strict_store`` parameter (a dict)."""
    (tmp_path / "run").mkdir()
    with HttpServerStore(StorageSettings(kind="http", **request.param), tmp_path / "run", RUN) as running:
        yield running  # type: ignore[misc]


@pytest.mark.parametrize("strict_store", [{"upload_idle_timeout_s": 1.0}], indirect=True)
def test_a_stalled_upload_loses_its_slot_lock_and_keeps_its_bytes(
        strict_store: HttpServerStore, suite: Suite, tmp_path: Path) -> None:
    source = suite.copy("qwen_a", tmp_path / "node0")
    data = (source / SHARD).read_bytes()
    sent = len(data) // 3
    parts = urlsplit(upload_url(strict_store.url, RUN, 1, 0, "actor"))
    head = (f"PUT {parts.path}?{urlencode(put_params(SHARD, data))} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Authorization: Bearer {strict_store.upload_token(1, 0)}\r\nContent-Length: {len(data)}\r\n\r\n")
    # The client sends a third of the body, then nothing, with the connection still open.
    with socket.create_connection((parts.hostname, parts.port)) as raw:
        raw.sendall(head.encode() + data[:sent])
        raw.settimeout(30)  # a hang guard: the server answers after its 1 s idle timeout
        status, body = read_response(raw)
    assert status == 408, body
    detail = json.loads(body)["detail"]
    assert f"no bytes for 1 s (storage.upload_idle_timeout_s); the {sent} bytes received are kept" in detail
    # The slot is free again, and the upload resumes where the stalled one stopped.
    client = node(strict_store, tmp_path / "node0")
    ref = client.put(source, "actor", 1, 0)
    assert client.report.bytes_sent == manifest_bytes(source) - sent
    assert file_sha256(Path(strict_store.resolve(ref, 1, 0).path) / SHARD) == file_sha256(source / SHARD)


def test_the_upload_idle_timeout_is_a_checked_config_key() -> None:
    assert load_settings().storage.upload_idle_timeout_s == StorageSettings.upload_idle_timeout_s == 60.0
    assert load_settings(overrides="storage.upload_idle_timeout_s=5").storage.upload_idle_timeout_s == 5.0
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(ConfigError, match="config key 'storage.upload_idle_timeout_s'"):
            load_settings(overrides=f"storage.upload_idle_timeout_s={bad}")


@pytest.mark.parametrize("strict_store", [{"max_files_per_upload": 3}], indirect=True)
def test_an_upload_slot_holds_a_bounded_number_of_files(strict_store: HttpServerStore, tmp_path: Path) -> None:
    slot = upload_url(strict_store.url, RUN, 1, 0, "actor")
    headers = auth(strict_store.upload_token(1, 0))
    files = {f"f{i}.json": f"[{i}]".encode() for i in range(3)}
    httpx.put(slot, params=put_params("partial.json", b"[10]"), headers=headers, content=b"[1").raise_for_status()
    for name, data in list(files.items())[:2]:
        assert httpx.put(slot, params=put_params(name, data), headers=headers, content=data).json()["complete"]
    refused = httpx.put(slot, params=put_params("f2.json", files["f2.json"]), headers=headers,
                        content=files["f2.json"])
    assert refused.status_code == 413, refused.text
    assert "already holds 3 files, the most one upload may hold" in refused.json()["detail"]
    # Files it already holds still complete or repeat; nothing new was written.
    resumed = httpx.put(slot, params=put_params("partial.json", b"[10]", offset=2), headers=headers, content=b"0]")
    assert resumed.json() == {"received": 4, "complete": True}
    again = httpx.put(slot, params=put_params("f0.json", files["f0.json"]), headers=headers, content=files["f0.json"])
    assert again.json()["complete"]
    assert sorted(httpx.get(slot, headers=headers).json()["complete"]) == ["f0.json", "f1.json", "partial.json"]


@pytest.mark.parametrize(("first", "first_body", "second", "conflict"), [
    ("huggingface", b"{}", "huggingface/config.json", "needs 'huggingface' to be a folder, but this upload "
                                                      "already holds a file 'huggingface'"),
    ("huggingface", b"{", "huggingface/config.json", "already holds a file 'huggingface'"),  # still arriving
    ("huggingface/config.json", b"{}", "huggingface", "'huggingface' is a folder of this upload"),
])
def test_a_file_and_a_folder_of_the_same_name_are_refused_naming_it(
        store: HttpServerStore, tmp_path: Path, first: str, first_body: bytes, second: str, conflict: str) -> None:
    slot = upload_url(store.url, RUN, 1, 0, "actor")
    headers = auth(store.upload_token(1, 0))
    declared = put_params(first, b"{}")
    httpx.put(slot, params=declared, headers=headers, content=first_body).raise_for_status()
    before = tree(tmp_path)
    refused = httpx.put(slot, params=put_params(second, b"{}"), headers=headers, content=b"{}")
    assert refused.status_code == 409, refused.text
    assert conflict in refused.json()["detail"] and "cannot have a file and a folder of the same name" in refused.text
    assert tree(tmp_path) == before  # refused before anything was written
    # A manifest listing both is refused as such (400), and nothing is committed.
    manifest = [{"name": name, "size": 2, "sha256": declared["sha256"]} for name in (first, second)]
    commit = httpx.post(slot, headers=headers, json={"manifest": manifest, "format": "hf-safetensors",
                                                     "world_size": 1, "sha256": "1" * 64})
    assert commit.status_code == 400, commit.text
    assert "lists 'huggingface' both as a file and as the folder of 'huggingface/config.json'" in commit.text
    assert tree(tmp_path) == before
    assert not (store.run_root / "round_1" / "client_0" / "actor").exists()


def test_tokens_open_only_their_own_slot_and_run(store: HttpServerStore) -> None:
    slot = upload_url(store.url, RUN, 2, 1, "actor")
    data = b"{}"
    for headers in ({}, auth("0" * 64), auth(store.read_token()), auth(store.upload_token(2, 0)),
                    auth(store.upload_token(1, 1))):
        response = httpx.put(slot, params=put_params("config.json", data), headers=headers, content=data)
        assert response.status_code == 403 and "store token" in response.text
    other_run = slot.replace(f"/runs/{RUN}/", "/runs/12/")
    response = httpx.put(other_run, params=put_params("config.json", data), headers=auth(store.upload_token(2, 1)),
                         content=data)
    assert response.status_code == 404 and "serves run 11, not run '12'" in response.text
    assert httpx.get(f"{store.url}/runs/{RUN}/models/round_1/global",
                     headers=auth(store.upload_token(2, 1))).status_code == 403
    assert not list(store.run_root.iterdir())


# -- downloads -----------------------------------------------------------------------------------


def test_a_download_is_verified_cached_and_resumed_after_a_cut(
        store: HttpServerStore, tiny_model_dir: Path, tmp_path: Path) -> None:
    shared = store.share(CheckpointRef.for_directory(tiny_model_dir))
    assert "/models/external/" in shared.path  # the base model lies outside the run root
    total = manifest_bytes(tiny_model_dir)
    weights = tiny_model_dir / "model.safetensors"
    # A real download that stops a quarter of the way into the weights, as a dropped link would.
    partial = tmp_path / "node0" / "cache" / f".partial-{shared.sha256}" / "model.safetensors.part"
    partial.parent.mkdir(parents=True)
    keep = weights.stat().st_size // 4
    with httpx.stream("GET", shared.path, params={"file": "model.safetensors"},
                      headers=auth(store.read_token())) as response, open(partial, "wb") as handle:
        for chunk in response.iter_bytes(4096):
            handle.write(chunk[: keep - handle.tell()])
            if handle.tell() >= keep:
                break
    client = node(store, tmp_path / "node0")
    local = client.fetch(shared)
    assert client.report.bytes_received == total - keep
    assert local == tmp_path / "node0" / "cache" / shared.sha256
    assert build_manifest(local) == build_manifest(tiny_model_dir)
    assert hash_checkpoint_dir(local) == shared.sha256
    # Evaluation, or the next message on this node: served from the cache, nothing downloaded.
    again = node(store, tmp_path / "node0")
    assert again.fetch(shared) == local and again.report.cache_hit and again.report.bytes_received == 0


def test_a_model_with_an_empty_file_is_fetched(store: HttpServerStore, tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "with-empty"
    shutil.copytree(tiny_model_dir, model)
    (model / "empty.txt").write_bytes(b"")  # a zero-byte file is a file too: it is hashed and sent
    shared = store.share(CheckpointRef.for_directory(model))
    local = node(store, tmp_path / "node0").fetch(shared)
    assert (local / "empty.txt").read_bytes() == b""
    assert build_manifest(local) == build_manifest(model) and hash_checkpoint_dir(local) == shared.sha256
    assert not list((tmp_path / "node0" / "cache").glob(".partial-*"))  # nothing left half-done


# Names a hub snapshot or a git clone may hold besides the weights; all must travel byte for byte.
ODD_NAMES = ("Model Card.md", "notes (v2) + extras & more=1 #5 %20 100%.txt", "résumé.txt")


def test_a_hub_snapshot_with_git_files_and_spaces_in_names_is_shared_and_fetched(
        store: HttpServerStore, tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "snapshot"
    shutil.copytree(tiny_model_dir, model)
    plain = build_manifest(model)
    # What `git clone` and `huggingface-cli download --local-dir` leave next to the weights.
    (model / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (model / ".git").mkdir()
    (model / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (model / ".cache" / "huggingface").mkdir(parents=True)
    (model / ".cache" / "huggingface" / ".gitignore").write_text("*\n")
    (model / ".hidden.json").write_text("{}")  # hidden: neither hashed nor sent, though .json
    for index, name in enumerate(ODD_NAMES):
        (model / name).write_bytes(f"file {index}\n".encode() * 1000)
    ref = CheckpointRef.for_directory(model)
    assert ref.sha256 == hash_checkpoint_dir(tiny_model_dir)  # hidden files are not model files
    shared = store.share(ref)
    local = node(store, tmp_path / "node0").fetch(shared)
    assert sorted(p.name for p in local.iterdir()) == sorted([e.name for e in plain.files] + list(ODD_NAMES))
    for name in ODD_NAMES:
        assert (local / name).read_bytes() == (model / name).read_bytes()
    assert hash_checkpoint_dir(local) == shared.sha256


def test_a_checkpoint_with_spaces_in_file_names_is_uploaded_and_committed(
        store: HttpServerStore, suite: Suite, tmp_path: Path) -> None:
    source = suite.copy("qwen_b", tmp_path / "node0")
    (source / "training notes.txt").write_text("lr 1e-6\n")
    (source / "huggingface" / "Model Card.md").write_text("# tiny\n")
    (source / ".gitignore").write_text("*.log\n")
    ref = node(store, tmp_path / "node0").put(source, "actor", 1, 0)
    landed = Path(store.resolve(ref, 1, 0).path)
    assert (landed / "training notes.txt").read_text() == "lr 1e-6\n"
    assert (landed / "huggingface" / "Model Card.md").read_text() == "# tiny\n"
    assert not (landed / ".gitignore").exists()
    assert build_manifest(landed) == build_manifest(source)


@pytest.mark.parametrize("name", ["a\\b.json", "x\n.json", "nul\x00.json", " lead.json", "trail.json ",
                                  "huggingface/.hidden", "huggingface/", "..", "./config.json",
                                  "huggingface/../config.json", "x" * 201])
def test_file_names_that_could_leave_their_folder_are_still_refused(store: HttpServerStore, tmp_path: Path,
                                                                     name: str) -> None:
    before = tree(tmp_path)
    response = httpx.put(upload_url(store.url, RUN, 1, 0, "actor"), params=put_params(name, b"{}"), content=b"{}",
                         headers=auth(store.upload_token(1, 0)))
    assert response.status_code == 400 and "is not allowed" in response.json()["detail"], response.text
    assert all((tmp_path / k).is_dir() for k in set(tree(tmp_path)) - set(before))


def test_a_model_altered_on_the_server_after_sharing_is_refused_by_the_client(
        store: HttpServerStore, tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "base"
    shutil.copytree(tiny_model_dir, model)
    shared = store.share(CheckpointRef.for_directory(model))
    with open(model / "model.safetensors", "r+b") as handle:
        handle.seek(-4, 2)
        handle.write(b"\x00\x00\x80\x7f")  # same size, other bytes
    client = node(store, tmp_path / "node0")
    with pytest.raises(CheckpointError, match="sha256 .* differs from the manifest"):
        client.fetch(shared)
    assert not (tmp_path / "node0" / "cache" / shared.sha256).exists()


def test_the_store_over_tls_is_trusted_only_through_the_run_ca(tmp_path: Path, tiny_model_dir: Path) -> None:
    tls = make_tls_files(tmp_path / "tls", hosts=("127.0.0.1",))
    settings = StorageSettings(kind="http", ssl_certfile=str(tls.server_cert), ssl_keyfile=str(tls.server_key),
                               ssl_ca_certfile=str(tls.ca_cert))
    (tmp_path / "run").mkdir()
    with HttpServerStore(settings, tmp_path / "run", RUN) as running:
        assert running.url.startswith("https://127.0.0.1:")
        fields = running.instruction_fields()
        assert fields["store-ca-pem"] == tls.ca_cert.read_text()
        shared = running.share(CheckpointRef.for_directory(tiny_model_dir))
        pinned = node(running, tmp_path / "node0", ca_pem=fields["store-ca-pem"])  # type: ignore[arg-type]
        assert hash_checkpoint_dir(pinned.fetch(shared)) == shared.sha256
        unpinned = node(running, tmp_path / "node1")  # system CAs only: the private CA is unknown
        with pytest.raises(CheckpointError, match="TLS certificate is not trusted"):
            unpinned.fetch(shared)
