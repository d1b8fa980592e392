"""The ServerApp's checkpoint store in an S3-compatible bucket (``storage.kind=s3``), via fsspec/s3fs.

For federations without a shared filesystem whose machines all reach one bucket (AWS S3, MinIO,
Ceph RGW, ...). Messages still carry references only: ``s3://<bucket>/<prefix>/runs/<run>/...``
plus a content hash. Layout under ``<storage.url>/runs/<run id>/``:

``models/<model id>/_files/<name>``            a global model's files (those :func:`.manifest.build_manifest` lists)
``models/<model id>/_manifest-<sha256>.json``  written last: a client reads a model only once it exists
``uploads/<round>/<client>/<kind>/_files/<name>``  a client's checkpoint files
``uploads/<round>/<client>/<kind>/_commit-<sha256>.json``  written last by the client: manifest, hash, ...

After each commit, what nothing reads any more (uploads of committed rounds, models retention does
not keep) is deleted, marker first (:meth:`S3ServerStore.release`, :mod:`.s3_retention`); a resumed
run deletes its earlier attempts' objects by the same rules (:meth:`S3ServerStore.release_earlier`).

A reference names its manifest (or commit) by the sha256 of that object's bytes, as a last path
segment ``m-<sha256>`` (``c-<sha256>``), and the reader checks the bytes against it before parsing
them: the per-file hashes a reader checks every file against therefore come from the trusted
channel (the server's instruction, the client's reply), not from an object a peer could rewrite.
The directory's content hash alone covers only the weights and top-level JSON files; the pinned
manifest covers the tokenizer, chat template and ``huggingface/`` files as well.

Credentials never travel: each machine's boto configuration (environment variables, ``~/.aws``,
an instance role) is used; instructions carry only the bucket URL, the run and
``storage.endpoint_url``. The bucket is not a trust boundary between clients (with one shared
credential any client can write anywhere), so the server reads an upload only from the slot of the
(round, client, kind) it expects, checks the commit against the digest in the client's Flower reply,
every file against that commit's manifest and the directory against the reply's content hash, and
refuses a mismatch naming the client; clients check a global model the same way against the
server's instruction. Per-client bucket policies that
limit each client to its own ``uploads/*/<client>/`` keys turn tampering into a refused write
instead of a refused round (docs/deployment.md, "Trust boundaries").

Each file of an upload is hashed once, on the server's disk, after its download; the directory's
content hash is combined from those digests, and the store writes a receipt beside the folder
(:mod:`.receipts`, as the http store does) so that the aggregation need not hash the files again
while they are unchanged (docs/performance.md, "Server-side passes over one upload").
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from logging import WARNING
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from flwr.common.logger import log

from fedagent_flwr.atomic import fsync_dir, fsync_tree
from fedagent_flwr.checkpoint.manifest import FileEntry, Manifest, build_manifest
from fedagent_flwr.checkpoint.receipts import ReceiptCheck, receipt_key, write_receipt
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef, hash_checkpoint_dir, is_sha256
from fedagent_flwr.checkpoint.store import (
    ENDPOINT_FIELD,
    KIND_FIELD,
    RUN_FIELD,
    URL_FIELD,
    Release,
    Released,
    ServerStore,
    StorageSettings,
    client_slot,
    own_upload_parts,
    require_hash,
)
from fedagent_flwr.checkpoint.upload_staging import CheckedFiles, check_in_place, checked_content_hash, recheck_leftover

FILES_DIR = "_files"
MANIFEST_TAG, COMMIT_TAG = "m", "c"  # a reference's last segment: m-<sha256 of the manifest object>, c-<...>
MAX_JSON_BYTES = 1024 * 1024  # a manifest of MAX_FILES entries is ~0.5 MiB
_PROBE = "_store-check"
_CHUNK = 8 * 1024 * 1024  # bytes one ranged read fetches


def marker_object(key: str, tag: str, digest: str) -> str:
    """The manifest (``tag`` m) or commit (c) object of ``key`` whose bytes hash to ``digest``."""
    return f"{key}/_{'manifest' if tag == MANIFEST_TAG else 'commit'}-{digest}.json"


def pinned(path: str, tag: str, who: str) -> tuple[str, str]:
    """``(reference path without its last segment, the sha256 that segment pins)`` for a reference
    ``<path>/<tag>-<sha256>``; CheckpointError naming ``who`` otherwise."""
    head, _, last = path.rstrip("/").rpartition("/")
    digest = last[len(tag) + 1:]
    if not last.startswith(f"{tag}-") or not is_sha256(digest):
        what = "manifest" if tag == MANIFEST_TAG else "commit"
        raise CheckpointError(f"{who} reference {path[:120]!r} does not pin its {what} (.../{tag}-<sha256>)")
    return head, digest


def bucket_path(url: str) -> str:
    """``bucket/prefix`` (what s3fs calls a path) of ``s3://bucket/prefix``, without a trailing slash."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise CheckpointError(f"{url[:120]!r} is not an s3://bucket/prefix URL")
    return f"{parts.netloc}{parts.path}".rstrip("/")


def open_filesystem(endpoint_url: str = "") -> Any:
    """An s3fs filesystem using this machine's own credentials; ``endpoint_url`` for an
    S3-compatible service ("" uses AWS, or the ``AWS_ENDPOINT_URL`` of this machine's environment).

    A new instance each time (fsspec caches instances by argument, which would keep credentials
    and endpoints of an earlier store), with short connection timeouts so that an unreachable
    endpoint fails in seconds; s3fs retries transient errors itself.
    """
    try:
        import s3fs
    except ImportError:
        raise CheckpointError(
            "storage.kind=s3 needs s3fs on every machine of the run: pip install 'fedagent-flwr[s3]'"
        ) from None
    return s3fs.S3FileSystem(
        endpoint_url=endpoint_url or None, skip_instance_cache=True,
        config_kwargs={"connect_timeout": 10, "read_timeout": 300, "retries": {"max_attempts": 3}},
    )


def from_s3_client(exc: BaseException) -> bool:
    """Whether ``exc`` came from the S3 client stack (botocore's own errors, or s3fs's translation
    of one, whose cause is botocore's), not from this machine's filesystem."""
    for error in (exc, exc.__cause__):
        if error is not None and type(error).__module__.split(".")[0] in ("botocore", "aiobotocore", "s3fs", "aiohttp"):
            return True
    return False


@contextmanager
def named_s3_errors(what: str, url: str, endpoint_url: str) -> Iterator[None]:
    """Turn an S3 client error met while doing ``what`` into a CheckpointError naming the bucket,
    the endpoint and this machine's credentials: a node's log then says what to fix instead of
    ending in a bare ``EndpointConnectionError``. Local errors (a full disk) pass unchanged."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        if not from_s3_client(exc):
            raise
        endpoint = endpoint_url or "AWS (no endpoint_url)"
        raise CheckpointError(
            f"{what}: the s3 store {url} at {endpoint} failed ({type(exc).__name__}: {str(exc)[:300]}); check that "
            "this machine reaches the endpoint and that its own AWS credentials may read and write there"
        ) from exc


def read_json_object(fs: Any, key: str, what: str, sha256: str) -> dict[str, Any]:
    """A small JSON object from the bucket whose bytes hash to ``sha256`` (at most MAX_JSON_BYTES
    are read, whatever the object's size); CheckpointError naming ``what`` otherwise."""
    try:
        data = fs.cat_file(key, start=0, end=MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointError(f"{what}: s3://{key} does not exist") from None
    if len(data) > MAX_JSON_BYTES:
        raise CheckpointError(f"{what} (s3://{key}) holds more than {MAX_JSON_BYTES} bytes")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{what} (s3://{key}) is not the one its reference pins (sha256 {sha256[:16]}...); "
                              "it was changed in the bucket: refused")
    try:
        body = json.loads(data)
    except ValueError as exc:
        raise CheckpointError(f"{what} (s3://{key}) is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise CheckpointError(f"{what} (s3://{key}) is not a JSON object")
    return body


def download_verified(fs: Any, files_key: str, entry: FileEntry, staging: Path, who: str,
                      checked: CheckedFiles) -> int:
    """Download one manifest file into ``staging`` (``<name>.part``, renamed, then checked);
    return the bytes downloaded (0 when an earlier, interrupted pass left it complete).

    The object's size is checked before a byte is read and its sha256 after, so an object that
    is not what the manifest says is refused naming ``who`` and never kept.

    The file is renamed to its name in ``staging`` first and hashed there by
    :func:`~.upload_staging.check_in_place` (:func:`~.upload_staging.hash_and_sync`), so that the
    stat recorded with its digest in ``checked`` (None when it may have changed while hashed) is
    the one taken before these very bytes were hashed (a file rename moves ``ctime``). The
    server's download of an upload writes its receipt from it (:mod:`.receipts`); the node's
    download of a global model combines the content hash from it (:func:`.node_cache.fill_cache`).
    A file found complete in ``staging`` may predate a crash between that rename and its check,
    so it is hashed again, and downloaded again when it does not match.
    """
    final = staging / entry.name
    what = f"{who}: s3://{files_key}/"
    if recheck_leftover(final, entry, checked, what):
        return 0
    key = f"{files_key}/{entry.name}"
    try:
        size = int(fs.info(key)["size"])
    except FileNotFoundError:
        raise CheckpointError(f"{who}: {entry.name} is missing from s3://{files_key}/") from None
    if size != entry.size:
        raise CheckpointError(
            f"{who}: s3://{key} holds {size} bytes, the manifest says {entry.size}; refused"
        )
    part = final.with_name(final.name + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    # At most entry.size bytes, in ranged reads: an object replaced by a larger one after the size
    # check cannot fill this disk.
    with open(part, "wb") as sink:
        if entry.size:
            with fs.open(key, "rb", cache_type="none") as source:
                while sink.tell() < entry.size and (chunk := source.read(min(_CHUNK, entry.size - sink.tell()))):
                    sink.write(chunk)
    if part.stat().st_size != entry.size:
        got = part.stat().st_size
        part.unlink()
        raise CheckpointError(f"{who}: the transfer of s3://{key} stopped at {got} of {entry.size} bytes; "
                              "try again")
    part.replace(final)
    check_in_place(final, entry, checked, what)
    return entry.size


def upload_files(fs: Any, directory: Path, manifest: Manifest, files_key: str) -> int:
    """Upload ``manifest``'s files of ``directory`` under ``files_key``; return the bytes sent.

    Each object appears whole or not at all (an S3 PUT, or a multipart upload's completion, is
    atomic); the reader still waits for the completion marker written after all of them.
    """
    sent = 0
    for entry in manifest.files:
        fs.put_file(str(directory / entry.name), f"{files_key}/{entry.name}")
        sent += entry.size
    return sent


def check_bucket(fs: Any, settings: StorageSettings, base: str) -> None:
    """Write, read and delete a probe object under ``base``: a missing bucket, missing
    credentials, missing permissions or an unreachable endpoint stop the run before round 0 with
    one message naming the settings and what to do."""
    probe = f"{base}/{_PROBE}"
    endpoint = settings.endpoint_url or "(AWS, or AWS_ENDPOINT_URL of this machine)"
    where = f"config keys 'storage.url' = {settings.url!r} and 'storage.endpoint_url' = {endpoint}"
    try:
        fs.pipe_file(probe, b"fedagent store check\n")
        fs.cat_file(probe)
        fs.rm_file(probe)
        return
    except FileNotFoundError as exc:
        problem = (f"the bucket does not exist ({exc}); create it (e.g. `aws s3 mb s3://{base.split('/')[0]}`) "
                   "or fix storage.url")
    except PermissionError as exc:
        problem = (f"access denied ({exc}); the credentials of this machine need s3:PutObject, GetObject, "
                   "DeleteObject and ListBucket on that prefix")
    except Exception as exc:  # noqa: BLE001 -- botocore's errors have no common base the run can name better
        name = type(exc).__name__
        if "Credential" in name or "credential" in str(exc):
            problem = (f"no credentials ({name}: {exc}); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                       "AWS_PROFILE or an instance role on every machine of the run (never in the config)")
        elif "Connect" in name or "Endpoint" in name or "connect" in str(exc).lower():
            problem = (f"the endpoint cannot be reached ({name}: {str(exc)[:300]}); check storage.endpoint_url "
                       "and that the service runs and is reachable from this machine")
        else:
            problem = f"{name}: {str(exc)[:300]}"
    raise CheckpointError(f"{where}: the checkpoint bucket is not usable: {problem}")


class S3ServerStore(ServerStore):
    """Shares global models into the bucket and downloads the clients' committed uploads."""

    kind = "s3"

    def __init__(self, settings: StorageSettings, run_root: str | os.PathLike[str], run_key: str,
                 fs: Any = None) -> None:
        super().__init__(run_root)
        self.settings = settings
        self.run_key = run_key
        self.url = settings.url.rstrip("/")
        self.base = bucket_path(self.url)
        self.fs = fs if fs is not None else open_filesystem(settings.endpoint_url)
        check_bucket(self.fs, settings, f"{self.base}/runs/{run_key}")
        self._shared: dict[tuple[str, str], CheckpointRef] = {}
        # The key of the receipts this store writes for the uploads it verified (:mod:`.receipts`):
        # random per run and kept in memory only, as the http store's.
        self._secret = secrets.token_bytes(32)
        self._models: dict[str, tuple[Path, str]] = {}  # model id -> (local directory, kind), for release

    def _key(self, *segments: str) -> str:
        return "/".join((self.base, "runs", self.run_key, *segments))

    def share(self, ref: CheckpointRef) -> CheckpointRef:
        """Upload the model's files once per run, then its manifest object (the completion marker)."""
        cache_key = (ref.path, ref.sha256)
        if cache_key not in self._shared:
            with named_s3_errors(f"sharing {ref.path}", self.url, self.settings.endpoint_url):
                self._shared[cache_key] = self._share(ref)
        return self._shared[cache_key]

    def _share(self, ref: CheckpointRef) -> CheckpointRef:
        require_hash(ref, "the server")
        directory = Path(ref.path).resolve()
        try:
            model_id = directory.relative_to(self.run_root).as_posix()
        except ValueError:  # the base model, outside the run root: named by its hash
            model_id = f"external/{ref.sha256[:16]}"
        model_key = self._key("models", model_id)
        manifest = build_manifest(directory)
        upload_files(self.fs, directory, manifest, f"{model_key}/{FILES_DIR}")
        body = json.dumps({"files": manifest.to_json(), "sha256": ref.sha256}).encode()
        digest = hashlib.sha256(body).hexdigest()
        self.fs.pipe_file(marker_object(model_key, MANIFEST_TAG, digest), body)  # last: the model is complete
        self._models[model_id] = (directory, ref.kind)
        return CheckpointRef(path=f"{self.url}/runs/{self.run_key}/models/{model_id}/{MANIFEST_TAG}-{digest}",
                             kind=ref.kind, format=ref.format, world_size=ref.world_size, sha256=ref.sha256)

    def resolve(self, ref: CheckpointRef, server_round: int, client: int) -> CheckpointRef:
        """Download client ``client``'s committed upload of ``server_round`` from its own slot only,
        checking every file and the whole directory; return it as a local directory."""
        who = f"client {client}"
        path, commit_digest = pinned(ref.path, COMMIT_TAG, who)
        expected = own_upload_parts(replace(ref, path=path), self.url, self.run_key, server_round, client)
        with named_s3_errors(f"download of {who}'s {ref.kind}", self.url, self.settings.endpoint_url):
            return self._download_upload(ref, server_round, client, expected, commit_digest)

    def _download_upload(self, ref: CheckpointRef, server_round: int, client: int,
                         expected: list[str], commit_digest: str) -> CheckpointRef:
        who = f"client {client}"
        slot_key = self._key(*expected)
        commit = read_json_object(self.fs, marker_object(slot_key, COMMIT_TAG, commit_digest),
                                  f"{who}'s upload commit", commit_digest)
        if commit.get("sha256") != ref.sha256 or commit.get("format") != ref.format \
                or commit.get("world_size") != ref.world_size:
            raise CheckpointError(f"{who}'s upload commit in s3://{slot_key}/ does not match its reply "
                                  "(content hash, format or world size); refused")
        manifest = Manifest.from_json(commit.get("files"), self.settings.max_file_bytes)
        slot = client_slot(self.run_root, server_round, client)
        final = slot / ref.kind
        receipts = self.receipt_check()
        if final.is_dir():
            trusted = receipts.trusted(final) if receipts is not None else {}
            known = {name: (t.stat.size, t.digest) for name, t in trusted.items()}
            if hash_checkpoint_dir(final, known=known) == ref.sha256:  # resolved before (a repeated reply)
                return _local(ref, final)
            shutil.rmtree(final)
        staging = slot / f".download-{ref.kind}"
        staging.mkdir(parents=True, exist_ok=True)
        checked: CheckedFiles = {}
        try:
            for entry in manifest.files:
                download_verified(self.fs, f"{slot_key}/{FILES_DIR}", entry, staging, who, checked)
        except CheckpointError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        # Every file was just hashed against the pinned manifest, so the content hash is combined
        # from those digests (as a node's fetch does): the reply's hash must be the manifest's, and
        # nothing unchanged since its check is read a second time for it.
        actual = checked_content_hash(staging, checked)
        if actual != ref.sha256:
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(f"{who}'s upload s3://{slot_key}/ hashes to {actual[:16]}..., its reply says "
                                  f"{ref.sha256[:16]}...; refused")
        fsync_tree(staging)
        staging.replace(final)  # renames the folder: the files' own stat (ctime included) stays
        fsync_dir(slot)
        if receipts is not None:
            stable = {name: (digest, stat) for name, (digest, stat) in checked.items() if stat is not None}
            try:
                write_receipt(final, stable, self.receipt_key())
            except OSError as exc:
                log(WARNING, "no receipt for %s (%s): the aggregation will hash its files", final, exc)
        return _local(ref, final)

    def receipt_key(self) -> bytes:
        """The key of this store's receipts (:func:`~.receipts.receipt_key`, from the run's secret)."""
        return receipt_key(self._secret, self.run_key)

    def receipt_check(self) -> ReceiptCheck | None:
        return ReceiptCheck(self.receipt_key()) if self.settings.trust_store_receipts else None

    def release(self, plan: Release) -> Released:
        """Delete this run's objects that ``plan`` no longer needs (:mod:`.s3_retention`: uploads of
        committed rounds, models not kept, each marker before its files); never raises. A model that
        went is uploaded again should it be shared again."""
        from fedagent_flwr.checkpoint.s3_retention import release_bucket

        released, gone, stale = release_bucket(self.fs, self._key(), plan, self._models, self.run_root)
        for model_id in gone:  # went: nothing of it to release later
            self._models.pop(model_id, None)
        for model_id in stale:  # its marker may be gone (a request that raised): share it again if asked
            where = f"/runs/{self.run_key}/models/{model_id}/{MANIFEST_TAG}-"
            self._shared = {k: v for k, v in self._shared.items() if where not in v.path}
        return released

    def release_earlier(self, run_ids: Sequence[int], client_uploads: bool, models: bool) -> Released | None:
        """Delete the objects of this run's earlier attempts (:func:`.s3_retention.release_earlier_attempts`),
        under ``runs/<id>/`` of exactly those ids: only non-negative integers (Flower's run ids, named
        by ``str(id)`` as this store names its own), never this run's own; None when nothing may go."""
        from fedagent_flwr.checkpoint.s3_retention import release_earlier_attempts

        keys = sorted({str(run_id) for run_id in run_ids if type(run_id) is int and run_id >= 0} - {self.run_key})
        if not keys or not (client_uploads or models):
            return None
        return release_earlier_attempts(self.fs, self.base, keys, client_uploads, models)

    def instruction_fields(self) -> dict[str, Any]:
        return {KIND_FIELD: self.kind, URL_FIELD: self.url, RUN_FIELD: self.run_key,
                ENDPOINT_FIELD: self.settings.endpoint_url}

    def describe(self) -> str:
        endpoint = f" at {self.settings.endpoint_url}" if self.settings.endpoint_url else ""
        return f"s3 store {self.url}{endpoint} (run {self.run_key}) -> {self.run_root}"


def _local(ref: CheckpointRef, directory: Path) -> CheckpointRef:
    return CheckpointRef(path=str(directory), kind=ref.kind, format=ref.format,
                         world_size=ref.world_size, sha256=ref.sha256)
