"""Validation sampling is the same with env services on and off.

With services on, the client's spec names every entry ``Service`` (the served env in its
``config["env"]``); each episode's sampling generator used to be seeded with that ``Service``, so
one model and config sampled other tokens, and scored otherwise, with services on than off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.clientapp.job import EvalJob
from fedagent_flwr.envs.spec import load_env_spec
from fedagent_flwr.rollout.episode import Episode
from fedagent_flwr.trainers.common import evaluator
from fedagent_flwr.trainers.common.evaluator import EvalSettings, episode_seeds
from fedagent_flwr.trainers.common.sampler import EpisodeTask

ENTRIES = [{"name": "TinyGuess", "n_envs": 1, "max_turns": 2, "config": {"lo": 1, "hi": 50}},
           {"name": "TinyGuess", "n_envs": 1, "max_turns": 2, "config": {"lo": 1, "hi": 3}}]
SEEDS = [0, 1]


def tasks_of(spec: dict[str, Any]) -> list[EpisodeTask]:
    """The evaluator's episode tasks for ``spec`` (as :func:`evaluator.evaluate_loaded` builds them)."""
    return [EpisodeTask(e.name, e.env_config(), s, e.max_turns, k)
            for e in load_env_spec(spec).envs for k, s in enumerate(SEEDS)]


@pytest.fixture
def served(tmp_path: Path) -> Any:
    """The same entries, served by real env services of client 0 (as the ClientApp rewrites them)."""
    from fedagent_flwr.clientapp.services import serve_env_spec, stop_client_services

    # A slot per episode of an entry: episodes play in lockstep (docs/extending.md, pool_size).
    settings = {"pool_size": len(SEEDS), "host": "127.0.0.1", "startup_timeout_s": 60.0}
    try:
        spec, _ = serve_env_spec({"envs": ENTRIES}, split="val", run_root=tmp_path, client_id=0, settings=settings)
        yield spec
    finally:
        stop_client_services(tmp_path, 0)


def test_episode_seeds_are_the_same_with_services_on_and_off(served: dict[str, Any]) -> None:
    assert [e["name"] for e in served["envs"]] == ["Service", "Service"]
    plain = episode_seeds(3, tasks_of({"envs": ENTRIES}), len(SEEDS))
    assert episode_seeds(3, tasks_of(served), len(SEEDS)) == plain
    assert len(set(plain)) == len(plain)  # every episode its own generator
    # an entry naming its env by the dotted path plays the same env: the same seeds
    dotted = [{**e, "name": "fedagent_flwr.envs.tiny_guess.TinyGuess"} for e in ENTRIES]
    assert episode_seeds(3, tasks_of({"envs": dotted}), len(SEEDS)) == plain


def test_validation_samples_are_the_same_with_services_on_and_off(
    served: dict[str, Any], tmp_path: Path, tiny_model_dir: Path, played_batches: list[list[Episode]]
) -> None:
    """The tiny model's sampled tokens, replies and scores of every validation episode are equal."""
    played = played_batches
    settings = EvalSettings(max_new_tokens=8, num_threads=1, device="cpu", val_temperature=1.0)
    results = []
    for name, spec in [("off", {"envs": ENTRIES}), ("on", served)]:
        job = EvalJob(model_path=str(tiny_model_dir), output_dir=str(tmp_path / name), env_spec=spec, round=1,
                      seeds=SEEDS)
        results.append(evaluator.evaluate(job, settings))
    off, on = played
    assert [e.response_ids for e in on] == [e.response_ids for e in off]
    assert [e.messages for e in on] == [e.messages for e in off]
    assert [(e.reward, e.success, e.num_turns) for e in on] == [(e.reward, e.success, e.num_turns) for e in off]
    drop = {"eval_seconds"}
    assert ({k: v for k, v in results[1].metrics.items() if k not in drop}
            == {k: v for k, v in results[0].metrics.items() if k not in drop})
