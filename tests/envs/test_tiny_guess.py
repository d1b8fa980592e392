"""TinyGuess (FedAgent's rules), the env registry and env specs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fedagent_flwr.envs.base import BaseTextEnv, EnvConfigError
from fedagent_flwr.envs.registry import UnknownEnvError, get_env_class, known_envs, make_env, register_env
from fedagent_flwr.envs.spec import EnvSpec, EnvSpecError, load_env_spec
from fedagent_flwr.envs.tiny_guess import (
    CORRECT_OBS,
    HIGHER_OBS,
    INVALID_OBS,
    LOWER_OBS,
    TinyGuess,
    parse_guess,
)


def run(coro):  # noqa: ANN001, ANN201 - tiny helper for async env calls
    return asyncio.run(coro)


async def _find_secret(env: BaseTextEnv, seed: int, lo: int, hi: int) -> tuple[int, int]:
    """Binary search using only the env's feedback; returns (secret, turns used)."""
    await env.reset(seed)
    low, high = lo, hi
    while True:
        guess = (low + high) // 2
        obs, reward, done, info = await env.step(f"<answer>{guess}</answer>")
        if obs == CORRECT_OBS:
            assert reward == 1.0 and done and info == {"success": True, "turns": info["turns"]}
            return guess, info["turns"]
        assert reward == 0.0 and not info["success"]
        if obs == HIGHER_OBS:
            low = guess + 1
        else:
            assert obs == LOWER_OBS
            high = guess - 1


@pytest.mark.parametrize("seed", [0, 1, 17, 49, 50, 123, 4_200_001])
def test_secret_follows_fedagent_formula(seed: int) -> None:
    env = TinyGuess({"lo": 1, "hi": 50, "max_turns": 10})
    secret, _ = run(_find_secret(env, seed, 1, 50))
    assert secret == 1 + seed % 50


def test_secret_with_other_range_and_reset_is_deterministic() -> None:
    env = TinyGuess({"lo": 10, "hi": 20, "max_turns": 10})
    first = run(_find_secret(env, 7, 10, 20))
    second = run(_find_secret(env, 7, 10, 20))
    assert first == second and first[0] == 10 + 7 % 11


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>17</answer>", 17),
        ("<ANSWER> 17 </Answer>", 17),
        ("I think 3, no: <answer>-4</answer> and 9", -4),
        ("maybe 10 or maybe 12", 12),
        ("no digits here", None),
        ("", None),
        # Longer than int() reads (4300 digits): no guess, as FedAgent's int() would have raised.
        ("<answer>" + "9" * 5000 + "</answer>", None),
        ("my guess: " + "9" * 5000, None),
        ("<answer>-" + "9" * 4301 + "</answer>", None),
        ("<answer>" + "9" * 4300 + "</answer>", int("9" * 4300)),  # still a (far too high) guess
        ("<answer>" + "0" * 5000 + "7</answer>", 7),  # leading zeros are not digits of the number
    ],
)
def test_parse_guess(text: str, expected: int | None) -> None:
    assert parse_guess(text) == expected


def test_an_absurdly_long_number_is_an_invalid_response_that_uses_the_turn() -> None:
    async def play() -> list[tuple[str, float, bool, dict]]:
        env = TinyGuess({"lo": 1, "hi": 50, "max_turns": 2})
        await env.reset(25)  # secret 26
        return [await env.step("<answer>" + "7" * 5000 + "</answer>"), await env.step("<answer>26</answer>")]

    assert run(play()) == [(INVALID_OBS, 0.0, False, {"success": False, "turns": 1}),
                           (CORRECT_OBS, 1.0, True, {"success": True, "turns": 2})]


def test_feedback_rewards_and_done() -> None:
    async def play() -> None:
        env = make_env("TinyGuess", {"lo": 1, "hi": 50, "max_turns": 3})
        obs, info = await env.reset(25)  # secret 26
        assert "1" in obs and "50" in obs and info == {"turns": 0}
        assert "<answer>N</answer>" in await env.system_prompt()
        assert await env.step("<answer>10</answer>") == (HIGHER_OBS, 0.0, False, {"success": False, "turns": 1})
        assert await env.step("nothing") == (INVALID_OBS, 0.0, False, {"success": False, "turns": 2})
        assert await env.step("40") == (LOWER_OBS, 0.0, True, {"success": False, "turns": 3})
        with pytest.raises(RuntimeError, match="reset"):
            await env.step("<answer>26</answer>")
        await env.reset(25)
        assert await env.step("<answer>26</answer>") == (CORRECT_OBS, 1.0, True, {"success": True, "turns": 1})
        await env.close()

    run(play())
    assert INVALID_OBS == "Invalid response. Reply as <answer>N</answer>."


def test_step_before_reset_is_refused() -> None:
    with pytest.raises(RuntimeError, match="reset"):
        run(TinyGuess({}).step("<answer>1</answer>"))


def test_targets_pool_and_goal_api() -> None:
    config = {"lo": 1, "hi": 50, "targets": [5, 9, 13]}
    assert TinyGuess.num_goals({"lo": 1, "hi": 50}) == 50
    assert TinyGuess.num_goals({}) == 50
    assert TinyGuess.num_goals(config) == 3
    for seed in range(6):
        secret, _ = run(_find_secret(TinyGuess({**config, "max_turns": 10}), seed, 1, 50))
        assert secret == config["targets"][seed % 3]
    assert TinyGuess.restrict_goals({"lo": 11, "hi": 20}, [0, 2])["targets"] == [11, 13]
    assert TinyGuess.restrict_goals(config, [2, 0])["targets"] == [13, 5]
    with pytest.raises(EnvConfigError, match="outside"):
        TinyGuess.restrict_goals(config, [3])


@pytest.mark.parametrize(
    ("config", "field"),
    [({"lo": 5, "hi": 4}, "'hi'"), ({"max_turns": 0}, "'max_turns'"), ({"lo": "1"}, "'lo'"),
     ({"targets": []}, "'targets'"), ({"targets": [1, "2"]}, "'targets'")],
)
def test_bad_config_names_the_field(config: dict, field: str) -> None:
    with pytest.raises(EnvConfigError, match=field):
        TinyGuess(config)


def test_registry_is_case_insensitive_and_lists_known_names() -> None:
    assert get_env_class("TinyGuess") is get_env_class("tinyguess") is get_env_class(" TINYGUESS ")
    assert isinstance(make_env("tinyguess", {"hi": 9}), TinyGuess)
    assert "TinyGuess" in known_envs()
    with pytest.raises(UnknownEnvError, match="NoSuchEnv.*TinyGuess"):
        make_env("NoSuchEnv")


def test_register_env_refuses_a_taken_name() -> None:
    with pytest.raises(ValueError, match="already taken"):

        @register_env("tinyguess")
        class Impostor(TinyGuess):
            pass


def test_load_env_spec_from_yaml_and_dict(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("envs:\n  - name: TinyGuess\n    n_envs: 4\n    max_turns: 3\n    config: {lo: 1, hi: 9}\n")
    spec = load_env_spec(path)
    assert isinstance(spec, EnvSpec) and len(spec.envs) == 1
    entry = spec.envs[0]
    assert (entry.name, entry.n_envs, entry.max_turns, entry.config) == ("TinyGuess", 4, 3, {"lo": 1, "hi": 9})
    assert entry.env_config() == {"max_turns": 3, "lo": 1, "hi": 9}
    assert load_env_spec(spec.to_dict()) == spec
    lowercase = load_env_spec({"envs": [{"name": "tinyguess", "n_envs": 1}]}).envs[0]
    assert (lowercase.name, lowercase.max_turns, lowercase.config) == ("TinyGuess", 6, {})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "'envs' must be a non-empty list"),
        ({"envs": []}, "'envs' must be a non-empty list"),
        ({"envs": [{"name": "TinyGuess"}]}, r"'envs\[0\]\.n_envs' is missing"),
        ({"envs": [{"name": "TinyGuess", "n_envs": 2}, {"name": "TinyGuess", "n_envs": 0}]}, r"envs\[1\]\.n_envs"),
        ({"envs": [{"name": "TinyGuess", "n_envs": 1, "max_turns": "6"}]}, r"envs\[0\]\.max_turns"),
        ({"envs": [{"name": "Nope", "n_envs": 1}]}, r"envs\[0\]\.name.*'Nope'.*TinyGuess"),
        ({"envs": [{"name": "TinyGuess", "n_envs": 1, "nenvs": 2}]}, r"unknown config key 'envs\[0\]\.nenvs'"),
        ({"envs": [{"name": "TinyGuess", "n_envs": 1, "config": [1]}]}, r"envs\[0\]\.config"),
        ({"envs": [], "extra": 1}, "unknown top-level"),
    ],
)
def test_bad_spec_names_the_field(raw: dict, message: str) -> None:
    with pytest.raises(EnvSpecError, match=message):
        load_env_spec(raw)


def test_bad_spec_files(tmp_path: Path) -> None:
    with pytest.raises(EnvSpecError, match="does not exist"):
        load_env_spec(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("envs: [unclosed\n")
    with pytest.raises(EnvSpecError, match="cannot be parsed"):
        load_env_spec(broken)
