"""Helpers for tests of the checkpoint stores: a client with an instruction's tokens, filesystem
snapshots (to show nothing was written outside the run root), and a bounded wait."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.checkpoint import content_hash
from fedagent_flwr.checkpoint.http_client import HttpClientStore
from fedagent_flwr.checkpoint.http_server import HttpServerStore
from fedagent_flwr.checkpoint.manifest import build_manifest

RUN = "11"  # the Flower run id the test stores serve
SHARD = "model_world_size_1_rank_0.pt"


def manifest_bytes(directory: Path) -> int:
    """What a full upload of checkpoint ``directory`` sends: the sizes of every file its manifest lists."""
    return sum(entry.size for entry in build_manifest(directory).files)


def tree(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` (outside ``skip``) with its size and mtime: a before/after snapshot."""
    found = {}
    for path in root.rglob("*"):
        if any(path == s or s in path.parents for s in skip):
            continue
        stat = path.lstat()
        found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


def node(store: HttpServerStore, work: Path, server_round: int = 1, client: int = 0, **kwargs: Any) -> HttpClientStore:
    """A client of ``store`` working in ``work``, with the tokens an instruction for (round, client) carries."""
    return HttpClientStore(store.url, RUN, store.read_token(), work,
                           upload_token=store.upload_token(server_round, client), **kwargs)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition``; a hang guard, not a timing bound (the server answers in milliseconds)."""
    deadline = time.monotonic() + 60
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


class HashCounter:
    """Counts the bytes fed to every sha256 that :mod:`fedagent_flwr.checkpoint.content_hash`
    creates (the aggregation's hashing while reading, a directory hashed at opening or at the
    check, the combining step): real hashlib digests, only counted. Install with :meth:`install`."""

    def __init__(self) -> None:
        self.bytes = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> HashCounter:
        import types

        monkeypatch.setattr(content_hash, "hashlib", types.SimpleNamespace(sha256=self.sha256))
        return self

    def sha256(self, data: bytes = b"") -> Any:
        counter = self
        real = hashlib.sha256(data)
        counter.bytes += len(data)

        class Counted:
            def update(self, block: Any) -> None:
                counter.bytes += memoryview(block).nbytes
                real.update(block)

            def digest(self) -> bytes:
                return real.digest()

            def hexdigest(self) -> str:
                return real.hexdigest()

        return Counted()


class DropReplyProxy:
    """A TCP proxy on loopback in front of ``target`` (``host:port``) that relays everything but
    the reply to the first request whose method is ``method``: the request reaches the server,
    which acts on it, and then the connection is closed before a byte of its reply comes back
    (a link that drops at the worst moment). Use as a context manager; ``url`` is the proxy's."""

    def __init__(self, target: str, method: bytes = b"POST") -> None:
        import socket
        import threading

        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._marker = method + b" "
        self._dropped = threading.Event()
        self.dropped = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[Any] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            self._sockets += [client, server]
            state = {"drop": False}
            threading.Thread(target=self._pipe, args=(client, server, state, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, state, False), daemon=True).start()

    def _pipe(self, source: Any, sink: Any, state: dict[str, bool], upstream: bool) -> None:
        import socket

        try:
            while data := source.recv(65536):
                if upstream and not self._dropped.is_set() and data.startswith(self._marker):
                    self._dropped.set()
                    state["drop"] = True  # this request goes through; its reply does not
                if not upstream and state["drop"]:
                    self.dropped = True
                    for sock in (source, sink):
                        sock.shutdown(socket.SHUT_RDWR)
                    return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def __enter__(self) -> DropReplyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()
        for sock in self._sockets:
            sock.close()


class StubGateway:
    """A real uvicorn server on loopback that answers every request with the fixed reply of its
    method (``{"GET": (status, body bytes, content type)}``; 404 for others): what a client of the
    store meets when a reverse proxy or gateway in front of it answers instead (a maintenance page,
    a JSON list or string). Use as a context manager; ``url`` is the gateway's."""

    def __init__(self, replies: dict[str, tuple[int, bytes, str]]) -> None:
        from starlette.types import Receive, Scope, Send

        from fedagent_flwr.checkpoint.http_server import serve_in_thread
        from fedagent_flwr.checkpoint.store import StorageSettings
        from fedagent_flwr.envs.service.server import bind_socket, socket_url

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                return
            while (await receive()).get("more_body"):  # drain the request body
                pass
            status, body, content_type = replies.get(scope["method"], (404, b"", "text/plain"))
            self.requests.append(scope["method"])
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", content_type.encode())]})
            await send({"type": "http.response.body", "body": body})

        self.requests: list[str] = []
        self._sock = bind_socket("127.0.0.1")
        self.url = socket_url(self._sock)
        settings = StorageSettings(kind="http")
        self._server, self._thread = serve_in_thread(app, self._sock, settings)

    def __enter__(self) -> StubGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()
