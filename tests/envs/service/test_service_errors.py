"""The HTTP env service app's errors: bad requests get readable 4xx replies, environment errors
500 with a message, a failed reset ends the episode, and a pool that cannot be built is reported;
the service survives each.

Everything runs for real: uvicorn on loopback in a thread and httpx clients; nothing is mocked.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fedagent_flwr.envs.base import BaseTextEnv
from fedagent_flwr.envs.service.app import ServiceSettings
from fedagent_flwr.envs.tiny_guess import CORRECT_OBS, INVALID_OBS, TinyGuess
from testkit.env_service import TINY_CONFIG, ThreadedService, new_session, post, service, wait_until


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
