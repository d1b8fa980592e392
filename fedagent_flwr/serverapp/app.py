"""ServerApp: compose the run config, build the strategy, run the rounds, write the summary.

The strategy selects, configures and aggregates; the rounds, their record and commits are the
ServerApp's (:mod:`.rounds`), and so is which SuperNode serves which partition (:mod:`.nodes`).

Re-running a run in the same run directory with the same config resumes it after its last
completed round (``serverapp.resume``).
"""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import asdict, fields
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.app.exception import AppExitException
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from flwr.supercore.exit import ExitCode

from fedagent_flwr.checkpoint import CheckpointError, CheckpointRef
from fedagent_flwr.checkpoint.content_hash import CONTENT_HASH_VERSION
from fedagent_flwr.checkpoint.store import ServerStore, open_server_store
from fedagent_flwr.config import ConfigError, RunSettings, load_settings
from fedagent_flwr.protocol import ShutdownInstruction
from fedagent_flwr.run_config import hydra_arguments
from fedagent_flwr.schema.run import StrategyKwargs
from fedagent_flwr.seeding import validation_seeds
from fedagent_flwr.serverapp import preflight
from fedagent_flwr.serverapp.failures import RunFailedError
from fedagent_flwr.serverapp.learning import describe
from fedagent_flwr.serverapp.nodes import NodeRegistry, is_simulation
from fedagent_flwr.serverapp.recorder import CURVE_FILE, SUMMARY_FILE, RunRecorder
from fedagent_flwr.serverapp.resume import (
    ResumeError,
    config_fingerprint,
    discard_uncommitted,
    exclusive_run_directory,
    load_previous_run,
)
from fedagent_flwr.serverapp.retention import Retention
from fedagent_flwr.serverapp.rounds import RoundLoop
from fedagent_flwr.serverapp.strategy import FedAvgFSDP, FedProxFSDP, RunPlan

app = ServerApp()


class RunSetupError(AppExitException):
    """The run cannot start (bad config, missing model or data, unusable output dir)."""

    exit_code = ExitCode.SERVERAPP_STRATEGY_PRECONDITION_UNMET


class RunFailed(AppExitException):
    """The run failed: it stopped before its last round (every client failed alike, too many empty
    rounds in a row, too few SuperNodes), or none of its rounds aggregated anything."""

    exit_code = ExitCode.SERVERAPP_EXCEPTION


# Statuses of a run whose every round ran: a re-run has nothing left to do.
FINISHED_STATUSES = ("completed", "degraded")


#: ``strategy.kwargs``' keys that the ServerApp reads itself (not passed to the Strategy class)
STRATEGY_KWARGS = frozenset(f.name for f in fields(StrategyKwargs))


def run_directory(settings: RunSettings, run_id: int) -> Path:
    """The run's absolute output directory, created if needed.

    ``run_name`` "" gives every Flower run a directory of its own (``run-<run id>``); an explicit
    name lets a re-run find, and resume, an earlier attempt at the same run.
    """
    name = settings.run.run_name or f"run-{run_id}"
    if "/" in name or name in (".", ".."):
        raise ConfigError(f"config key 'run_name' = {name!r} must be a plain directory name")
    run_dir = (Path(settings.run.output_dir).expanduser() / name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def load_strategy_class(class_path: str) -> type[FedAvgFSDP]:
    """Import ``package.module.Class`` and check it is a Flower Strategy."""
    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"config key 'strategy.class_path' = {class_path!r} cannot be imported: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(f"config key 'strategy.class_path' = {class_path!r} is not a flwr Strategy subclass")
    if not issubclass(cls, FedAvgFSDP):
        raise ConfigError(
            f"strategy {class_path!r} must subclass fedagent_flwr.serverapp.strategy.FedAvgFSDP: "
            "clients exchange checkpoint references, which plain array strategies cannot aggregate"
        )
    return cls


def run_plan(settings: RunSettings) -> RunPlan:
    """The run-wide part of every instruction, from the resolved config."""
    return RunPlan(
        algorithm=settings.run.algorithm,
        local_steps=settings.run.train.local_steps,
        epochs=settings.run.train.epochs,
        # per-client validation: every validation episode, on each trained client's own model
        client_eval_seeds=tuple(validation_seeds(settings.run.eval.seed, settings.run.eval.num_episodes))
        if settings.run.eval.per_client else (),
        trainer=settings.trainer_settings,
        train_env_spec=dict(settings.train_env_spec),
        val_env_spec=dict(settings.val_env_spec),
        partition=dict(settings.partition),
        service=asdict(settings.run.env.service),
        per_client=dict(settings.trainer.get("per_client") or {}),
    )


def build_strategy(
    settings: RunSettings, run_dir: Path, initial_model: CheckpointRef, store: ServerStore | None = None,
    initial_critic: CheckpointRef | None = None,
) -> FedAvgFSDP:
    """Instantiate the configured strategy with the run's plan (``store`` None: shared filesystem;
    ``initial_critic``: PPO's global critic of a resumed run)."""
    run = settings.run
    cls = load_strategy_class(run.strategy.class_path)
    # the Strategy class's own keyword arguments; the ServerApp's known keys (checked) are not among them
    extra = {k: v for k, v in settings.raw["strategy"]["kwargs"].items()
             if k not in STRATEGY_KWARGS}
    planned: dict[str, Any] = dict(
        run_root=str(run_dir),
        initial_model=initial_model,
        num_clients=settings.run.clients.total,
        clients_per_round=settings.clients_per_round,
        base_seed=settings.run.seed,
        local_client_id=settings.run.experiment.local_client_id,
        fixed_weights=tuple(settings.run.strategy.weights),
        plan=run_plan(settings),
        eval_seeds=validation_seeds(run.eval.seed, run.eval.num_episodes) if run.eval.enabled else [],
        store=store,
        nodes=NodeRegistry(settings.run.clients.total, run.strategy.kwargs.discovery_timeout),
        initial_critic=initial_critic,
    )
    clash = sorted(set(planned) & set(extra))
    if clash:
        raise ConfigError(f"config key 'strategy.kwargs.{clash[0]}' is set by the run itself and cannot be overridden")
    kwargs = {**planned, **extra}
    if issubclass(cls, FedProxFSDP) or "proximal_mu" in inspect.signature(cls).parameters:
        kwargs["proximal_mu"] = settings.run.strategy.proximal_mu
    elif settings.run.strategy.proximal_mu > 0:
        raise ConfigError(
            f"config key 'strategy.proximal_mu' = {settings.run.strategy.proximal_mu} has no effect with "
            f"{cls.__name__}; use strategy=fedprox (FedProxFSDP) or set it to 0"
        )
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # ValueError: a Flower setting (strategy.kwargs) it refuses
        raise ConfigError(f"strategy {settings.run.strategy.class_path!r} rejected its arguments: {exc}") from None


def adv_estimator(settings: RunSettings) -> str:
    """The advantage estimator the trainers run: the algorithm's (``gae`` for PPO, else ``grpo``),
    unless the verl backend's ``extra_overrides`` set ``algorithm.adv_estimator`` (appended last,
    so the last such override is the one verl uses)."""
    estimator = "gae" if settings.run.algorithm == "ppo" else "grpo"
    if settings.trainer_backend == "verl":
        for item in settings.trainer.get("extra_overrides") or []:
            key, _, value = str(item).lstrip("+").partition("=")
            if key.strip() == "algorithm.adv_estimator" and value.strip():
                estimator = value.strip()
    return estimator


def summary_header(settings: RunSettings, run_id: int, base_model: CheckpointRef | None) -> dict[str, Any]:
    """FedAgent's summary fields (reference/fedagent.md §1.7) plus ours.

    ``base_model`` None: the configured model could not be used; the header of a run that failed
    at start names the configured path and has no fingerprint (nothing can resume it).
    """
    return {
        "run_id": run_id,
        "total_clients": settings.run.clients.total,
        "clients_per_round": settings.clients_per_round,
        "total_rounds": settings.run.num_rounds,
        "epochs_per_round": settings.run.train.epochs,  # E; each epoch is local_steps optimiser steps
        "local_steps": settings.run.train.local_steps,
        "client_eval": settings.run.eval.per_client,  # FedAgent's client_end_eval: client_val_curve has the points
        "env_kind": settings.run.env.name,
        "mode": settings.mode,
        "adv_estimator": adv_estimator(settings),
        "local_client_id": settings.run.experiment.local_client_id if settings.mode == "local" else None,
        "partition_strategy": settings.partition["strategy"],
        "strategy": settings.run.strategy.name,
        "strategy_class": settings.run.strategy.class_path,
        "proximal_mu": settings.run.strategy.proximal_mu,
        "trainer_backend": settings.trainer_backend,
        "base_seed": settings.run.seed,
        "base_model": base_model.path if base_model is not None else settings.run.model.path,
        "base_model_sha256": base_model.sha256 if base_model is not None else None,
        "content_hash": CONTENT_HASH_VERSION,  # how every sha256 here was computed
        "config": settings.raw,
        # A re-run resumes this run only with the same resolved config and base model.
        "config_sha256": config_fingerprint(settings.raw, base_model.sha256) if base_model is not None else None,
    }


def setup_failed(exc: Exception | str) -> RunSetupError:
    """Log why the run cannot start (an error, or its reason as recorded) and turn it into Flower's
    exit for an unmet precondition."""
    log(ERROR, "[fedagent] cannot start the run: %s", exc)
    return RunSetupError(str(exc))


def run_failed(exc: Exception) -> RunFailed:
    """Log why the run stopped and turn it into Flower's exit for a failed ServerApp."""
    log(ERROR, "[fedagent] run failed: %s", exc)
    return RunFailed(str(exc))


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federated job the run config describes (typed keys, ``config-name`` and ``overrides``)."""
    run_config = context.run_config
    try:
        settings = load_settings(*hydra_arguments(run_config))
        run_dir = run_directory(settings, context.run_id)
    except (ConfigError, ValueError, OSError) as exc:
        raise setup_failed(exc) from None
    log(INFO, "[fedagent] run directory: %s", run_dir)
    try:
        with exclusive_run_directory(run_dir):
            start_run(grid, settings, run_dir, context.run_id)
    except ResumeError as exc:
        raise setup_failed(exc) from None


def start_run(grid: Grid, settings: RunSettings, run_dir: Path, run_id: int) -> None:
    """Check what every client would otherwise fail on, then run (or resume) the rounds in ``run_dir``.

    The environments are checked first (:func:`preflight.check_env_specs`): they take milliseconds,
    while the default model is converted (about a minute) the first time it is used. A failed check
    stops the run here, and the summary says so when ``run_dir`` holds no other run's record
    (:func:`record_failed_start`); an earlier attempt's record is left as it is, to be resumed once
    the cause is fixed.
    """
    from fedagent_flwr.models.smollm2 import ModelResolutionError, resolve_model_path

    try:
        warnings = preflight.check_env_specs(settings, data_is_local=is_simulation(grid))
        warnings += preflight.service_pool_warnings(settings)
        warnings += preflight.client_count_warnings(settings)
        preflight.check_request_seed_groups(settings)
        try:
            base = preflight.base_model(resolve_model_path(settings.run.model.path), settings.run.model.path)
        except (ModelResolutionError, OSError) as exc:
            raise ConfigError(f"config key 'model.path' = {settings.run.model.path!r}: {exc}") from None
        preflight.check_lora_targets(settings, Path(base.path))
    except ConfigError as exc:
        record_failed_start(run_dir, summary_header(settings, run_id, None), str(exc))
        raise setup_failed(exc) from None
    for warning in warnings:
        log(WARNING, "[fedagent] %s", warning)
    run_rounds(grid, settings, run_dir, summary_header(settings, run_id, base), base)


def failed_before_any_round(run_dir: Path) -> bool:
    """Whether ``run_dir``'s summary is of a run that failed before completing anything.

    Such a record holds no result, so a re-run with a corrected config may replace it instead of
    being refused as "another configuration" (the usual fix of a failed start changes the config).
    """
    try:
        stored = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(stored, dict) and stored.get("status") == "failed"
            and stored.get("last_completed_round") is None and not stored.get("rounds"))


def record_failed_start(run_dir: Path, header: dict[str, Any], reason: str) -> None:
    """Write a ``failed`` summary for a run that could not start, unless ``run_dir`` holds the
    record of another run (which a re-run may still resume) rather than a failed start."""
    if (run_dir / SUMMARY_FILE).exists() and not failed_before_any_round(run_dir):
        return
    RunRecorder(run_dir, header).finish("failed", reason)


def run_rounds(grid: Grid, settings: RunSettings, run_dir: Path, header: dict[str, Any],
               base: CheckpointRef) -> None:
    """Run (or resume) the rounds of the run in ``run_dir`` and record them."""
    try:
        previous = load_previous_run(run_dir, header)
    except ResumeError:
        if not failed_before_any_round(run_dir):
            raise
        log(INFO, "[fedagent] %s holds a run that failed before any round; starting afresh", run_dir)
        previous = None
    last_completed = previous.last_completed_round if previous else None
    if previous is not None:
        if previous.status in FINISHED_STATUSES and last_completed == settings.run.num_rounds:
            log(INFO, "[fedagent] %s already holds this run, %s: nothing to do", run_dir, previous.status)
            return
        start_model = previous.global_model(base)
        log(INFO, "[fedagent] resuming the run in %s after %s", run_dir,
            "nothing (no round completed)" if last_completed is None else f"round {last_completed}")
        for path in discard_uncommitted(run_dir, last_completed):
            log(INFO, "[fedagent] removed %s (written after the last completed round)", path)
    else:
        start_model = base

    recorder = RunRecorder(run_dir, header, previous, tracking=settings.tracking)
    try:
        store = open_server_store(settings.storage, run_dir, run_key=str(header["run_id"]))
    except (CheckpointError, OSError) as exc:
        reason = f"cannot start the checkpoint store: {exc}"  # the same words in the summary and the log
        recorder.finish("failed", reason)
        raise setup_failed(reason) from None
    try:
        _run_with_store(grid, settings, run_dir, start_model, recorder, store, last_completed,
                        previous.global_critic() if previous is not None else None)
    finally:
        store.close()


def _run_with_store(grid: Grid, settings: RunSettings, run_dir: Path, start_model: CheckpointRef,
                    recorder: RunRecorder, store: ServerStore, last_completed: int | None,
                    start_critic: CheckpointRef | None = None) -> None:
    """Build the strategy over ``store``, run the remaining rounds, tell the nodes the run is over."""
    try:
        # start_critic: PPO resumed after a round that aggregated critics.
        strategy = build_strategy(settings, run_dir, start_model, store, start_critic)
    except ConfigError as exc:
        recorder.finish("failed", str(exc))
        raise setup_failed(exc) from None
    retention = Retention.from_settings(settings.storage, run_dir, store)
    # a resumed run: removals its last attempt noted and died before recording, the store's copies of earlier attempts
    retention.after_resume(recorder)
    loop = RoundLoop(strategy, grid, recorder, timeout=settings.run.round_timeout, last_completed=last_completed,
                     before_commit=lambda r: retention.before_commit(recorder, r),
                     after_commit=lambda r: retention.after_commit(recorder, r), run_root=run_dir,
                     max_empty_rounds=settings.run.max_empty_rounds)
    log(INFO, "[fedagent] %s run: %d rounds, N=%d, M=%d, env %s, trainer %s, strategy %s",
        settings.mode, settings.run.num_rounds, settings.run.clients.total, settings.clients_per_round,
        settings.run.env.name, settings.trainer_backend, type(strategy).__name__)
    if settings.trainer_settings.mode == "persistent" and settings.run.clients.total > 1:
        # Memory scales with the node count, not with how many clients train at once.
        log(INFO, "[fedagent] trainer.mode=persistent: each node keeps one trainer (model, and with verl "
            "its GPU memory) for the whole run; a simulation holds all %d on this machine at once "
            "(trainer.mode=subprocess holds only the clients training at a time)", settings.run.clients.total)
    try:
        loop.run(settings.run.num_rounds, evaluate_base=settings.run.eval.enabled and settings.run.eval.before_train)
    except RunFailedError as exc:  # its message is the reason, in one line
        recorder.finish("failed", str(exc))
        raise run_failed(exc) from None
    except BaseException as exc:
        recorder.finish("failed", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        try:
            strategy.nodes.shutdown(grid, ShutdownInstruction(store.instruction_fields()))
        except Exception as exc:  # never mask the run's own outcome
            log(WARNING, "[fedagent] could not tell the nodes to shut down: %s", exc)
    status, reason = recorder.outcome()
    recorder.finish(status, reason)
    if status == "failed":  # every round ran, none aggregated anything: nothing was trained
        raise run_failed(RunFailedError(reason))
    if reason:
        log(WARNING, "[fedagent] run %s: %s", status, reason)
    truncation = recorder.summary.get("truncation")
    if truncation:  # reported, not an exit status: the run did what it was configured to (serverapp.truncation)
        log(WARNING, "[fedagent] run %s, but %s", status, truncation["note"])
    comparison = recorder.summary["learning"].get("final_vs_base")
    if comparison is not None:
        log(INFO, "[fedagent] %s", describe(comparison))
    log(INFO, "[fedagent] final global model: %s", strategy.global_model.path)
    log(INFO, "[fedagent] summary: %s", recorder.summary_path)
    log(INFO, "[fedagent] learning curve: %s", run_dir / CURVE_FILE)
