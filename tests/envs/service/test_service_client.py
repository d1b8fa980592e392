"""ServiceTextEnv, the env service's client: episodes equal to in-process ones, env specs naming a
service, more episodes than slots, config checks, and which errors it retries (with backoff).

Everything runs for real: uvicorn on loopback in a thread and httpx clients; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Any

import httpx
import pytest

from fedagent_flwr.envs.base import EnvConfigError
from fedagent_flwr.envs.registry import get_env_class, make_env
from fedagent_flwr.envs.service.app import ServiceSettings
from fedagent_flwr.envs.service.client import ServiceError, ServiceTextEnv, backoff_delay
from fedagent_flwr.envs.service.server import socket_url
from fedagent_flwr.envs.spec import load_env_spec
from fedagent_flwr.envs.tiny_guess import HIGHER_OBS, TinyGuess
from testkit.env_service import HANG_GUARD_S, TINY_CONFIG, ThreadedService, play, service


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
