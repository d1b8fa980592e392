"""The ClientApp's side of the HTTP checkpoint store (the server side is :mod:`.http_server`).

``fetch`` downloads a global model of the current run into a node-local, content-addressed
cache (``<work dir>/cache/<sha256>/``): every file is checked against the server's manifest and
the directory against the reference's content hash before it is renamed into place, so the cache
only ever holds complete, verified models, and a later round or evaluation of the same model
downloads nothing; node config ``cache-keep`` bounds it (:mod:`.node_cache`). ``put`` uploads a
checkpoint file by file (the server checks each sha256) and commits it. Both resume an interrupted
transfer where it stopped: a download from the partial file it left (HTTP ``Range``), an upload
from the offset the server reports.
"""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from fedagent_flwr.checkpoint.manifest import FileEntry, Manifest, build_manifest
from fedagent_flwr.checkpoint.node_store import NodeClientStore, TransferReport
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointKind, CheckpointRef
from fedagent_flwr.checkpoint.store import progress_url
from fedagent_flwr.checkpoint.upload_staging import CheckedFiles, check_in_place, recheck_leftover
from fedagent_flwr.progress import MAX_PROGRESS_BYTES

_CHUNK = 1024 * 1024
_MAX_DETAIL_CHARS = 2000  # of an error body quoted in a CheckpointError (a proxy's HTML page can be long)


class HttpClientStore(NodeClientStore):
    """Fetch global models from and put checkpoints into the run's HTTP store."""

    kind = "http"

    def __init__(self, url: str, run_key: str, read_token: str, work_dir: str | os.PathLike[str], *,
                 upload_token: str = "", ca_pem: str = "", retries: int = 5, timeout_s: float = 120.0,
                 cache_keep: int = 0) -> None:
        if not url.startswith(("http://", "https://")):
            raise CheckpointError(f"store url {url!r} is not an http(s) URL")
        super().__init__(url, run_key, Path(work_dir), cache_keep)
        self.retries = retries
        # A CA from the instruction pins the store's certificate; without one, the system's CAs.
        self._verify: Any = ssl.create_default_context(cadata=ca_pem) if ca_pem else True
        self._timeout = httpx.Timeout(timeout_s, connect=30.0)
        self._read_headers = {"Authorization": f"Bearer {read_token}"}
        self._upload_headers = {"Authorization": f"Bearer {upload_token}"}
        self._http: httpx.Client | None = None

    @contextmanager
    def _session(self) -> Iterator[httpx.Client]:
        """One connection pool per fetch or put (a ClientApp process handles one message)."""
        with httpx.Client(verify=self._verify, timeout=self._timeout) as http:
            self._http = http
            try:
                yield http
            finally:
                self._http = None

    # -- download -----------------------------------------------------------------------------
    def fetch(self, ref: CheckpointRef) -> Path:
        _, digest = self.model_segments(ref.path, ref)
        return self.cached_fetch(ref, digest, lambda staging: self._download_all(ref.path, staging), self._session())

    def _download_all(self, model_url: str, staging: Path) -> CheckedFiles:
        manifest = Manifest.from_json(self._get_json(model_url)["files"])
        checked: CheckedFiles = {}
        for entry in manifest.files:
            self._download(model_url, entry, staging, checked)
        return checked

    def _get_json(self, url: str) -> Any:
        response = self._request("GET", url, headers=self._read_headers)
        _raise_for_store(response, f"GET {url}")
        return response.json()

    def _download(self, model_url: str, entry: FileEntry, staging: Path, checked: CheckedFiles) -> None:
        """One file into ``staging`` (``<name>.part``, resumed; renamed, then checked against
        ``entry`` and noted in ``checked``: :func:`~.upload_staging.check_in_place`)."""
        final = staging / entry.name
        what = f"download of {model_url}"
        if recheck_leftover(final, entry, checked, what):  # left by an interrupted fetch
            self.report.files_skipped += 1
            return
        part = final.with_name(final.name + ".part")
        part.parent.mkdir(parents=True, exist_ok=True)
        if entry.size == 0:
            part.write_bytes(b"")  # no bytes to request: an empty file (a leftover truncated) is complete
        for attempt in range(self.retries + 1):
            have = part.stat().st_size if part.exists() else 0
            if have > entry.size:
                part.unlink()
                have = 0
            if have < entry.size:
                headers = {**self._read_headers, **({"Range": f"bytes={have}-"} if have else {})}
                try:
                    with self._client().stream(
                        "GET", model_url, params={"file": entry.name}, headers=headers
                    ) as response:
                        if response.status_code not in (200, 206):
                            response.read()
                            _raise_for_store(response, f"download of {entry.name}")
                        mode = "ab" if response.status_code == 206 else "wb"  # 200: the whole file again
                        with open(part, mode) as handle:
                            for chunk in response.iter_bytes(_CHUNK):
                                handle.write(chunk)
                                self.report.bytes_received += len(chunk)
                except httpx.TransportError as exc:
                    _pause(attempt, self.retries, f"download of {entry.name}", exc)
                    continue
            if part.stat().st_size != entry.size:
                _pause(attempt, self.retries, f"download of {entry.name}",
                       f"got {part.stat().st_size} of {entry.size} bytes")
                continue
            part.replace(final)
            check_in_place(final, entry, checked, what)
            return

    # -- upload -------------------------------------------------------------------------------
    def put(self, directory: str | os.PathLike[str], kind: CheckpointKind, server_round: int,
            client: int) -> CheckpointRef:
        local = CheckpointRef.for_directory(directory, kind)
        manifest = build_manifest(directory)
        slot = f"{self.url}/runs/{self.run_key}/uploads/{server_round}/{client}/{kind}"
        self.report = TransferReport(started=time.monotonic())
        with self._session():
            ref = self._put(Path(directory), local, manifest, slot)
        print(self.report.describe(f"client {client}'s {kind} of round {server_round} uploaded"), flush=True)
        return ref

    def _put(self, directory: Path, local: CheckpointRef, manifest: Manifest, slot: str) -> CheckpointRef:
        status = self._upload_status(slot)
        if status["committed"]:
            raise CheckpointError(f"upload slot {slot} is already committed")
        for entry in manifest.files:
            if status["complete"].get(entry.name) == {"size": entry.size, "sha256": entry.sha256}:
                self.report.files_skipped += 1
                continue
            self._upload(slot, directory / entry.name, entry, int(status["partial"].get(entry.name, 0)))
        body = {"manifest": manifest.to_json(), "format": local.format, "world_size": local.world_size,
                "sha256": local.sha256}
        response = self._request("POST", slot, headers=self._upload_headers, json=body)
        _raise_for_store(response, f"commit of {slot}")
        return CheckpointRef(**response.json()["ref"])

    def _upload_status(self, slot: str) -> dict[str, Any]:
        response = self._request("GET", slot, headers=self._upload_headers)
        _raise_for_store(response, f"upload status of {slot}")
        return dict(response.json())

    def _upload(self, slot: str, path: Path, entry: FileEntry, offset: int) -> None:
        restarted = False
        for attempt in range(self.retries + 1):
            params: dict[str, str | int] = {
                "file": entry.name, "offset": offset, "size": entry.size, "sha256": entry.sha256
            }
            try:
                response = self._client().put(slot, params=params, headers=self._upload_headers,
                                          content=_file_chunks(path, offset, self.report))
            except httpx.TransportError as exc:
                _pause(attempt, self.retries, f"upload of {entry.name}", exc)
                offset = int(self._upload_status(slot)["partial"].get(entry.name, 0))
                continue
            if response.status_code == 409 and "received" in _json_object(response):
                offset = int(_json_object(response)["received"])  # the server holds a different prefix
                continue
            if response.status_code == 408:  # the server gave up on a stalled body; it kept the bytes
                _pause(attempt, self.retries, f"upload of {entry.name}",
                       _json_object(response).get("detail") or f"HTTP 408: {response.text[:200]}")
                offset = int(self._upload_status(slot)["partial"].get(entry.name, 0))
                continue
            if response.status_code == 422 and not restarted:
                restarted, offset = True, 0  # the server dropped a corrupt partial file: once more
                continue
            _raise_for_store(response, f"upload of {entry.name}")
            if response.json()["complete"]:
                return
            offset = int(response.json()["received"])
            _pause(attempt, self.retries, f"upload of {entry.name}", f"stopped at byte {offset}")
        raise CheckpointError(f"upload of {entry.name} to {slot} did not complete after {self.retries + 1} attempts")

    # -- progress -----------------------------------------------------------------------------
    forwards_progress = True

    def send_progress(self, data: bytes, server_round: int, client: int) -> None:
        """One PUT of the progress file's bytes (at most MAX_PROGRESS_BYTES) to the client's slot;
        no retries: the next change sends the whole file again."""
        url = progress_url(self.url, self.run_key, server_round, client)
        with httpx.Client(verify=self._verify, timeout=httpx.Timeout(10.0)) as http:
            response = http.put(url, content=data[:MAX_PROGRESS_BYTES], headers=self._upload_headers)
        _raise_for_store(response, f"progress report to {url}")

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        for attempt in range(self.retries + 1):
            try:
                return self._client().request(method, url, **kwargs)
            except httpx.TransportError as exc:
                _pause(attempt, self.retries, f"{method} {url}", exc)
        raise AssertionError("unreachable: _pause raises on the last attempt")


    def _client(self) -> httpx.Client:
        if self._http is None:
            raise RuntimeError("HttpClientStore transfers run inside fetch() or put()")
        return self._http


def _file_chunks(path: Path, offset: int, report: TransferReport) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        handle.seek(offset)
        while chunk := handle.read(_CHUNK):
            report.bytes_sent += len(chunk)
            yield chunk


def _pause(attempt: int, retries: int, what: str, problem: object) -> None:
    """Back off before the next attempt, or give up with a CheckpointError after the last one.

    A certificate the client does not trust is final: retrying cannot fix it.
    """
    if "CERTIFICATE_VERIFY_FAILED" in str(problem) or "certificate verify failed" in str(problem):
        raise CheckpointError(f"{what}: the store's TLS certificate is not trusted ({problem}); "
                              "the run's storage.ssl_ca_certfile must be the CA that signed it")
    if attempt >= retries:
        raise CheckpointError(f"{what} failed after {retries + 1} attempts: {problem}")
    time.sleep(min(30.0, 0.5 * 2**attempt))


def _json_object(response: httpx.Response) -> dict[str, Any]:
    """The response's body if it is a JSON object, else ``{}``: what answers may be a proxy or
    gateway in front of the store, whose error body can be any JSON (a list, a string) or none."""
    try:
        body = response.json()
    except ValueError:  # not JSON, or not text at all
        return {}
    return body if isinstance(body, dict) else {}


def _raise_for_store(response: httpx.Response, what: str) -> None:
    """CheckpointError with the store's ``detail`` (or the body as text) unless ``response`` succeeded."""
    if response.is_success:
        return
    detail = _json_object(response).get("detail")
    text = detail if isinstance(detail, str) and detail else response.text.strip() or "(empty body)"
    if len(text) > _MAX_DETAIL_CHARS:
        text = text[:_MAX_DETAIL_CHARS] + f"... ({len(text)} characters)"
    raise CheckpointError(f"checkpoint store refused the {what} (HTTP {response.status_code}): {text}")
