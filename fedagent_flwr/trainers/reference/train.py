"""One reference-trainer job end to end: check it, load the model, train (or evaluate), write the
result file. :func:`train_loaded` / :func:`evaluate_loaded` are shared with the persistent session
(:mod:`.session`), which only loads the weights differently."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedagent_flwr.checkpoint.content_hash import hash_checkpoint_dir
from fedagent_flwr.clientapp.job import EvalJob, EvalResult, TrainJob, TrainResult, save
from fedagent_flwr.envs.spec import EnvSpec
from fedagent_flwr.progress import StepProgress, report_step
from fedagent_flwr.rollout.episode import Episode
from fedagent_flwr.rollout.groups import zero_variance_group_share
from fedagent_flwr.seeding import train_env_seed, train_group_ids
from fedagent_flwr.trainers.common import evaluator
from fedagent_flwr.trainers.common.checks import check_eval_job as check_eval_fields
from fedagent_flwr.trainers.common.checks import check_train_header, check_train_world, check_turns_fit
from fedagent_flwr.trainers.common.client_rule import RuleChain, backend_settings
from fedagent_flwr.trainers.common.evaluator import episode_metrics, load_model, mean
from fedagent_flwr.trainers.common.sampler import EpisodeTask, HFPolicy, play_episodes
from fedagent_flwr.trainers.common.seeds import derive_seed, seed_everything
from fedagent_flwr.trainers.reference.checkpoint import write_fsdp_checkpoint
from fedagent_flwr.trainers.reference.config import GRPOConfig
from fedagent_flwr.trainers.reference.grpo import TokenSample, grpo_advantages, grpo_update, windowed_samples
from fedagent_flwr.trainers.reference.lora import adapter_seed, fresh_adapter, write_adapter_checkpoint

PROG = "reference_trainer"
TRAIN_RESULT = "train_result.json"


def step_tasks(spec: EnvSpec, data_seed: int, step: int, rollout_n: int) -> list[EpisodeTask]:
    """The episodes of local step ``step``: ``rollout_n`` rollouts of every env instance of every
    spec entry (seeded :func:`~fedagent_flwr.seeding.train_env_seed`), one instance's rollouts one
    GRPO group (:func:`~fedagent_flwr.seeding.train_group_ids`: the env seed, unless another
    instance of the step has that seed)."""
    instances = [(entry, train_env_seed(data_seed, j, step, entry.n_envs, i))
                 for j, entry in enumerate(spec.envs) for i in range(entry.n_envs)]
    groups = train_group_ids([seed for _, seed in instances])
    return [EpisodeTask(entry.name, entry.env_config(), seed, entry.max_turns, group)
            for (entry, seed), group in zip(instances, groups, strict=True) for _ in range(rollout_n)]


def _config(job: TrainJob | EvalJob) -> GRPOConfig:
    return backend_settings(GRPOConfig.from_mapping, job.trainer, PROG)


def check_train_job(job: TrainJob) -> tuple[EnvSpec, GRPOConfig, Path, RuleChain]:
    """Validate everything about a TrainJob that can be checked before loading the model; the
    client rules come built (FedProx's first when ``proximal_mu`` > 0), ready for the update."""
    check_train_header(job, "reference trainer", ("grpo",))
    cfg = _config(job)
    world = check_train_world(job, PROG)
    return world.spec, cfg, world.model_path, world.rules


def train(job: TrainJob) -> TrainResult:
    """Run ``job.epochs`` x ``job.local_steps`` GRPO steps and write the checkpoint and ``train_result.json``."""
    spec, cfg, model_path, rules = check_train_job(job)  # before importing torch: bad input fails fast
    started = time.monotonic()
    model, tokenizer = load_model(model_path, cfg.num_threads)
    # keep: a persistent session's job, rerun in this fresh process after its trainer died or
    # stalled (the ClientApp's fallback; the server refuses keep with trainer.mode=subprocess): it
    # trains from a new AdamW and says so.
    fresh = {"optimizer_state_kept": 0.0} if cfg.optimizer_state == "keep" else None
    return train_loaded(job, spec, cfg, rules, model, tokenizer, started, extra_metrics=fresh, model_path=model_path)


def make_optimizer(model: Any, cfg: GRPOConfig) -> Any:
    """The job's AdamW over ``model``'s trainable parameters (a persistent session may load the
    client's previous round's state into it before :func:`train_loaded` runs)."""
    import torch

    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                             weight_decay=cfg.weight_decay)


def train_loaded(job: TrainJob, spec: EnvSpec, cfg: GRPOConfig, rules: RuleChain, model: Any,
                 tokenizer: Any, started: float, optimizer: Any = None,
                 extra_metrics: dict[str, float] | None = None, model_path: Path | None = None) -> TrainResult:
    """Train ``model`` (the job's starting weights, loaded) in place; the rest of :func:`train`.

    Seeded here, after loading, so a fresh process and a persistent session that only reloaded
    the weights train bit-identically. ``optimizer``: :func:`make_optimizer`'s (a new one when
    None); ``extra_metrics`` join the result's metrics. With ``model.lora`` a fresh adapter is
    attached to ``model`` first (:mod:`.lora`) and only it is trained and written, with the
    content hash of ``model_path`` (the directory ``model`` was loaded from; None: the job's
    ``model_path``) as the model it was trained on; the adapter is taken out again (unmerged)
    before this returns or raises, so ``model`` keeps its weights and layout (a persistent
    session's live model loads the next round's weights without a copy per round).
    """
    if cfg.lora.rank > 0:  # federated LoRA: train a fresh adapter on the global model, save only it
        if optimizer is not None:  # it would hold the full model's parameters, not the adapter's
            raise ValueError("with model.lora the optimiser is made after the adapter is attached: pass none")
        # the server reads the adapter on this model only (checkpoint.lora_reader); hashed before training
        base_sha256 = hash_checkpoint_dir(model_path or Path(job.model_path))
        with fresh_adapter(model, cfg.lora, adapter_seed(job.base_seed, job.round, job.client_id)) as adapter:
            return _train(job, spec, cfg, rules, model, tokenizer, started, None, extra_metrics, (adapter, base_sha256))
    return _train(job, spec, cfg, rules, model, tokenizer, started, optimizer, extra_metrics, None)


def _train(job: TrainJob, spec: EnvSpec, cfg: GRPOConfig, rules: RuleChain, model: Any, tokenizer: Any,
           started: float, optimizer: Any, extra_metrics: dict[str, float] | None,
           lora: tuple[Any, str] | None) -> TrainResult:
    """:func:`train_loaded`'s seeding, GRPO steps and result; ``lora``: the attached adapter (peft's
    wrapper of ``model``) and the start model's content hash, to write the adapter alone."""
    import torch

    adapter, base_sha256 = lora if lora is not None else (None, "")
    seed_everything(job.data_seed)
    compute_dtype = cfg.torch_compute_dtype()
    # Sampling uses a copy in the compute dtype, refreshed after every update (like verl syncing
    # the trained weights into vLLM); in fp32 the trained model samples itself.
    sampler = model if compute_dtype == torch.float32 else copy.deepcopy(model).to(compute_dtype)
    policy = HFPolicy(sampler, tokenizer, cfg.gen_batch_size, cfg.prefill == "incremental")
    # A frozen copy of the starting (global) weights is the KL reference (FedProx's rule keeps
    # its own anchor).
    ref_model = None
    if cfg.kl_coef > 0:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    if optimizer is None:
        optimizer = make_optimizer(model, cfg)
    sampling = cfg.sampling()

    all_episodes: list[Episode] = []
    num_samples = 0
    losses, kls, rule_values = [], [], []
    # Every GRPO group of the job: one instance's rollouts at one update (a replayed instance of a
    # later epoch is a group of its own, as in verl, whose trainer gives each step's rows new uids).
    group_rewards: list[float] = []
    group_keys: list[tuple[int, int]] = []
    total_steps = job.epochs * job.local_steps
    # FedAgent's E (verl's total_epochs over one round's dataset): every epoch replays the same
    # instances in the same order, with fresh rollouts from the current weights.
    for update in range(total_steps):
        epoch, step = divmod(update, job.local_steps)
        step_started = time.monotonic()
        tasks = step_tasks(spec, job.data_seed, step, cfg.rollout_n)
        # Sampling continues with the optimiser step's own stream (the first epoch's are those of
        # a run without epochs), so a replayed instance gets new rollouts, as in verl.
        generator = torch.Generator().manual_seed(derive_seed("rollout", job.data_seed, update))
        episodes = play_episodes(policy, tokenizer, tasks, sampling, cfg.max_model_len, generator,
                                 cfg.rollout_mode, cfg.history_length, chat_template_kwargs=cfg.chat_template_kwargs)
        rollout_seconds = time.monotonic() - step_started
        groups = [t.group for t in tasks]
        samples: Sequence[TokenSample]
        if cfg.rollout_mode == "windowed":
            # One sample per turn, each with its episode's group and return (windowed_samples).
            samples, scores, sample_groups = windowed_samples(episodes, groups)
        else:
            samples, scores, sample_groups = list(episodes), [e.reward for e in episodes], groups
        advantages = grpo_advantages(scores, sample_groups)
        group_rewards += [e.reward for e in episodes]
        group_keys += [(update, group) for group in groups]
        stats = grpo_update(model, ref_model, optimizer, samples, advantages, cfg, policy.pad_id, rules)
        num_samples += len(samples)
        if sampler is not model:
            sampler.load_state_dict(model.state_dict())  # copies and casts to the sampler's dtype
        all_episodes += episodes
        losses.append(stats.loss)
        kls.append(stats.kl)
        rule_values.append(stats.rule_values[-1] if stats.rule_values else 0.0)  # the user's rule runs last
        print(
            f"step {update + 1}/{total_steps} epoch {epoch + 1}/{job.epochs} episodes {len(episodes)} "
            f"samples {len(samples)} "
            f"reward_mean {mean([e.reward for e in episodes]):.4f} "
            f"success_rate {mean([float(e.success) for e in episodes]):.4f} "
            f"loss {stats.loss:.6f} seconds {time.monotonic() - step_started:.2f} "
            f"(rollout {rollout_seconds:.2f})",
            flush=True,
        )
        report_step(job.output_dir, StepProgress(update + 1, total_steps, round(time.monotonic() - started, 1),
                                                 mean([float(e.success) for e in episodes])))

    # Over the whole job, not per step: a step that drew only over-long first prompts is a flat
    # group, but a job in which no episode played a turn has nothing to report.
    check_turns_fit(all_episodes, cfg.max_new_tokens, cfg.max_model_len, "trainer.max_model_len")
    output_dir = Path(job.output_dir)
    step_dir = output_dir / "checkpoints" / f"global_step_{total_steps}"
    actor_dir = (write_adapter_checkpoint(adapter, step_dir, base_sha256) if adapter is not None
                 else write_fsdp_checkpoint(model, tokenizer, step_dir))
    metrics = episode_metrics(all_episodes)
    metrics.update(
        loss=mean(losses),
        kl=mean(kls),
        zero_variance_group_share=zero_variance_group_share(group_rewards, group_keys),
        num_samples=float(num_samples),
        train_seconds=time.monotonic() - started,
        proximal_mu=float(job.proximal_mu),
    )
    if job.trainer.get("client_rule"):  # the user's rule (trainer.client_rule), not FedProx's
        metrics["client_rule_value"] = mean(rule_values)
    metrics.update(extra_metrics or {})
    result = TrainResult(
        actor_dir=str(actor_dir.resolve()),
        actor_format="fsdp-shards" if adapter is None else "peft-lora",
        num_episodes=len(all_episodes),
        metrics=metrics,
        world_size=1,
    )
    save(result, output_dir / TRAIN_RESULT)
    return result


def check_eval_job(job: EvalJob) -> tuple[EnvSpec, GRPOConfig, Path]:
    """Validate an EvalJob before any model is loaded."""
    cfg = _config(job)
    spec, model_path = check_eval_fields(job)
    return spec, cfg, model_path


def evaluate(job: EvalJob) -> EvalResult:
    """One episode per seed (in every env of the full, unpartitioned spec) at val temperature."""
    spec, cfg, model_path = check_eval_job(job)
    started = time.monotonic()
    model, tokenizer = load_model(model_path, cfg.num_threads)
    return evaluate_loaded(job, spec, cfg, model, tokenizer, started)


def evaluate_loaded(job: EvalJob, spec: EnvSpec, cfg: GRPOConfig, model: Any, tokenizer: Any,
                    started: float) -> EvalResult:
    """:func:`fedagent_flwr.trainers.common.evaluator.evaluate_loaded` with this trainer's config."""
    return evaluator.evaluate_loaded(job, spec, cfg, model, tokenizer, started)
