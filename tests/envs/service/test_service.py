"""The HTTP env service: app, server process, ServiceTextEnv client and the process manager.

Everything runs for real: uvicorn on loopback (in a thread for the app tests, as a subprocess
for the server/manager tests) and httpx clients; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import uvicorn

from fedagent_flwr.envs.base import BaseTextEnv, EnvConfigError
from fedagent_flwr.envs.registry import get_env_class, make_env
from fedagent_flwr.envs.service.app import ServiceSettings, create_service_app
from fedagent_flwr.envs.service.client import ServiceError, ServiceTextEnv, backoff_delay
from fedagent_flwr.envs.service.manager import (
    EnvServiceError,
    EnvServiceManager,
    ServiceLaunch,
)
from fedagent_flwr.envs.service.server import bind_socket, build_env_setup, socket_url
from fedagent_flwr.envs.spec import load_env_spec
from fedagent_flwr.envs.tiny_guess import CORRECT_OBS, HIGHER_OBS, INVALID_OBS, TinyGuess
from fedagent_flwr.procs import ProcessRef, group_members

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
        self.thread.start()
        wait_until(lambda: self.server.started, "uvicorn to start")
        if wait_ready:
            wait_until(lambda: httpx.get(f"{self.url}/health").json()["ready"], "the pool to be ready")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(HANG_GUARD_S)
        self.sock.close()


@contextlib.contextmanager
def service(pool_size: int = 2, **settings: Any) -> Iterator[ThreadedService]:
    svc = ThreadedService(ServiceSettings(env_name="TinyGuess", pool_size=pool_size, **settings)).start()
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def shared_service() -> Iterator[ThreadedService]:
    """One pool-of-4 service for the tests that do not care about pool pressure."""
    with service(pool_size=4, partition={"name": "uniform", "client": 1}, variant={},
                 max_body_bytes=4096) as svc:
        yield svc


def post(url: str, path: str, payload: Any = None, **kwargs: Any) -> httpx.Response:
    if payload is not None:
        kwargs["json"] = payload
    return httpx.post(f"{url}{path}", **kwargs)


def new_session(url: str, seed: int = 3) -> str:
    session_id = post(url, "/create", {}).json()["session_id"]
    assert post(url, "/reset", {"session_id": session_id, "seed": seed}).status_code == 200
    return session_id


# --- the app ------------------------------------------------------------------------------------

def test_health_echoes_settings(shared_service: ThreadedService) -> None:
    health = httpx.get(f"{shared_service.url}/health").json()
    assert health["ready"] is True and health["ok"] is True and health["error"] is None
    assert health["env"] == "TinyGuess"
    assert health["pool_size"] == 4
    assert health["partition"] == {"name": "uniform", "client": 1}
    assert health["variant"] == {}
    assert health["info"] == {"num_goals": 20}
    assert health["free"] + health["sessions"] == 4


def test_replayed_step_returns_cached_reply_and_applies_once(shared_service: ThreadedService) -> None:
    url = shared_service.url
    sid = new_session(url, seed=3)  # secret 4
    first = post(url, "/step", {"session_id": sid, "step_id": 0, "action": "<answer>1</answer>"})
    again = post(url, "/step", {"session_id": sid, "step_id": 0, "action": "<answer>1</answer>"})
    assert first.status_code == again.status_code == 200
    assert first.json()["replayed"] is False and again.json()["replayed"] is True
    assert {**first.json(), "replayed": None} == {**again.json(), "replayed": None}
    # A different action under an applied id is still a replay: the id, not the text, decides.
    other = post(url, "/step", {"session_id": sid, "step_id": 0, "action": "<answer>4</answer>"}).json()
    assert other["obs"] == HIGHER_OBS and other["replayed"] is True
    nxt = post(url, "/step", {"session_id": sid, "step_id": 1, "action": "<answer>2</answer>"}).json()
    assert nxt["info"]["turns"] == 2  # the env saw exactly one step before this one
    post(url, "/close", {"session_id": sid})


def test_concurrent_duplicate_steps_apply_once(shared_service: ThreadedService) -> None:
    url = shared_service.url
    sid = new_session(url, seed=3)

    async def hammer() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url) as client:
            body = {"session_id": sid, "step_id": 0, "action": "<answer>1</answer>"}
            replies = await asyncio.gather(*(client.post("/step", json=body) for _ in range(8)))
        return [r.json() for r in replies]

    replies = asyncio.run(hammer())
    assert sum(not r["replayed"] for r in replies) == 1
    assert {r["info"]["turns"] for r in replies} == {1}
    nxt = post(url, "/step", {"session_id": sid, "step_id": 1, "action": "<answer>2</answer>"}).json()
    assert nxt["info"]["turns"] == 2
    post(url, "/close", {"session_id": sid})


def test_out_of_order_and_unknown_session(shared_service: ThreadedService) -> None:
    url = shared_service.url
    sid = post(url, "/create", {}).json()["session_id"]
    before_reset = post(url, "/step", {"session_id": sid, "step_id": 0, "action": "1"})
    assert before_reset.status_code == 409 and "/reset" in before_reset.json()["error"]
    post(url, "/reset", {"session_id": sid, "seed": 0})
    ahead = post(url, "/step", {"session_id": sid, "step_id": 2, "action": "1"})
    assert ahead.status_code == 409
    assert "out of order" in ahead.json()["error"] and "next step of this episode is 0" in ahead.json()["error"]
    # Solve (secret 1) and step again: the episode is over.
    assert post(url, "/step", {"session_id": sid, "step_id": 0, "action": "1"}).json()["obs"] == CORRECT_OBS
    after_done = post(url, "/step", {"session_id": sid, "step_id": 1, "action": "1"})
    assert after_done.status_code == 409 and "ended" in after_done.json()["error"]
    # A reset starts step ids again at 0.
    post(url, "/reset", {"session_id": sid, "seed": 1})
    assert post(url, "/step", {"session_id": sid, "step_id": 0, "action": "1"}).json()["replayed"] is False
    assert post(url, "/close", {"session_id": sid}).json()["released"] is True

    for path, body in (("/step", {"session_id": "nope", "step_id": 0, "action": "1"}),
                       ("/reset", {"session_id": "nope", "seed": 0})):
        reply = post(url, path, body)
        assert reply.status_code == 404 and "unknown session 'nope'" in reply.json()["error"]
    # Closing twice (a retried close) is harmless and says nothing was released.
    assert post(url, "/close", {"session_id": sid}).json() == {"session_id": sid, "released": False}


@pytest.mark.parametrize(
    ("path", "kwargs", "status", "needle"),
    [
        ("/step", {"content": b"{not json"}, 400, "malformed JSON"),
        ("/step", {"content": b"[1, 2]"}, 422, "JSON object"),
        ("/step", {"json": {"session_id": "s", "step_id": "0", "action": "1"}}, 422, "step_id"),
        ("/step", {"json": {"session_id": "s", "step_id": -1, "action": "1"}}, 422, "step_id"),
        ("/step", {"json": {"session_id": "s", "step_id": 0, "action": 5}}, 422, "action"),
        ("/step", {"json": {"session_id": "s", "step_id": 0, "text": "1"}}, 422, "text"),
        ("/reset", {"json": {"session_id": "s", "seed": True}}, 422, "seed"),
        ("/reset", {"json": {"session_id": "s"}}, 422, "seed: Field required"),
        ("/create", {"json": {"session_id": ""}}, 422, "session_id"),
        ("/close", {"content": b"\xff\xfe\x00"}, 400, "malformed JSON"),
        ("/step", {"content": b"{" + b" " * 5000 + b"}"}, 413, "too large"),
        # A chunked upload (no Content-Length) is bounded too.
        ("/step", {"content": iter([b"{", b" " * 3000, b" " * 3000, b"}"])}, 413, "too large"),
        ("/nowhere", {"json": {}}, 404, "Not Found"),
    ],
)
def test_bad_requests_get_readable_4xx(shared_service: ThreadedService, path: str, kwargs: dict[str, Any],
                                       status: int, needle: str) -> None:
    reply = httpx.post(f"{shared_service.url}{path}", **kwargs)
    assert reply.status_code == status
    assert needle in reply.json()["error"]
    # The service is still serving.
    assert httpx.get(f"{shared_service.url}/health").json()["ready"] is True


def test_absurd_actions_are_invalid_responses_and_absurd_seeds_are_4xx() -> None:
    with service(pool_size=1) as svc:  # the default 64 KiB body limit: a 5000-digit action fits
        url = svc.url
        sid = new_session(url, seed=25)
        # A number int() refuses is an unparseable reply: an "Invalid response" that uses the turn.
        huge = post(url, "/step", {"session_id": sid, "step_id": 0, "action": "<answer>" + "9" * 5000 + "</answer>"})
        assert huge.status_code == 200, huge.text
        assert (huge.json()["obs"], huge.json()["done"], huge.json()["info"]) == (
            INVALID_OBS, False, {"success": False, "turns": 1})
        assert post(url, "/step", {"session_id": sid, "step_id": 1, "action": "3"}).json()["info"]["turns"] == 2

        # Seeds beyond a signed 64-bit integer are refused by name, and the episode goes on.
        for seed in (2**63, -(2**63) - 1, 10**40):
            refused = post(url, "/reset", {"session_id": sid, "seed": seed})
            assert refused.status_code == 422, refused.text
            assert (f"seed {seed} is outside the allowed range [-9223372036854775808, 9223372036854775807]"
                    in refused.json()["error"])
        too_long = post(url, "/reset", content=b'{"session_id": "%s", "seed": 1%s}' % (sid.encode(), b"0" * 5000))
        assert too_long.status_code == 400 and "holds a number of 5001 digits" in too_long.json()["error"]
        assert post(url, "/step", {"session_id": sid, "step_id": 2, "action": "4"}).json()["info"]["turns"] == 3
        for seed in (2**63 - 1, -(2**63)):
            assert post(url, "/reset", {"session_id": sid, "seed": seed}).status_code == 200
        assert httpx.get(f"{url}/health").json()["ready"] is True


def test_deeply_nested_json_gets_a_readable_400() -> None:
    with service(pool_size=1) as svc:
        # Nested past Python's recursion limit (a RecursionError), or merely deeper than any request needs.
        for body in (b"[" * 30_000 + b"]" * 30_000, b'{"session_id": ' + b"[" * 40 + b"]" * 40 + b"}"):
            for path in ("/create", "/reset", "/step", "/close"):
                nested = httpx.post(f"{svc.url}{path}", content=body)
                assert nested.status_code == 400, nested.text
                assert "nests JSON deeper than 32 levels" in nested.json()["error"]
        assert httpx.get(f"{svc.url}/health").json()["ready"] is True


def test_create_waits_for_a_free_slot_then_succeeds() -> None:
    with service(pool_size=2) as svc:
        url = svc.url

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
                held = [(await client.post("/create", json={})).json()["session_id"] for _ in range(2)]
                extra = [asyncio.create_task(client.post("/create", json={"session_id": f"x{i}"}))
                         for i in range(2)]

                async def both_waiting() -> bool:
                    return (await client.get("/health")).json()["waiting"] == 2

                await async_wait_until(both_waiting, "two creates to queue")
                assert not any(task.done() for task in extra)
                for sid in held:
                    assert (await client.post("/close", json={"session_id": sid})).json()["released"]
                replies = await asyncio.gather(*extra)
                assert [r.status_code for r in replies] == [200, 200]
                health = (await client.get("/health")).json()
                assert (health["sessions"], health["free"], health["waiting"]) == (2, 0, 0)
                # Creating an existing session again is a no-op (a retried create leaks nothing).
                again = (await client.post("/create", json={"session_id": "x0"})).json()
                assert again["existed"] is True
                assert (await client.get("/health")).json()["sessions"] == 2

        asyncio.run(scenario())


def test_create_times_out_with_503_when_pool_stays_busy() -> None:
    with service(pool_size=1, create_timeout_s=0.2) as svc:
        assert post(svc.url, "/create", {}).status_code == 200
        reply = post(svc.url, "/create", {})
        assert reply.status_code == 503
        assert "no free env slot" in reply.json()["error"] and "pool of 1" in reply.json()["error"]
        assert httpx.get(f"{svc.url}/health").json()["waiting"] == 0


class _Fragile(TinyGuess):
    """TinyGuess whose step raises on the action "boom" (an environment bug)."""

    async def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if action_text == "boom":
            raise ValueError("boom")
        return await super().step(action_text)


def test_environment_errors_are_500_with_a_message_and_the_service_survives() -> None:
    settings = ServiceSettings(env_name="TinyGuess", pool_size=1)
    svc = ThreadedService(settings, factory=lambda _slot: _Fragile(TINY_CONFIG)).start()
    try:
        sid = new_session(svc.url, seed=3)
        reply = post(svc.url, "/step", {"session_id": sid, "step_id": 0, "action": "boom"})
        assert reply.status_code == 500 and reply.json()["error"] == "environment error: ValueError: boom"
        # The failed step was not recorded: the same id can still be played.
        ok = post(svc.url, "/step", {"session_id": sid, "step_id": 0, "action": "4"}).json()
        assert ok["obs"] == CORRECT_OBS and ok["replayed"] is False
    finally:
        svc.stop()


class _FailingReset(TinyGuess):
    """TinyGuess whose reset raises for seed 13 (an environment that cannot start an episode)."""

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        if seed == 13:
            raise RuntimeError("no goal for seed 13")
        return await super().reset(seed)


def test_a_failed_reset_ends_the_previous_episode_instead_of_replaying_it() -> None:
    settings = ServiceSettings(env_name="TinyGuess", pool_size=1)
    svc = ThreadedService(settings, factory=lambda _slot: _FailingReset(TINY_CONFIG)).start()
    try:
        sid = new_session(svc.url, seed=3)
        first = post(svc.url, "/step", {"session_id": sid, "step_id": 0, "action": "10"}).json()
        assert first["done"] is False and first["replayed"] is False
        reply = post(svc.url, "/reset", {"session_id": sid, "seed": 13})
        assert reply.status_code == 500 and "no goal for seed 13" in reply.json()["error"]
        # No episode is in progress now: neither the old episode's step 0 comes back as if it
        # belonged to this one, nor does its next step act on an env whose reset failed.
        for step_id in (0, 1):
            stale = post(svc.url, "/step", {"session_id": sid, "step_id": step_id, "action": "10"})
            assert stale.status_code == 409, (step_id, stale.json())
            assert "call /reset before /step" in stale.json()["error"]
        # A reset that works starts a fresh episode at step 0.
        assert post(svc.url, "/reset", {"session_id": sid, "seed": 3}).status_code == 200
        again = post(svc.url, "/step", {"session_id": sid, "step_id": 0, "action": "10"}).json()
        assert again["replayed"] is False
    finally:
        svc.stop()


def test_a_pool_that_cannot_be_built_is_reported_not_fatal() -> None:
    def broken(slot: int) -> BaseTextEnv:
        raise RuntimeError(f"no data for slot {slot}")

    svc = ThreadedService(ServiceSettings(env_name="TinyGuess", pool_size=2), factory=broken).start(wait_ready=False)
    try:
        wait_until(lambda: httpx.get(f"{svc.url}/health").json()["error"] is not None, "the pool error")
        health = httpx.get(f"{svc.url}/health").json()
        assert health["ready"] is False and "RuntimeError: no data for slot" in health["error"]
        reply = post(svc.url, "/create", {})
        assert reply.status_code == 503 and "building the env pool failed" in reply.json()["error"]
    finally:
        svc.stop()


# --- the client ---------------------------------------------------------------------------------

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


def test_service_episode_matches_in_process_episode(shared_service: ThreadedService) -> None:
    remote_config = {"url": shared_service.url, "env": "TinyGuess"}
    for seed in (0, 7, 19):
        local = asyncio.run(play(TinyGuess(TINY_CONFIG), seed))
        remote = asyncio.run(play(ServiceTextEnv(remote_config), seed))
        assert remote == local
        assert local[-1][2] is True  # the binary search finishes within the turn budget
    scripted = ["no number here", "<answer>30</answer>", "5", "<answer>6</answer>", "x", "y"]
    assert asyncio.run(play(make_env("Service", remote_config), 5, scripted)) == asyncio.run(
        play(TinyGuess(TINY_CONFIG), 5, scripted)
    )
    health = httpx.get(f"{shared_service.url}/health").json()
    assert health["sessions"] == 0 and health["free"] == 4  # every close gave its slot back


def test_env_spec_can_point_at_a_service(shared_service: ThreadedService) -> None:
    spec = load_env_spec({"envs": [{"name": "service", "n_envs": 2,
                                    "config": {"url": shared_service.url, "env": "TinyGuess"}}]})
    entry = spec.envs[0]
    assert entry.name == "Service" and get_env_class(entry.name) is ServiceTextEnv
    env = make_env(entry.name, entry.env_config())  # max_turns from the spec is passed and ignored
    assert asyncio.run(play(env, 2))[-1][3]["success"] is True


def test_more_concurrent_episodes_than_slots_all_finish() -> None:
    with service(pool_size=2) as svc:
        async def many() -> list[list[Any]]:
            envs = [ServiceTextEnv({"url": svc.url}) for _ in range(6)]
            return await asyncio.gather(*(play(env, seed) for seed, env in enumerate(envs)))

        results = asyncio.run(many())
        expected = [asyncio.run(play(TinyGuess(TINY_CONFIG), seed)) for seed in range(6)]
        assert results == expected
        assert httpx.get(f"{svc.url}/health").json()["free"] == 2


def test_client_config_is_checked(shared_service: ThreadedService) -> None:
    with pytest.raises(EnvConfigError, match="url"):
        ServiceTextEnv({})
    with pytest.raises(EnvConfigError, match="max_retries"):
        ServiceTextEnv({"url": "http://127.0.0.1:1", "max_retries": -1})
    env = ServiceTextEnv({"url": shared_service.url, "env": "WebShop"})
    with pytest.raises(EnvConfigError, match="hosts 'TinyGuess'"):
        asyncio.run(env.reset(0))
    asyncio.run(env.close())
    assert httpx.get(f"{shared_service.url}/health").json()["sessions"] == 0


def test_http_errors_are_not_retried_and_close_returns_the_session(
    shared_service: ThreadedService, caplog: pytest.LogCaptureFixture
) -> None:
    url = shared_service.url

    async def scenario() -> None:
        env = ServiceTextEnv({"url": url, "backoff_base_s": 0.0})
        try:
            await env.reset(0)
            await env.step("1")  # solved: the episode is over
            with pytest.raises(ServiceError) as err:
                await env.step("2")
            assert err.value.status == 409 and "ended" in str(err.value)
            assert (await env._http().get("/health")).json()["sessions"] >= 1
        finally:
            await env.close()

    with caplog.at_level(logging.WARNING, logger="fedagent_flwr.envs.service.client"):
        asyncio.run(scenario())
    assert not [r for r in caplog.records if "retry" in r.getMessage()]
    assert httpx.get(f"{url}/health").json()["sessions"] == 0


def test_transport_errors_are_retried_then_reported(caplog: pytest.LogCaptureFixture) -> None:
    # A bound but not listening socket refuses connections and keeps the port from being reused.
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    env = ServiceTextEnv({"url": socket_url(dead), "max_retries": 2, "backoff_base_s": 0.01,
                          "backoff_cap_s": 0.02})
    try:
        with caplog.at_level(logging.WARNING, logger="fedagent_flwr.envs.service.client"):
            with pytest.raises(ServiceError) as err:
                asyncio.run(env.reset(0))
        assert err.value.status is None
        assert "unreachable" in str(err.value) and "after 3 attempt(s)" in str(err.value)
        assert len([r for r in caplog.records if "retry" in r.getMessage()]) == 2
        assert env.session_id is None
        asyncio.run(env.close())  # nothing to return; must not raise either
    finally:
        dead.close()


def test_transport_error_retry_reaches_a_late_service_and_replays_steps() -> None:
    # The port is reserved (bound) but refuses connections until the service starts listening.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = socket_url(sock)
    retried = threading.Event()

    class _Flag(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "retry" in record.getMessage():
                retried.set()

    handler = _Flag()
    client_logger = logging.getLogger("fedagent_flwr.envs.service.client")
    client_logger.addHandler(handler)
    svc: ThreadedService | None = None
    try:
        async def scenario() -> tuple[Any, Any, Any]:
            nonlocal svc
            env = ServiceTextEnv({"url": url, "max_retries": 1000, "backoff_base_s": 0.01,
                                  "backoff_cap_s": 0.05})
            try:
                first = asyncio.create_task(env.reset(3))
                await asyncio.to_thread(retried.wait, HANG_GUARD_S)
                assert retried.is_set() and not first.done()
                sock.listen(16)
                svc = await asyncio.to_thread(
                    lambda: ThreadedService(ServiceSettings(env_name="TinyGuess", pool_size=1), sock).start()
                )
                reset = await first
                step0 = await env.step("<answer>1</answer>")
                # What a transport retry of step 0 sends: the same id again (env.step_id is 1 now).
                replay = (await env._http().post(
                    "/step", json={"session_id": env.session_id, "step_id": 0, "action": "<answer>1</answer>"}
                )).json()
                step1 = await env.step("<answer>2</answer>")
                return reset, (step0, replay), step1
            finally:
                await env.close()

        reset, (step0, replay), step1 = asyncio.run(scenario())
        assert reset[0].startswith("Guess the secret number")
        assert step0[0] == HIGHER_OBS and replay["replayed"] is True and replay["obs"] == step0[0]
        assert step1[3]["turns"] == 2  # the replay did not count as a turn
    finally:
        client_logger.removeHandler(handler)
        if svc is not None:
            svc.stop()
        sock.close()


def test_backoff_is_capped_exponential_with_deterministic_jitter() -> None:
    delays = [backoff_delay(a, 0.3, 4.0, "session-1") for a in range(8)]
    assert delays == [backoff_delay(a, 0.3, 4.0, "session-1") for a in range(8)]
    for attempt, delay in enumerate(delays):
        nominal = min(4.0, 0.3 * 2 ** attempt)
        assert 0.5 * nominal <= delay < nominal
    assert delays != [backoff_delay(a, 0.3, 4.0, "session-2") for a in range(8)]


# --- the server process and its manager ---------------------------------------------------------

def _proc_exists(process: ProcessRef | None) -> bool:
    """Whether that very process exists, even as a zombie (its pid may belong to another one by
    now: pids wrap quickly on a busy machine)."""
    return process is not None and ProcessRef.of(process.pid, zombie_ok=True) == process


def test_manager_start_attach_restart_stop(tmp_path: Path) -> None:
    state_file = tmp_path / "svc" / "tinyguess.json"
    launch = ServiceLaunch(env="TinyGuess", config=TINY_CONFIG, pool_size=2,
                           partition={"name": "uniform", "goal_indices": [0, 2, 4]})
    manager = EnvServiceManager(launch, state_file, stop_grace_s=5.0)
    try:
        url = manager.ensure_running()
        health = httpx.get(f"{url}/health").json()
        assert health["ready"] and health["partition"] == {"name": "uniform", "goal_indices": [0, 2, 4]}
        assert health["info"] == {"num_goals": 3}  # the partition restricted the goal pool
        assert url.startswith("http://127.0.0.1:")
        first_pid = manager.pid
        assert first_pid is not None and [p.pid for p in group_members(first_pid)] == [first_pid]
        # A CPU program beside the trainers: it sees no GPU, and JAX (bm25s's backend) stays on the CPU.
        service_env = psutil.Process(first_pid).environ()
        assert service_env.get("CUDA_VISIBLE_DEVICES") == "" and service_env.get("JAX_PLATFORMS") == "cpu"

        # A fresh process (as Flower runs each message) finds and reuses the same service.
        probe = subprocess.run(
            [sys.executable, "-c",
             "import json, sys\n"
             "from fedagent_flwr.envs.service.manager import EnvServiceManager\n"
             "m = EnvServiceManager.attach(sys.argv[1])\n"
             "print(json.dumps({'alive': m.is_alive(), 'url': m.ensure_running(), 'pid': m.pid}))\n",
             str(state_file)],
            capture_output=True, text=True, timeout=HANG_GUARD_S, check=True,
        )
        assert json.loads(probe.stdout) == {"alive": True, "url": url, "pid": first_pid}
        attached = EnvServiceManager.attach(state_file)
        assert attached.launch == launch and attached.url == url and attached.is_alive()

        # kill -9: the attached manager notices and restarts it on a new process and port.
        first = ProcessRef.of(first_pid)
        os.kill(first_pid, signal.SIGKILL)
        wait_until(lambda: not attached.is_alive(), "the killed service to be seen as dead")
        new_url = attached.ensure_running()
        assert attached.pid != first_pid and first is not None and not _proc_exists(first)  # reaped, not a zombie
        assert httpx.get(f"{new_url}/health").json()["ready"] is True
        assert EnvServiceManager.attach(state_file).url == new_url
        # The restarted service serves a full episode.
        env = ServiceTextEnv({"url": new_url, "env": "TinyGuess"})
        assert asyncio.run(play(env, 1))[-1][3]["success"] is True

        # Stopping from another manager instance leaves no process and no process group.
        second_pid = attached.pid
        assert second_pid is not None
        second = ProcessRef.of(second_pid)
        EnvServiceManager.attach(state_file).stop()
        assert second is not None and not _proc_exists(second)
        assert group_members(second_pid) == []
        assert not state_file.exists() and not manager.is_alive()
        with pytest.raises(EnvServiceError, match="no env service state file"):
            EnvServiceManager.attach(state_file)
        manager.stop()  # stopping again is a no-op
    finally:
        manager.stop()


def test_attach_or_create_replaces_a_service_with_another_partition(tmp_path: Path) -> None:
    state_file = tmp_path / "svc.json"
    launch_a = ServiceLaunch(env="TinyGuess", config=TINY_CONFIG, pool_size=1, partition={"goal_indices": [0]})
    launch_b = ServiceLaunch(env="TinyGuess", config=TINY_CONFIG, pool_size=1, partition={"goal_indices": [1]})
    first = EnvServiceManager.attach_or_create(state_file, launch_a)
    try:
        first.ensure_running()
        pid_a = first.pid
        assert pid_a is not None
        service_a = ProcessRef.of(pid_a)
        assert EnvServiceManager.attach_or_create(state_file, launch_a).pid == pid_a  # reused
        second = EnvServiceManager.attach_or_create(state_file, launch_b)
        assert service_a is not None and not _proc_exists(service_a)  # the other partition's service is gone
        url = second.ensure_running()
        assert httpx.get(f"{url}/health").json()["partition"] == {"goal_indices": [1]}
        second.stop()
    finally:
        first.stop()
        EnvServiceManager.attach_or_create(state_file, launch_b).stop()


@pytest.mark.parametrize("damage", ["unknown launch key", "no launch", "not JSON"])
def test_attach_or_create_stops_the_service_of_a_state_file_it_cannot_parse(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    """The old service is stopped and the file moved aside with a warning naming both; the same call
    then serves a new service: the job that met the damaged file is not failed for it (after a
    package upgrade every client meets one at once, and failing them all alike stopped the run)."""
    state_file = tmp_path / "svc.json"
    launch = ServiceLaunch(env="TinyGuess", config=TINY_CONFIG, pool_size=1)
    first = EnvServiceManager.attach_or_create(state_file, launch, stop_grace_s=5.0)
    try:
        first.ensure_running()
        pid = first.pid
        assert pid is not None
        service = ProcessRef.of(pid)
        state = json.loads(state_file.read_text())
        if damage == "unknown launch key":  # written by another version of the package, say
            state["launch"]["pool_timeout_s"] = 3.0
        elif damage == "no launch":
            del state["launch"]
        damaged = json.dumps(state) if damage != "not JSON" else state_file.read_text()[:40]
        state_file.write_text(damaged)
        with caplog.at_level(logging.WARNING, logger="fedagent_flwr.envs.service.manager"):
            second = EnvServiceManager.attach_or_create(state_file, launch, stop_grace_s=5.0)
        message = caplog.text
        assert f"env service state file {state_file} is unreadable" in message
        assert f"its service (pid {pid}) was stopped" in message and "svc.json.unreadable" in message
        assert service is not None and not _proc_exists(service) and group_members(pid) == []
        assert not state_file.exists() and (tmp_path / "svc.json.unreadable").read_text() == damaged
        # This very call's manager starts a new service.
        assert httpx.get(f"{second.ensure_running()}/health").json()["ready"] and second.pid != pid
    finally:
        EnvServiceManager.attach_or_create(state_file, launch).stop()
        first.stop()


@contextlib.contextmanager
def bystander_groups() -> Iterator[dict[str, int]]:
    """Process groups this manager did not start: a live group, and a group whose leader has
    exited but whose member lives on. Each is stopped by its pid at the end."""
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    orphaned = subprocess.Popen(["/bin/sh", "-c", "sleep 600 & echo $!"], start_new_session=True,
                                stdout=subprocess.PIPE, text=True)
    assert orphaned.stdout is not None
    member = int(orphaned.stdout.readline())
    orphaned.wait()  # the leader is gone (and reaped); its group lives on in `member`
    orphaned.stdout.close()
    try:
        yield {"alive": alive.pid, "orphaned": orphaned.pid, "member": member}
    finally:
        for pid in (alive.pid, member):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        alive.wait()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(member, 0)


def test_a_forged_state_file_never_makes_the_manager_signal_another_group(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    launch = ServiceLaunch(env="TinyGuess", config=TINY_CONFIG, pool_size=1)
    other = EnvServiceManager(launch, tmp_path / "other.json")  # a real service, of another state file
    other.ensure_running()
    state_file = tmp_path / "svc.json"
    try:
        with bystander_groups() as victims:
            alive_ref = ProcessRef.of(victims["alive"])

            def forge(pid: int, pgid: int) -> None:
                started = ProcessRef.of(pid)
                state_file.write_text(json.dumps({
                    **(started.to_json() if started else {"pid": pid}), "pgid": pgid, "url": "http://127.0.0.1:9",
                    "log_file": str(tmp_path / "x.log"), "launch": dataclasses.asdict(launch)}))

            forgeries = [
                (victims["alive"], victims["alive"]),  # a live group, with its true start time
                (2**22 + 7, victims["alive"]),  # a pid that does not exist, and someone's group
                (os.getpid(), victims["alive"]),  # a live pid with another group
                (victims["orphaned"], victims["orphaned"]),  # a group whose leader exited
                (other.pid, other.pid),  # our own service, but started for another state file
            ]
            for pid, pgid in forgeries:
                assert pid is not None and pgid is not None
                forge(pid, pgid)
                with caplog.at_level(logging.WARNING):
                    EnvServiceManager.attach(state_file).stop()
                assert not state_file.exists()
                assert all(Path(f"/proc/{v}").exists() for v in (victims["alive"], victims["member"]))
                assert other.is_alive()
            assert "which this manager did not start" in caplog.text
            # A forged record is not reused either: ensure_running starts a service of its own.
            forge(victims["alive"], victims["alive"])
            manager = EnvServiceManager.attach_or_create(state_file, launch)
            url = manager.ensure_running()
            assert manager.pid != victims["alive"] and httpx.get(f"{url}/health").json()["ready"]
            manager.stop()
            assert Path(f"/proc/{victims['alive']}").exists() and alive_ref is not None and alive_ref.alive()
    finally:
        other.stop()
        EnvServiceManager.attach_or_create(state_file, launch).stop()


def test_manager_reports_a_service_that_cannot_start(tmp_path: Path) -> None:
    state_file = tmp_path / "bad.json"
    manager = EnvServiceManager(ServiceLaunch(env="TinyGuess", config={"lo": 5, "hi": 1}), state_file)
    with pytest.raises(EnvServiceError) as err:
        manager.ensure_running()
    message = str(err.value)
    assert "exited with code 2" in message and str(manager.log_file) in message
    assert "'hi' (1) must be >= 'lo' (5)" in message
    assert not state_file.exists()


def test_server_module_writes_its_url_and_exits_on_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready" / "url.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedagent_flwr.envs.service.server", "--env", "tinyguess",
         "--config", json.dumps(TINY_CONFIG), "--pool", "1", "--port", "0", "--ready-file", str(ready),
         "--variant", "{}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, "the ready file")
        url = ready.read_text().strip()
        health = httpx.get(f"{url}/health").json()
        assert health["env"] == "TinyGuess" and health["pool_size"] == 1
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught: -SIGTERM, not 0.
        assert proc.wait(HANG_GUARD_S) in (0, -signal.SIGTERM)
        assert proc.stdout is not None and f"listening on {url}" in proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_server_module_refuses_bad_arguments() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fedagent_flwr.envs.service.server", "--env", "TinyGuess",
         "--partition", "[1]"],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert result.returncode == 2 and "--partition must be a JSON object" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "fedagent_flwr.envs.service.server", "--env", "NoSuchEnv", "--pool", "1"],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert result.returncode == 2 and "unknown environment 'NoSuchEnv'" in result.stderr


def test_service_exits_with_its_owner_so_a_crash_leaves_no_orphan(tmp_path: Path) -> None:
    # The owner stands in for the node's long-lived process (a Ray actor, a SuperNode) that
    # dies without a clean shutdown: SIGKILL, so no shutdown message ever arrives.
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        launch = ServiceLaunch(env="TinyGuess", config=TINY_CONFIG, pool_size=1, owner_pid=owner.pid)
        manager = EnvServiceManager(launch, tmp_path / "svc.json")
        manager.ensure_running()
        service_pid = manager.pid
        assert service_pid is not None and manager.is_alive()
        # Another process of the same node (new owner pid) reuses the running service.
        same = EnvServiceManager.attach_or_create(tmp_path / "svc.json",
                                                  dataclasses.replace(launch, owner_pid=os.getpid()))
        assert same.pid == service_pid
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 60  # bounded wait for the watchdog (checks every 2 s)
        while Path(f"/proc/{service_pid}").exists() and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(service_pid, os.WNOHANG)  # reap it: we are its parent here
            time.sleep(0.2)
        assert not Path(f"/proc/{service_pid}").exists(), "the service outlived its owner"
        assert "owner process" in manager.log_file.read_text()
    finally:
        if owner.poll() is None:
            owner.kill()
        with contextlib.suppress(Exception):
            EnvServiceManager.attach(tmp_path / "svc.json").stop()
