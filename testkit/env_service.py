"""The HTTP env service as its tests (``tests/envs/service``) run it: a real uvicorn server for the
service app in a background thread, request helpers, and a scripted episode player for TinyGuess.

Everything runs for real: uvicorn on loopback and httpx clients; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import uvicorn

from fedagent_flwr.envs.base import BaseTextEnv
from fedagent_flwr.envs.service.app import ServiceSettings, create_service_app
from fedagent_flwr.envs.service.server import bind_socket, build_env_setup, socket_url
from fedagent_flwr.envs.tiny_guess import HIGHER_OBS

#: The TinyGuess config the services play: secrets 1..20, six turns (a binary search always wins).
TINY_CONFIG = {"lo": 1, "hi": 20, "max_turns": 6}
HANG_GUARD_S = 30.0  # only bounds a broken test; no assertion depends on speed


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` until true; fail (not hang) if it never becomes true."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


async def async_wait_until(predicate: Callable[[], Awaitable[bool]], what: str) -> None:
    """Await ``predicate`` until true, in the event loop; fail (not hang) if it never becomes true."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.01)


class ThreadedService:
    """A real uvicorn server for the service app, on a loopback socket, in a background thread."""

    def __init__(self, settings: ServiceSettings, sock: socket.socket | None = None,
                 factory: Callable[[int], BaseTextEnv] | None = None) -> None:
        if factory is None:
            setup = build_env_setup(settings.env_name, TINY_CONFIG, settings.partition)
            factory, settings = setup.factory, dataclasses.replace(settings, info=setup.info)
        self.app = create_service_app(factory, settings)
        self.sock = sock or bind_socket("127.0.0.1", 0)
        self.url = socket_url(self.sock)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on", ws="none")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)

    def start(self, wait_ready: bool = True) -> ThreadedService:
        """Start serving; wait until uvicorn runs and (if ``wait_ready``) the env pool is ready."""
        self.thread.start()
        wait_until(lambda: self.server.started, "uvicorn to start")
        if wait_ready:
            wait_until(lambda: httpx.get(f"{self.url}/health").json()["ready"], "the pool to be ready")
        return self

    def stop(self) -> None:
        """Ask uvicorn to exit, wait for its thread (bounded) and close the socket."""
        self.server.should_exit = True
        self.thread.join(HANG_GUARD_S)
        self.sock.close()


@contextlib.contextmanager
def service(pool_size: int = 2, **settings: Any) -> Iterator[ThreadedService]:
    """A started TinyGuess service with ``pool_size`` slots and other :class:`ServiceSettings`
    ``settings``, stopped when the block ends."""
    svc = ThreadedService(ServiceSettings(env_name="TinyGuess", pool_size=pool_size, **settings)).start()
    try:
        yield svc
    finally:
        svc.stop()


def post(url: str, path: str, payload: Any = None, **kwargs: Any) -> httpx.Response:
    """POST ``payload`` (as JSON, unless None) to ``path`` of the service at ``url``."""
    if payload is not None:
        kwargs["json"] = payload
    return httpx.post(f"{url}{path}", **kwargs)


def new_session(url: str, seed: int = 3) -> str:
    """Create a session on the service at ``url`` and reset it with ``seed``; return its id."""
    session_id = post(url, "/create", {}).json()["session_id"]
    assert post(url, "/reset", {"session_id": session_id, "seed": seed}).status_code == 200
    return session_id


async def play(env: BaseTextEnv, seed: int, actions: list[str] | None = None) -> list[Any]:
    """Play one episode: scripted ``actions``, else a binary search driven by the feedback."""
    transcript: list[Any] = [await env.system_prompt(), await env.reset(seed)]
    low, high = TINY_CONFIG["lo"], TINY_CONFIG["hi"]
    try:
        for turn in range(TINY_CONFIG["max_turns"]):
            guess = (low + high) // 2
            action = actions[turn] if actions else f"I think <answer>{guess}</answer>"
            obs, reward, done, info = await env.step(action)
            transcript.append((obs, reward, done, info))
            if done:
                break
            if obs == HIGHER_OBS:
                low = guess + 1
            elif obs != "Invalid response. Reply as <answer>N</answer>.":
                high = guess - 1
    finally:
        await env.close()
    return transcript
