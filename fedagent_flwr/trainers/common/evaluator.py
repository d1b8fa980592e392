"""The Hugging Face evaluator both backends use: validation episodes of one model, one per seed
in every env of the full (unpartitioned) spec, at the validation temperature, in the run's rollout
mode (concat or windowed: the agent loop the model is trained with is the one it is scored with).

The verl backend evaluates this way too, on the node's GPU: a 135M-parameter model needs seconds
for it, whereas a verl job would spend minutes starting Ray and vLLM. It passes the token bounds its
agent loop trains under (:meth:`VerlSettings.token_bounds`: the prompt and response budgets, not
only their sum), so validation cuts an episode where training would; the reference backend has one
budget, ``trainer.max_model_len``, for both.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedagent_flwr.clientapp.job import EvalJob, EvalResult, save
from fedagent_flwr.envs.registry import get_env_class
from fedagent_flwr.envs.spec import EnvSpec
from fedagent_flwr.rollout.bounds import TokenBounds
from fedagent_flwr.rollout.episode import Episode, SamplingParams
from fedagent_flwr.schema.trainer import AgentLoopKnobs, EvalKnobs
from fedagent_flwr.trainers.common.checks import InputError, check_eval_job, check_turns_fit
from fedagent_flwr.trainers.common.precision import torch_compute_dtype, torch_device
from fedagent_flwr.trainers.common.sampler import EpisodeTask, HFPolicy, play_episodes
from fedagent_flwr.trainers.common.seeds import derive_seed, seed_everything

EVAL_RESULT = "eval_result.json"
MODEL_LEN_KEY = "trainer.max_model_len"  # the key that sets EvalSettings.max_model_len (reference backend)


@dataclass
class EvalSettings(AgentLoopKnobs, EvalKnobs):
    """How to evaluate: the knobs (and their defaults, the reference trainer's) are
    :class:`~fedagent_flwr.schema.trainer.EvalKnobs`'s and the agent loop's; each backend builds it from its own
    (already checked) settings."""

    def val_sampling(self) -> SamplingParams:
        """The validation sampling parameters."""
        return SamplingParams(self.max_new_tokens, self.val_temperature, self.val_top_p)


def load_model(path: Path, num_threads: int) -> tuple[Any, Any]:
    """Tokenizer and fp32 model (in eval mode) from a resolved local model directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    except (OSError, ValueError) as exc:  # no config/weights/tokenizer, unknown architecture
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"cannot load the model from {path}: {first}") from exc
    model.eval()
    return model, tokenizer


def evaluate(job: EvalJob, settings: EvalSettings, model_len_key: str = MODEL_LEN_KEY,
             bounds: TokenBounds | None = None) -> EvalResult:
    """Check ``job``, load its model and play the validation episodes; writes ``eval_result.json``.
    ``model_len_key`` names the config key(s) that set ``settings.max_model_len``, for errors;
    ``bounds``: see :func:`episode_bounds`."""
    spec, model_path = check_eval_job(job)
    started = time.monotonic()
    model, tokenizer = load_model(model_path, settings.num_threads)
    return evaluate_loaded(job, spec, settings, model, tokenizer, started, model_len_key, bounds)


def episode_bounds(settings: EvalSettings, bounds: TokenBounds | None = None) -> TokenBounds:
    """The token bounds validation plays under: ``bounds``, those of a backend whose training also
    bounds the prompt and the response (verl: :meth:`VerlSettings.token_bounds`), else
    ``settings.max_model_len`` alone (the reference trainer's one budget). ``bounds`` must have
    ``settings.max_model_len`` as its context, or the two would disagree (ValueError)."""
    if bounds is None:
        return TokenBounds(settings.max_model_len)
    if bounds.max_model_len != settings.max_model_len:
        raise ValueError(f"the evaluator's bounds {bounds} disagree with max_model_len {settings.max_model_len}")
    return bounds


def evaluate_loaded(job: EvalJob, spec: EnvSpec, settings: EvalSettings, model: Any, tokenizer: Any,
                    started: float, model_len_key: str = MODEL_LEN_KEY,
                    bounds: TokenBounds | None = None) -> EvalResult:
    """Play the validation episodes with ``model`` (fp32, loaded; moved to the device here) under
    :func:`episode_bounds`."""
    import torch

    bounds = episode_bounds(settings, bounds)
    seed_everything(derive_seed("eval", job.round))
    device = torch_device(settings.device)
    policy = HFPolicy(model.to(device=device, dtype=torch_compute_dtype(settings.compute_dtype, device)),
                      tokenizer, settings.gen_batch_size, settings.prefill == "incremental")
    tasks = [EpisodeTask(e.name, e.env_config(), int(s), e.max_turns, k)
             for e in spec.envs for k, s in enumerate(job.seeds)]
    generators = [torch.Generator(device=device).manual_seed(seed) for seed in episode_seeds(job.round, tasks,
                                                                                            len(job.seeds))]
    waves = episode_waves(spec, len(job.seeds))
    if len(waves) > 1:
        print(f"evaluate: {len(tasks)} episodes in {len(waves)} waves: an entry has more episodes than its env "
              "plays at once (max_concurrent; for an env service, env.service.pool_size)", flush=True)
    played: dict[int, Episode] = {}
    for wave in waves:
        episodes = play_episodes(policy, tokenizer, [tasks[i] for i in wave], settings.val_sampling(),
                                 bounds.max_model_len, [generators[i] for i in wave], settings.rollout_mode,
                                 settings.history_length, max_prompt_len=bounds.max_prompt_len,
                                 max_response_len=bounds.max_response_len,
                                 chat_template_kwargs=settings.chat_template_kwargs)
        played.update(zip(wave, episodes, strict=True))
    episodes = [played[i] for i in range(len(tasks))]
    check_turns_fit(episodes, settings.max_new_tokens, bounds.max_model_len, model_len_key, bounds.max_prompt_len)
    metrics = episode_metrics(episodes)
    for j, name in enumerate(env_metric_names(spec)):
        mine = episodes[j * len(job.seeds):(j + 1) * len(job.seeds)]
        metrics[f"success_rate/{name}"] = mean([float(e.success) for e in mine])
    metrics["eval_seconds"] = time.monotonic() - started
    score = f" score_mean {metrics['score_mean']:.4f}" if "score_mean" in metrics else ""
    print(f"evaluate: {len(episodes)} episodes on {device}: success_rate {metrics['success_rate']:.4f} "
          f"reward_mean {metrics['reward_mean']:.4f}{score} in {metrics['eval_seconds']:.1f} s", flush=True)
    result = EvalResult(
        num_episodes=len(episodes),
        success_rate=metrics["success_rate"],
        reward_mean=metrics["reward_mean"],
        metrics=metrics,
    )
    save(result, Path(job.output_dir) / EVAL_RESULT)
    return result


def played_env_name(env_name: str, config: dict[str, Any]) -> str:
    """The registered name of the env an entry named ``env_name`` with ``config`` plays: the served
    env's for an entry played through an env service (named ``Service``, the served env in
    ``config["env"]``), the entry's own env's otherwise (also when the entry names it by a dotted
    path). The same whether env services are on or off."""
    cls = get_env_class(env_name)
    return cls.served_env_name(config) or cls.env_name or env_name


def episode_seeds(server_round: int, tasks: Sequence[EpisodeTask], seeds_per_entry: int) -> list[int]:
    """The seed of each validation episode's sampling generator, from the round, the episode's
    entry index, the env it plays (:func:`played_env_name`, so that env services on or off give the
    same seeds and samples) and its env seed: an episode samples the same tokens whichever client
    evaluates it and whatever else shares its batches, so the validation score of a model does not
    depend on how many clients split the episodes."""
    return [derive_seed("eval", server_round, index // seeds_per_entry, played_env_name(task.env_name, task.config),
                        task.seed) for index, task in enumerate(tasks)]


def episode_waves(spec: EnvSpec, seeds_per_entry: int) -> list[list[int]]:
    """The validation episodes' indices (entry by entry, ``seeds_per_entry`` each, as
    :func:`evaluate_loaded` lists them) in the waves a lockstep player plays one after another.

    An entry whose env plays at most ``m`` episodes at once (:meth:`BaseTextEnv.max_concurrent`:
    an env service's pool) has its ``k``-th episode in wave ``k // m``; without a limit all go in
    one wave. One batch waits for every running episode, so an episode left waiting for a pool
    slot would stall the rest until the service's create timeout. Each episode keeps its own
    sampling generator, so a wave changes when an episode is played, not its seed.
    """
    limits = [get_env_class(e.name).max_concurrent(e.env_config()) or seeds_per_entry for e in spec.envs]
    count = max((-(-seeds_per_entry // m) for m in limits), default=1)
    return [[j * seeds_per_entry + k for j, m in enumerate(limits) for k in range(seeds_per_entry) if k // m == w]
            for w in range(count)]


def env_metric_names(spec: EnvSpec) -> list[str]:
    """The name each entry's per-env metric carries (``success_rate/<name>``): the env's name (for
    an entry played through an env service, named ``Service``, the served env's, ``config["env"]``),
    or, where several entries of the spec have that name (one env with different configs), the name
    with the entry's index (``TinyGuess[1]``, as ``envs[1]``), so that no entry's metric overwrites
    another's."""
    names = [get_env_class(entry.name).served_env_name(entry.config) or entry.name for entry in spec.envs]
    return [f"{name}[{j}]" if names.count(name) > 1 else name for j, name in enumerate(names)]


def mean(values: Sequence[float]) -> float:
    """The mean of ``values``, 0 for none."""
    return float(sum(values) / len(values)) if values else 0.0


def episode_score(episode: Episode) -> float | None:
    """The env's own score of a finished episode (``info["task_score"]`` of its last turn, as
    WebShop reports it), or None when the env reports none."""
    if not episode.turns:
        return None
    score = episode.turns[-1].info.get("task_score")
    return float(score) if isinstance(score, (int, float)) else None


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Means over ``episodes`` of what every episode records (training and evaluation alike), and
    ``score_mean`` when the env scores every one of them (WebShop: success is a score of 1.0 only,
    so the score shows progress that success hides)."""
    metrics = {
        "reward_mean": mean([e.reward for e in episodes]),
        "success_rate": mean([float(e.success) for e in episodes]),
        "num_turns_mean": mean([float(e.num_turns) for e in episodes]),
        "truncated_rate": mean([float(e.truncated) for e in episodes]),
        "response_tokens_mean": mean([float(e.trained_tokens) for e in episodes]),
        "samples_mean": mean([float(e.num_samples) for e in episodes]),  # windowed: one per turn
    }
    scores = [episode_score(e) for e in episodes]
    if episodes and all(s is not None for s in scores):
        metrics["score_mean"] = mean([s for s in scores if s is not None])
    return metrics
