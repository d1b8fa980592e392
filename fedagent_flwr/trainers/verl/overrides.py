"""TrainJob + VerlSettings -> the Hydra overrides of one ``verl.trainer.main_ppo`` job.

Pure and verl-free, so the exact command a client will run can be built, logged and checked
(composed and validated against verl's own config schema in the tests) without a GPU.

Choices that are not plain knobs:

* **Batching.** One training step plays every env instance of the client's partition once
  (``train_batch_size`` = sum of ``n_envs``), each ``rollout.n`` times; the dataset is planned
  step-major and not shuffled, so step ``s`` plays exactly the instances the reference trainer
  plays at step ``s``. ``total_epochs`` = ``epochs`` (FedAgent's E: verl replays the same rows,
  in the same order, with fresh rollouts each epoch) and ``total_training_steps`` =
  ``epochs x local_steps``.
* **Saving.** ``save_freq`` = ``epochs x local_steps`` so the last step (and only it) is saved; the actor
  (and critic) save ``model`` + ``extra`` only: the optimiser state is never aggregated and would
  triple the bytes written.
* **Isolation.** The job starts its *own* Ray cluster (``address=local``) in its own temp dir, so
  concurrent clients on one host (and Flower's simulation cluster) never meet.
* **Shared GPUs.** ``kv_cache_gib`` > 0 fixes vLLM's KV cache size instead of letting it profile
  free memory: profiling fails ("Error in memory profiling", "No available memory for the cache
  blocks") when clients sharing a GPU start their engines at the same time (seen on an H200).
* **Logging.** verl's ``console`` logger (the job's log) and its ``file`` logger, whose JSONL
  the client reads for per-step metrics (:mod:`.verl_log`), plus the user's ``trainer.verl_logger``.
* **Chat template.** ``model.chat_template_kwargs`` becomes ``data.apply_chat_template_kwargs``, which
  verl's agent-loop base class reads (and hands to ours; our episode dataset renders nothing);
  written only when non-empty.
* **PPO.** ``adv_estimator=gae`` with a critic that starts from the aggregated critic of the
  previous round (``job.critic_path``), or from the base model in the first round.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedagent_flwr.schema.run import ALGORITHMS, Train
from fedagent_flwr.trainers.verl.settings import VerlSettings

AGENT_LOOP_MODULE = "fedagent_flwr.trainers.verl.agent_loop"
DATASET_MODULE = "fedagent_flwr.trainers.verl.dataset"
WINDOWED_MANAGER = "fedagent_flwr.trainers.verl.windowed.WindowedAgentLoopManager"
SEEDED_MANAGER = "fedagent_flwr.trainers.verl.request_seeds.SeededAgentLoopManager"
SEEDED_WINDOWED_MANAGER = "fedagent_flwr.trainers.verl.windowed.SeededWindowedAgentLoopManager"


@dataclass(frozen=True)
class JobPaths:
    """Where one verl job reads and writes (all absolute)."""

    model_path: str  # HF directory of the global model (actor start, and ref policy)
    critic_path: str  # HF directory of the critic's start ("" -> the model, PPO only)
    rows_file: str  # the row plan (data.train_files)
    val_rows_file: str  # a (small) row plan for data.val_files; verl builds it even unused
    agent_loop_file: str  # agent-loop registry YAML
    checkpoint_dir: str  # trainer.default_local_dir
    ray_temp_dir: str  # the job's private Ray temp dir (keep it short: Unix socket paths)


def agent_loop_manager(settings: VerlSettings) -> str | None:
    """The agent-loop manager class the job names (``agent_loop_manager_class``), or None for
    verl's own: windowed mode's, with a seed per request when ``request_seeds`` is on
    (:mod:`.request_seeds`)."""
    if settings.rollout_mode == "windowed":
        return SEEDED_WINDOWED_MANAGER if settings.request_seeds else WINDOWED_MANAGER
    return SEEDED_MANAGER if settings.request_seeds else None


def split_group_error(batch_size: int, agent_workers: int, workers_key: str = "trainer.agent_workers") -> str | None:
    """Why seeded requests (``trainer.request_seeds``) would repeat a seed, or None.

    verl's ``AgentLoopManager.generate_sequences`` splits a step's ``batch_size x rollout.n`` rows
    (groups of ``rollout.n`` consecutive rows) into ``agent_workers`` equal chunks
    (``DataProto.chunk``); every chunk holds whole groups exactly when ``agent_workers`` divides
    ``batch_size``. Otherwise a group spans two chunks, its ``rollout_n`` restarts at 0 in the
    second, and two of its rollouts would get the same seeds."""
    if batch_size % agent_workers == 0:
        return None
    return (f"config key '{workers_key}' = {agent_workers} with trainer.request_seeds=true must divide the env "
            f"instances a verl step plays (the sum of env.train.envs.*.n_envs = {batch_size}): verl gives each "
            "agent-loop worker an equal chunk of the step's rows, and a GRPO group split over two chunks would "
            "reuse its seeds; set agent_workers to a divisor of it (1 always works)")


def build_overrides(
    *,
    algorithm: str,
    settings: VerlSettings,
    paths: JobPaths,
    batch_size: int,
    local_steps: int,
    seed: int,
    experiment_name: str,
    epochs: int = Train.epochs,
) -> list[str]:
    """Hydra overrides for ``python -m verl.trainer.main_ppo``, in a stable order.

    ``batch_size`` is the number of env instances per step; ``seed`` seeds verl's own RNG use
    (rollout sampling in vLLM and the dataloader), derived by the caller from the data seed;
    ``epochs`` is how many times verl goes through the ``local_steps`` batches of rows.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be 'grpo' or 'ppo', got {algorithm!r}")
    if batch_size < 1 or local_steps < 1 or epochs < 1:
        raise ValueError(f"batch_size, local_steps and epochs must be >= 1, got {batch_size}, {local_steps} "
                         f"and {epochs}")
    total_steps = epochs * local_steps
    s = settings
    mini_batch = min(s.ppo_mini_batch_size, batch_size)
    micro = min(s.micro_batch_size_per_gpu, mini_batch * s.rollout_n)
    use_kl = s.kl_coef > 0
    overrides = [
        f"algorithm.adv_estimator={'gae' if algorithm == 'ppo' else 'grpo'}",
        "algorithm.use_kl_in_reward=False",
        # data: one row per env instance, planned by the entry module
        f"data.train_files={paths.rows_file}",
        f"data.val_files={paths.val_rows_file}",
        f"data.custom_cls.path=pkg://{DATASET_MODULE}",
        "data.custom_cls.name=EnvEpisodeDataset",
        f"data.train_batch_size={batch_size}",
        f"data.val_batch_size={batch_size}",
        f"data.max_prompt_length={s.max_prompt_length}",
        f"data.max_response_length={s.max_response_length}",
        "data.shuffle=False",
        "data.dataloader_num_workers=0",
        f"data.seed={seed}",
        # model
        f"actor_rollout_ref.model.path={paths.model_path}",
        f"+actor_rollout_ref.model.override_config.attn_implementation={s.attn_implementation}",
        f"actor_rollout_ref.model.use_remove_padding={s.use_remove_padding}",
        # actor
        f"actor_rollout_ref.actor.optim.lr={s.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.ppo_epochs={s.ppo_epochs}",
        f"actor_rollout_ref.actor.clip_ratio={s.clip_ratio}",
        f"actor_rollout_ref.actor.entropy_coeff={s.entropy_coeff}",
        f"actor_rollout_ref.actor.use_kl_loss={use_kl}",
        f"actor_rollout_ref.actor.kl_loss_coef={s.kl_coef}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,extra]",
        # rollout: vLLM async server, our agent loop
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={s.rollout_n}",
        f"actor_rollout_ref.rollout.temperature={s.temperature}",
        f"actor_rollout_ref.rollout.top_p={s.top_p}",
        f"actor_rollout_ref.rollout.val_kwargs.temperature={s.val_temperature}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={s.gpu_memory_utilization}",
        f"actor_rollout_ref.rollout.enforce_eager={s.enforce_eager}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.agent.num_workers={s.agent_workers}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={paths.agent_loop_file}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=fedagent_env",
        # windowed mode (rollout.mode): one training row per turn (trainers/verl/windowed.py); a seed
        # per vLLM request (request_seeds, trainers/verl/request_seeds.py)
        *([f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={manager}"]
          if (manager := agent_loop_manager(s)) else []),
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        # the loop sets reward_score itself; reward workers only idle
        "reward.num_workers=1",
        # trainer
        f"trainer.n_gpus_per_node={s.n_gpus_per_node}",
        "trainer.nnodes=1",
        f"trainer.total_epochs={epochs}",
        f"trainer.total_training_steps={total_steps}",
        f"trainer.save_freq={total_steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=False",
        f"trainer.logger=[{','.join(s.loggers)}]",
        "trainer.project_name=fedagent_flwr",
        f"trainer.experiment_name={experiment_name}",
        f"trainer.default_local_dir={paths.checkpoint_dir}",
        "trainer.resume_mode=disable",
        f"trainer.use_v1={s.use_v1}",
        # a private Ray cluster per job
        f"ray_kwargs.ray_init.num_cpus={s.ray_num_cpus}",
        "+ray_kwargs.ray_init.address=local",
        f"+ray_kwargs.ray_init._temp_dir={paths.ray_temp_dir}",
        "+ray_kwargs.ray_init.include_dashboard=False",
    ]
    if algorithm == "ppo":
        critic_start = paths.critic_path or paths.model_path
        overrides += [
            f"critic.model.path={critic_start}",
            f"+critic.model.override_config.attn_implementation={s.attn_implementation}",
            f"critic.model.use_remove_padding={s.use_remove_padding}",
            f"critic.optim.lr={s.critic_lr}",
            f"critic.ppo_mini_batch_size={mini_batch}",
            f"critic.ppo_micro_batch_size_per_gpu={micro}",
            f"critic.ppo_epochs={s.ppo_epochs}",
            "critic.checkpoint.save_contents=[model,extra]",
        ]
    # Start-up knobs (docs/gpu.md, "Start-up phases"), written only when they leave verl's default,
    # so a job with the defaults runs the very command it ran before they existed.
    if not s.torch_compile:
        # verl's FSDP engine reads its own ``fsdp_config.use_torch_compile`` (engine/fsdp.yaml sets
        # it to true, not linked to the actor's key), so the actor's and the reference's engine
        # configs are set, and the actor's key too. PPO's critic config has no such key: left alone.
        overrides += ["actor_rollout_ref.actor.use_torch_compile=False",
                      "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
                      "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False"]
    if s.cudagraph_capture_sizes:
        overrides.append("actor_rollout_ref.rollout.cudagraph_capture_sizes="
                         f"[{','.join(str(n) for n in s.cudagraph_capture_sizes)}]")
    if s.kv_cache_gib > 0:
        # A fixed KV cache: vLLM then skips its memory profiling, which fails when another job on
        # the same GPU allocates or frees memory meanwhile (clients sharing a GPU start together).
        overrides.append("+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes="
                         f"{int(s.kv_cache_gib * 2**30)}")
    if s.chat_template_kwargs:
        # the agent loop renders every prompt with verl's data.apply_chat_template_kwargs; the run's
        # validation (the Hugging Face evaluator) renders with the same model.chat_template_kwargs
        # "++": verl declares the key as an empty mapping, to which Hydra adds keys only so
        overrides.append(f"++data.apply_chat_template_kwargs={hydra_value(s.chat_template_kwargs)}")
    overrides += list(s.extra_overrides)
    return overrides


def hydra_value(value: Any) -> str:
    """``value`` (a mapping with identifier keys, JSON scalars, lists; what the schema lets
    ``model.chat_template_kwargs`` hold) in Hydra's override grammar, read back as the same value:
    strings quoted, so that ``true``, ``1`` or ``null`` stay strings (Hydra's quoting: a quote, and the
    backslashes before a quote or the closing one, escaped; the schema refuses ``${``, an interpolation)."""
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{key}:{hydra_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(item) for item in value) + "]"
    if isinstance(value, str):
        text = re.sub(r"(\\+)(?='|$)", r"\1\1", value)
        return "'" + text.replace("'", "\\'") + "'"
    return json.dumps(value)  # true/false, null, numbers (finite: the schema refuses nan and inf)


def job_paths(work_dir: Path, model_path: str, critic_path: str, ray_temp_dir: str) -> JobPaths:
    """The standard layout of one job under ``work_dir`` (``<client output>/verl``)."""
    work_dir = work_dir.resolve()
    return JobPaths(
        model_path=model_path,
        critic_path=critic_path,
        rows_file=str(work_dir / "train_rows.json"),
        val_rows_file=str(work_dir / "val_rows.json"),
        agent_loop_file=str(work_dir / "agent_loops.yaml"),
        checkpoint_dir=str(work_dir.parent / "checkpoints"),
        ray_temp_dir=ray_temp_dir,
    )
