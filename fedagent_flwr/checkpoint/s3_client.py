"""The ClientApp's side of the S3 checkpoint store (the server side and the bucket layout: :mod:`.s3_store`).

``fetch`` reads a global model of the current run into the node's content-addressed cache
(``<work dir>/cache/<sha256>/``) exactly as the http store's client does (:func:`.node_cache.fill_cache`:
every file checked against the manifest object the reference pins by its sha256, the folder
against the reference's content hash, then renamed; node config ``cache-keep`` honoured). ``put``
uploads a checkpoint's manifest files into the client's own upload location and writes its commit
object last, named by its sha256, which the returned reference pins, so the server never reads
half an upload nor a commit a peer rewrote. Credentials are this machine's own (boto's usual lookup).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from fedagent_flwr.checkpoint.manifest import Manifest, build_manifest
from fedagent_flwr.checkpoint.node_store import NodeClientStore, TransferReport
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointKind, CheckpointRef
from fedagent_flwr.checkpoint.s3_store import (
    COMMIT_TAG,
    FILES_DIR,
    MANIFEST_TAG,
    bucket_path,
    download_verified,
    marker_object,
    named_s3_errors,
    open_filesystem,
    pinned,
    read_json_object,
    upload_files,
)
from fedagent_flwr.checkpoint.upload_staging import CheckedFiles


class S3ClientStore(NodeClientStore):
    """Fetch global models from and put checkpoints into the run's bucket."""

    kind = "s3"

    def __init__(self, url: str, run_key: str, work_dir: str | os.PathLike[str], *, endpoint_url: str = "",
                 cache_keep: int = 0, fs: Any = None) -> None:
        super().__init__(url, run_key, Path(work_dir), cache_keep)
        self.base = bucket_path(self.url)
        self.endpoint_url = endpoint_url
        self._fs = fs

    @property
    def fs(self) -> Any:
        """The s3fs filesystem, opened at first use (a cache hit never touches the bucket)."""
        if self._fs is None:
            self._fs = open_filesystem(self.endpoint_url)
        return self._fs

    def fetch(self, ref: CheckpointRef) -> Path:
        """The global model ``ref`` names, in this node's cache: downloaded unless cached, each file
        checked against the manifest the reference pins and the folder against its content hash."""
        path, manifest_digest = pinned(ref.path, MANIFEST_TAG, "global model")
        segments, digest = self.model_segments(path, ref)
        model_key = "/".join((self.base, "runs", self.run_key, *segments))
        return self.cached_fetch(
            ref, digest, lambda staging: self._download_all(model_key, digest, manifest_digest, staging),
            named_s3_errors(f"fetch of global model {digest[:12]}", self.url, self.endpoint_url))

    def _download_all(self, model_key: str, digest: str, manifest_digest: str, staging: Path) -> CheckedFiles:
        marker = read_json_object(self.fs, marker_object(model_key, MANIFEST_TAG, manifest_digest),
                                  "global model manifest", manifest_digest)
        if marker.get("sha256") != digest:
            raise CheckpointError(f"global model s3://{model_key}/ is another model than the reference's "
                                  f"{digest[:16]}... (or is being replaced); refused")
        manifest = Manifest.from_json(marker.get("files"))
        checked: CheckedFiles = {}
        for entry in manifest.files:
            received = download_verified(self.fs, f"{model_key}/{FILES_DIR}", entry, staging, "global model", checked)
            self.report.bytes_received += received
            self.report.files_skipped += received == 0 and entry.size > 0
        return checked

    def put(self, directory: str | os.PathLike[str], kind: CheckpointKind, server_round: int,
            client: int) -> CheckpointRef:
        """Upload checkpoint ``directory`` to this client's own location of the round, the commit
        last; the reference returned pins that commit's bytes (``.../c-<sha256>``)."""
        local = CheckpointRef.for_directory(directory, kind)
        manifest = build_manifest(directory)
        segments = ("uploads", str(server_round), str(client), kind)
        slot_key = "/".join((self.base, "runs", self.run_key, *segments))
        self.report = TransferReport(started=time.monotonic())
        body = json.dumps({"files": manifest.to_json(), "format": local.format, "world_size": local.world_size,
                           "sha256": local.sha256}).encode()
        commit_digest = hashlib.sha256(body).hexdigest()
        with named_s3_errors(f"upload of client {client}'s {kind} of round {server_round}", self.url,
                             self.endpoint_url):
            # The commit is named by its digest and written last; a retried put writes the same files
            # and the same commit again (no HEAD or list: a client may hold only Put/Get on its keys).
            self.report.bytes_sent = upload_files(self.fs, Path(directory), manifest, f"{slot_key}/{FILES_DIR}")
            self.fs.pipe_file(marker_object(slot_key, COMMIT_TAG, commit_digest), body)
        print(self.report.describe(f"client {client}'s {kind} of round {server_round} uploaded"), flush=True)
        return CheckpointRef(path=f"{self.url}/runs/{self.run_key}/{'/'.join(segments)}/{COMMIT_TAG}-{commit_digest}",
                             kind=kind, format=local.format, world_size=local.world_size, sha256=local.sha256)
