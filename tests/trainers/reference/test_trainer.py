"""The CPU reference GRPO trainer, run as a real subprocess on the tiny model."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from fedagent_flwr.checkpoint import CheckpointRef, open_checkpoint
from fedagent_flwr.clientapp.job import EvalJob, EvalResult, TrainJob, TrainResult, load, save
from fedagent_flwr.seeding import train_env_seed
from fedagent_flwr.trainers.reference.grpo import grpo_advantages
from testkit.reference_trainer import SPEC, TRAINER, run_trainer, train_job


def trained(tmp: Path, model: Path, name: str, **overrides: Any) -> tuple[TrainResult, dict[str, torch.Tensor], str]:
    proc = run_trainer("train", train_job(tmp, model, name, **overrides))
    assert proc.returncode == 0, proc.stderr
    result = load(TrainResult, tmp / name / "train_result.json")
    state = torch.load(Path(result.actor_dir) / "model_world_size_1_rank_0.pt", weights_only=True)
    return result, state, proc.stdout


def start_weights(model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model / "model.safetensors"))


def l2_from(state: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    return float(sum(((state[k] - start[k]) ** 2).sum() for k in start) ** 0.5)


@pytest.fixture(scope="module")
def baseline(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> tuple[Path, TrainResult, dict[str, torch.Tensor], str]:
    """One training run (client 1, mu = 0) shared by the layout, determinism and FedProx tests."""
    tmp = tmp_path_factory.mktemp("trainer")
    return (tmp, *trained(tmp, tiny_model_dir, "a"))


def test_checkpoint_layout_and_result(baseline: tuple, tiny_model_dir: Path) -> None:
    tmp, result, state, stdout = baseline
    actor = tmp / "a" / "checkpoints" / "global_step_1" / "actor"
    assert Path(result.actor_dir) == actor.resolve()
    assert (result.actor_format, result.world_size, result.num_episodes) == ("fsdp-shards", 1, 4)
    assert json.loads((actor / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 1}
    hf = actor / "huggingface"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (hf / name).is_file(), name
    assert not any(p.name.startswith(".") for p in (tmp / "a" / "checkpoints").iterdir())  # no temp left

    start = start_weights(tiny_model_dir)
    assert set(start) <= set(state)  # HF key names (plus the tied lm_head.weight)
    assert all(v.dtype == torch.float32 for v in state.values())
    assert l2_from(state, start) > 1e-3  # training moved the weights

    metrics = result.metrics
    for key in ("reward_mean", "success_rate", "num_turns_mean", "truncated_rate", "loss", "kl",
                "train_seconds", "proximal_mu"):
        assert key in metrics, key
    assert 0.0 <= metrics["success_rate"] <= 1.0 and metrics["proximal_mu"] == 0.0
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 1 and "episodes 4" in lines[0] and "reward_mean" in lines[0]

    # The server-side reader accepts it as a world-size-1 FSDP checkpoint.
    ref = CheckpointRef.for_directory(actor)
    assert (ref.format, ref.world_size) == ("fsdp-shards", 1)
    with open_checkpoint(ref, root=tmp) as reader:
        assert set(reader.keys()) == set(state)
        assert torch.equal(reader.read("model.embed_tokens.weight"), state["model.embed_tokens.weight"])


def test_same_job_gives_bit_identical_weights(baseline: tuple, tiny_model_dir: Path) -> None:
    tmp, result, state, _ = baseline
    again, state2, _ = trained(tmp, tiny_model_dir, "a_again")
    assert state.keys() == state2.keys()
    assert all(torch.equal(state[k], state2[k]) for k in state)
    timing_free = {k: v for k, v in result.metrics.items() if "seconds" not in k}
    assert timing_free == {k: v for k, v in again.metrics.items() if "seconds" not in k}


def test_float32_mode_is_bit_identical_too(tmp_path: Path, tiny_model_dir: Path) -> None:
    fp32 = {**TRAINER, "compute_dtype": "float32"}
    _, first, _ = trained(tmp_path, tiny_model_dir, "f1", trainer=fp32)
    _, second, _ = trained(tmp_path, tiny_model_dir, "f2", trainer=fp32)
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_clients_train_differently(baseline: tuple, tiny_model_dir: Path) -> None:
    tmp, _, state, _ = baseline
    _, other, _ = trained(tmp, tiny_model_dir, "client0", client_id=0, data_seed=42 + 100)
    assert not all(torch.equal(state[k], other[k]) for k in state)


def test_fedprox_stays_closer_to_the_start(baseline: tuple, tiny_model_dir: Path) -> None:
    tmp, _, state, _ = baseline
    prox_result, prox_state, _ = trained(tmp, tiny_model_dir, "prox", proximal_mu=100.0)
    start = start_weights(tiny_model_dir)
    assert prox_result.metrics["proximal_mu"] == 100.0
    assert l2_from(prox_state, start) < 0.5 * l2_from(state, start)


def test_kl_micro_batches_several_envs_and_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    spec = {"envs": [SPEC["envs"][0], {"name": "tinyguess", "n_envs": 1, "max_turns": 1, "config": {"hi": 9}}]}
    knobs = {**TRAINER, "kl_coef": 0.5, "micro_batch_size": 4}
    result, _, stdout = trained(tmp_path, tiny_model_dir, "kl", env_spec=spec, local_steps=2, trainer=knobs)
    assert result.num_episodes == 2 * (2 + 1) * 2
    assert Path(result.actor_dir).parent.name == "global_step_2"
    assert result.metrics["kl"] > 0.0  # the second PPO epoch has moved away from the reference
    assert [line.split()[1] for line in stdout.splitlines() if line.startswith("step ")] == ["1/2", "2/2"]


def _evaluate(tmp_path: Path, model_dir: Path, spec: dict, server_round: int) -> EvalResult:
    """The trainer's ``evaluate`` command run on seeds 0-2 of ``spec``; its result."""
    job = EvalJob(model_path=str(model_dir), output_dir=str(tmp_path / "eval"), env_spec=spec,
                  round=server_round, seeds=[0, 1, 2], trainer={"max_new_tokens": 8})
    save(job, tmp_path / "eval.json")
    proc = run_trainer("evaluate", tmp_path / "eval.json")
    assert proc.returncode == 0, proc.stderr
    return load(EvalResult, tmp_path / "eval" / "eval_result.json")


def test_evaluate_mode(tmp_path: Path, tiny_model_dir: Path) -> None:
    result = _evaluate(tmp_path, tiny_model_dir, SPEC, server_round=3)
    assert result.num_episodes == 3
    assert 0.0 <= result.success_rate <= 1.0 and result.reward_mean == pytest.approx(result.success_rate)
    assert result.metrics["success_rate/TinyGuess"] == result.success_rate
    assert result.metrics["num_turns_mean"] > 0


def test_entries_of_one_env_keep_their_own_success_rate(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two entries of the same env (here two TinyGuess ranges) each keep their per-env success rate,
    keyed with the entry's index; one used to overwrite the other under ``success_rate/TinyGuess``.
    A name that appears once keeps its plain key (``test_evaluate_mode``)."""
    spec = {"envs": [{"name": "TinyGuess", "n_envs": 1, "max_turns": 2, "config": {"lo": 1, "hi": 50}},
                     {"name": "TinyGuess", "n_envs": 1, "max_turns": 2, "config": {"lo": 1, "hi": 3}}]}
    result = _evaluate(tmp_path, tiny_model_dir, spec, server_round=1)
    assert result.num_episodes == 6
    per_env = {k: v for k, v in result.metrics.items() if k.startswith("success_rate/")}
    assert sorted(per_env) == ["success_rate/TinyGuess[0]", "success_rate/TinyGuess[1]"], per_env
    # three episodes each: the run's rate is the mean of the two entries'
    assert (per_env["success_rate/TinyGuess[0]"] + per_env["success_rate/TinyGuess[1]"]) / 2 == pytest.approx(
        result.success_rate)


def test_entries_played_through_env_services_are_named_by_the_served_env(tmp_path: Path,
                                                                         tiny_model_dir: Path) -> None:
    """With env services on, the client's spec names every entry ``Service`` (the served env is in
    its ``config["env"]``): the per-env keys name the served env, ``success_rate/TinyGuess``, with
    the entry's index only where two entries serve the same env (as without services)."""
    from fedagent_flwr.clientapp.services import serve_env_spec, stop_client_services

    entry = {"name": "TinyGuess", "n_envs": 1, "max_turns": 2, "config": {"lo": 1, "hi": 50}}
    # A slot per episode of an entry: episodes play in lockstep (docs/extending.md, pool_size).
    settings = {"pool_size": 2, "host": "127.0.0.1", "startup_timeout_s": 60.0}
    expected = {1: ["success_rate/TinyGuess"], 2: ["success_rate/TinyGuess[0]", "success_rate/TinyGuess[1]"]}
    try:
        for count, keys in expected.items():
            envs = [entry, {**entry, "config": {"lo": 1, "hi": 3}}][:count]
            served, _ = serve_env_spec({"envs": envs}, split=f"val{count}", run_root=tmp_path, client_id=0,
                                       settings=settings)
            assert [e["name"] for e in served["envs"]] == ["Service"] * count
            job = EvalJob(model_path=str(tiny_model_dir), output_dir=str(tmp_path / f"eval{count}"), env_spec=served,
                          round=1, seeds=[0, 1], trainer={"max_new_tokens": 8})
            save(job, tmp_path / f"eval{count}.json")
            proc = run_trainer("evaluate", tmp_path / f"eval{count}.json")
            assert proc.returncode == 0, proc.stderr
            result = load(EvalResult, tmp_path / f"eval{count}" / "eval_result.json")
            assert result.num_episodes == 2 * count
            assert sorted(k for k in result.metrics if k.startswith("success_rate/")) == keys, result.metrics
    finally:
        stop_client_services(tmp_path, 0)


def _bad(tmp: Path, name: str, content: str | dict) -> Path:
    path = tmp / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.mark.parametrize(
    ("mode", "make", "needle"),
    [
        ("train", lambda tmp, model: tmp / "missing.json", "missing.json"),
        ("train", lambda tmp, model: _bad(tmp, "broken.json", "{not json"), "not valid JSON"),
        ("train", lambda tmp, model: _bad(tmp, "unknown_env.json", asdict(TrainJob(
            str(model), str(tmp / "o"), {"envs": [{"name": "NoSuchEnv", "n_envs": 1}]}, 0, 0, 1, 42))),
         "'NoSuchEnv'"),
        ("train", lambda tmp, model: _bad(tmp, "bad_strategy.json", asdict(TrainJob(
            str(model), str(tmp / "o"), SPEC, 0, 0, 1, 42, partition={"strategy": "zipf"}))), "'zipf'"),
        ("train", lambda tmp, model: _bad(tmp, "no_model.json", asdict(TrainJob(
            str(tmp / "no-such-model"), str(tmp / "o"), SPEC, 0, 0, 1, 42))), "no-such-model"),
        ("train", lambda tmp, model: _bad(tmp, "bad_knob.json", asdict(TrainJob(
            str(model), str(tmp / "o"), SPEC, 0, 0, 1, 42, trainer={"rollout_n": "two"}))), "trainer.rollout_n"),
        ("train", lambda tmp, model: _bad(tmp, "bad_type.json", {**asdict(TrainJob(
            str(model), str(tmp / "o"), SPEC, 0, 0, 1, 42)), "local_steps": "3"}), "'local_steps'"),
        ("train", lambda tmp, model: _bad(tmp, "bad_dtype.json", asdict(TrainJob(
            str(model), str(tmp / "o"), SPEC, 0, 0, 1, 42, trainer={"compute_dtype": "fp8"}))),
         "trainer.compute_dtype"),
        ("train", lambda tmp, model: _bad(tmp, "not_a_model.json", asdict(TrainJob(
            str(tmp), str(tmp / "o"), SPEC, 0, 0, 1, 42))), "cannot load the model"),
        ("evaluate", lambda tmp, model: _bad(tmp, "eval_extra.json", {"model_path": str(model)}), "eval_extra.json"),
        ("fly", lambda tmp, model: tmp / "x.json", "expected 'train JOB.json'"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    tmp_path: Path, tiny_model_dir: Path, mode: str, make: Any, needle: str
) -> None:
    proc = run_trainer(mode, make(tmp_path, tiny_model_dir))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert needle in lines[0] and lines[0].startswith("reference_trainer: error:")


def test_grpo_groups_of_different_entries_never_share_an_id() -> None:
    """An entry whose rows of a step run past its block of 1000 seeds (``n_envs`` x ``local_steps`` >
    1000) plays seeds of the next entry's block: at step 1, entry 0 (600 instances) plays offsets
    600-1199, entry 1 (100 instances) 1000 + 100-199. The env seed was the group id, so the 100
    instances of entry 1 shared GRPO groups with 100 of entry 0 and were scored against them. Each
    instance now has its own group; where no seed repeats, the id is still the seed."""
    from fedagent_flwr.envs.spec import load_env_spec
    from fedagent_flwr.trainers.reference.train import step_tasks

    spec = load_env_spec({"envs": [{"name": "TinyGuess", "n_envs": 600, "config": {"lo": 1, "hi": 50}},
                                   {"name": "TinyGuess", "n_envs": 100, "config": {"lo": 1, "hi": 5}}]})
    for step in range(3):
        tasks = step_tasks(spec, 142, step, rollout_n=2)
        instances: dict[int, set[tuple[int, int]]] = {}  # group id -> the (entry, seed) instances in it
        for index, task in enumerate(tasks):
            instances.setdefault(task.group, set()).add((int(index >= 2 * 600), task.seed))
        assert len(tasks) == 2 * 700 and len(instances) == 700, (step, len(instances))
        assert all(len(members) == 1 for members in instances.values()), step  # one instance per group
        if step == 0:  # no seed repeats: the ids are the env seeds, as before
            assert [t.group for t in tasks] == [t.seed for t in tasks]
    one_entry = load_env_spec({"envs": [{"name": "TinyGuess", "n_envs": 2, "config": {}}]})
    assert [t.group for t in step_tasks(one_entry, 143, 1, 2)] == [train_env_seed(143, 0, 1, 2, i)
                                                                   for i in range(2) for _ in range(2)]


def test_seed_rule_and_advantages() -> None:
    assert train_env_seed(143, 0, 0, 2, 1) == 14_300_001
    assert train_env_seed(143, 1, 2, 4, 3) == 14_300_000 + 1000 + 8 + 3
    assert grpo_advantages([1.0, 0.0, 0.5, 0.5, 2.0], [7, 7, 8, 8, 9]) == pytest.approx(
        [1 / (2**0.5 / 2 + 1e-6) * 0.5, -1 / (2**0.5 / 2 + 1e-6) * 0.5, 0.0, 0.0, 0.0]
    )


@pytest.mark.parametrize("mode", ["train", "evaluate"])
def test_a_budget_no_turn_fits_in_is_refused_naming_the_key(tmp_path: Path, tiny_model_dir: Path, mode: str) -> None:
    """trainer.max_model_len passes its bound (>= 16) but no first prompt fits in it: the job is
    refused with the keys to change, not reported as episodes played that all scored 0."""
    small = {**TRAINER, "max_model_len": 64}
    if mode == "train":
        job = train_job(tmp_path, tiny_model_dir, "small", trainer=small)
    else:
        job = tmp_path / "small.json"
        save(EvalJob(model_path=str(tiny_model_dir), output_dir=str(tmp_path / "small"), env_spec=SPEC, round=1,
                     seeds=[0, 1], trainer=small), job)
    proc = run_trainer(mode, job)
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert not (tmp_path / "small" / f"{mode}_result.json").exists()
    error = [line for line in proc.stderr.splitlines() if line.startswith("reference_trainer: error:")]
    assert len(error) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "no episode could play a single turn" in error[0]
    assert "trainer.max_model_len (64)" in error[0] and "trainer.max_new_tokens (8)" in error[0]
