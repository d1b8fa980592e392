"""The Ray actor of a persistent verl trainer: verl's legacy TaskRunner, kept alive across rounds.

``start`` does what ``verl.trainer.main_ppo_v0.TaskRunner.run`` does up to ``init_workers()``
(same helpers: ``create_rl_dataset``, ``create_rl_sampler``, ``need_critic``,
``need_reference_policy``, ``validate_config``, ``RayPPOTrainer``), with the reloadable worker
classes of :mod:`.persistent_workers`. ``train_round`` then runs one client-round on the live
workers (FedAgent's persistent task runner, reference/fedagent.md §1.9):

1. point the config at the round: rows file, ``data.seed``, ``trainer.default_local_dir``,
   ``trainer.experiment_name``;
2. except right after ``start`` (the workers were just built from this round's paths), load the
   round's global model into the actor and reference engines and the critic's start into the
   critic (new optimiser and LR scheduler, unless ``trainer.optimizer_state: keep`` carries the
   same client's previous state over; FedProx / client-rule state forgotten);
3. rebuild the train dataloader from the round's rows (``RayPPOTrainer._create_dataloader``);
4. reseed ``random`` / NumPy / torch with the data seed and run the stock ``fit()``: it resets
   ``global_steps`` to 0, loads no checkpoint (``resume_mode=disable``), pushes the actor's
   weights into vLLM (``checkpoint_manager.update_weights``) before step 1, and saves the last step;
5. put the vLLM replicas to sleep again (``fit()`` ends with them awake after the last weight
   update; verl's own steps always update weights into sleeping replicas).

Every metrics dict ``fit()`` logs is recorded, with the seconds since the call began, through a
subclass of verl's ``Tracking`` installed for the duration of ``fit()``.

Both steps are timed phase by phase (:mod:`.phases`) from this side of verl's API: around the
calls made here, and, for the duration of ``init_workers()`` / ``fit()``, around the calls verl
makes on objects it reaches through attributes (:func:`.phases.timed_calls`: the resource pool,
the worker group, the vLLM servers, the agent-loop and reward managers; the weight sync,
generation, updates and checkpoint save). verl's files stay as they are; everything is put back
when the call returns.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.trainer.main_ppo_v0 import BaseTaskRunner
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler, need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.utils.dataset.rl_dataset import collate_fn

from fedagent_flwr.trainers.common.seeds import reseed
from fedagent_flwr.trainers.verl import phases
from fedagent_flwr.trainers.verl.persistent_workers import ReloadableActorRolloutRefWorker, ReloadableTrainingWorker
from fedagent_flwr.trainers.verl.verl_log import numeric_metrics

TAG = "[persistent]"


@contextmanager
def recording_tracking(records: list[dict[str, Any]], t0: float) -> Iterator[None]:
    """While active, every ``Tracking`` that ``fit()`` creates also appends
    ``{"step", "t", "metrics"}`` to ``records`` (``t``: seconds since ``t0``)."""
    import verl.utils.tracking as tracking

    stock = tracking.Tracking

    class RecordingTracking(stock):  # type: ignore[misc, valid-type]
        def log(self, data: dict[str, Any], step: int, backend: Any = None) -> None:
            records.append({"step": int(step), "t": time.monotonic() - t0, "metrics": numeric_metrics(data)})
            super().log(data=data, step=step, backend=backend)

    tracking.Tracking = RecordingTracking  # type: ignore[misc]  # the swap is the point (restored below)
    try:
        yield
    finally:
        tracking.Tracking = stock  # type: ignore[misc]


class PersistentTaskRunner(BaseTaskRunner):
    """One per session, as a Ray actor (``ray.remote(PersistentTaskRunner)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.config: DictConfig | None = None
        self.trainer: RayPPOTrainer | None = None
        self.tokenizer: Any = None
        self.processor: Any = None
        self.recorder = phases.from_environment()
        # process start -> here: Python, Ray's worker set-up, verl's trainer and torch imported
        phases.record_process_start(self.recorder, "task_runner_spawn")
        # the session's first weight sync and generation are start-up phases (named first_*)
        self._syncs, self._generations = phases.CallLog(), phases.CallLog()
        # (client, round) of the completed client-round the engines' optimiser state is from (None:
        # a new session, or a round that failed part-way and left a state that belongs to no round)
        self._state_from: tuple[int, int] | None = None
        # (client, round) whose fit() finished, until the session says its result was collected
        self._fitted: tuple[int, int] | None = None

    def add_actor_rollout_worker(self, config: DictConfig) -> tuple[type, type]:
        _, worker_group_cls = super().add_actor_rollout_worker(config)
        for role in (Role.ActorRollout, Role.ActorRolloutRef):
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(ReloadableActorRolloutRefWorker)
        return ReloadableActorRolloutRefWorker, worker_group_cls

    def add_critic_worker(self, config: DictConfig) -> None:
        super().add_critic_worker(config)
        self.role_worker_mapping[Role.Critic] = ray.remote(ReloadableTrainingWorker)

    def start(self, config: DictConfig) -> dict[str, Any]:
        """``TaskRunner.run`` up to and including ``init_workers()``; the workers are then idle and
        the vLLM replicas asleep."""
        started, started_at = time.monotonic(), time.time()
        print(f"{TAG} TaskRunner pid {os.getpid()}: starting verl's workers", flush=True)
        OmegaConf.resolve(config)
        actor_rollout_cls, worker_group_cls = self.add_actor_rollout_worker(config)
        self.add_critic_worker(config)
        self.add_reward_model_resource_pool(config)
        self.add_teacher_model_resource_pool(config)
        self.add_ref_policy_worker(config, actor_rollout_cls)
        validate_config(config=config, use_reference_policy=need_reference_policy(config),
                        use_critic=need_critic(config))
        model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
        self.tokenizer, self.processor = model_config.tokenizer, model_config.processor
        resource_pool_manager = self.init_resource_pool_mgr(config)
        train_dataset = self._dataset(config, config.data.train_files, is_train=True)
        val_dataset = self._dataset(config, config.data.val_files, is_train=False)
        self.trainer = RayPPOTrainer(
            config=config, tokenizer=self.tokenizer, processor=self.processor,
            role_worker_mapping=self.role_worker_mapping, resource_pool_manager=resource_pool_manager,
            ray_worker_group_cls=worker_group_cls, train_dataset=train_dataset, val_dataset=val_dataset,
            collate_fn=collate_fn, train_sampler=create_rl_sampler(config.data, train_dataset),
        )
        self.recorder.record("trainer_setup", started_at)  # roles, tokenizer, datasets, RayPPOTrainer
        self._init_workers(self.trainer, resource_pool_manager, worker_group_cls)
        self.config = config
        info = {"pid": os.getpid(), "use_critic": bool(self.trainer.use_critic),
                "use_reference_policy": bool(self.trainer.use_reference_policy),
                "seconds": round(time.monotonic() - started, 2)}
        print(f"{TAG} workers ready in {info['seconds']} s: critic={info['use_critic']} "
              f"ref={info['use_reference_policy']}", flush=True)
        return info

    def _init_workers(self, trainer: RayPPOTrainer, pools: Any, worker_group_cls: type) -> None:
        """``trainer.init_workers()``, its steps timed; the agent-loop and reward workers it only
        creates are watched until they answer (:meth:`_watch_ready`) without waiting for them."""
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.experimental.agent_loop import AgentLoopManager
        from verl.experimental.reward_loop import RewardLoopManager
        from verl.workers.rollout.llm_server import LLMServerManager

        rec = self.recorder
        with ExitStack() as stack, rec.phase("init_workers"):
            timed = [(pools, "create_resource_pool", "ray_resource_pool"),
                     (worker_group_cls, "__init__", "worker_group_create"),  # spawns the FSDP workers
                     (RewardLoopManager, "__init__", "reward_loop_create"),
                     (LLMServerManager, "create", "rollout_engine_init"),  # launches the vLLM servers
                     (AgentLoopManager, "create", "agent_loop_workers_create"),
                     (CheckpointEngineManager, "sleep_replicas", "sleep_replicas")]
            logs = {name: stack.enter_context(phases.timed_calls(owner, attribute, rec, name))
                    for owner, attribute, name in timed}
            trainer.init_workers()
        groups = {"agent_loop_workers_ready": (getattr(trainer.async_rollout_manager, "agent_loop_workers", []),
                                               logs["agent_loop_workers_create"].last_started),
                  "reward_loop_workers_ready": (getattr(trainer.reward_loop_manager, "reward_loop_workers", []),
                                                logs["reward_loop_create"].last_started)}
        for name, (workers, created) in groups.items():
            if workers and created is not None:
                threading.Thread(target=self._watch_ready, args=(name, list(workers), created), daemon=True).start()

    def _watch_ready(self, name: str, workers: list[Any], created: float) -> None:
        """Record ``name`` once every Ray actor in ``workers`` answers (from ``created`` on): verl
        creates them without waiting, so their start-up overlaps whatever comes next."""
        try:
            ray.get([worker.__ray_ready__.remote() for worker in workers], timeout=900)
        except Exception as exc:  # noqa: BLE001 - a timing aid: never fail the session over it
            print(f"{TAG} note: could not time {name}: {type(exc).__name__}: {exc}", flush=True)
            return
        self.recorder.record(name, created, workers=len(workers))

    def _dataset(self, config: DictConfig, files: Any, is_train: bool) -> Any:
        key = "train_max_samples" if is_train else "val_max_samples"
        return create_rl_dataset(files, config.data, self.tokenizer, self.processor, is_train=is_train,
                                 max_samples=config.data.get(key, -1))

    def train_round(self, plan: dict[str, Any]) -> dict[str, Any]:
        """One client-round (see the module docstring); ``plan`` is :func:`.persistent.round_plan`."""
        t0, t0_at = time.monotonic(), time.time()
        trainer, config = self.trainer, self.config
        if trainer is None or config is None:
            raise RuntimeError("train_round before start: the session's workers were never built")
        label = f"{TAG} round {plan['round']} client {plan['client_id']}"
        rec = self.recorder.bound(round=int(plan["round"]), client=int(plan["client_id"]))
        with open_dict(config):
            config.data.train_files = plan["rows_file"]
            config.data.seed = int(plan["seed"])
            config.trainer.default_local_dir = plan["checkpoint_dir"]
            config.trainer.experiment_name = plan["experiment_name"]

        reloaded: dict[str, Any] = {}
        keep = self._keeps_optimizer(plan, label)
        kept = False
        self._round_started()
        if plan["reload"]:
            reloaded["actor"] = trainer.actor_rollout_wg.fedagent_reload(plan["model_path"], int(plan["seed"]), keep)
            ranks = trainer.actor_rollout_wg.world_size
            _check_reload(reloaded["actor"], "actor", plan["model_path"], ranks)
            if trainer.use_reference_policy:
                _check_reload(reloaded["actor"], "ref", plan["model_path"], ranks)
            if trainer.use_critic:
                reloaded["critic"] = trainer.critic_wg.fedagent_reload(plan["critic_path"], int(plan["seed"]), keep)
                _check_reload(reloaded["critic"], "critic", plan["critic_path"], trainer.critic_wg.world_size)
            hooks = sorted({tag for rank in reloaded["actor"] for tag in rank["actor"]["hooks_reset"]})
            kept = optimizer_kept(reloaded)
            print(f"{label}: reloaded actor{'+ref' if trainer.use_reference_policy else ''} from "
                  f"{plan['model_path']}{' and critic from ' + plan['critic_path'] if trainer.use_critic else ''} "
                  f"on {len(reloaded['actor'])} rank(s) in {time.monotonic() - t0:.2f} s; hooks reset: {hooks}; "
                  f"optimiser state {'kept from the previous round' if kept else 'fresh'}", flush=True)
            rec.record("reload", t0_at)
            for role, answers in (("actor", reloaded["actor"]), ("ref", reloaded["actor"]),
                                  ("critic", reloaded.get("critic") or [])):
                seconds = [float((a.get(role) or {}).get("seconds", 0.0)) for a in answers if a.get(role)]
                if seconds:  # the slowest rank: they load side by side
                    rec.record_seconds(f"reload_{role}", max(seconds), ranks=len(seconds))
        reload_s = time.monotonic() - t0

        dataloader_at = time.time()
        train_dataset = self._dataset(config, config.data.train_files, is_train=True)
        trainer._create_dataloader(train_dataset, trainer.val_dataset, collate_fn,
                                   create_rl_sampler(config.data, train_dataset))
        if len(trainer.train_dataloader) != int(plan["local_steps"]):
            raise RuntimeError(f"the round's dataloader has {len(trainer.train_dataloader)} batches, "
                               f"expected {plan['local_steps']} (rows {plan['rows_file']})")
        print(f"{label}: dataloader rebuilt from {plan['rows_file']} ({len(train_dataset)} rows, "
              f"{len(trainer.train_dataloader)} batches), seed {plan['seed']}, checkpoints to "
              f"{plan['checkpoint_dir']}", flush=True)
        rec.record("dataloader", dataloader_at)
        reseed(int(plan["seed"]))
        records: list[dict[str, Any]] = []
        fit_started = time.monotonic()
        with recording_tracking(records, t0), self._timed_fit(trainer, rec), rec.phase("fit"):
            trainer.fit()
        fit_s = time.monotonic() - fit_started
        with rec.phase("sleep_replicas"):
            trainer.checkpoint_manager.sleep_replicas()  # type: ignore[attr-defined]  # set by init_workers()
        print(f"{label}: fit() done in {fit_s:.2f} s ({len(records)} steps logged), vLLM replicas asleep",
              flush=True)
        rec.record("train_round", t0_at)
        self._round_fitted(plan)
        return {"records": records, "reload_s": round(reload_s, 2), "fit_s": round(fit_s, 2),
                "reloaded": reloaded, "optimizer_state_kept": kept}

    def _round_started(self) -> None:
        """A round begins reloading the engines: whatever state they held belongs to no completed
        round until this one completes."""
        self._state_from = self._fitted = None

    def _round_fitted(self, plan: dict[str, Any]) -> None:
        """The round's ``fit()`` returned: its state is keepable only once the session confirms
        that the result was collected (:meth:`round_collected`)."""
        self._fitted = (int(plan["client_id"]), int(plan["round"]))

    def round_collected(self, client_id: int, round_: int) -> None:
        """The session collected this client-round's result (its checkpoint found, its result
        file written): only now is the engines' optimiser state a completed round's, one that a
        next round may keep. A round whose result could not be collected leaves none, as the
        reference trainer's session, which takes its state at the same point."""
        if self._fitted == (client_id, round_):
            self._state_from = self._fitted
        self._fitted = None

    def _keeps_optimizer(self, plan: dict[str, Any], label: str) -> bool:
        """Whether this round's reload keeps the engines' optimiser state (``trainer.optimizer_state:
        keep``): only a state the same client's earlier, completed round left. A node trains one
        client, but should a job of another client arrive, or a round run again (a resumed run
        whose trainer outlived the server), or follow a round that failed part-way, it starts
        with a fresh optimiser, said here."""
        if plan.get("optimizer_state") != "keep" or not plan["reload"]:
            return False
        client, round_ = int(plan["client_id"]), int(plan["round"])
        if self._state_from is None or self._state_from[0] != client or self._state_from[1] >= round_:
            source = ("no completed round" if self._state_from is None
                      else f"client {self._state_from[0]}'s round {self._state_from[1]}")
            print(f"{label}: the engines' optimiser state is from {source}, not from an earlier round of "
                  "this client: starting with a fresh optimiser", flush=True)
            return False
        return True

    @contextmanager
    def _timed_fit(self, trainer: RayPPOTrainer, rec: phases.PhaseRecorder) -> Iterator[None]:
        """While ``fit()`` runs: each weight sync, generation, update and checkpoint save is a phase
        (the session's first sync and generation are ``first_weight_sync`` / ``first_generation``)."""
        manager: Any = trainer.checkpoint_manager  # type: ignore[attr-defined]  # set by init_workers()
        timed: list[tuple[Any, str, str, str, phases.CallLog | None]] = [
            (manager, "update_weights", "weight_sync", "first_weight_sync", self._syncs),
            (trainer.async_rollout_manager, "generate_sequences", "generation", "first_generation", self._generations),
            (trainer, "_update_actor", "update_actor", "", None),
            (trainer, "_save_checkpoint", "checkpoint_save", "", None),
        ]
        if trainer.use_critic:
            timed.append((trainer, "_update_critic", "update_critic", "", None))
        with ExitStack() as stack:
            for owner, attribute, name, first, calls in timed:
                stack.enter_context(phases.timed_calls(owner, attribute, rec, name, first, calls))
            yield


def optimizer_kept(reloaded: dict[str, Any]) -> bool:
    """Whether every rank of the actor (and of the critic, with PPO) loaded its previous round's
    optimiser state (:func:`.persistent_workers.reload_training_worker`'s ``optimizer_state``)."""
    states = [(answer.get("actor") or {}).get("optimizer_state") for answer in reloaded.get("actor") or []]
    states += [(answer.get("critic") or {}).get("optimizer_state") for answer in reloaded.get("critic") or []]
    return bool(states) and all(state == "kept" for state in states)


def _check_reload(answers: Any, role: str, path: str, world_size: int) -> None:
    """Each of the ``world_size`` ranks reports ``role`` loaded from ``path``, or this raises naming
    what is missing: an FSDP rank left on the previous weights would train a model that is neither."""
    if not isinstance(answers, list) or not answers:
        raise RuntimeError(f"fedagent_reload ({role}) returned {answers!r}, expected one answer per rank")
    ranks = sorted(int((answer or {}).get("rank", -1)) for answer in answers)
    if ranks != list(range(world_size)):
        raise RuntimeError(f"fedagent_reload ({role}) was answered by ranks {ranks}, expected ranks 0 to "
                           f"{world_size - 1} (one per GPU of the worker group)")
    for answer in answers:
        got = (answer or {}).get(role)
        if not got or got.get("path") != path:
            raise RuntimeError(f"fedagent_reload: rank {answer.get('rank', '?')} did not reload the {role} "
                               f"from {path} (answer: {answer})")
