"""The verl trainer backend, run by the ClientApp as a subprocess::

    python -m fedagent_flwr.clientapp.verl_backend.entry train    JOB.json   # TrainJob
    python -m fedagent_flwr.clientapp.verl_backend.entry evaluate JOB.json   # EvalJob
    python -m fedagent_flwr.clientapp.verl_backend.entry serve    CHANNEL    # persistent (.persistent)

``train`` turns the TrainJob into one ``python -m verl.trainer.main_ppo`` job (GRPO, or PPO with a
federated critic) on this client's partition and reports its checkpoint as a TrainResult:

1. checks the job and the verl settings, and plans the rows (env instances) of every local step
   with the same seed rule as the reference trainer (:mod:`.dataset`);
2. writes the agent-loop registry YAML (verl's ``agent_loop_config_path``: the ``@register``
   decorator alone never reaches Ray's workers) and the Hydra overrides (:mod:`.overrides`);
3. starts verl in a session of its own with a scrubbed environment: no inherited ``RAY_*`` (a
   trainer must never join Flower's simulation cluster), a private Ray cluster and temp dir per
   job, the FedProx hook armed through ``sitecustomize`` when ``proximal_mu > 0`` (:mod:`.fedprox`);
4. tees verl's log to ``<output>/verl/verl.log``, parses its per-step metrics and timings, and
   stops whatever is left of the job's Ray cluster when verl exits, also on failure or timeout;
5. refuses to report a result that is not there: a non-zero exit (crash, CUDA out of memory), a
   missing actor (or critic) checkpoint, no episode played, or FedProx not active in every actor
   worker each exit non-zero with one line naming the cause and the log.

``evaluate`` plays the validation episodes with the global model through Hugging Face generation
on the node's GPU (the reference trainer's evaluator): a 135M-parameter model needs seconds for
that, whereas a verl job would spend minutes starting Ray and vLLM.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from fedagent_flwr.checkpoint.ref import SHARD_GLOB
from fedagent_flwr.clientapp.client_rule import RULE_KEYS, load_client_rule, without_rule_keys
from fedagent_flwr.clientapp.job import EvalJob, JobFileError, TrainJob, TrainResult, backend_main, save
from fedagent_flwr.clientapp.verl_backend import critic_attention, fedprox, user_hooks, weight_sync
from fedagent_flwr.clientapp.verl_backend.dataset import AGENT_NAME, plan_rows, write_rows
from fedagent_flwr.clientapp.verl_backend.overrides import AGENT_LOOP_MODULE, JobPaths, build_overrides, job_paths
from fedagent_flwr.clientapp.verl_backend.settings import VerlSettings, VerlSettingsError
from fedagent_flwr.clientapp.verl_backend.verl_log import parse_step_line
from fedagent_flwr.envs.base import EnvConfigError
from fedagent_flwr.envs.registry import UnknownEnvError, make_env
from fedagent_flwr.envs.spec import EnvSpecError
from fedagent_flwr.hetero import PartitionError, partition_env_spec
from fedagent_flwr.models.smollm2 import ModelResolutionError, resolve_model_path
from fedagent_flwr.procs import kill_matching, stop_group
from fedagent_flwr.rollout.groups import zero_variance_group_share

PROG = "verl_backend"
TRAIN_RESULT = "train_result.json"
_OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "torch.OutOfMemoryError")
# vLLM could not size its KV cache: another process on the GPU changed its memory use meanwhile.
_VLLM_MEMORY_MARKERS = ("Error in memory profiling", "No available memory for the cache blocks")
_ERROR_LINE = re.compile(r"\b[A-Za-z_.]*(Error|Exception): ")


class InputError(ValueError):
    """A job this backend cannot run (bad field, setting, env, model)."""


class VerlJobFailed(RuntimeError):
    """The verl job ran but did not produce a usable result."""


def job_environment(base: dict[str, str], *, proximal_mu: float, marker_dir: str,
                    critic_attn: str = "", plugin_modules: Sequence[str] = (),
                    client_rule: dict[str, Any] | None = None, rule_marker_dir: str = "") -> dict[str, str]:
    """The verl job's environment: ``base`` minus Ray's variables, plus what the job needs.

    * ``RAY_*`` removed: a verl driver that inherits ``RAY_ADDRESS`` (Flower's Ray actors set it)
      would join Flower's cluster instead of starting its own;
    * ``PYTHONPATH``: the FedProx ``sitecustomize`` directory and this package first, so every
      Ray worker imports the same code;
    * vLLM without FlashInfer's sampler (the GPU wheel set leaves FlashInfer out), unbuffered
      output, Ray logs not de-duplicated (each worker's lines matter when something fails);
    * the FedProx variables only when ``proximal_mu > 0``; the user hooks' variables
      (:mod:`.user_hooks`) only when ``plugin_modules`` / ``client_rule`` are given;
    * the host-wide weight-sync lock (:mod:`.weight_sync`), unless ``base`` turns it off.
    """
    env = {k: v for k, v in base.items() if not k.startswith("RAY_")}
    for key in (fedprox.ENV_MU, fedprox.ENV_MARKERS, user_hooks.ENV_PLUGINS, user_hooks.ENV_RULE,
                user_hooks.ENV_RULE_MARKERS):
        env.pop(key, None)
    package_root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (fedprox.SITE_DIR, package_root, base.get("PYTHONPATH", "")) if p
    )
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.setdefault("TOKENIZERS_PARALLELISM", "true")
    env["PYTHONUNBUFFERED"] = "1"
    env["RAY_DEDUP_LOGS"] = "0"
    env["HYDRA_FULL_ERROR"] = "1"
    env[weight_sync.ENV_LOCK] = base.get(weight_sync.ENV_LOCK, weight_sync.DEFAULT_LOCK)
    env.pop(critic_attention.ENV_ATTN, None)
    if critic_attn:
        env[critic_attention.ENV_ATTN] = critic_attn  # see critic_attention: verl hard-codes FA2
    if proximal_mu > 0:
        env[fedprox.ENV_MU] = repr(float(proximal_mu))
        env[fedprox.ENV_MARKERS] = marker_dir
    if plugin_modules:
        env[user_hooks.ENV_PLUGINS] = ",".join(plugin_modules)
    if client_rule:
        env[user_hooks.ENV_RULE] = json.dumps(client_rule, sort_keys=True)
        env[user_hooks.ENV_RULE_MARKERS] = rule_marker_dir
    return env


def ray_temp_dir(output_dir: str) -> str:
    """A short per-job Ray temp dir: Ray puts Unix sockets under it (paths must stay < 108 bytes)."""
    digest = hashlib.sha256(str(Path(output_dir).resolve()).encode()).hexdigest()[:10]
    return f"/tmp/fa-ray-{digest}"


def agent_loop_registry(settings: VerlSettings, episode_log: str) -> list[dict[str, Any]]:
    """The ``agent_loop_config_path`` YAML content: our loop under ``AGENT_NAME``."""
    return [{
        "name": AGENT_NAME,
        "_target_": f"{AGENT_LOOP_MODULE}.EnvAgentLoop",
        "max_new_tokens": settings.max_new_tokens,
        "invalid_action_penalty": settings.invalid_action_penalty,
        "episode_log": episode_log,
    }]


def experiment_name(job: TrainJob) -> str:
    return f"round{job.round}_client{job.client_id}"


def check_train_job(job: TrainJob) -> tuple[VerlSettings, Any, Path, dict[str, Any] | None]:
    """Everything checkable before verl starts; raises InputError naming the culprit."""
    if job.algorithm not in ("grpo", "ppo"):
        raise InputError(f"algorithm {job.algorithm!r}: the verl backend does 'grpo' or 'ppo'")
    if isinstance(job.local_steps, bool) or not isinstance(job.local_steps, int) or job.local_steps < 1:
        raise InputError(f"local_steps must be an integer >= 1, got {job.local_steps!r}")
    if not 0 <= job.client_id < job.num_clients:
        raise InputError(f"client_id {job.client_id} is out of range for num_clients {job.num_clients}")
    if job.proximal_mu < 0:
        raise InputError(f"proximal_mu must be >= 0, got {job.proximal_mu}")
    if job.critic_path and not Path(job.critic_path).is_dir():
        raise InputError(f"critic_path {job.critic_path} is not a directory")
    try:
        settings, ignored = VerlSettings.from_mapping(without_rule_keys(job.trainer))
    except VerlSettingsError as exc:
        raise InputError(str(exc)) from None
    if ignored:
        print(f"{PROG}: note: ignoring trainer keys {ignored}", file=sys.stderr)
    for name in settings.plugin_modules:
        # Located, not run (it imports verl): a typo fails here instead of in a Ray worker.
        if _module_spec(name) is None:
            raise InputError(f"trainer.plugin_modules: module {name!r} is not importable (install it or put it on PYTHONPATH)")
    rule = None
    if load_client_rule(job.trainer) is not None:  # built once here, so a bad rule fails before verl starts
        rule = {key: job.trainer.get(key) for key in RULE_KEYS}
    spec = partition_env_spec(job.env_spec, job.partition, job.client_id, job.num_clients,
                              base_seed=job.base_seed)
    for entry in spec.envs:
        make_env(entry.name, entry.env_config())  # config errors surface now, not in a Ray worker
    return settings, spec, resolve_model_path(job.model_path), rule


def _module_spec(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package that is missing, or a malformed name
        return None


def run_verl(command: list[str], env: dict[str, str], cwd: Path, log_path: Path,
             temp_dir: str) -> tuple[int, float | None, list[str], dict[int, dict[str, float]]]:
    """Run verl in its own session; tee its output to ``log_path`` and our stdout.

    Returns (exit code, seconds from launch to the first training step or None, the last lines,
    per-step metrics). A SIGTERM to this process stops the job's whole process group.
    """
    started = time.monotonic()
    first_step: float | None = None
    tail: deque[str] = deque(maxlen=40)
    steps: dict[int, dict[str, float]] = {}
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1, start_new_session=True)

    def forward_term(signum: int, frame: Any) -> None:
        stop_group(process.pid, grace_s=5.0)
        kill_matching(temp_dir)  # what is left of the job's private Ray cluster (its temp dir)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, forward_term)
    succeeded = False
    try:
        with open(log_path, "w") as log_file:
            assert process.stdout is not None
            for line in process.stdout:
                log_file.write(line)
                log_file.flush()
                sys.stdout.write(line)
                tail.append(line.rstrip())
                parsed = parse_step_line(line)
                if parsed is not None:
                    steps[parsed[0]] = parsed[1]
                    if first_step is None:
                        first_step = time.monotonic() - started
        code = process.wait()
        succeeded = code == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_group(process.pid, grace_s=5.0)  # verl if still running, and helpers left in its session
        kill_matching(temp_dir)
        if succeeded:
            # Each job makes a new dir in /tmp, outside the run. After a success its worker output is
            # already in verl.log (RAY_DEDUP_LOGS=0); after a failure Ray's own logs are kept to debug.
            shutil.rmtree(temp_dir, ignore_errors=True)
    return code, first_step, list(tail), steps


def known_cause(text: str) -> str | None:
    """A root cause recognised in verl's output (GPU memory), phrased for the operator; else None."""
    if any(marker in text for marker in _OOM_MARKERS):
        return "ran out of GPU memory (CUDA out of memory)"
    if any(marker in text for marker in _VLLM_MEMORY_MARKERS):
        return ("could not start vLLM: its KV-cache sizing failed because another process on the GPU "
                "changed its memory use meanwhile (set trainer.kv_cache_gib > 0 when clients share a GPU)")
    return None


def _failure_reason(code: int, tail: Sequence[str]) -> str:
    """One line for why verl failed: a known root cause, else the first error line of the tail
    (chained tracebacks print the root cause first), else the last line."""
    known = known_cause("\n".join(tail))
    if known is not None:
        return known
    if code < 0:
        return f"was killed by signal {-code}"
    errors = [line for line in tail if _ERROR_LINE.search(line)]
    line = (errors[:1] or [line for line in tail if line.strip()][-1:] or ["no output"])[0]
    match = _ERROR_LINE.search(line)
    return f"exited with code {code}: {(line[match.start():] if match else line).strip()[:400]}"


def _checkpoint_dir(root: Path, step: int, role: str) -> Path:
    directory = root / f"global_step_{step}" / role
    if not directory.is_dir() or not list(directory.glob(SHARD_GLOB)):
        raise VerlJobFailed(f"verl finished but wrote no {role} checkpoint ({SHARD_GLOB}) in {directory}")
    return directory


def _episode_metrics(path: Path) -> tuple[int, dict[str, float]]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    if not records:
        raise VerlJobFailed(f"verl finished but no episode was recorded in {path}")
    n = len(records)
    return n, {
        "reward_mean": sum(float(r["reward"]) for r in records) / n,
        "score_mean": sum(float(r["score"]) for r in records) / n,
        "success_rate": sum(float(bool(r["success"])) for r in records) / n,
        "num_turns_mean": sum(float(r["num_turns"]) for r in records) / n,
        "truncated_rate": sum(float(bool(r["truncated"])) for r in records) / n,
        "invalid_actions_mean": sum(float(r["invalid"]) for r in records) / n,
        # verl repeats each row rollout.n times: the episodes of one seed form a GRPO group,
        # scored by "score" (the reward verl trains on).
        "zero_variance_group_share": zero_variance_group_share(
            [float(r["score"]) for r in records], [(r.get("env"), r["seed"]) for r in records]),
    }


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
    rule: dict[str, Any] | None
    output: Path  # the job's output_dir
    work: Path  # <output>/verl
    paths: JobPaths
    rows: int
    batch_size: int
    episode_log: Path
    marker_dir: Path
    rule_marker_dir: Path
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
    settings, spec, model_path, rule = checked if checked is not None else check_train_job(job)
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
    marker_dir = own / "fedprox_markers"
    shutil.rmtree(marker_dir, ignore_errors=True)
    rule_marker_dir = own / "client_rule_markers"
    shutil.rmtree(rule_marker_dir, ignore_errors=True)

    rows = plan_rows(spec, job.data_seed, job.local_steps, episode_log=str(episode_log))
    batch_size = sum(entry.n_envs for entry in spec.envs)
    write_rows(rows, Path(paths.rows_file))
    write_rows(rows[:batch_size], Path(paths.val_rows_file))
    # A session's YAML is read once, when its agent loops start: it must not name a round's log.
    registry = agent_loop_registry(settings, "" if shared_dir is not None else str(episode_log))
    Path(paths.agent_loop_file).write_text(yaml.safe_dump(registry))
    overrides = build_overrides(
        algorithm=job.algorithm, settings=settings, paths=paths, batch_size=batch_size,
        local_steps=job.local_steps, seed=job.data_seed, experiment_name=experiment_name(job),
    )
    env = job_environment(dict(os.environ), proximal_mu=job.proximal_mu, marker_dir=str(marker_dir),
                          critic_attn=settings.attn_implementation if job.algorithm == "ppo" else "",
                          plugin_modules=settings.plugin_modules, client_rule=rule,
                          rule_marker_dir=str(rule_marker_dir))
    return PreparedTrain(settings=settings, model_path=model_path, rule=rule, output=output, work=work,
                         paths=paths, rows=len(rows), batch_size=batch_size, episode_log=episode_log,
                         marker_dir=marker_dir, rule_marker_dir=rule_marker_dir, overrides=overrides, env=env)


def describe(job: TrainJob, prep: PreparedTrain) -> str:
    """The one line announcing a client-round."""
    return (f"{PROG}: round {job.round} client {job.client_id}: {job.algorithm} on {prep.rows} env "
            f"instances ({prep.batch_size} per step x {job.local_steps} steps, n={prep.settings.rollout_n}), "
            f"model {prep.model_path}")


def collect_result(job: TrainJob, prep: PreparedTrain, steps: dict[int, dict[str, float]],
                   first_step: float | None, started: float, log: str,
                   extra_metrics: dict[str, float] | None = None) -> TrainResult:
    """Check what verl left and write ``train_result.json`` (step 5 of the module docstring).

    ``steps`` are verl's per-step metrics, ``first_step`` the seconds from ``started`` to the end of
    step 1 (None if unknown), ``log`` where the failure messages send the reader.
    """
    settings = prep.settings
    checkpoints = Path(prep.paths.checkpoint_dir)
    actor_dir = _checkpoint_dir(checkpoints, job.local_steps, "actor")
    critic_dir = _checkpoint_dir(checkpoints, job.local_steps, "critic") if job.algorithm == "ppo" else None
    if job.proximal_mu > 0:
        markers = fedprox.read_markers(str(prep.marker_dir))
        if len(markers) < settings.n_gpus_per_node:
            raise VerlJobFailed(
                f"FedProx (mu={job.proximal_mu}) was active in {len(markers)} of {settings.n_gpus_per_node} "
                f"actor workers; refusing to report a FedAvg update as FedProx (log: {log})"
            )
    if prep.rule is not None and len(fedprox.read_markers(str(prep.rule_marker_dir))) < settings.n_gpus_per_node:
        raise VerlJobFailed(
            f"the client rule {prep.rule['client_rule']} was not active in every actor worker; refusing to "
            f"report an update made without it (log: {log})"
        )
    num_episodes, metrics = _episode_metrics(prep.episode_log)
    last = steps.get(max(steps)) if steps else {}
    for key in _STEP_KEYS:
        if last and key in last:
            metrics[f"verl/{key}"] = last[key]
    metrics["verl/steps"] = float(len(steps))
    if first_step is not None:
        # The first metric line is printed when step 1 ends: cold start = that moment minus step 1.
        metrics["verl/launch_to_step1_end_s"] = round(first_step, 2)
        step1 = steps.get(min(steps), {}).get("timing_s/step") if steps else None
        if step1 is not None:
            metrics["verl/cold_start_s"] = round(first_step - step1, 2)
    metrics["train_seconds"] = round(time.monotonic() - started, 2)
    metrics["proximal_mu"] = float(job.proximal_mu)
    if job.proximal_mu > 0:
        metrics["fedprox/active_workers"] = float(len(fedprox.read_markers(str(prep.marker_dir))))
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


def train(job: TrainJob) -> TrainResult:
    """Run one verl job for ``job`` and write ``train_result.json``."""
    started = time.monotonic()
    prep = prepare_train(job)
    work = prep.work
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *prep.overrides]
    (work / "command.txt").write_text(" \\\n  ".join(command) + "\n")
    print(describe(job, prep), flush=True)
    code, first_step, tail, steps = run_verl(command, prep.env, work, work / "verl.log", prep.paths.ray_temp_dir)
    if code != 0:
        raise VerlJobFailed(f"verl {_failure_reason(code, tail)} (log: {work / 'verl.log'})")
    return collect_result(job, prep, steps, first_step, started, str(work / "verl.log"))


def evaluate(job: EvalJob) -> Any:
    """Validation episodes with Hugging Face generation on the node's accelerator."""
    from fedagent_flwr.clientapp import reference_trainer

    try:
        settings, _ = VerlSettings.from_mapping(job.trainer)
    except VerlSettingsError as exc:
        raise InputError(str(exc)) from None
    knobs = {
        "max_new_tokens": settings.max_new_tokens,
        "val_temperature": settings.val_temperature,
        "max_model_len": settings.max_model_len,
        "device": "auto",
    }
    eval_job = EvalJob(**{**job.__dict__, "trainer": knobs})
    return reference_trainer.evaluate(eval_job)


_BAD_INPUT = (InputError, JobFileError, EnvSpecError, UnknownEnvError, PartitionError, EnvConfigError,
              ModelResolutionError, ValueError)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``train`` / ``evaluate`` / ``serve``); exit status 0 ok, 2 bad input, 1 the verl job failed."""
    return backend_main(PROG, argv, train, evaluate, _BAD_INPUT, failures=(VerlJobFailed,),
                        session_factory=_session)


def _session() -> Any:
    """The persistent trainer's session (``serve CHANNEL_DIR``); imported here, not at the top: it
    builds on this module."""
    from fedagent_flwr.clientapp.verl_backend.persistent import VerlSession

    return VerlSession()


if __name__ == "__main__":
    sys.exit(main())
