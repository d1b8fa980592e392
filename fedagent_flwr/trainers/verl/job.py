"""One verl client-round as a library: check the TrainJob, write what verl reads for it (rows,
agent-loop registry, Hydra overrides, the job's environment), and turn what verl left into a
TrainResult. The command (:mod:`.entry`) and the persistent session (:mod:`.persistent`) both
build on it; evaluation is the shared Hugging Face evaluator (:func:`evaluate`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from fedagent_flwr.atomic import write_text_atomic
from fedagent_flwr.checkpoint.ref import SHARD_GLOB
from fedagent_flwr.clientapp.job import EvalJob, EvalResult, TrainJob, TrainResult, save
from fedagent_flwr.progress import StepProgress, report_step
from fedagent_flwr.rollout.groups import zero_variance_group_share
from fedagent_flwr.schema.run import ALGORITHMS
from fedagent_flwr.trainers.common import evaluator
from fedagent_flwr.trainers.common.checks import InputError, check_train_header, check_train_world
from fedagent_flwr.trainers.common.client_rule import RULE_KEYS, backend_settings, job_rule_specs
from fedagent_flwr.trainers.common.evaluator import EvalSettings
from fedagent_flwr.trainers.common.fedprox import FEDPROX_RULE
from fedagent_flwr.trainers.verl import critic_attention, engine_hooks, user_hooks, weight_sync
from fedagent_flwr.trainers.verl.dataset import AGENT_NAME, FINGERPRINT_FILE, plan_rows, write_rows
from fedagent_flwr.trainers.verl.overrides import (
    AGENT_LOOP_MODULE,
    JobPaths,
    build_overrides,
    job_paths,
    split_group_error,
)
from fedagent_flwr.trainers.verl.runner import ray_temp_dir
from fedagent_flwr.trainers.verl.settings import VerlSettings
from fedagent_flwr.trainers.verl.verl_log import FILE_LOGGER_ENV, StepCallback

PROG = "verl_backend"
TRAIN_RESULT = "train_result.json"
#: vLLM's switch for its batch-invariant kernels (``vllm/envs.py``), read when an engine starts
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


class VerlJobFailed(RuntimeError):
    """The verl job ran but did not produce a usable result."""


def job_environment(base: dict[str, str], *, rules: Sequence[dict[str, Any]] = (), marker_dir: str = "",
                    critic_attn: str = "", plugin_modules: Sequence[str] = (), step_file: str = "",
                    batch_invariant: bool = False) -> dict[str, str]:
    """The verl job's environment: ``base`` minus Ray's variables, plus what the job needs.

    * ``RAY_*`` removed: a verl driver that inherits ``RAY_ADDRESS`` (Flower's Ray actors set it)
      would join Flower's cluster instead of starting its own;
    * ``PYTHONPATH``: the hooks' ``sitecustomize`` directory (``site/``) and this package first,
      so every Ray worker imports the same code;
    * vLLM without FlashInfer's sampler (the GPU wheel set leaves FlashInfer out), unbuffered
      output, Ray logs not de-duplicated (each worker's lines matter when something fails);
    * the user hooks' variables (:mod:`.user_hooks`) only when ``plugin_modules`` / ``rules`` (the
      job's client rules, FedProx's among them, :func:`job_rule_specs`) are given; ``marker_dir``
      is where each actor worker that runs the rules reports it;
    * the host-wide weight-sync lock (:mod:`.weight_sync`), unless ``base`` turns it off;
    * ``step_file``: where verl's file logger writes the per-step metrics (:mod:`.verl_log`);
    * ``VLLM_BATCH_INVARIANT=1`` exactly when ``batch_invariant`` (``trainer.batch_invariant``):
      vLLM's batch-invariant kernels. One inherited from ``base`` is dropped either way, so the
      setting alone decides (verl's ``get_ppo_ray_runtime_env`` forwards the driver's value, or
      "0", to every Ray worker, and vLLM's engine processes inherit it from theirs).
    """
    env = {k: v for k, v in base.items() if not k.startswith("RAY_")}
    for key in (user_hooks.ENV_PLUGINS, user_hooks.ENV_RULES, user_hooks.ENV_RULE_MARKERS):
        env.pop(key, None)
    package_root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (engine_hooks.SITE_DIR, package_root, base.get("PYTHONPATH", "")) if p
    )
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.setdefault("TOKENIZERS_PARALLELISM", "true")
    env["PYTHONUNBUFFERED"] = "1"
    env["RAY_DEDUP_LOGS"] = "0"
    env["HYDRA_FULL_ERROR"] = "1"
    env[weight_sync.ENV_LOCK] = base.get(weight_sync.ENV_LOCK, weight_sync.DEFAULT_LOCK)
    env.pop(critic_attention.ENV_ATTN, None)
    env.pop(FILE_LOGGER_ENV, None)
    env.pop(BATCH_INVARIANT_ENV, None)
    if batch_invariant:
        env[BATCH_INVARIANT_ENV] = "1"
    if step_file:
        env[FILE_LOGGER_ENV] = step_file
    if critic_attn:
        env[critic_attention.ENV_ATTN] = critic_attn  # see critic_attention: verl hard-codes FA2
    if plugin_modules:
        env[user_hooks.ENV_PLUGINS] = ",".join(plugin_modules)
    if rules:
        env[user_hooks.ENV_RULES] = json.dumps(list(rules), sort_keys=True)
        env[user_hooks.ENV_RULE_MARKERS] = marker_dir
    return env


def agent_loop_registry(settings: VerlSettings, episode_log: str) -> list[dict[str, Any]]:
    """The ``agent_loop_config_path`` YAML content: our loop under ``AGENT_NAME``."""
    return [{
        "name": AGENT_NAME,
        "_target_": f"{AGENT_LOOP_MODULE}.EnvAgentLoop",
        "max_new_tokens": settings.max_new_tokens,
        "invalid_action_penalty": settings.invalid_action_penalty,
        "episode_log": episode_log,
        "history_length": settings.history_length,  # windowed mode's window (run_windowed)
        # a fingerprint line per vLLM request beside the episode log (trainer.request_fingerprints)
        "request_fingerprints": settings.request_fingerprints,
    }]


def experiment_name(job: TrainJob) -> str:
    """verl's ``trainer.experiment_name`` for a client-round (it names the job's log lines)."""
    return f"round{job.round}_client{job.client_id}"


def check_train_job(job: TrainJob) -> tuple[VerlSettings, Any, Path, dict[str, Any] | None]:
    """Everything checkable before verl starts; raises InputError naming the culprit."""
    check_train_header(job, "verl backend", ALGORITHMS)
    if job.critic_path and not Path(job.critic_path).is_dir():
        raise InputError(f"critic_path {job.critic_path} is not a directory")
    settings = backend_settings(VerlSettings.from_mapping, job.trainer, PROG)
    for name in settings.plugin_modules:
        # Located, not run (it imports verl): a typo fails here instead of in a Ray worker.
        if _module_spec(name) is None:
            raise InputError(
                f"trainer.plugin_modules: module {name!r} is not importable (install it or put it on PYTHONPATH)"
            )
    world = check_train_world(job, PROG)  # the rule is built once there: a bad one fails before verl starts
    if settings.request_seeds and (split := split_group_error(sum(e.n_envs for e in world.spec.envs),
                                                              settings.agent_workers)):
        raise InputError(split)
    rule = {key: job.trainer.get(key) for key in RULE_KEYS} if world.user_rule else None
    return settings, world.spec, world.model_path, rule


def _module_spec(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package that is missing, or a malformed name
        return None



def checkpoint_dir(root: Path, step: int, role: str) -> Path:
    directory = root / f"global_step_{step}" / role
    if not directory.is_dir() or not list(directory.glob(SHARD_GLOB)):
        raise VerlJobFailed(f"verl finished but wrote no {role} checkpoint ({SHARD_GLOB}) in {directory}")
    return directory


def flat_group_share(records: Sequence[dict[str, Any]]) -> float | None:
    """``zero_variance_group_share`` over the GRPO groups verl formed: each step, verl's trainer
    gives every row a fresh ``uid`` and repeats it ``rollout.n`` times, and its GRPO groups by that
    uid, so one group is one env instance's rollouts at one step (a replayed instance of a later
    epoch, or an instance of another spec entry with the same env and seed, is another group).
    Each group's scores are its rows' (windowed mode: every turn row's, ``turn_scores``).

    None when a record carries no uid: grouping by anything else could merge groups."""
    if not records or any("uid" not in r for r in records):
        return None
    scores: list[float] = []
    groups: list[str] = []
    for r in records:
        rows = [float(s) for s in r.get("turn_scores") or [r["score"]]]
        scores += rows
        groups += [str(r["uid"])] * len(rows)
    return zero_variance_group_share(scores, groups)


def episode_metrics(path: Path) -> tuple[int, dict[str, float]]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    if not records:
        raise VerlJobFailed(f"verl finished but no episode was recorded in {path}")
    n = len(records)
    metrics = {
        "reward_mean": sum(float(r["reward"]) for r in records) / n,
        "score_mean": sum(float(r["score"]) for r in records) / n,
        "success_rate": sum(float(bool(r["success"])) for r in records) / n,
        "num_turns_mean": sum(float(r["num_turns"]) for r in records) / n,
        "truncated_rate": sum(float(bool(r["truncated"])) for r in records) / n,
        "invalid_actions_mean": sum(float(r["invalid"]) for r in records) / n,
    }
    share = flat_group_share(records)
    if share is None:
        print(f"{PROG}: note: episodes in {path} carry no GRPO group id (uid); "
              "zero_variance_group_share not reported", file=sys.stderr)
    else:
        metrics["zero_variance_group_share"] = share
    return n, metrics


#: every step's metrics of a client-round, kept under its output (``<output>/verl/``) in both trainer
#: modes: a persistent session's own step file lives in the session's directory and starts anew
#: every round, so without this copy a round's per-step record would be gone with the session. A
#: subprocess job's verl writes this file itself (:func:`prepare_train`), so it is never there twice.
STEPS_FILE = "steps.jsonl"

# verl step metrics worth carrying into the TrainResult (the rest stays in verl.log).
_STEP_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss",
              "critic/score/mean", "response_length/mean", "timing_s/step", "timing_s/gen",
              "timing_s/old_log_prob", "timing_s/ref", "timing_s/values", "timing_s/adv",
              "timing_s/update_actor", "timing_s/update_critic", "timing_s/save_checkpoint")


@dataclass(frozen=True)
class PreparedTrain:
    """One client-round made ready for verl: checked inputs, row plan and overrides written."""

    settings: VerlSettings
    model_path: Path
    rules: list[dict[str, Any]]  # the job's client rules, FedProx's first (job_rule_specs)
    output: Path  # the job's output_dir
    work: Path  # <output>/verl
    paths: JobPaths
    rows: int
    batch_size: int
    episode_log: Path
    marker_dir: Path  # where the actor workers running the rules report
    step_file: Path  # verl's file logger: one JSON line per step (verl_log)
    overrides: list[str]
    env: dict[str, str]  # the verl processes' environment (job_environment)


def prepare_train(job: TrainJob, shared_dir: Path | None = None,
                  checked: tuple[VerlSettings, Any, Path, dict[str, Any] | None] | None = None) -> PreparedTrain:
    """Check ``job`` and write what verl reads for it (steps 1-2 of the module docstring).

    ``shared_dir`` is a persistent session's own directory (:mod:`.persistent`): the agent-loop
    YAML, the hook marker directories and the Ray temp dir are fixed when the session starts, so
    they live there instead of under the job's output. Each row then names the round's episode
    log, so episodes land in this job's output either way. ``checked`` is
    :func:`check_train_job`'s answer when the caller already has it.
    """
    settings, spec, model_path, _ = checked if checked is not None else check_train_job(job)
    rules = job_rule_specs(job.proximal_mu, job.trainer)
    output = Path(job.output_dir).resolve()
    work = output / "verl"
    work.mkdir(parents=True, exist_ok=True)
    own = shared_dir if shared_dir is not None else work
    temp_dir = ray_temp_dir(str(shared_dir if shared_dir is not None else output))
    paths = job_paths(work, str(model_path), job.critic_path, temp_dir)
    if shared_dir is not None:
        paths = replace(paths, agent_loop_file=str(shared_dir / "agent_loops.yaml"))
    else:
        shutil.rmtree(temp_dir, ignore_errors=True)
    # A retried client-round must never report a checkpoint or episodes of an earlier attempt.
    shutil.rmtree(paths.checkpoint_dir, ignore_errors=True)
    episode_log = work / "episodes.jsonl"
    episode_log.unlink(missing_ok=True)
    # the agent loop's request fingerprints (trainer.request_fingerprints) go beside the episode log
    (work / FINGERPRINT_FILE).unlink(missing_ok=True)
    marker_dir = own / "client_rule_markers"
    shutil.rmtree(marker_dir, ignore_errors=True)
    # A session's processes keep the environment they started with: its step file is its own. A
    # subprocess job's verl logs straight into the file the round keeps (keep_steps then rewrites
    # it whole): a file of verl's own beside it would hold every step a second time.
    step_file = shared_dir / "verl_steps.jsonl" if shared_dir is not None else work / STEPS_FILE

    # One epoch of rows; verl replays them job.epochs times (trainer.total_epochs).
    rows = plan_rows(spec, job.data_seed, job.local_steps, episode_log=str(episode_log))
    batch_size = sum(entry.n_envs for entry in spec.envs)
    write_rows(rows, Path(paths.rows_file))
    write_rows(rows[:batch_size], Path(paths.val_rows_file))
    # A session's YAML is read once, when its agent loops start: it must not name a round's log.
    registry = agent_loop_registry(settings, "" if shared_dir is not None else str(episode_log))
    Path(paths.agent_loop_file).write_text(yaml.safe_dump(registry))
    overrides = build_overrides(
        algorithm=job.algorithm, settings=settings, paths=paths, batch_size=batch_size,
        local_steps=job.local_steps, seed=job.data_seed, experiment_name=experiment_name(job), epochs=job.epochs,
    )
    env = job_environment(dict(os.environ), rules=rules, marker_dir=str(marker_dir),
                          critic_attn=settings.attn_implementation if job.algorithm == "ppo" else "",
                          plugin_modules=settings.plugin_modules, step_file=str(step_file),
                          batch_invariant=settings.batch_invariant)
    return PreparedTrain(settings=settings, model_path=model_path, rules=rules, output=output, work=work,
                         paths=paths, rows=len(rows), batch_size=batch_size, episode_log=episode_log,
                         marker_dir=marker_dir, step_file=step_file, overrides=overrides, env=env)


def describe(job: TrainJob, prep: PreparedTrain) -> str:
    """The one line announcing a client-round."""
    return (f"{PROG}: round {job.round} client {job.client_id}: {job.algorithm} on {prep.rows} env "
            f"instances ({prep.batch_size} per step x {job.local_steps} steps, x {job.epochs} epochs, "
            f"n={prep.settings.rollout_n}), "
            f"model {prep.model_path}")


def progress_reporter(job: TrainJob, prep: PreparedTrain, started: float) -> StepCallback:
    """The callback that turns each verl step into the client's progress record
    (:mod:`fedagent_flwr.progress`), with the success rate of that step's episodes: the row plan is
    step-major and verl plays a step's rows before logging it, so step ``s`` owns episodes
    ``(s-1)*k .. s*k-1`` of the episode log (``k`` = rows per step x ``rollout.n``)."""
    per_step = prep.batch_size * prep.settings.rollout_n

    def on_step(step: int, metrics: dict[str, float]) -> None:
        success = None
        if prep.episode_log.exists():
            lines = [line for line in prep.episode_log.read_text().splitlines() if line.strip()]
            mine = lines[(step - 1) * per_step: step * per_step]
            try:
                if mine:
                    success = sum(float(bool(json.loads(line).get("success"))) for line in mine) / len(mine)
            except ValueError:  # a line still being written: report the step without it
                success = None
        # verl's global step: epochs x local_steps of them, the episode log growing in that order
        report_step(prep.output, StepProgress(step, job.epochs * job.local_steps,
                                              round(time.monotonic() - started, 1), success))

    return on_step


def active_rule_workers(prep: PreparedTrain) -> int:
    """How many actor workers reported running all of the job's client rules (0 without rules)."""
    if not prep.rules:
        return 0
    wanted = [spec["client_rule"] for spec in prep.rules]
    return sum(1 for marker in engine_hooks.read_markers(str(prep.marker_dir)) if marker.get("rules") == wanted)


def keep_steps(path: Path, steps: dict[int, dict[str, float]]) -> None:
    """Write a round's per-step metrics to ``path`` (written whole, then renamed), one JSON line a
    step in verl's file-logger form (``{"step": n, "data": {...}}``, :mod:`.verl_log`), in step
    order. A round's first step is where two runs of one config can first differ, and the round's
    ``metrics.jsonl`` entry keeps only its last step."""
    write_text_atomic(path, "".join(json.dumps({"step": step, "data": steps[step]}, sort_keys=True) + "\n"
                                    for step in sorted(steps)))


def collect_result(job: TrainJob, prep: PreparedTrain, steps: dict[int, dict[str, float]],
                   first_step: float | None, started: float, log: str,
                   extra_metrics: dict[str, float] | None = None) -> TrainResult:
    """Check what verl left and write ``train_result.json`` (step 5 of the module docstring).

    ``steps`` are verl's per-step metrics (its file logger's, :mod:`.verl_log`), ``first_step`` the
    seconds from ``started`` to the end of step 1 (None if unknown), ``log`` where the failure messages send the reader.
    """
    settings = prep.settings
    keep_steps(prep.work / STEPS_FILE, steps)  # first, so a round that fails below keeps its steps too
    checkpoints = Path(prep.paths.checkpoint_dir)
    last_step = job.epochs * job.local_steps  # verl's global step of the one save
    actor_dir = checkpoint_dir(checkpoints, last_step, "actor")
    critic_dir = checkpoint_dir(checkpoints, last_step, "critic") if job.algorithm == "ppo" else None
    active = active_rule_workers(prep)
    if job.proximal_mu > 0 and active < settings.n_gpus_per_node:
        raise VerlJobFailed(
            f"FedProx (mu={job.proximal_mu}) was active in {active} of {settings.n_gpus_per_node} "
            f"actor workers; refusing to report a FedAvg update as FedProx (log: {log})"
        )
    user_rules = [spec["client_rule"] for spec in prep.rules if spec["client_rule"] != FEDPROX_RULE]
    if prep.rules and active < settings.n_gpus_per_node:
        raise VerlJobFailed(
            f"the client rule {', '.join(user_rules)} was not active in every actor worker; refusing to "
            f"report an update made without it (log: {log})"
        )
    num_episodes, metrics = episode_metrics(prep.episode_log)
    last = steps.get(max(steps)) if steps else {}
    for key in _STEP_KEYS:
        if last and key in last:
            metrics[f"verl/{key}"] = last[key]
    metrics["verl/steps"] = float(len(steps))
    if first_step is not None:
        # verl logs step 1's metrics when step 1 ends: cold start = that moment minus step 1.
        metrics["verl/launch_to_step1_end_s"] = round(first_step, 2)
        step1 = steps.get(min(steps), {}).get("timing_s/step") if steps else None
        if step1 is not None:
            metrics["verl/cold_start_s"] = round(first_step - step1, 2)
    metrics["train_seconds"] = round(time.monotonic() - started, 2)
    metrics["proximal_mu"] = float(job.proximal_mu)
    if job.proximal_mu > 0:
        metrics["fedprox/active_workers"] = float(active)
    metrics.update(extra_metrics or {})
    result = TrainResult(
        actor_dir=str(actor_dir),
        actor_format="fsdp-shards",
        num_episodes=num_episodes,
        metrics=metrics,
        critic_dir=str(critic_dir) if critic_dir else "",
        world_size=settings.n_gpus_per_node,
    )
    save(result, prep.output / TRAIN_RESULT)
    return result


def evaluate(job: EvalJob) -> EvalResult:
    """Validation episodes with Hugging Face generation on the node's accelerator, with the
    sampling knobs of the verl settings (the rest at the evaluator's defaults), under the token
    bounds the agent loop trains under (prompt and response budgets, not only their sum)."""
    settings, _ = VerlSettings.from_mapping(job.trainer)
    bounds = settings.token_bounds
    return evaluator.evaluate(job, EvalSettings(
        max_new_tokens=settings.max_new_tokens,
        val_temperature=settings.val_temperature,
        max_model_len=bounds.max_model_len,
        device="auto",
        rollout_mode=settings.rollout_mode,  # scored with the agent loop it was trained with
        history_length=settings.history_length,
        chat_template_kwargs=settings.chat_template_kwargs,  # rendered as the agent loop renders (verl's data key)
    ), model_len_key="trainer.max_prompt_length + trainer.max_response_length", bounds=bounds)
