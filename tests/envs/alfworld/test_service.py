"""ALFWorld over HTTP on the real engine: the service process runs under the ALFWorld service venv
(alfworld 0.4.2, textworld 1.7.0) with engine worker processes, on games rebuilt from the shared
trial. Nothing is mocked: real uvicorn, real TextWorld, httpx clients."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fedagent_flwr.envs.alfworld.data import load_games
from fedagent_flwr.envs.alfworld.env import SYSTEM_PROMPT, WIN_REWARD
from fedagent_flwr.envs.service.client import ServiceTextEnv
from fedagent_flwr.envs.service.manager import EnvServiceError, EnvServiceManager
from testkit.alfworld_service import TRIAL_TASK, seed_of, service_launch, walkthrough


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, alfworld_python: Path, alfworld_data: Path) -> Iterator[str]:
    state = tmp_path_factory.mktemp("alfworld-service") / "svc.json"
    with EnvServiceManager(service_launch(alfworld_python, alfworld_data, engine_workers=2), state,
                           startup_timeout_s=180) as manager:
        yield manager.ensure_running()


def _reply(command: str) -> str:
    return f"<think>the next step of the plan</think><action>{command}</action>"


def test_health_names_the_engine_and_its_workers(service: str) -> None:
    health = httpx.get(f"{service}/health", timeout=10).json()
    assert health["ready"] and health["env"] == "ALFWorld"
    assert health["info"]["engine_workers"] == 2 and health["info"]["textworld"] == "1.7.0"
    assert health["info"]["num_goals"] == 6 and len(health["info"]["task_types"]) == 5


def test_shared_trial_is_won_by_its_walkthrough_over_http(service: str, alfworld_data: Path) -> None:
    async def play() -> None:
        env = ServiceTextEnv({"url": service, "env": "ALFWorld"})
        try:
            assert await env.system_prompt() == SYSTEM_PROMPT
            obs, info = await env.reset(seed_of(alfworld_data, TRIAL_TASK))
            assert info["task_type"] == "pick_heat_then_place_in_recep"
            assert "Your task is to: heat some potato and put it in sinkbasin." in obs
            assert obs.startswith("Your current observation is: -= Welcome to TextWorld, ALFRED! =-")
            commands = info["admissible_commands"]
            assert "go to microwave 1" in commands and "help" not in commands
            assert "'go to microwave 1'" in obs  # the admissible list is part of the observation
            steps = walkthrough(info["game"])
            for i, command in enumerate(steps):
                obs, reward, done, info = await env.step(_reply(command))
                assert info["action"] == command and info["is_action_valid"] == 1
                if i < len(steps) - 1:
                    assert (reward, done, info["success"]) == (0.0, False, False)
            assert (reward, done, info["success"], info["won"]) == (WIN_REWARD, True, True, True)
            assert info["turns"] == len(steps)
        finally:
            await env.close()

    asyncio.run(play())


def test_invalid_action_and_untagged_reply(service: str) -> None:
    async def play() -> None:
        env = ServiceTextEnv({"url": service, "env": "ALFWorld"})
        try:
            await env.reset(3)
            obs, reward, done, info = await env.step(_reply("fly to the moon"))
            assert "Nothing happens." in obs and (reward, done, info["success"]) == (0.0, False, False)
            assert info["is_action_valid"] == 1  # well-formed reply; the engine judges the command
            # No tags: FedAgent's fallback sends the last 30 characters and flags the reply invalid.
            reply = "I would rather just look around the kitchen for a while"
            obs, reward, done, info = await env.step(reply)
            assert info["action"] == reply.lower()[-30:] and info["is_action_valid"] == 0
            assert reward == 0.0 and not done
        finally:
            await env.close()

    asyncio.run(play())


def test_step_ids_replay_and_refuse_out_of_order(service: str) -> None:
    with httpx.Client(base_url=service, timeout=60) as http:
        session = http.post("/create", json={"session_id": "replay"}).json()["session_id"]
        try:
            http.post("/reset", json={"session_id": session, "seed": 1}).raise_for_status()
            first = http.post("/step", json={"session_id": session, "step_id": 0, "action": _reply("look")}).json()
            assert first["replayed"] is False
            again = http.post("/step", json={"session_id": session, "step_id": 0, "action": _reply("inventory")})
            assert again.json() == {**first, "replayed": True}  # cached: "inventory" was never applied
            ahead = http.post("/step", json={"session_id": session, "step_id": 5, "action": _reply("look")})
            assert ahead.status_code == 409 and "out of order" in ahead.json()["error"]
            second = http.post("/step", json={"session_id": session, "step_id": 1, "action": _reply("inventory")})
            assert second.json()["info"]["turns"] == 2 and "not carrying anything" in second.json()["obs"]
            unknown = http.post("/step", json={"session_id": "nobody", "step_id": 0, "action": "look"})
            assert unknown.status_code == 404
        finally:
            http.post("/close", json={"session_id": session})


def test_concurrent_episodes_on_different_workers_all_win(service: str, alfworld_data: Path) -> None:
    """Four sessions at once over two engine workers: every episode plays to its own win."""
    games = load_games(alfworld_data, "train")

    async def play(seed: int) -> tuple[float, bool]:
        env = ServiceTextEnv({"url": service, "env": "ALFWorld"})
        try:
            _obs, info = await env.reset(seed)
            assert info["game"] == games[seed % len(games)].game_file
            for command in walkthrough(info["game"]):
                _obs, reward, done, info = await env.step(_reply(command))
            return reward, info["success"]
        finally:
            await env.close()

    async def all_games() -> list[tuple[float, bool]]:
        return await asyncio.gather(*(play(seed) for seed in range(4)))

    assert asyncio.run(all_games()) == [(WIN_REWARD, True)] * 4


def test_partitioned_service_plays_only_its_goals(tmp_path: Path, alfworld_python: Path, alfworld_data: Path) -> None:
    games = load_games(alfworld_data, "train")
    launch = service_launch(alfworld_python, alfworld_data, engine_workers=1, pool=1)
    launch = dataclasses.replace(launch, partition={"strategy": "uniform", "goal_indices": [4, 5]})
    with EnvServiceManager(launch, tmp_path / "svc.json", startup_timeout_s=180) as manager:
        url = manager.ensure_running()
        health = manager.health()
        assert health["partition"]["goal_indices"] == [4, 5] and health["info"]["num_goals"] == 2

        async def played() -> set[str]:
            seen = set()
            for seed in range(6):
                env = ServiceTextEnv({"url": url})
                try:
                    seen.add((await env.reset(seed))[1]["game"])
                finally:
                    await env.close()
            return seen

        assert asyncio.run(played()) <= {games[4].game_file, games[5].game_file}


def test_bad_data_dir_fails_the_start_with_the_reason(tmp_path: Path, alfworld_python: Path) -> None:
    launch = service_launch(alfworld_python, tmp_path / "nowhere")
    with EnvServiceManager(launch, tmp_path / "svc.json", startup_timeout_s=60) as manager:
        with pytest.raises(EnvServiceError, match="has no json_2.1.1"):
            manager.ensure_running()


def test_env_refuses_to_play_without_its_service(alfworld_data: Path) -> None:
    from fedagent_flwr.envs.alfworld.env import AlfWorldEnv

    env = AlfWorldEnv({"data_dir": str(alfworld_data), "split": "train"})
    with pytest.raises(RuntimeError, match="only inside its service"):
        asyncio.run(env.reset(0))
