"""The checks every trainer backend runs on a job before it loads a model or starts a framework.

Both backends refuse the same bad input with the same words, and they refuse it before the
expensive part (torch, Ray, vLLM): a typo in a multi-hour run should fail in a second. A backend
calls :func:`check_train_header` (the job's own fields), checks its own settings, then
:func:`check_train_world` (client rule, partition, environments, model), which is the costlier half.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedagent_flwr.clientapp.job import EvalJob, TrainJob
from fedagent_flwr.envs.base import EnvConfigError
from fedagent_flwr.envs.registry import UnknownEnvError, make_env
from fedagent_flwr.envs.spec import EnvSpec, EnvSpecError, load_env_spec
from fedagent_flwr.hetero import PartitionError, partition_env_spec
from fedagent_flwr.models.smollm2 import ModelResolutionError, resolve_model_path
from fedagent_flwr.rollout.episode import Episode
from fedagent_flwr.seeding import SEEDS_PER_ENTRY
from fedagent_flwr.trainers.common.client_rule import ClientRuleError, RuleChain, job_rule_specs


class InputError(ValueError):
    """A job a backend cannot run (bad field, setting, env, model): reported as one line on
    stderr with exit status 2."""


#: What every backend reports as bad input (exit status 2; a persistent session answers it and keeps
#: serving): its own checks' and the shared modules' errors (a bad job file is refused as such anyway).
BAD_INPUT = (InputError, EnvSpecError, UnknownEnvError, PartitionError, EnvConfigError, ModelResolutionError,
             ClientRuleError)


def check_train_header(job: TrainJob, backend: str, algorithms: Sequence[str]) -> None:
    """The algorithm (one of ``algorithms``); the job's field types and bounds were checked when
    its file was loaded (:func:`fedagent_flwr.clientapp.job.load`)."""
    if job.algorithm not in algorithms:  # exact: verl branches on job.algorithm == "ppo"
        wanted = " or ".join(repr(a) for a in algorithms)
        raise InputError(f"algorithm {job.algorithm!r}: the {backend} only does {wanted}")


@dataclass(frozen=True)
class TrainWorld:
    """What a train job resolves to outside the backend's settings."""

    spec: EnvSpec  # this client's partition of the env spec
    model_path: Path  # the starting model, as a local directory
    rule_specs: list[dict[str, Any]]  # the job's client rules, FedProx's first (job_rule_specs)
    rules: RuleChain  # the same rules, built (once, so a bad rule fails here)
    user_rule: bool  # whether the last rule is the user's trainer.client_rule


def check_train_world(job: TrainJob, prog: str) -> TrainWorld:
    """Client rules, partition, environment configs and model path of a train job.

    Every environment is built once so that its config errors surface now, not mid-rollout (or
    in a Ray worker); ``prog`` prefixes the notes printed on stderr.
    """
    rule_specs = job_rule_specs(job.proximal_mu, job.trainer)
    rules = RuleChain.from_specs(rule_specs)
    spec = partition_env_spec(job.env_spec, job.partition, job.client_id, job.num_clients,
                              base_seed=job.base_seed)
    if len(spec.envs) > 1 and any(e.n_envs * job.local_steps > SEEDS_PER_ENTRY for e in spec.envs):
        print(f"{prog}: note: more than {SEEDS_PER_ENTRY} env seeds per spec entry; later entries "
              "reuse some of the seeds of earlier ones", file=sys.stderr)
    for entry in spec.envs:
        make_env(entry.name, entry.env_config())
    return TrainWorld(spec, resolve_model_path(job.model_path), rule_specs, rules,
                      user_rule=bool(job.trainer.get("client_rule")))


def check_eval_job(job: EvalJob) -> tuple[EnvSpec, Path]:
    """Env spec (the full, unpartitioned one), seeds and model path of an EvalJob."""
    spec = load_env_spec(job.env_spec)
    if not job.seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in job.seeds):
        raise InputError(f"seeds must be a non-empty list of integers, got {job.seeds!r}")
    for entry in spec.envs:
        make_env(entry.name, entry.env_config())
    return spec, resolve_model_path(job.model_path)


def check_turns_fit(episodes: Sequence[Episode], max_new_tokens: int, max_model_len: int, budget_key: str,
                    max_prompt_len: int | None = None, prompt_key: str = "trainer.max_prompt_length") -> None:
    """Refuse a rollout in which no episode could play even its first turn (its prompt plus
    ``max_new_tokens`` exceeds ``max_model_len``, the token budget the config key ``budget_key``
    sets, or its prompt exceeds ``max_prompt_len``, the prompt budget ``prompt_key`` sets where the
    rollout has one): there is nothing to train on or to score, and going on would report a client
    that played no turn as one that played its episodes and scored 0. The message names the budget
    that stopped it: with a prompt budget whose remainder holds ``max_new_tokens`` (verl's, where the
    schema keeps ``max_new_tokens`` within the response budget) only the prompt budget can."""
    if not episodes or any(e.num_turns > 0 or not e.truncated for e in episodes):
        return
    lengths = [len(e.prompt_ids) for e in episodes if e.prompt_ids]  # concat mode: the first prompt
    prompt = f" (the shortest has {min(lengths)} tokens)" if lengths else ""
    if max_prompt_len is not None and max_new_tokens <= max_model_len - max_prompt_len:
        raise InputError(
            f"no episode could play a single turn: the first prompt{prompt} exceeds {prompt_key} "
            f"({max_prompt_len}); raise {prompt_key}"
        )
    raise InputError(
        f"no episode could play a single turn: the first prompt{prompt} plus trainer.max_new_tokens "
        f"({max_new_tokens}) does not fit in {budget_key} ({max_model_len}); raise {budget_key} or lower "
        "trainer.max_new_tokens"
    )
