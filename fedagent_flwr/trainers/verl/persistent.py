"""The persistent verl trainer: one verl session per node, kept across rounds (issue 8).

``python -m fedagent_flwr.trainers.verl.entry serve CHANNEL_DIR`` keeps a
:class:`VerlSession` alive (:mod:`fedagent_flwr.clientapp.trainer_server`), so Ray, the FSDP
workers and the vLLM engine start once per run instead of once per client-round. The first train
job starts the session:

1. the same checks, row plan, agent-loop YAML, Hydra overrides and environment as the subprocess
   path (:func:`.job.prepare_train`); the variables the ``sitecustomize`` hooks read (FedProx,
   the critic loader fix, plugins, the client rule) go into this process's ``os.environ`` before
   ``ray.init``, so every Ray worker inherits them, and the private Ray cluster gets a temp dir of
   its own;
2. verl's ``ppo_trainer`` config composed in-process from those overrides (as
   ``verl.trainer.main_ppo`` composes it), and one Ray actor, :class:`.persistent_runner.PersistentTaskRunner`,
   that builds verl's trainer and workers and lives until :meth:`VerlSession.close`.

Every train job then runs one client-round in that actor (``train_round``: new global weights
into the actor, reference and critic engines, this round's rows and seed, the stock ``fit()``) and
reports the same :class:`TrainResult` as the subprocess path, plus ``verl/persistent_round``,
``verl/reload_s``, with ``trainer.optimizer_state: keep`` ``optimizer_state_kept`` (1.0 when
the client's AdamW and LR-scheduler state was carried over from its previous round, else 0.0: the
session's first round has nothing to keep) and, once, ``verl/session_start_s``. ``verl/cold_start_s`` keeps its meaning,
the time before step 1: Ray and worker start-up in the first round, the reload afterwards.
The start-up and every round are also timed phase by phase (:mod:`.phases`): ``[phase]`` lines
in the log and ``phases.jsonl`` in the trainer's channel directory, where
``tools/gpu/phases.py`` reads them.

What verl fixed when the session started (the algorithm, every ``trainer`` setting, the step
budget and batch size, FedProx's ``mu``, the client rule) cannot change under a live session: a
job asking for other values is refused (:class:`SettingsChanged`, the trainer server's typed
:class:`~fedagent_flwr.clientapp.trainer_server.SessionSettingsFixed`, with the differences
named), never trained with stale settings. The ClientApp then replaces the trainer, saying why
(the cold start this mode exists to avoid is paid once more, announced), and the fresh session
starts with the job's settings (:mod:`fedagent_flwr.clientapp.persistent`).

Evaluation runs here with Hugging Face generation, exactly as the subprocess path does
(:func:`.job.evaluate`); the vLLM replicas sleep between rounds, so the GPU has room for it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fedagent_flwr.clientapp.job import EvalJob, TrainJob, TrainResult
from fedagent_flwr.clientapp.trainer_server import (
    CHANNEL_ENV,
    LOG_FILE,
    SessionSettingsFixed,
    record_leftover_markers,
)
from fedagent_flwr.trainers.verl import job as verl_job
from fedagent_flwr.trainers.verl import phases
from fedagent_flwr.trainers.verl.job import InputError, PreparedTrain, VerlJobFailed
from fedagent_flwr.trainers.verl.runner import CAUSE_WAIT_S, cleanup_ray, known_cause, logged_cause
from fedagent_flwr.trainers.verl.settings import VerlSettings
from fedagent_flwr.trainers.verl.verl_log import StepWatch

PROG = "verl_backend (persistent)"
LOG_HINT = "the trainer server's log"


def compose_verl_config(overrides: list[str]) -> Any:
    """verl's ``ppo_trainer`` config with ``overrides`` applied (verl's own Hydra schema), as
    ``python -m verl.trainer.main_ppo OVERRIDES`` composes it."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def session_fingerprint(job: TrainJob, settings: VerlSettings, rule: dict[str, Any] | None,
                        batch_size: int) -> dict[str, Any]:
    """Everything a live session cannot change, keyed by the name a user would look for."""
    fixed: dict[str, Any] = {
        "algorithm": job.algorithm,
        "local_steps": job.local_steps,
        "epochs": job.epochs,
        "env instances per step (sum of n_envs)": batch_size,
        "proximal_mu": float(job.proximal_mu),
        "trainer.client_rule": rule,
    }
    fixed.update({f"trainer.{key}": value for key, value in asdict(settings).items()})
    return fixed


class SettingsChanged(InputError, SessionSettingsFixed):
    """A job asks a live session for other values of what it fixed at its start (bad input to
    this session; the trainer server answers it as ``settings_fixed``, and the ClientApp replaces
    the trainer)."""

    def __init__(self, message: str, settings: list[str]) -> None:
        SessionSettingsFixed.__init__(self, message, settings)  # ValueError's comes first in the MRO


def changed_keys(session: dict[str, Any], job: dict[str, Any]) -> list[str]:
    """The fixed settings whose values the job would change, sorted."""
    return [key for key in sorted(set(session) | set(job)) if session.get(key) != job.get(key)]


def fixed_differences(session: dict[str, Any], job: dict[str, Any]) -> list[str]:
    """``key: session X, job Y`` for every fixed value the job would change (sorted by key)."""
    return [f"{key}: session {session.get(key)!r}, job {job.get(key)!r}" for key in changed_keys(session, job)]


def round_plan(job: TrainJob, prep: PreparedTrain, *, reload: bool) -> dict[str, Any]:
    """What :meth:`.persistent_runner.PersistentTaskRunner.train_round` needs for one client-round."""
    model_path = str(prep.model_path)
    return {
        "round": job.round,
        "client_id": job.client_id,
        "model_path": model_path,
        # as build_overrides starts the critic: the aggregated one, else the model (round 1)
        "critic_path": (prep.paths.critic_path or model_path) if job.algorithm == "ppo" else "",
        "rows_file": prep.paths.rows_file,
        "checkpoint_dir": prep.paths.checkpoint_dir,
        "experiment_name": verl_job.experiment_name(job),
        "seed": job.data_seed,
        "local_steps": job.local_steps,
        "reload": reload,
        "optimizer_state": prep.settings.optimizer_state,  # keep: the reload keeps the optimisers' state
    }


def root_cause(exc: BaseException, log_path: Path | None = None, log_offset: int = 0,
               wait_s: float = CAUSE_WAIT_S) -> str:
    """One line for an exception raised through Ray: the original error where Ray kept it, with
    the operator's phrasing for a known cause (GPU memory). When the exception names none, the
    server's log from ``log_offset`` on (what Ray's workers printed meanwhile) may: vLLM's engine
    fails with "Engine core initialization failed. See root cause above.", and the root cause
    (not enough free GPU memory) is only in that log. Ray forwards the workers' lines into it
    asynchronously, so the log is watched for up to ``wait_s`` seconds for a known cause to arrive
    (:func:`~.runner.logged_cause`)."""
    cause = getattr(exc, "cause", None)
    inner = cause if isinstance(cause, BaseException) else exc
    text = f"{type(inner).__name__}: {inner}"
    known = known_cause(f"{text}\n{exc}") or (
        logged_cause(log_path, log_offset, wait_s) if log_path is not None else None)
    line = " ".join(text.split())
    return f"{known} ({line[:300]})" if known else line[:600]


def _size(path: Path | None) -> int:
    """The size of ``path`` in bytes (0: none, or unreadable)."""
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def _release_cached_gpu_memory() -> None:
    """Free what torch's caching allocator keeps in this process (no-op without CUDA)."""
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def apply_environment(env: dict[str, str]) -> None:
    """Make ``os.environ`` equal to ``env`` (what Ray's processes will inherit)."""
    for key in list(os.environ):
        if key not in env:
            del os.environ[key]
    os.environ.update(env)


class VerlSession:
    """A verl trainer kept alive across rounds (the ``TrainerSession`` of :mod:`..trainer_server`).

    ``work_dir``: where the session keeps its own files (agent-loop YAML, hook markers); a fresh
    temporary directory when not given, removed by :meth:`close`. The phases are recorded in
    ``phases.jsonl`` in the trainer server's channel directory (``$FEDAGENT_TRAINER_CHANNEL``), else
    in ``work_dir`` (then removed with a temporary one).
    The session's clock starts with this process (the trainer server is started for its first job).
    """

    def __init__(self, work_dir: str | None = None) -> None:
        self._work_dir_arg = work_dir
        self.work_dir: Path | None = None
        self.ray_temp_dir = ""
        self.runner: Any = None
        self.fixed: dict[str, Any] | None = None
        self.rounds = 0
        self._environ_before: dict[str, str] | None = None
        self.t0 = phases.process_started_at() or time.time()
        self.recorder: phases.PhaseRecorder | None = None

    # -- TrainerSession ------------------------------------------------------------------------

    def train(self, job: TrainJob) -> TrainResult:
        """One client-round on the live session (started by the first call); writes
        ``<output_dir>/train_result.json`` like :func:`.entry.train`."""
        started, started_at = time.monotonic(), time.time()
        recorder = self._recorder()
        if self.runner is None:
            recorder.record("server_start", self.t0, started_at)
        in_round = recorder.bound(round=job.round, client=job.client_id)
        checked = verl_job.check_train_job(job)
        settings, spec, _, rule = checked
        fingerprint = session_fingerprint(job, settings, rule, sum(e.n_envs for e in spec.envs))
        if self.fixed is not None:
            differences = fixed_differences(self.fixed, fingerprint)
            if differences:
                raise SettingsChanged(
                    "this job needs settings other than those the persistent verl session started with "
                    f"({'; '.join(differences)}); they are fixed for the session's life, so the job needs "
                    "a new session (the ClientApp replaces the trainer)",
                    changed_keys(self.fixed, fingerprint),
                )
        prep = verl_job.prepare_train(job, shared_dir=self._session_dir(), checked=checked)
        in_round.record("prepare", started_at)
        print(verl_job.describe(job, prep), flush=True)
        extra: dict[str, float] = {}
        first = self.runner is None
        if first:
            extra["verl/session_start_s"] = self._start(prep)
            self.fixed = fingerprint
        plan = round_plan(job, prep, reload=not first)
        called_at = time.monotonic() - started
        # verl's file logger starts the session's step file anew in every fit(); followed meanwhile
        # for the progress records the server relays (the metrics come back with the call).
        prep.step_file.unlink(missing_ok=True)
        with StepWatch(prep.step_file, verl_job.progress_reporter(job, prep, started)):
            out = self._get(self.runner.train_round.remote(plan), f"round {job.round} client {job.client_id}")
        self.rounds += 1
        records = out.get("records") or []
        steps = {int(r["step"]): dict(r["metrics"]) for r in records}
        first_step = called_at + float(records[0]["t"]) if records else None
        extra["verl/persistent_round"] = float(self.rounds)
        extra["verl/reload_s"] = float(out.get("reload_s", 0.0))
        # with trainer.optimizer_state=keep only (as the subprocess path): 1.0 when this round's
        # optimisers continued from the client's previous round, 0.0 when they started fresh (a
        # session's first round: nothing to keep yet). A reset run's metrics stay those of a
        # subprocess-mode run, which the persistent mode must equal.
        if job.trainer.get("optimizer_state") == "keep":
            extra["optimizer_state_kept"] = 1.0 if out.get("optimizer_state_kept") else 0.0
        with in_round.phase("collect_result"):
            result = verl_job.collect_result(job, prep, steps, first_step, started, LOG_HINT, extra_metrics=extra)
        if job.trainer.get("optimizer_state") == "keep":  # the round completed: a next one may keep its state
            self._get(self.runner.round_collected.remote(job.client_id, job.round),
                      f"round {job.round} client {job.client_id}")
        in_round.record("round_total", started_at)
        return result

    def evaluate(self, job: EvalJob) -> Any:
        """Hugging Face evaluation in this process, as :func:`.job.evaluate`; the evaluation
        model's GPU memory is handed back afterwards (vLLM wakes up into it next round)."""
        try:
            return verl_job.evaluate(job)
        finally:
            _release_cached_gpu_memory()

    def close(self) -> None:
        """Stop the TaskRunner, the workers, vLLM and the private Ray cluster; leave no process behind."""
        runner, self.runner = self.runner, None
        try:
            import ray

            if runner is not None:
                try:
                    ray.kill(runner)
                except Exception as exc:  # noqa: BLE001 - the cluster may already be gone
                    print(f"{PROG}: note: killing the TaskRunner: {exc}", flush=True)
            if ray.is_initialized():
                ray.shutdown()
        finally:
            if self.ray_temp_dir:
                cleanup_ray(self.ray_temp_dir)
            if self._environ_before is not None:
                apply_environment(self._environ_before)
                self._environ_before = None
            if self.work_dir is not None and self._work_dir_arg is None:
                shutil.rmtree(self.work_dir, ignore_errors=True)
                self.work_dir = None

    # -- internals -----------------------------------------------------------------------------

    def _recorder(self) -> phases.PhaseRecorder:
        """The session's phase recorder (see the class docstring for where it writes)."""
        if self.recorder is None:
            channel = os.environ.get(CHANNEL_ENV, "")
            directory = Path(channel) if channel else self._session_dir()
            self.recorder = phases.PhaseRecorder(directory / phases.FILE_NAME, self.t0)
        return self.recorder

    def _session_dir(self) -> Path:
        if self.work_dir is None:
            if self._work_dir_arg:
                self.work_dir = Path(self._work_dir_arg).resolve()
                self.work_dir.mkdir(parents=True, exist_ok=True)
            else:
                self.work_dir = Path(tempfile.mkdtemp(prefix="fa-verl-session-"))
        return self.work_dir

    def _start(self, prep: PreparedTrain) -> float:
        """Compose verl's config, start the private Ray cluster and the TaskRunner with its workers;
        returns the seconds it took. On failure everything started is stopped again."""
        started, started_at = time.monotonic(), time.time()
        recorder = self._recorder()
        # The server's log (a trainer server's session): Ray's workers print into it, and a failed
        # start's root cause may be there only; what it holds from here on is this start's.
        channel = os.environ.get(CHANNEL_ENV, "")
        server_log = Path(channel) / LOG_FILE if channel else None
        log_offset = _size(server_log)
        stage = "composing verl's config"
        try:
            import ray
            from omegaconf import OmegaConf
            from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
            from verl.trainer.ppo.utils import need_critic, need_reference_policy
            from verl.utils.config import validate_config
            from verl.utils.device import auto_set_device

            config = compose_verl_config(prep.overrides)
            auto_set_device(config)
            validate_config(config=config, use_reference_policy=need_reference_policy(config),
                            use_critic=need_critic(config))
            recorder.record("compose_config", started_at)

            stage = "starting the private Ray cluster"
            self._environ_before = dict(os.environ)
            # the processes Ray starts record their phases into the same file, on the same clock
            apply_environment({**prep.env, **recorder.environment()})
            self.ray_temp_dir = prep.paths.ray_temp_dir
            shutil.rmtree(self.ray_temp_dir, ignore_errors=True)
            # Ray's processes carry the temp dir in their command lines; should this server be
            # killed outright, the ClientApp stops them by it (the GPU must be free for the rerun).
            record_leftover_markers([self.ray_temp_dir])
            if ray.is_initialized():
                raise RuntimeError("Ray is already initialised in this process; a session needs its own cluster")
            # as verl.trainer.main_ppo.run_ppo initialises Ray
            ray_init = config.ray_kwargs.get("ray_init", {})
            runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), ray_init.get("runtime_env", {}))
            with recorder.phase("ray_start"):
                ray.init(**OmegaConf.to_container(  # type: ignore[arg-type]  # a mapping: created from a dict
                    OmegaConf.create({**ray_init, "runtime_env": runtime_env})))

            stage = "starting verl's TaskRunner and workers (init_workers)"
            with recorder.phase("driver_imports"):  # verl's trainer, torch: the class pickles by reference
                from fedagent_flwr.trainers.verl.persistent_runner import PersistentTaskRunner
            with recorder.phase("task_runner"):  # its own phases are recorded inside (persistent_runner)
                self.runner = ray.remote(PersistentTaskRunner).remote()
                info = ray.get(self.runner.start.remote(config))
        except Exception as exc:
            recorder.record("session_start", started_at, failed=True, stage=stage)
            sys.stdout.flush()  # our own lines in the log before it is read
            try:
                # Before close(): while Ray runs it still forwards its workers' last lines (vLLM's
                # root cause among them) into the log; only a running Ray has lines still to come.
                ray_module = sys.modules.get("ray")
                forwarding = ray_module is not None and ray_module.is_initialized()
                reason = root_cause(exc, server_log, log_offset, CAUSE_WAIT_S if forwarding else 0.0)
            finally:
                self.close()
            raise VerlJobFailed(f"the persistent verl session could not start ({stage}): "
                                f"{reason} (log: {LOG_HINT})") from exc
        seconds = round(time.monotonic() - started, 2)
        recorder.record("session_start", started_at)
        print(f"{PROG}: session started in {seconds} s (Ray temp dir {self.ray_temp_dir}, TaskRunner pid "
              f"{info.get('pid')}, critic={info.get('use_critic')}, ref={info.get('use_reference_policy')})",
              flush=True)
        return seconds

    def _get(self, ref: Any, what: str) -> Any:
        import ray

        try:
            return ray.get(ref)
        except Exception as exc:
            raise VerlJobFailed(f"the persistent verl session failed in {what}: {root_cause(exc)} "
                                f"(log: {LOG_HINT})") from exc
