"""E local epochs (``train.epochs``, FedAgent's E) and the per-client validation plumbing.

* the reference trainer with E = 2 runs 2 x local_steps updates, each epoch on the same instances
  (seeds) in the same order, and its first epoch is exactly a run without epochs;
* the verl job asks verl for E epochs over the one epoch of rows it plans, and verl's own
  dataloader then serves the same seeds in every epoch; the checkpoint is read at step E x S;
* both keys are checked at start, naming the key; the summary reports E;
* the protocol carries E and the per-client validation seeds; the per-client merge gives the
  evaluator a loadable model with the client's trained weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.clientapp.job import TrainJob, TrainResult
from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.envs.spec import load_env_spec
from fedagent_flwr.protocol import CLIENT_VAL_PREFIX, EvalReply, TrainInstruction
from fedagent_flwr.seeding import train_env_seed
from fedagent_flwr.serverapp.app import run_plan, summary_header
from fedagent_flwr.trainers.reference import train as reference
from fedagent_flwr.trainers.verl.dataset import plan_rows, write_rows
from fedagent_flwr.trainers.verl.overrides import build_overrides, job_paths
from fedagent_flwr.trainers.verl.settings import VerlSettings
from testkit.verl_probe import compose_verl_config

SPEC = {"envs": [{"name": "TinyGuess", "n_envs": 2, "max_turns": 1, "config": {"lo": 1, "hi": 50}}]}
TRAINER = {"rollout_n": 2, "max_new_tokens": 4, "lr": 1e-2, "num_threads": 2}


@pytest.fixture
def torch_state() -> Iterator[None]:
    """The reference trainer runs in this process here: give back the global torch state it sets."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def _train_recorded(tmp: Path, model: Path, monkeypatch: pytest.MonkeyPatch, *, epochs: int,
                    local_steps: int) -> tuple[TrainResult, list[dict[str, Any]], int]:
    """Train with the real reference trainer; record what every rollout played and count updates."""
    plays: list[dict[str, Any]] = []
    updates = 0
    real_play, real_update = reference.play_episodes, reference.grpo_update

    def play(policy: Any, tokenizer: Any, tasks: Any, *args: Any, **kwargs: Any) -> Any:
        episodes = real_play(policy, tokenizer, tasks, *args, **kwargs)
        plays.append({"seeds": [t.seed for t in tasks],
                      "responses": [list(e.response_ids) for e in episodes]})
        return episodes

    def update(*args: Any, **kwargs: Any) -> Any:
        nonlocal updates
        updates += 1
        return real_update(*args, **kwargs)

    monkeypatch.setattr(reference, "play_episodes", play)
    monkeypatch.setattr(reference, "grpo_update", update)
    job = TrainJob(model_path=str(model), output_dir=str(tmp / f"e{epochs}"), env_spec=SPEC, round=1, client_id=0,
                   num_clients=1, data_seed=142, local_steps=local_steps, epochs=epochs,
                   partition={"strategy": "none"}, trainer=dict(TRAINER))
    return reference.train(job), plays, updates


def test_reference_trainer_replays_the_rounds_instances_each_epoch(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, torch_state: None) -> None:
    result, plays, updates = _train_recorded(tmp_path, tiny_model_dir, monkeypatch, epochs=2, local_steps=2)
    step_seeds = [[train_env_seed(142, 0, step, 2, i) for i in range(2) for _ in range(2)] for step in range(2)]
    assert [p["seeds"] for p in plays] == step_seeds + step_seeds  # epoch 2 replays epoch 1's instances
    assert updates == 4  # 2 epochs x 2 local steps, one optimiser update each
    assert result.num_episodes == 4 * 4
    assert Path(result.actor_dir) == (tmp_path / "e2" / "checkpoints" / "global_step_4" / "actor").resolve()
    # fresh rollouts of the replayed instances, from the updated weights and the step's own stream
    assert plays[2]["responses"] != plays[0]["responses"]

    once, plays_once, updates_once = _train_recorded(tmp_path, tiny_model_dir, monkeypatch, epochs=1, local_steps=2)
    assert updates_once == 2 and once.num_episodes == 8
    assert plays_once == plays[:2]  # epochs=1 is today's run, and E=2's first epoch is exactly it
    assert Path(once.actor_dir).parent.name == "global_step_2"


def test_verl_job_asks_for_epochs_and_verls_loader_replays_the_same_rows(tmp_path: Path, tiny_model_dir: Path) -> None:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.dataset.rl_dataset import collate_fn

    settings, _ = VerlSettings.from_mapping({"rollout_n": 2})
    paths = job_paths(tmp_path / "verl", str(tiny_model_dir), "", "/tmp/fa-ray-test")
    rows = plan_rows(load_env_spec(SPEC), data_seed=143, local_steps=2)
    assert len(rows) == 4  # one epoch of rows: E adds none
    write_rows(rows, Path(paths.rows_file))
    write_rows(rows[:2], Path(paths.val_rows_file))
    overrides = build_overrides(algorithm="grpo", settings=settings, paths=paths, batch_size=2, local_steps=2,
                                seed=143, experiment_name="round1_client0", epochs=3)
    cfg = compose_verl_config(overrides)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert (cfg.trainer.total_epochs, cfg.trainer.total_training_steps, cfg.trainer.save_freq) == (3, 6, 6)
    assert cfg.data.shuffle is False

    # verl's own dataloader for this config, iterated as RayPPOTrainer.fit does (epochs, then batches)
    trainer = SimpleNamespace(config=cfg, tokenizer=None, processor=None)
    RayPPOTrainer._create_dataloader(trainer, None, None, collate_fn, None)  # type: ignore[arg-type]
    assert trainer.total_training_steps == 6
    served = [[int(s) for s in batch["seed"]] for _ in range(cfg.trainer.total_epochs)
              for batch in trainer.train_dataloader]
    one_epoch = [[r["seed"] for r in rows[:2]], [r["seed"] for r in rows[2:]]]
    assert served == one_epoch * 3

    default = build_overrides(algorithm="grpo", settings=settings, paths=paths, batch_size=2, local_steps=2,
                              seed=143, experiment_name="e")
    assert "trainer.total_epochs=1" in default and "trainer.total_training_steps=2" in default
    with pytest.raises(ValueError, match="epochs"):
        build_overrides(algorithm="grpo", settings=settings, paths=paths, batch_size=2, local_steps=2, seed=1,
                        experiment_name="e", epochs=0)


def test_verl_result_is_read_from_the_last_epochs_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    from fedagent_flwr.trainers.verl.job import VerlJobFailed, collect_result, prepare_train

    job = TrainJob(model_path=str(tiny_model_dir), output_dir=str(tmp_path / "out"), env_spec=SPEC, round=1,
                   client_id=0, num_clients=1, data_seed=7, local_steps=2, epochs=3, partition={"strategy": "none"})
    prep = prepare_train(job)
    assert "trainer.total_epochs=3" in prep.overrides and "trainer.total_training_steps=6" in prep.overrides
    assert prep.rows == 4
    prep.episode_log.write_text(json.dumps({"env": "TinyGuess", "seed": 1, "reward": 1.0, "score": 1.0,
                                            "success": True, "num_turns": 1, "truncated": False,
                                            "invalid": 0}) + "\n")
    early = Path(prep.paths.checkpoint_dir) / "global_step_2" / "actor"
    early.mkdir(parents=True)
    (early / "model_world_size_1_rank_0.pt").write_bytes(b"x")
    with pytest.raises(VerlJobFailed, match="global_step_6"):  # step 2 ends epoch 1, not the round
        collect_result(job, prep, {}, None, 0.0, "verl.log")
    last = Path(prep.paths.checkpoint_dir) / "global_step_6" / "actor"
    last.mkdir(parents=True)
    (last / "model_world_size_1_rank_0.pt").write_bytes(b"x")
    assert collect_result(job, prep, {}, None, 0.0, "verl.log").actor_dir == str(last)


@pytest.mark.parametrize(("override", "message"), [
    ("train.epochs=0", "config key 'train.epochs' = 0 is invalid"),
    ("train.epochs=two", "config key 'train.epochs' must be int"),
    ("eval.per_client=yes", "config key 'eval.per_client' must be bool"),
    ("eval.per_client=true eval.num_episodes=0", "config key 'eval.per_client' = true"),
])
def test_bad_epochs_or_per_client_stop_the_run_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings("config", override)


def test_the_summary_and_the_plan_carry_epochs_and_per_client_seeds(tiny_model_dir: Path) -> None:
    default = load_settings("config", "")
    assert (default.run.train.epochs, default.run.eval.per_client) == (1, False)
    assert run_plan(default).client_eval_seeds == ()
    settings = load_settings("config", "train.epochs=3 train.local_steps=2 eval.per_client=true eval.num_episodes=3")
    plan = run_plan(settings)
    assert plan.epochs == 3 and plan.client_eval_seeds == (700000, 700001, 700002)  # eval.seed 7's episodes
    one_epoch = run_plan(load_settings("config", "train.local_steps=2")).train_episodes()
    assert plan.train_episodes() == 3 * one_epoch  # the most num-examples a client may report
    header = summary_header(settings, 1, CheckpointRef(path=str(tiny_model_dir)))
    assert (header["epochs_per_round"], header["local_steps"], header["client_eval"]) == (3, 2, True)
    assert load_settings("config", "experiment=paper_webshop_grpo").run.train.epochs == 3  # FedAgent's E


def test_train_instruction_carries_epochs_and_per_client_validation() -> None:
    base = dict(server_round=2, client_id=1, num_clients=2, data_seed=243, base_seed=42, algorithm="grpo",
                local_steps=2, trainer={}, env_spec=SPEC, partition={}, service={"enabled": False},
                global_model=CheckpointRef(path="/run/global"))
    sent = TrainInstruction(**base, epochs=3, client_eval_seeds=[5, 6], val_env_spec={"envs": []})  # type: ignore[arg-type]
    assert TrainInstruction.from_record(sent.to_record()) == sent
    plain = TrainInstruction(**base)  # type: ignore[arg-type]
    record = plain.to_record()
    assert "client-eval-seeds" not in record["config"] and "val-env-spec-json" not in record["config"]
    del record["config"]["epochs"]  # an older server's instruction: one epoch
    assert TrainInstruction.from_record(record).epochs == 1
    reply = EvalReply(num_examples=4, success_rate=0.25, reward_mean=0.5, score_mean=None)
    metrics = reply.metrics(CLIENT_VAL_PREFIX)
    assert metrics == {"client-val-num-examples": 4, "client-val-success-rate": 0.25, "client-val-reward-mean": 0.5}
    assert EvalReply.from_metrics({"num-examples": 9, **metrics}, CLIENT_VAL_PREFIX) == reply


def test_per_client_merge_gives_the_evaluator_the_clients_trained_weights(
        tmp_path: Path, tiny_model_dir: Path, torch_state: None) -> None:
    from safetensors.torch import load_file

    from fedagent_flwr.clientapp.client_val import trained_model_dir
    from fedagent_flwr.trainers.common.evaluator import load_model
    from fedagent_flwr.trainers.reference.checkpoint import ACTOR_SHARD, write_fsdp_checkpoint

    model, tokenizer = load_model(tiny_model_dir, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # "trained": differs from the start everywhere
    actor = write_fsdp_checkpoint(model, tokenizer, tmp_path / "client" / "global_step_1")
    result = TrainResult(actor_dir=str(actor), actor_format="fsdp-shards", num_episodes=1, metrics={})
    merged = trained_model_dir(result, tiny_model_dir, tmp_path / "client_val" / "model")
    trained = torch.load(actor / ACTOR_SHARD, weights_only=True)
    written = load_file(str(merged / "model.safetensors"))
    assert written and all(torch.equal(written[k], trained[k]) for k in written)
    loaded, _ = load_model(merged, 2)  # what the evaluator does with it
    assert torch.equal(loaded.state_dict()["model.norm.weight"], trained["model.norm.weight"])
    assert json.loads((merged / "config.json").read_text())["architectures"]


def test_a_live_verl_session_refuses_a_job_with_other_epochs(tiny_model_dir: Path, tmp_path: Path) -> None:
    """verl fixes total_epochs when a persistent session starts: a job asking for another E is refused."""
    from fedagent_flwr.trainers.verl import job as verl_job
    from fedagent_flwr.trainers.verl.persistent import fixed_differences, session_fingerprint

    def fingerprint(epochs: int) -> dict[str, Any]:
        job = TrainJob(model_path=str(tiny_model_dir), output_dir=str(tmp_path / f"e{epochs}"), env_spec=SPEC,
                       round=1, client_id=0, num_clients=1, data_seed=7, epochs=epochs,
                       partition={"strategy": "none"})
        settings, spec, _, rule = verl_job.check_train_job(job)
        return session_fingerprint(job, settings, rule, sum(e.n_envs for e in spec.envs))

    assert fixed_differences(fingerprint(2), fingerprint(2)) == []
    assert fixed_differences(fingerprint(2), fingerprint(3)) == ["epochs: session 2, job 3"]
