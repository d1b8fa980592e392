"""Validation through an env service whose pool is smaller than an entry's episodes.

The evaluator samples in lockstep: a batch waits for every running episode. An episode waiting
for a pool slot therefore stalled all the others until the service gave up on it (its create
timeout), and the evaluation failed: FedAgent's paper experiments validate 500 WebShop / 140
ALFWorld episodes on one client with a pool of 64. The evaluator now plays each entry in waves
of its pool; every episode keeps its own generator, so the episodes are the ones played without
a service.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.clientapp.job import EvalJob
from fedagent_flwr.envs.base import EnvConfigError
from fedagent_flwr.envs.registry import make_env
from fedagent_flwr.envs.spec import load_env_spec
from fedagent_flwr.rollout.episode import Episode
from fedagent_flwr.trainers.common import evaluator
from fedagent_flwr.trainers.common.evaluator import EvalSettings, episode_waves

ENTRIES = [{"name": "TinyGuess", "n_envs": 1, "max_turns": 2, "config": {"lo": 1, "hi": 50}},
           {"name": "TinyGuess", "n_envs": 1, "max_turns": 2, "config": {"lo": 1, "hi": 3}}]
SEEDS = [0, 1, 2]
POOL = 2  # fewer slots than the 3 episodes of each entry


@pytest.fixture
def small_pool(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """ENTRIES served by real env services of POOL slots that refuse a create after 3 s waiting."""
    from fedagent_flwr.envs.service.manager import EnvServiceManager, ServiceLaunch

    managers, served = [], []
    try:
        for index, (entry, loaded) in enumerate(zip(ENTRIES, load_env_spec({"envs": ENTRIES}).envs, strict=True)):
            # as the ClientApp serves an entry (clientapp/services.py): its env config
            launch = ServiceLaunch(env=loaded.name, config=loaded.env_config(), pool_size=POOL, create_timeout_s=3.0)
            managers.append(EnvServiceManager(launch, tmp_path / "services" / f"val_{index}.json"))
            url = managers[-1].ensure_running()
            served.append({**entry, "name": "Service", "config": {"url": url, "env": "TinyGuess", "pool_size": POOL}})
        yield {"envs": served}
    finally:
        for manager in managers:
            manager.stop()


def test_waves_hold_at_most_the_pool_of_each_entry() -> None:
    served = [{**e, "name": "Service", "config": {"url": "http://127.0.0.1:9", "pool_size": 2}} for e in ENTRIES]
    assert episode_waves(load_env_spec({"envs": served}), 3) == [[0, 1, 3, 4], [2, 5]]
    assert episode_waves(load_env_spec({"envs": served}), 2) == [[0, 1, 2, 3]]
    mixed = [served[0], {**served[1], "config": {"url": "http://127.0.0.1:9", "pool_size": 1}}]
    assert episode_waves(load_env_spec({"envs": mixed}), 3) == [[0, 1, 3], [2, 4], [5]]
    # no limit (a plain env, or a service entry written by hand without its pool): one wave
    assert episode_waves(load_env_spec({"envs": ENTRIES}), 3) == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("pool", [0, -1, 1.5, "4", True])
def test_a_bad_pool_size_is_refused_naming_the_key(pool: Any) -> None:
    with pytest.raises(EnvConfigError, match="'pool_size' must be an integer >= 1"):
        make_env("Service", {"url": "http://127.0.0.1:9", "pool_size": pool})


def test_validation_plays_in_waves_of_the_pool_and_samples_as_without_services(
    small_pool: dict[str, Any], tmp_path: Path, tiny_model_dir: Path, played_batches: list[list[Episode]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before the waves, the third episode of an entry waited for a slot that the lockstep batch
    never gave back, and the service refused it after its create timeout: the evaluation failed."""
    played = played_batches
    settings = EvalSettings(max_new_tokens=8, num_threads=1, device="cpu", val_temperature=1.0)
    results = {}
    for name, spec in [("off", {"envs": ENTRIES}), ("pool", small_pool)]:
        job = EvalJob(model_path=str(tiny_model_dir), output_dir=str(tmp_path / name), env_spec=spec, round=1,
                      seeds=SEEDS)
        start = len(played)
        results[name] = evaluator.evaluate(job, settings)
        if name == "pool":
            assert [len(wave) for wave in played[start:]] == [2 * POOL, 2 * len(SEEDS) - 2 * POOL]
    assert "6 episodes in 2 waves" in capsys.readouterr().out
    off, in_order = played[0], {}
    for wave, episodes in zip(episode_waves(load_env_spec(small_pool), len(SEEDS)), played[1:], strict=True):
        in_order.update(zip(wave, episodes, strict=True))
    pooled = [in_order[i] for i in range(len(off))]
    assert [e.response_ids for e in pooled] == [e.response_ids for e in off]
    assert [e.messages for e in pooled] == [e.messages for e in off]
    assert [(e.reward, e.success, e.num_turns) for e in pooled] == [(e.reward, e.success, e.num_turns) for e in off]
    drop = {"eval_seconds"}
    assert ({k: v for k, v in results["pool"].metrics.items() if k not in drop}
            == {k: v for k, v in results["off"].metrics.items() if k not in drop})
    assert results["pool"].num_episodes == 2 * len(SEEDS)
