"""The HTTP env service app's sessions: health, replayed and concurrent steps applied once, step
order and unknown sessions, and creates waiting for (or timing out on) a free pool slot.

Everything runs for real: uvicorn on loopback in a thread and httpx clients; nothing is mocked.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from fedagent_flwr.envs.tiny_guess import CORRECT_OBS, HIGHER_OBS
from testkit.env_service import HANG_GUARD_S, ThreadedService, async_wait_until, new_session, post, service


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
