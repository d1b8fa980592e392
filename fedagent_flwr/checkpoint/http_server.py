"""The ServerApp's checkpoint store over HTTP(S), for federations that share no filesystem.

One uvicorn server runs in a thread of the ServerApp process for the whole run, bound to ``storage.host`` (loopback
unless configured otherwise), with TLS when a certificate is set. Everything lives under ``/runs/<run id>/``:

``GET  /runs/<run>/models/<model id>``              manifest of a model the server shared
``GET  /runs/<run>/models/<model id>?file=<name>``  one file (HTTP ``Range`` resumes a download)
``GET  /runs/<run>/uploads/<round>/<client>/<kind>``  what the server holds of an upload so far
``PUT  ...uploads/<round>/<client>/<kind>?file=&offset=&size=&sha256=``  append bytes to one file
``POST ...uploads/<round>/<client>/<kind>``          commit: manifest in, reference out
``PUT  /runs/<run>/progress/<round>/<client>``       the client's progress file (:mod:`fedagent_flwr.progress`)

Reads need the run's read token, uploads and progress reports the token of their (round, client) slot; both are
HMACs of a random per-run secret and travel only inside Flower instructions. An upload lands in
``<run root>/round_<r>/client_<c>/.upload-<kind>/`` and becomes ``.../<kind>/`` by one rename at commit, after
which the slot is final: only the very same commit again (a retry whose reply was lost) is answered, with the
same reference. A file is kept only once its bytes match the sha256 declared for it; a dropped connection keeps
the bytes received so far, and the next ``PUT`` continues at that offset. At commit the store writes
``.../.receipt-<kind>.json`` beside the checkpoint: the digests it verified with each file's stat data, HMAC'd
with a key from the run's secret, so the aggregation can skip hashing files that have not changed since
(:mod:`.receipts`; ``storage.trust_store_receipts``).

A ``PUT`` holds its slot's lock while it reads the body, so a client that stops sending mid-body
gets HTTP 408 after ``storage.upload_idle_timeout_s`` without a byte and the lock is free again
(its bytes are kept, as for a dropped connection). A slot holds at most
``max_files_per_upload`` files (the most a manifest may list); one more is refused with 413. A file
and a folder of the same name (``huggingface`` beside ``huggingface/x``) are refused with 409 before
a byte is written, and a manifest listing both with 400. The staging folder's files:
:mod:`.upload_staging`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import shutil
import threading
import time
from logging import WARNING
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse
from flwr.common.logger import log
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp

from fedagent_flwr.atomic import fsync_dir, write_json_atomic
from fedagent_flwr.checkpoint.manifest import Manifest, build_manifest, check_file_name, check_sha256
from fedagent_flwr.checkpoint.receipts import FileStat, ReceiptCheck, receipt_key, write_receipt
from fedagent_flwr.checkpoint.ref import KINDS, CheckpointError, CheckpointRef, resolve_inside
from fedagent_flwr.checkpoint.store import (
    CA_FIELD,
    KIND_FIELD,
    READ_TOKEN_FIELD,
    RUN_FIELD,
    UPLOAD_TOKEN_FIELD,
    URL_FIELD,
    ServerStore,
    StorageSettings,
    client_slot,
    own_upload_parts,
)
from fedagent_flwr.checkpoint.upload_staging import (
    FILES,
    RECEIVED,
    hash_and_sync,
    held_files,
    name_conflict,
    partial,
    received,
    write_through,
)
from fedagent_flwr.envs.service.server import bind_socket, socket_url
from fedagent_flwr.jsonbody import JsonBodyError, loads_bounded
from fedagent_flwr.progress import MAX_PROGRESS_BYTES, PROGRESS_FILE

MAX_COMMIT_BYTES = 1024 * 1024  # a manifest of MAX_FILES entries is ~0.5 MiB


def upload_url(base_url: str, run_key: str, server_round: int, client: int, kind: str) -> str:
    """The reference (and endpoint) of client ``client``'s ``kind`` upload in ``server_round``."""
    return f"{base_url}/runs/{run_key}/uploads/{server_round}/{client}/{kind}"


class HttpServerStore(ServerStore):
    """Serves the run's shared models and receives the clients' checkpoints (see the module docstring)."""

    kind = "http"

    def __init__(self, settings: StorageSettings, run_root: str | os.PathLike[str], run_key: str) -> None:
        super().__init__(run_root)
        self.settings = settings
        self.run_key = run_key
        # Tokens authorise transfers of this run only, so they must be unguessable: a random
        # secret, not one derived from the (public) config seed.
        self._secret = secrets.token_bytes(32)
        self._models: dict[str, tuple[Path, Manifest]] = {}
        self._shared: dict[tuple[str, str], CheckpointRef] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # Per upload slot, the files whose digest matched on receipt, with their stat when hashed.
        # Kept in memory only: nothing on disk can add to what the store signs, and a restarted
        # store (a new secret anyway) knows of no file, so the aggregation hashes them itself.
        self._verified: dict[str, dict[str, tuple[str, FileStat]]] = {}
        self._committed: dict[str, tuple[Manifest, CheckpointRef]] = {}  # per slot: a repeat gets the same reply
        self._ca_pem = Path(settings.ssl_ca_certfile).read_text() if settings.ssl_ca_certfile else ""
        try:
            self._sock = bind_socket(settings.host, settings.port)
        except OSError as exc:  # the port is taken, or the address is not this machine's
            raise CheckpointError(
                f"config keys 'storage.host' = {settings.host!r} and 'storage.port' = {settings.port}: cannot "
                f"listen on {settings.host}:{settings.port} ({exc.strerror or exc}); choose a free port (0 picks one, "
                "when the clients run on this machine) or an address of this machine") from None
        bound = socket_url(self._sock)
        if settings.tls:
            bound = "https" + bound[len("http"):]
        self.url = (settings.url or bound).rstrip("/")
        self._server, self._thread = serve_in_thread(create_store_app(self), self._sock, settings)

    # -- tokens -------------------------------------------------------------------------------
    def _token(self, purpose: str) -> str:
        return hmac.new(self._secret, f"{self.run_key}:{purpose}".encode(), hashlib.sha256).hexdigest()

    def read_token(self) -> str:
        return self._token("read")

    def upload_token(self, server_round: int, client: int) -> str:
        return self._token(f"upload:{server_round}:{client}")

    def receipt_key(self) -> bytes:
        """The key that authenticates this store's receipts (:func:`~.receipts.receipt_key`)."""
        return receipt_key(self._secret, self.run_key)

    # -- ServerStore --------------------------------------------------------------------------
    def share(self, ref: CheckpointRef) -> CheckpointRef:
        key = (ref.path, ref.sha256)
        if key not in self._shared:
            directory = Path(ref.path).resolve()
            try:
                model_id = directory.relative_to(self.run_root).as_posix()
            except ValueError:  # the base model, outside the run root: named by its hash
                model_id = f"external/{ref.sha256[:16] or 'unhashed'}"
            self._models[model_id] = (directory, build_manifest(directory))
            self._shared[key] = CheckpointRef(
                path=f"{self.url}/runs/{self.run_key}/models/{model_id}", kind=ref.kind, format=ref.format,
                world_size=ref.world_size, sha256=ref.sha256,
            )
        return self._shared[key]

    def resolve(self, ref: CheckpointRef, server_round: int, client: int) -> CheckpointRef:
        who = f"client {client}"
        own_upload_parts(ref, self.url, self.run_key, server_round, client)
        directory = self.slot_dir(server_round, client, ref.kind)
        if not directory.is_dir():
            raise CheckpointError(f"{who} reference {ref.path!r}: the upload was never committed")
        local = CheckpointRef(path=str(directory), kind=ref.kind, format=ref.format,
                              world_size=ref.world_size, sha256=ref.sha256)
        resolve_inside(local, self.run_root)
        return local

    def instruction_fields(self) -> dict[str, Any]:
        return {KIND_FIELD: self.kind, URL_FIELD: self.url, RUN_FIELD: self.run_key,
                READ_TOKEN_FIELD: self.read_token(), CA_FIELD: self._ca_pem}

    def upload_grant(self, server_round: int, client: int) -> dict[str, Any]:
        return {UPLOAD_TOKEN_FIELD: self.upload_token(server_round, client)}

    def receipt_check(self) -> ReceiptCheck | None:
        return ReceiptCheck(self.receipt_key()) if self.settings.trust_store_receipts else None

    def describe(self) -> str:
        return f"http store {self.url} (run {self.run_key}) -> {self.run_root}"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()

    # -- layout -------------------------------------------------------------------------------
    def slot_dir(self, server_round: int, client: int, kind: str) -> Path:
        return self.run_root / f"round_{server_round}" / f"client_{client}" / kind

    def staging_dir(self, server_round: int, client: int, kind: str) -> Path:
        return self.run_root / f"round_{server_round}" / f"client_{client}" / f".upload-{kind}"

    def lock(self, slot: str) -> asyncio.Lock:
        return self._locks.setdefault(slot, asyncio.Lock())

    def verified(self, slot: str) -> dict[str, tuple[str, FileStat]]:
        """The files of upload ``slot`` verified on receipt (name -> sha256, stat when hashed)."""
        return self._verified.setdefault(slot, {})

    def model(self, model_id: str) -> tuple[Path, Manifest]:
        if model_id not in self._models:
            raise HTTPException(404, f"run {self.run_key} shares no model {model_id[:120]!r}")
        return self._models[model_id]


# ------------------------------------------------------------------------------------------ app


def _authorise(request: Request, token: str) -> None:
    header = request.headers.get("authorization", "")
    if not hmac.compare_digest(header.encode(), f"Bearer {token}".encode()):
        raise HTTPException(403, "missing or wrong store token for this resource")


def _check_run(store: HttpServerStore, run: str) -> None:
    if run != store.run_key:
        raise HTTPException(404, f"this store serves run {store.run_key}, not run {run[:40]!r}")


def _slot(store: HttpServerStore, request: Request, run: str, server_round: int, client: int,
          kind: str) -> tuple[Path, str]:
    """Check run, kind and the slot's token; return (staging dir, lock name)."""
    _check_run(store, run)
    if kind not in KINDS:
        raise HTTPException(404, f"unknown checkpoint kind {kind[:40]!r} (expected one of {KINDS})")
    if server_round < 0 or client < 0:
        raise HTTPException(404, "round and client must be >= 0")
    _authorise(request, store.upload_token(server_round, client))
    return store.staging_dir(server_round, client, kind), f"{server_round}/{client}/{kind}"


async def _read_json_body(request: Request) -> Any:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_COMMIT_BYTES:
            raise HTTPException(413, f"request body exceeds {MAX_COMMIT_BYTES} bytes")
    try:
        return loads_bounded(bytes(body))
    except JsonBodyError as exc:
        raise HTTPException(400, f"request body {exc}") from None


def create_store_app(store: HttpServerStore) -> FastAPI:
    """The FastAPI application of ``store`` (routes in the module docstring)."""
    app = FastAPI(title="fedagent checkpoint store", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(CheckpointError)
    async def _refused(request: Request, exc: CheckpointError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ready": True, "run": store.run_key}

    @app.get("/runs/{run}/models/{model_id:path}", response_model=None)
    async def model(run: str, model_id: str, request: Request, file: str | None = None) -> Any:
        _check_run(store, run)
        _authorise(request, store.read_token())
        directory, manifest = store.model(model_id)
        if file is None:
            return {"files": manifest.to_json()}
        check_file_name(file)
        entry = manifest.entry(file)
        return FileResponse(directory / entry.name, media_type="application/octet-stream")

    @app.get("/runs/{run}/uploads/{server_round}/{client}/{kind}")
    async def upload_status(run: str, server_round: int, client: int, kind: str, request: Request) -> dict[str, Any]:
        staging, _ = _slot(store, request, run, server_round, client, kind)
        committed = store.slot_dir(server_round, client, kind).is_dir()
        return {"committed": committed, "complete": received(staging), "partial": partial(staging)}

    @app.put("/runs/{run}/uploads/{server_round}/{client}/{kind}")
    async def upload_file(run: str, server_round: int, client: int, kind: str, request: Request,
                          file: str, offset: int, size: int, sha256: str) -> dict[str, Any]:
        staging, slot = _slot(store, request, run, server_round, client, kind)
        check_file_name(file)
        check_sha256(sha256, f"upload of {file!r}")
        if not 0 <= size <= store.settings.max_file_bytes:
            raise HTTPException(413, f"{file!r}: {size} bytes is not in [0, {store.settings.max_file_bytes}] "
                                "(storage.max_file_bytes)")
        if not 0 <= offset <= size:
            raise HTTPException(400, f"{file!r}: offset {offset} is outside [0, {size}]")
        async with store.lock(slot):
            if store.slot_dir(server_round, client, kind).is_dir():
                raise HTTPException(409, f"upload {slot} is already committed")
            complete = received(staging)
            if file in complete:
                if complete[file] == {"size": size, "sha256": sha256}:
                    return {"received": size, "complete": True}
                raise HTTPException(409, f"{file!r} was already received with another size or sha256")
            conflict = name_conflict(staging, file)
            if conflict:  # refused before a byte is written
                raise HTTPException(409, conflict)
            target = staging / FILES / file
            part = target.with_name(target.name + ".part")
            limit = store.settings.max_files_per_upload
            if not part.exists() and held_files(staging) >= limit:
                raise HTTPException(413, f"{file!r}: upload {slot} already holds {limit} files, the most one "
                                    "upload may hold; commit the checkpoint (a manifest lists at most that many)")
            part.parent.mkdir(parents=True, exist_ok=True)
            have = part.stat().st_size if part.exists() else 0
            if offset != have:
                # FastAPI passes a Response through; the dict annotation stays the route's documented body.
                return JSONResponse({"detail": f"{file!r}: upload continues at byte {have}, not {offset}",  # type: ignore[return-value]
                                     "received": have}, status_code=409)
            have = await _append_body(request, part, have, size, file, store.settings.upload_idle_timeout_s)
            if have < size:
                return {"received": have, "complete": False}
            store.verified(slot).pop(file, None)
            # Renamed first and hashed under its final name: the stat the receipt records is then
            # the one taken before these very bytes were hashed (a rename moves ctime).
            part.replace(target)
            actual, checked = await run_in_threadpool(hash_and_sync, target)
            if actual != sha256:
                target.unlink()
                raise HTTPException(422, f"{file!r}: received bytes hash to {actual[:16]}..., the upload "
                                    f"declared {sha256[:16]}...; discarded, upload it again")
            if checked is not None:  # the digest matched and the file did not change while hashed
                store.verified(slot)[file] = (sha256, checked)
            write_json_atomic(staging / RECEIVED, {**complete, file: {"size": size, "sha256": sha256}})
            return {"received": size, "complete": True}

    @app.post("/runs/{run}/uploads/{server_round}/{client}/{kind}")
    async def commit(run: str, server_round: int, client: int, kind: str, request: Request) -> dict[str, Any]:
        staging, slot = _slot(store, request, run, server_round, client, kind)
        body = await _read_json_body(request)
        if not isinstance(body, dict) or set(body) != {"manifest", "format", "world_size", "sha256"}:
            raise HTTPException(400, "commit body must be a JSON object with manifest, format, world_size, sha256")
        manifest = Manifest.from_json(body["manifest"], store.settings.max_file_bytes)
        world_size = body["world_size"]
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise HTTPException(400, f"world_size {world_size!r} is not an integer")
        ref = CheckpointRef(path=upload_url(store.url, store.run_key, server_round, client, kind),
                            kind=kind,  # type: ignore[arg-type]  # the route validates kind against CheckpointRef's kinds
                            format=str(body["format"]), world_size=world_size,  # type: ignore[arg-type]
                            sha256=check_sha256(body["sha256"], "commit"))
        ref.check_fields()
        final = store.slot_dir(server_round, client, kind)
        reply = {"ref": {name: getattr(ref, name) for name in ("path", "kind", "format", "world_size", "sha256")}}
        async with store.lock(slot):
            if final.is_dir():
                if store._committed.get(slot) == (manifest, ref):  # the same commit again: its reply was lost
                    return reply
                raise HTTPException(409, f"upload {slot} is already committed")
            complete = received(staging)
            for entry in manifest.files:
                if complete.get(entry.name) != {"size": entry.size, "sha256": entry.sha256}:
                    raise HTTPException(409, f"{entry.name!r} has not been received completely with sha256 "
                                        f"{entry.sha256[:16]}...; upload it before committing")
            files = staging / FILES
            # Anything received but not in the manifest (a leftover of an earlier attempt) stays out.
            listed = {entry.name for entry in manifest.files}
            for path in sorted(files.rglob("*"), reverse=True):
                name = path.relative_to(files).as_posix()
                if path.is_file() and name not in listed:
                    path.unlink()
            verified = store._verified.pop(slot, {})
            files.replace(final)  # renames the folder: the files' own stat (ctime included) stays
            store._committed[slot] = (manifest, ref)
            fsync_dir(final.parent)
            if store.settings.trust_store_receipts:
                await run_in_threadpool(_write_receipt, store, final, manifest, verified)
            shutil.rmtree(staging)
        return reply

    @app.put("/runs/{run}/progress/{server_round}/{client}")
    async def progress(run: str, server_round: int, client: int, request: Request) -> dict[str, Any]:
        _check_run(store, run)
        if server_round < 0 or client < 0:
            raise HTTPException(404, "round and client must be >= 0")
        _authorise(request, store.upload_token(server_round, client))
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_PROGRESS_BYTES:
                raise HTTPException(413, f"a progress report holds at most {MAX_PROGRESS_BYTES} bytes")
        # Where a shared filesystem's trainer would have written it: the relay reads one place.
        target = client_slot(store.run_root, server_round, client) / PROGRESS_FILE
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{PROGRESS_FILE}.tmp")
        tmp.write_bytes(bytes(body))
        tmp.replace(target)
        return {"received": len(body)}

    return app


async def _append_body(request: Request, part: Path, have: int, size: int, name: str, idle_timeout_s: float) -> int:
    """Append the request body to ``part`` (holding ``have`` bytes), never beyond ``size``.

    A body longer than declared is refused and the partial file dropped; a dropped connection
    keeps what arrived, for the next request to continue. So does a body that sends nothing for
    ``idle_timeout_s``: 408, so that a stalled client cannot hold its slot's lock for ever.
    """
    chunks = request.stream().__aiter__()
    with open(part, "ab") as handle:
        while True:
            try:
                async with asyncio.timeout(idle_timeout_s):
                    chunk = await anext(chunks)
            except (StopAsyncIteration, ClientDisconnect):
                break  # the whole body, or a dropped connection: keep what arrived
            except TimeoutError:
                raise HTTPException(408, f"{name!r}: no bytes for {idle_timeout_s:g} s "
                                    f"(storage.upload_idle_timeout_s); the {have} bytes received are kept, "
                                    "resume the upload from there") from None
            if have + len(chunk) > size:
                handle.close()
                part.unlink()
                raise HTTPException(413, f"{name!r}: the body runs past the declared {size} bytes; "
                                    "partial file discarded")
            await run_in_threadpool(write_through, handle, chunk)
            have += len(chunk)
    return have


def _write_receipt(store: HttpServerStore, final: Path, manifest: Manifest,
                   verified: dict[str, tuple[str, FileStat]]) -> None:
    """Record what was verified on receipt beside the committed checkpoint (:mod:`.receipts`); a
    receipt that cannot be written only means the aggregation hashes those files itself."""
    checked = {entry.name: verified[entry.name] for entry in manifest.files
               if entry.name in verified and verified[entry.name][0] == entry.sha256}
    try:
        write_receipt(final, checked, store.receipt_key())
    except OSError as exc:
        log(WARNING, "no receipt for %s (%s): the aggregation will hash its files", final, exc)


def serve_in_thread(app: ASGIApp, sock: Any, settings: StorageSettings) -> tuple[Any, threading.Thread]:
    """Serve the ASGI ``app`` on the bound socket ``sock`` in a daemon thread, with TLS when
    ``settings`` name a certificate; return ``(uvicorn server, thread)`` once it accepts connections
    (set the server's ``should_exit`` and join the thread to stop it). CheckpointError when it
    cannot start. The store serves itself with it; tests stand up stand-in gateways with it."""
    import uvicorn

    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", ws="none",
        ssl_certfile=settings.ssl_certfile or None, ssl_keyfile=settings.ssl_keyfile or None,
    )
    server = uvicorn.Server(config)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # reported to the starting thread below
            failure.append(exc)

    thread = threading.Thread(target=run, name="checkpoint-store", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60  # a hang guard: start-up takes milliseconds
    while not server.started:
        if failure or not thread.is_alive():
            sock.close()
            raise CheckpointError(f"the checkpoint store could not start: {failure[0] if failure else 'exited'}")
        if time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise CheckpointError("the checkpoint store did not start within 60 s")
        time.sleep(0.02)
    return server, thread
