"""The persistent verl trainer (``verl_backend.persistent``) on a CPU machine.

* every verl 0.9.1 internal the session relies on is where the session expects it (a verl upgrade
  that moves one fails here, not on the GPU machine);
* the per-round logic: what changes between two jobs of one session (paths, seed, rows, the
  episode log each row names, reload or not) and what a live session refuses to change;
* the worker side without a GPU: a reload rebuilds the engine from the new path and forgets the
  FedProx anchor, which the next optimiser step captures again;
* a first train job goes through config composition, the private Ray cluster and verl's
  TaskRunner up to verl's GPU check, fails as one clear ``VerlJobFailed``, and ``close()`` leaves
  no Ray process behind; the phases it went through are in ``phases.jsonl``, from both processes.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from fedagent_flwr.clientapp.job import TrainJob, save
from fedagent_flwr.clientapp.trainer_server import CHANNEL_ENV, SETTINGS_FIXED, SessionSettingsFixed, serve
from fedagent_flwr.trainers.common.client_rule import job_rule_specs
from fedagent_flwr.trainers.verl import engine_hooks, entry, user_hooks
from fedagent_flwr.trainers.verl import job as verl_job
from fedagent_flwr.trainers.verl.agent_loop import episode_log_path
from fedagent_flwr.trainers.verl.dataset import EnvEpisodeDataset, read_rows
from fedagent_flwr.trainers.verl.job import InputError
from fedagent_flwr.trainers.verl.persistent import (
    VerlSession,
    fixed_differences,
    root_cause,
    round_plan,
    session_fingerprint,
)
from fedagent_flwr.trainers.verl.phases import read_phases
from fedagent_flwr.trainers.verl.runner import ray_temp_dir
from fedagent_flwr.trainers.verl.verl_log import numeric_metrics

REPO = Path(__file__).resolve().parents[3]
SPEC = {"envs": [{"name": "TinyGuess", "n_envs": 3, "max_turns": 3, "config": {"lo": 1, "hi": 10}}]}


def _job(model: Path, out: Path, round_: int, **change: Any) -> TrainJob:
    fields: dict[str, Any] = dict(model_path=str(model), output_dir=str(out), env_spec=SPEC, round=round_,
                                  client_id=0, num_clients=2, data_seed=42 + 100 * round_, local_steps=2,
                                  partition={"strategy": "none"},
                                  trainer={"rollout_n": 2, "max_prompt_length": 256, "max_response_length": 128,
                                           "ray_num_cpus": 4})
    fields.update(change)
    return TrainJob(**fields)


def test_verl_internals_the_session_relies_on_exist() -> None:
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch
    from verl.single_controller.ray.base import _bind_workers_method_to_parent
    from verl.trainer.main_ppo_v0 import BaseTaskRunner, TaskRunner
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
    from verl.utils import tracking
    from verl.workers.config import HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    from fedagent_flwr.trainers.verl import persistent_runner, persistent_workers

    def source(obj: Any) -> str:
        return inspect.getsource(obj)

    for name in ("add_actor_rollout_worker", "add_critic_worker", "add_reward_model_resource_pool",
                 "add_teacher_model_resource_pool", "add_ref_policy_worker", "init_resource_pool_mgr"):
        assert callable(getattr(BaseTaskRunner, name)), name
    # start() follows the stock TaskRunner.run up to init_workers: the same steps, in that order.
    stock = source(TaskRunner.__ray_actor_class__.run)
    steps = ["add_actor_rollout_worker", "add_critic_worker", "add_reward_model_resource_pool",
             "add_teacher_model_resource_pool", "add_ref_policy_worker", "validate_config",
             "init_resource_pool_mgr", "create_rl_dataset", "create_rl_sampler", "RayPPOTrainer(",
             "trainer.init_workers()", "trainer.fit()"]
    assert [stock.index(s) for s in steps] == sorted(stock.index(s) for s in steps)
    assert {Role.ActorRollout, Role.ActorRolloutRef, Role.Critic}

    assert list(inspect.signature(RayPPOTrainer._create_dataloader).parameters) == [
        "self", "train_dataset", "val_dataset", "collate_fn", "train_sampler"]
    init_workers = source(RayPPOTrainer.init_workers)
    for attr in ("self.critic_wg =", "self.actor_rollout_wg =", "self.checkpoint_manager = CheckpointEngineManager(",
                 "self.checkpoint_manager.sleep_replicas()"):
        assert attr in init_workers, attr
    init = source(RayPPOTrainer.__init__)
    assert "self.use_critic =" in init and "self.use_reference_policy =" in init
    assert "self.train_dataloader =" in source(RayPPOTrainer._create_dataloader)
    assert "self.val_dataset" in source(RayPPOTrainer._create_dataloader)
    fit = source(RayPPOTrainer.fit)
    # fit() restarts at step 0, loads no checkpoint with resume_mode=disable, pushes the actor's
    # weights into vLLM before step 1, and builds its Tracking at call time (recording_tracking).
    for needle in ("self.global_steps = 0", "self._load_checkpoint()",
                   "self.checkpoint_manager.update_weights(self.global_steps)",
                   "from verl.utils.tracking import Tracking", "logger.log(data=metrics, step=self.global_steps)",
                   "self._init_dump_executor()", "self.config.trainer.default_local_dir"):
        assert needle in fit or needle in source(RayPPOTrainer._save_checkpoint), needle
    assert 'resume_mode == "disable"' in source(RayPPOTrainer._load_checkpoint)
    assert list(inspect.signature(tracking.Tracking.log).parameters) == ["self", "data", "step", "backend"]
    assert callable(CheckpointEngineManager.sleep_replicas) and callable(CheckpointEngineManager.update_weights)

    # Worker side: reset() = engine.initialize(), which builds from model_config.local_path.
    assert getattr(TrainingWorker.reset, MAGIC_ATTR)["dispatch_mode"] == Dispatch.ONE_TO_ALL
    assert "self.engine.initialize()" in source(TrainingWorker.reset)
    assert "self.actor.reset()" in source(ActorRolloutRefWorker.init_model)
    assert "self.ref.reset()" in source(ActorRolloutRefWorker.init_model)
    assert "self.actor: TrainingWorker | None = None" in source(ActorRolloutRefWorker.__init__)
    assert "self.ref: TrainingWorker | None = None" in source(ActorRolloutRefWorker.__init__)
    assert "self._build_model_optimizer()" in source(FSDPEngine.initialize)
    assert "self.checkpoint_manager = FSDPCheckpointManager(" in source(FSDPEngine.initialize)
    assert "pretrained_model_name_or_path=self.model_config.local_path" in source(FSDPEngine._build_module)
    built = source(FSDPEngine._build_model_optimizer)
    for attr in ("self.module = module", "self.optimizer = optimizer", "self.lr_scheduler = lr_scheduler"):
        assert attr in built, attr
    assert "local_path" in HFModelConfig.__dataclass_fields__

    # Our subclasses' method is bound by verl's worker groups like init_model.
    for cls in (persistent_workers.ReloadableActorRolloutRefWorker, persistent_workers.ReloadableTrainingWorker):
        assert getattr(cls.fedagent_reload, MAGIC_ATTR)["dispatch_mode"] == Dispatch.ONE_TO_ALL
        holder = type("WorkerDict", (), {})
        _bind_workers_method_to_parent(holder, "actor_rollout_ref", cls)
        assert hasattr(holder, "actor_rollout_ref_fedagent_reload") and hasattr(
            holder,
            "actor_rollout_ref_reset" if cls is persistent_workers.ReloadableTrainingWorker
            else "actor_rollout_ref_init_model")
    assert issubclass(persistent_runner.PersistentTaskRunner, BaseTaskRunner)
    from verl.single_controller.base.worker_group import WorkerGroup

    assert "return len(self._workers)" in source(WorkerGroup.world_size.fget)  # what a reload is checked against


def test_a_reload_must_be_answered_by_every_rank_of_the_worker_group() -> None:
    from fedagent_flwr.trainers.verl.persistent_runner import _check_reload

    def answer(rank: int, path: str = "/g") -> dict[str, Any]:
        return {"rank": rank, "actor": {"path": path}}

    _check_reload([answer(0), answer(1)], "actor", "/g", 2)
    with pytest.raises(RuntimeError, match=r"answered by ranks \[0\], expected ranks 0 to 1"):
        _check_reload([answer(0)], "actor", "/g", 2)  # a rank left on the previous round's weights
    with pytest.raises(RuntimeError, match=r"answered by ranks \[0, 0\]"):
        _check_reload([answer(0), answer(0)], "actor", "/g", 2)
    with pytest.raises(RuntimeError, match="rank 1 did not reload the actor from /g"):
        _check_reload([answer(0), answer(1, "/old")], "actor", "/g", 2)


def test_two_jobs_of_one_session_differ_in_paths_seed_rows_and_episode_log(tiny_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    shared = tmp_path / "session"
    shared.mkdir()
    first = _job(tiny_model_dir, tmp_path / "r1", 1)
    second = _job(tiny_model_dir, tmp_path / "r2", 2, algorithm="ppo", critic_path=str(tiny_model_dir))
    second_grpo = _job(tiny_model_dir, tmp_path / "r2", 2)
    p1 = verl_job.prepare_train(first, shared_dir=shared)
    p2 = verl_job.prepare_train(second_grpo, shared_dir=shared)
    # Fixed for the session: agent-loop YAML, markers, Ray temp dir (and they are not the job's).
    assert p1.paths.agent_loop_file == p2.paths.agent_loop_file == str(shared / "agent_loops.yaml")
    assert p1.marker_dir == p2.marker_dir == shared / "client_rule_markers"
    assert p1.paths.ray_temp_dir == p2.paths.ray_temp_dir == ray_temp_dir(str(shared))
    assert yaml.safe_load(Path(p1.paths.agent_loop_file).read_text())[0]["episode_log"] == ""
    # Per round: rows, checkpoints, episode log, seed.
    assert p1.paths.rows_file != p2.paths.rows_file and p1.paths.checkpoint_dir != p2.paths.checkpoint_dir
    rows1, rows2 = read_rows(p1.paths.rows_file), read_rows(p2.paths.rows_file)
    assert {r["episode_log"] for r in rows1} == {str(tmp_path / "r1" / "verl" / "episodes.jsonl")}
    assert {r["episode_log"] for r in rows2} == {str(tmp_path / "r2" / "verl" / "episodes.jsonl")}
    assert [r["seed"] for r in rows1] != [r["seed"] for r in rows2]
    assert EnvEpisodeDataset(data_files=p2.paths.rows_file)[0]["episode_log"] == rows2[0]["episode_log"]
    plan1, plan2 = round_plan(first, p1, reload=False), round_plan(second_grpo, p2, reload=True)
    assert (plan1["seed"], plan2["seed"]) == (142, 242) and (plan1["reload"], plan2["reload"]) == (False, True)
    assert plan2["checkpoint_dir"] == str((tmp_path / "r2" / "checkpoints").resolve())
    assert plan2["experiment_name"] == "round2_client0" and plan2["local_steps"] == 2
    assert plan1["critic_path"] == ""  # GRPO: no critic
    # PPO: the critic starts from the aggregated critic, or from the model in round 1.
    ppo1 = verl_job.prepare_train(_job(tiny_model_dir, tmp_path / "p1", 1, algorithm="ppo"), shared_dir=shared)
    assert round_plan(_job(tiny_model_dir, tmp_path / "p1", 1, algorithm="ppo"), ppo1,
                      reload=False)["critic_path"] == str(ppo1.model_path)
    ppo2 = verl_job.prepare_train(second, shared_dir=shared)
    assert round_plan(second, ppo2, reload=True)["critic_path"] == str(tiny_model_dir)
    # The subprocess path keeps its own layout, and the YAML still names its log.
    alone = verl_job.prepare_train(_job(tiny_model_dir, tmp_path / "solo", 1))
    assert alone.paths.agent_loop_file == str((tmp_path / "solo" / "verl" / "agent_loops.yaml").resolve())
    assert yaml.safe_load(Path(alone.paths.agent_loop_file).read_text())[0]["episode_log"] == str(alone.episode_log)


def test_a_live_session_refuses_jobs_that_change_what_it_fixed(tiny_model_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def fingerprint(job: TrainJob) -> dict[str, Any]:
        settings, spec, _, rule = verl_job.check_train_job(job)
        return session_fingerprint(job, settings, rule, sum(e.n_envs for e in spec.envs))

    base = _job(tiny_model_dir, tmp_path / "a", 1)
    same = _job(tiny_model_dir, tmp_path / "b", 2, data_seed=7, client_id=1, model_path=str(tmp_path))
    assert fixed_differences(fingerprint(base), fingerprint(same)) == []
    # The ClientApp's own keys are no session settings (app.py does not even send them): a live server adopts them.
    clientapp_keys = {"timeout_s": 60.0, "persistent_idle_s": 5.0, "stall_timeout_s": 0.0, "mode": "persistent"}
    kept = _job(tiny_model_dir, tmp_path / "e", 2, trainer={**base.trainer, **clientapp_keys})
    assert fixed_differences(fingerprint(base), fingerprint(kept)) == []
    two_envs = {"envs": [{**SPEC["envs"][0], "n_envs": 4}]}
    cases = {
        "algorithm": {"algorithm": "ppo"},
        "local_steps": {"local_steps": 3},
        "proximal_mu": {"proximal_mu": 0.1},
        "trainer.lr": {"trainer": {**base.trainer, "lr": 2e-6}},
        "trainer.n_gpus_per_node": {"trainer": {**base.trainer, "n_gpus_per_node": 2}},
        "env instances per step": {"env_spec": two_envs},
        "trainer.client_rule": {"trainer": {**base.trainer, "client_rule": "examples.client_rule.ProximalFreeze",
                                             "client_rule_args": {"mu": 0.1, "freeze": "embed_tokens"}}},
    }
    for key, change in cases.items():
        changed = fingerprint(_job(tiny_model_dir, tmp_path / "c", 2, **change))
        differences = fixed_differences(fingerprint(base), changed)
        assert any(d.startswith(key) for d in differences), (key, differences)

    session = VerlSession(work_dir=str(tmp_path / "session"))
    session.fixed = fingerprint(base)  # as after a first job; no Ray is started below
    job = _job(tiny_model_dir, tmp_path / "d", 2, trainer={**base.trainer, "lr": 3e-6})
    with pytest.raises(InputError, match=r"trainer.lr: session 1e-06, job 3e-06") as refused:
        session.train(job)
    # typed for the trainer server, which answers it with its own kind (the ClientApp replaces the trainer)
    assert isinstance(refused.value, SessionSettingsFixed) and refused.value.settings == ["trainer.lr"]
    assert not (tmp_path / "d" / "verl").exists()  # refused before anything was written
    channel = tmp_path / "channel"
    save(job, tmp_path / "d.json")
    (channel / "inbox").mkdir(parents=True)
    (channel / "inbox" / "1.json").write_text(json.dumps({"seq": 1, "mode": "train", "job": str(tmp_path / "d.json")}))
    (channel / "inbox" / "2.json").write_text(json.dumps({"seq": 2, "mode": "stop"}))
    monkeypatch.delenv(CHANNEL_ENV, raising=False)  # serve() sets it for its session
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert serve(channel, lambda: session, "verl", entry._BAD_INPUT, (verl_job.VerlJobFailed,), 60) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    answer = json.loads((channel / "outbox" / "1.json").read_text())
    assert (answer["ok"], answer["kind"], answer["settings"]) == (False, SETTINGS_FIXED, ["trainer.lr"])
    session.close()


def test_episodes_land_in_the_log_their_row_names(tiny_model_dir: Path, smollm2_tokenizer: Any,
                                                  tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from fedagent_flwr.trainers.verl.agent_loop import EnvAgentLoop
    from testkit.verl_agent_loop import HFServer, loop_config

    assert episode_log_path({"episode_log": "/r2.jsonl"}, "/yaml.jsonl") == "/r2.jsonl"
    assert episode_log_path({"episode_log": ""}, "/yaml.jsonl") == "/yaml.jsonl"
    assert episode_log_path({}, "") == ""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    cfg = loop_config(prompt_length=256, response_length=64)
    loop = EnvAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=HFServer(model),
                        tokenizer=smollm2_tokenizer, processor=None, dataset_cls=EnvEpisodeDataset,
                        data_config=DictConfigWrap(cfg.data), max_new_tokens=4, episode_log="")
    for round_ in (1, 2):
        row = {"env_name": "TinyGuess", "env_config": {"lo": 1, "hi": 10}, "seed": round_, "max_turns": 1,
               "episode_log": str(tmp_path / f"round{round_}.jsonl")}
        asyncio.run(loop.run({"temperature": 0.0}, **row))
    for round_ in (1, 2):
        records = [json.loads(line) for line in (tmp_path / f"round{round_}.jsonl").read_text().splitlines()]
        assert [r["seed"] for r in records] == [round_]


def test_reload_rebuilds_the_engine_and_the_fedprox_anchor_is_taken_again(tmp_path: Path) -> None:
    from fedagent_flwr.trainers.verl.persistent_workers import reload_training_worker

    class FSDPEngine:
        def optimizer_step(self) -> None:
            with torch.no_grad():
                for p in self.module.parameters():
                    p -= p.grad

    module = SimpleNamespace(__name__="fake_impl", FSDPEngine=FSDPEngine)
    user_hooks.patch_engine_with_rules(module, job_rule_specs(0.5, {}), str(tmp_path / "markers"))

    class Worker:  # verl's TrainingWorker, as far as a reload touches it
        def __init__(self) -> None:
            self.engine = FSDPEngine()
            self.engine.model_config = SimpleNamespace(local_path="/round1")
            self.resets: list[str] = []
            self.reset()

        def reset(self) -> None:  # FSDPEngine.initialize(): a model "loaded" from local_path
            path = self.engine.model_config.local_path
            self.resets.append(path)
            self.engine.module = torch.nn.Linear(2, 1, bias=False)
            with torch.no_grad():
                self.engine.module.weight.fill_(float(len(self.resets)))
            self.engine.optimizer = self.engine.lr_scheduler = self.engine.checkpoint_manager = object()

    worker = Worker()

    def step() -> None:
        worker.engine.module.weight.grad = torch.zeros_like(worker.engine.module.weight)
        worker.engine.optimizer_step()

    step()
    anchor = worker.engine.__dict__["_fedagent_client_rule"][0].rules[0].anchor  # FedProx's
    assert torch.equal(anchor["weight"], torch.ones(1, 2))
    shutil_markers = tmp_path / "markers"
    assert len(engine_hooks.read_markers(str(shutil_markers))) == 1
    for path in shutil_markers.iterdir():
        path.unlink()  # the session clears the marker dir before each round

    answer = reload_training_worker(worker, "/round2")
    assert answer["path"] == "/round2" and answer["hooks_reset"] == ["client_rule"]
    assert worker.resets == ["/round1", "/round2"] and worker.engine.model_config.local_path == "/round2"
    assert "_fedagent_client_rule" not in worker.engine.__dict__
    step()
    anchor = worker.engine.__dict__["_fedagent_client_rule"][0].rules[0].anchor
    assert torch.equal(anchor["weight"], torch.full((1, 2), 2.0))  # the new round's weights
    assert len(engine_hooks.read_markers(str(shutil_markers))) == 1  # and the hook reported itself again


def test_metrics_and_errors_from_ray_read_as_one_line() -> None:
    import numpy as np

    assert numeric_metrics({"a": np.float64(0.5), "b": torch.tensor(2.0), "c": "x", "d": [1, 2],
                            "e": float("nan"), "f": 3}) == {"a": 0.5, "b": 2.0, "f": 3.0}

    class RayTaskError(Exception):
        def __init__(self, cause: BaseException) -> None:
            super().__init__("ray.exceptions.RayTaskError(ValueError): long traceback\n...")
            self.cause = cause

    assert root_cause(RayTaskError(ValueError("Total available GPUs 0 is less than total desired GPUs 1"))) == (
        "ValueError: Total available GPUs 0 is less than total desired GPUs 1")
    assert root_cause(RuntimeError("CUDA out of memory. Tried")).startswith("ran out of GPU memory")


# What a trainer server's log held when vLLM could not start beside three other sessions on an H200
# (Ray forwards the worker's lines; the exception the session gets says only "see root cause above").
# Each log line is one "..." group below, ending in \n.
_VLLM_REFUSED = (
    "\x1b[36m(vLLMHttpServer pid=9908)\x1b[0m (Worker pid=10029) ERROR 12-02 07:50:45 [multiproc_executor.py:898] "
    "WorkerProc failed to start.\n"
    "\x1b[36m(vLLMHttpServer pid=9908)\x1b[0m (Worker pid=10029) ERROR 12-02 07:50:45 [multiproc_executor.py:898] "
    "    raise ValueError(\n"
    "\x1b[36m(vLLMHttpServer pid=9908)\x1b[0m (Worker pid=10029) ERROR 12-02 07:50:45 [multiproc_executor.py:898] "
    "ValueError: Free memory on device cuda:0 (1.54/139.8 GiB) on startup is less than desired GPU memory "
    "utilization (0.3, 41.94 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.\n"
    "\x1b[36m(vLLMHttpServer pid=9908)\x1b[0m (EngineCore pid=10003) ERROR 12-02 07:50:48 [core.py:1231] "
    "Exception: WorkerProc initialization failed due to an exception in a background process. "
    "See stack trace for root cause.\n"
    "[phase] name=session_start t=176.40 dt=167.69 pid=8045 failed=True "
    "stage=starting verl's TaskRunner and workers (init_workers)\n"
)


def test_a_failed_session_start_names_vllms_root_cause_from_the_servers_log(tmp_path: Path) -> None:
    engine = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    log = tmp_path / "server.log"
    log.write_text("an earlier server's start: ValueError: Free memory on device cuda:0 (9.0/139.8 GiB) on startup "
                   "is less than desired GPU memory utilization (0.3, 41.94 GiB).\n")
    offset = log.stat().st_size
    # nothing after the offset, within the wait: the exception's own words (an earlier server's
    # failure is not this one's)
    assert root_cause(engine, log, offset, wait_s=0.5) == ("RuntimeError: Engine core initialization failed. See "
                                                           "root cause above. Failed core proc(s): {}")
    with open(log, "a") as out:
        out.write(_VLLM_REFUSED)
    assert root_cause(engine, log, offset) == (
        "ran out of GPU memory: vLLM could not start (Free memory on device cuda:0 (1.54/139.8 GiB) on startup is "
        "less than desired GPU memory utilization (0.3, 41.94 GiB)); run fewer sessions on the GPU at once or lower "
        "trainer.gpu_memory_utilization (RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {})")
    assert root_cause(engine, tmp_path / "missing.log") == root_cause(engine)


# Appends argv[2] to the file argv[1] once argv[3] seconds have passed, as Ray's log forwarding does
# with a worker's last lines after the driver already has the exception.
_LATE_WRITER = "import sys, time; time.sleep(float(sys.argv[3])); open(sys.argv[1], 'a').write(sys.argv[2])"


def test_a_root_cause_that_reaches_the_log_after_the_exception_is_waited_for(tmp_path: Path) -> None:
    """Ray forwards its workers' lines asynchronously: the session can have vLLM's "see root cause
    above" before the root cause is in the server's log. Another process appends it a second after
    the read begins, and the reason names it (a read at once finds only the exception's words)."""
    engine = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    log = tmp_path / "server.log"
    log.write_text("trainer server up\n")
    offset = log.stat().st_size
    writer = subprocess.Popen([sys.executable, "-c", _LATE_WRITER, str(log), _VLLM_REFUSED, "1.0"])
    try:
        reason = root_cause(engine, log, offset)
    finally:
        assert writer.wait(timeout=60) == 0
    assert reason.startswith("ran out of GPU memory: vLLM could not start (Free memory on device cuda:0 "
                             "(1.54/139.8 GiB) on startup is less than desired GPU memory utilization "
                             "(0.3, 41.94 GiB))")
    # A line that names no known cause does not end the wait early; the wait then ends with what
    # the log holds (the exception's own words).
    writer = subprocess.Popen([sys.executable, "-c", _LATE_WRITER, str(log), "still no cause\n", "0.2"])
    try:
        reason = root_cause(engine, log, log.stat().st_size, wait_s=1.0)
    finally:
        assert writer.wait(timeout=60) == 0
    assert reason == "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    assert log.read_text().endswith("still no cause\n")


_SESSION_SCRIPT = r"""
import json, sys
from fedagent_flwr.clientapp.job import load, TrainJob
from fedagent_flwr.trainers.verl.job import VerlJobFailed
from fedagent_flwr.trainers.verl.persistent import VerlSession
import os, tempfile
made, mkdtemp = [], tempfile.mkdtemp
tempfile.mkdtemp = lambda **kw: made.append(mkdtemp(**kw)) or made[-1]
before = dict(os.environ)
session = VerlSession()
error = ""
try:
    session.train(load(TrainJob, sys.argv[1]))
except VerlJobFailed as exc:
    error = str(exc)
temp_dir, work_dir = session.ray_temp_dir, made[0]
session.close()
import ray
print(json.dumps({"error": error, "temp_dir": temp_dir, "work_dir": work_dir, "ray": ray.is_initialized(),
                  "environ_restored": dict(os.environ) == before, "rounds": session.rounds}))
"""


def test_a_first_job_starts_the_session_up_to_verls_gpu_check_and_close_leaves_nothing(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from fedagent_flwr.clientapp.job import save
    from fedagent_flwr.procs import pids_with_cmdline

    job = _job(tiny_model_dir, tmp_path / "out", 1, proximal_mu=0.1)
    save(job, tmp_path / "job.json")
    channel = tmp_path / "channel"  # as the trainer server sets it: the session's phases go there
    run = subprocess.run([sys.executable, "-c", _SESSION_SCRIPT, str(tmp_path / "job.json")], cwd=REPO,
                         capture_output=True, text=True, timeout=900,
                         env={**os.environ, "FEDAGENT_TRAINER_CHANNEL": str(channel)})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert "could not start (starting verl's TaskRunner and workers (init_workers))" in result["error"], result
    assert "Total available GPUs 0" in result["error"]
    assert result["ray"] is False and result["environ_restored"] is True and result["rounds"] == 0
    assert result["temp_dir"] and pids_with_cmdline(result["temp_dir"]) == []
    # The TaskRunner built verl's trainer on our rows before the GPU check (its log, in Ray's dir).
    logs = "".join(p.read_text(errors="replace") for p in Path(result["temp_dir"]).glob("session_*/logs/worker-*.out"))
    assert "[persistent] TaskRunner pid" in logs and "Size of train dataloader: 2" in logs
    assert not Path(result["work_dir"]).exists()
    assert (tmp_path / "out" / "verl" / "train_rows.json").exists()
    assert not (tmp_path / "out" / "train_result.json").exists()
    # Its phases up to the GPU check, recorded by the server process and the TaskRunner actor on one clock.
    records = {r["phase"]: r for r in read_phases(channel / "phases.jsonl")}
    driver = ("server_start", "prepare", "compose_config", "ray_start", "driver_imports", "task_runner",
              "session_start")
    runner = ("task_runner_spawn", "trainer_setup", "ray_resource_pool", "init_workers")
    assert set(records) == {*driver, *runner}, sorted(records)
    assert len({records[name]["pid"] for name in driver}) == 1 and len({records[name]["pid"] for name in runner}) == 1
    assert records["ray_start"]["pid"] != records["trainer_setup"]["pid"]
    assert [name for name in (*driver, *runner) if records[name].get("failed")] == [
        "task_runner", "session_start", "ray_resource_pool", "init_workers"]  # verl's GPU check
    assert records["session_start"]["stage"] == "starting verl's TaskRunner and workers (init_workers)"
    assert records["prepare"]["round"] == 1 and "round" not in records["ray_start"]
    assert (records["ray_start"]["t"] <= records["task_runner_spawn"]["t"] <= records["trainer_setup"]["start"]
            <= records["init_workers"]["start"] <= records["ray_resource_pool"]["t"] <= records["task_runner"]["t"])
    assert "[phase] name=ray_start t=" in run.stdout and "[phase] name=trainer_setup t=" in logs
    shutil.rmtree(result["temp_dir"])  # Ray's dir lives in /tmp, outside tmp_path


def test_the_entry_module_serves_a_persistent_session() -> None:
    from fedagent_flwr.trainers.verl.persistent import VerlSession

    run = subprocess.run([sys.executable, "-m", "fedagent_flwr.trainers.verl.entry", "bogus", "x"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "'serve CHANNEL_DIR'" in run.stderr
    assert isinstance(entry.session(), VerlSession)


def test_a_rounds_steps_are_kept_under_its_output_even_when_the_round_fails(tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    """A session's step file lives in the session's directory and starts anew each round, so each
    round's steps are written under the round's own output, where ``tools/gpu/collect.sh`` packs them
    (and a subprocess-mode job's are too): also when collecting the result fails."""
    shared = tmp_path / "session"
    shared.mkdir()
    job = _job(tiny_model_dir, tmp_path / "r1", 1)
    prep = verl_job.prepare_train(job, shared_dir=shared)
    assert prep.step_file.parent == shared  # the session's, not the round's
    steps = {2: {"critic/score/mean": 0.1796875}, 1: {"critic/score/mean": 0.140625, "timing_s/step": 47.9}}
    with pytest.raises(verl_job.VerlJobFailed):  # verl saved no checkpoint here
        verl_job.collect_result(job, prep, steps, None, 0.0, "x")
    kept = tmp_path / "r1" / "verl" / verl_job.STEPS_FILE
    assert [json.loads(line) for line in kept.read_text().splitlines()] == [
        {"step": 1, "data": {"critic/score/mean": 0.140625, "timing_s/step": 47.9}},
        {"step": 2, "data": {"critic/score/mean": 0.1796875}},
    ]
    alone = verl_job.prepare_train(_job(tiny_model_dir, tmp_path / "s1", 1))  # subprocess mode: the same place
    with pytest.raises(verl_job.VerlJobFailed):
        verl_job.collect_result(_job(tiny_model_dir, tmp_path / "s1", 1), alone, {1: {"x": 1.0}}, None, 0.0, "x")
    assert (tmp_path / "s1" / "verl" / verl_job.STEPS_FILE).read_text() == '{"data": {"x": 1.0}, "step": 1}\n'
