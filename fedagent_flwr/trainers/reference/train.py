"""The reference trainer: a compact single-process GRPO trainer for CPU (laptops, CI).

Run as a subprocess by the ClientApp::

    python -m fedagent_flwr.clientapp.reference_trainer train    JOB.json   # TrainJob
    python -m fedagent_flwr.clientapp.reference_trainer evaluate JOB.json   # EvalJob
    python -m fedagent_flwr.clientapp.reference_trainer serve CHANNEL_DIR    # persistent (reference_session)

It plays multi-turn episodes with the shared episode runner (:mod:`fedagent_flwr.rollout`), so the
token layout and masks are the ones the verl agent loop trains on, and writes its checkpoint in
verl's FSDP layout (world size 1), so the server aggregates it like any verl client's::

    <output_dir>/checkpoints/global_step_<local_steps>/actor/
        model_world_size_1_rank_0.pt   torch.save of the fp32 state_dict (HF key names)
        fsdp_config.json               {"FSDP_version": 2, "world_size": 1}
        huggingface/                   config.json, generation_config.json, tokenizer files
    <output_dir>/train_result.json     TrainResult

Training, per local step: every env-spec entry ``j`` contributes ``n_envs`` environment seeds
(rule in :func:`train_env_seed`), each played ``rollout_n`` times (one GRPO group); advantages are
group-relative, ``(r - mean) / (std + 1e-6)`` (0 for a single-episode group); the update is
``ppo_epochs`` passes of the clipped surrogate averaged over the response tokens the model
generated, minus ``entropy_coeff`` x entropy, plus ``kl_coef`` x low-variance KL to the starting
weights, plus FedProx's ``mu/2 * ||w - w_start||^2`` when ``proximal_mu > 0``; AdamW. A client
rule (``trainer.client_rule``, :mod:`fedagent_flwr.clientapp.client_rule`) sees the gradients of
every step just before clipping and the optimiser step.

Precision: with ``compute_dtype`` "bfloat16" (the "auto" choice on CPUs with native bf16)
sampling uses a bf16 copy of the weights and the update runs under bf16 autocast, while master
weights, optimiser state and the checkpoint stay fp32 - verl's mixed-precision recipe, about 2x
faster on a laptop CPU. "float32" keeps everything in fp32.

Everything is seeded from the job's ``data_seed``: the same job on the same machine gives
bit-identical checkpoint tensors. Bad input (missing/invalid job, unknown env, bad partition, missing model) exits with
status 2 and one line on stderr naming the culprit.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fedagent_flwr.atomic import temporary_dir
from fedagent_flwr.clientapp.client_rule import ClientRule, ClientRuleError, load_client_rule, without_rule_keys
from fedagent_flwr.clientapp.job import (
    EvalJob,
    EvalResult,
    JobFileError,
    TrainJob,
    TrainResult,
    backend_main,
    save,
)
from fedagent_flwr.envs.base import EnvConfigError
from fedagent_flwr.envs.registry import UnknownEnvError, make_env
from fedagent_flwr.envs.spec import EnvSpec, EnvSpecError, load_env_spec
from fedagent_flwr.hetero import PartitionError, partition_env_spec
from fedagent_flwr.models.smollm2 import ModelResolutionError, resolve_model_path
from fedagent_flwr.rollout.episode import Episode, GenerateFn, SamplingParams, run_episode
from fedagent_flwr.rollout.groups import zero_variance_group_share
from fedagent_flwr.seeding import SEEDS_PER_ENTRY, train_env_seed

PROG = "reference_trainer"
ACTOR_SHARD = "model_world_size_1_rank_0.pt"
TRAIN_RESULT = "train_result.json"
EVAL_RESULT = "eval_result.json"
# A rollout prints how far it got at most this often: long CPU rollouts print nothing else for
# minutes, and the ClientApp's progress watchdog (trainer.stall_timeout_s) judges by output lines.
PROGRESS_EVERY_S = 30.0
# Spec entries are 1000 seeds apart (FedAgent's dataset rule); more seeds per entry would run
# into the next entry's range.


class InputError(ValueError):
    """Bad input to the trainer: reported as one line on stderr with exit status 2."""


_CHOICES = {"compute_dtype": ("auto", "float32", "bfloat16"), "device": ("auto", "cpu", "cuda")}


def _native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 / AMX); emulated bf16 is slower than fp32."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # private probe; absent means "do not assume"
        return False


# --------------------------------------------------------------------------------------------
# Hyper-parameters
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GRPOConfig:
    """Hyper-parameters read from ``job.trainer`` (defaults follow FedAgent/verl where they exist)."""

    rollout_n: int = 2  # episodes per environment seed (GRPO group size)
    lr: float = 1e-5
    weight_decay: float = 0.0
    kl_coef: float = 0.0  # low-variance KL (k3) to the starting weights
    entropy_coeff: float = 0.001  # FedAgent's value; keeps updates non-zero at zero advantage
    clip_ratio: float = 0.2
    ppo_epochs: int = 1
    grad_clip: float = 1.0  # verl's actor default; <= 0 disables clipping
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    val_temperature: float = 0.4  # FedAgent's validation temperature
    val_top_p: float = 1.0
    max_model_len: int = 1024
    num_threads: int = 0  # torch threads; 0 keeps torch's default
    micro_batch_size: int = 8  # episodes per forward/backward in the update
    gen_batch_size: int = 32  # episodes sampled together (KV cache memory grows with it)
    # "bfloat16": sample with a bf16 copy of the weights and run the update's forward/backward
    # under bf16 autocast (fp32 master weights, optimiser and checkpoint), as verl's FSDP mixed
    # precision + bf16 vLLM do; about 2x faster on CPUs with native bf16. "auto" picks bfloat16
    # on such CPUs, else "float32" (everything in fp32).
    compute_dtype: str = "auto"
    # "auto": the first CUDA GPU when there is one (the verl backend evaluates this way on GPU
    # nodes), else the CPU. Training always runs on the CPU.
    device: str = "auto"

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> tuple[GRPOConfig, list[str]]:
        """Validated config from ``job.trainer`` and the keys it ignored (other backends' knobs)."""
        values: dict[str, Any] = {}
        known = {f.name: f for f in fields(cls)}
        for key, value in (raw or {}).items():
            if key not in known:
                continue
            default = known[key].default
            if isinstance(default, str):
                choices = _CHOICES[key]
                if value not in choices:
                    raise InputError(f"trainer.{key} must be one of {list(choices)}, got {value!r}")
            elif isinstance(default, int) and not isinstance(default, bool):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise InputError(f"trainer.{key} must be an integer, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InputError(f"trainer.{key} must be a number, got {value!r}")
            values[key] = type(default)(value)
        config = cls(**values)
        config._check()
        return config, sorted(k for k in (raw or {}) if k not in known)

    def _check(self) -> None:
        positive = ("rollout_n", "ppo_epochs", "max_new_tokens", "max_model_len", "micro_batch_size",
                    "gen_batch_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise InputError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "weight_decay", "kl_coef", "entropy_coeff", "clip_ratio", "num_threads"):
            if getattr(self, name) < 0:
                raise InputError(f"trainer.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("top_p", "val_top_p"):
            if not 0 < getattr(self, name) <= 1:
                raise InputError(f"trainer.{name} must be in (0, 1], got {getattr(self, name)}")

    def torch_device(self) -> Any:
        """The resolved evaluation device."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_compute_dtype(self, device: Any = None) -> Any:
        """The resolved compute dtype (``torch.float32`` or ``torch.bfloat16``); "auto" is bf16
        on a GPU and on CPUs with native bf16."""
        import torch

        if self.compute_dtype == "auto":
            on_gpu = device is not None and torch.device(device).type == "cuda"
            return torch.bfloat16 if on_gpu or _native_bf16() else torch.float32
        return torch.bfloat16 if self.compute_dtype == "bfloat16" else torch.float32

    def sampling(self, validate: bool = False) -> SamplingParams:
        if validate:
            return SamplingParams(self.max_new_tokens, self.val_temperature, self.val_top_p)
        return SamplingParams(self.max_new_tokens, self.temperature, self.top_p)


# --------------------------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------------------------


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from labelled parts, stable across processes (sha256, not salted hash())."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch, and ask torch for deterministic kernels."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


# --------------------------------------------------------------------------------------------
# Sampling with a Hugging Face model
# --------------------------------------------------------------------------------------------


class HFPolicy:
    """Samples continuations from a causal LM with a KV cache, many prompts per batch.

    Prompts are left-padded (with matching position ids) so one prefill plus one forward per new
    token serves the whole batch. A seeded ``torch.Generator`` drives all sampling, so a run is
    reproducible independently of the global torch RNG.
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int) -> None:
        self.model = model
        self.batch_size = batch_size
        stop: set[int] = set()
        for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
            if isinstance(source, int):
                stop.add(source)
            elif isinstance(source, (list, tuple)):
                stop.update(int(s) for s in source)
        self.stop_ids: tuple[int, ...] = tuple(sorted(stop))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad if pad is not None else 0)
        # transformers 5.2x renamed ``past_key_values`` to ``cache``; accept either.
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def sample(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, generator: Any
    ) -> list[list[int]]:
        """New token ids for every prompt (stopping at an EOS, which is kept)."""
        results: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            results += self._sample_chunk(prompts[start:start + self.batch_size], sampling, generator)
        return results

    def _sample_chunk(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, generator: Any
    ) -> list[list[int]]:
        import torch

        batch, width = len(prompts), max(len(p) for p in prompts)
        device = self.model.device
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            attention[row, width - len(prompt):] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        stop = torch.tensor(self.stop_ids, dtype=torch.long, device=device)
        outputs: list[list[int]] = [[] for _ in range(batch)]
        alive = torch.ones(batch, dtype=torch.bool, device=device)
        with torch.no_grad():
            out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                             use_cache=True, logits_to_keep=1)
            next_position = positions[:, -1:] + 1
            for t in range(sampling.max_new_tokens):
                tokens = _pick_tokens(out.logits[:, -1, :].float(), sampling, generator)
                chosen = tokens.tolist()
                for row in torch.nonzero(alive).flatten().tolist():
                    outputs[row].append(int(chosen[row]))
                alive &= ~torch.isin(tokens, stop)
                if not bool(alive.any()) or t + 1 == sampling.max_new_tokens:
                    break
                attention = torch.cat([attention, torch.ones((batch, 1), dtype=torch.long, device=device)], dim=1)
                cache = getattr(out, "cache", None)
                if cache is None:
                    cache = getattr(out, "past_key_values", None)
                out = self.model(input_ids=tokens[:, None], attention_mask=attention,
                                 position_ids=next_position, use_cache=True, **{self._cache_kw: cache})
                next_position = next_position + 1
        return outputs


def _pick_tokens(logits: Any, sampling: SamplingParams, generator: Any) -> Any:
    """One token per row: greedy at temperature <= 0, else temperature + nucleus sampling."""
    import torch

    if sampling.temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token once the mass before it already reaches top_p; the top token always stays.
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return order.gather(-1, choice).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class LockstepBatcher:
    """Turns many concurrent episodes' ``generate`` calls into batched sampling.

    A batch is sampled once *every* unfinished episode is waiting for tokens, and its rows are
    ordered by episode index. The batches therefore do not depend on when environment steps
    return (in-process or over HTTP), which keeps sampling reproducible.
    """

    def __init__(self, policy: HFPolicy, generator: Any, num_episodes: int) -> None:
        self.policy = policy
        self.generator = generator
        self.active = num_episodes
        self.pending: dict[int, tuple[list[int], SamplingParams, asyncio.Future[list[int]]]] = {}
        self.total, self.batches = num_episodes, 0
        self.started = self.last_report = time.monotonic()

    def generate_fn(self, index: int) -> GenerateFn:
        """The ``generate`` callable for episode ``index`` (the row it takes in every batch)."""

        async def generate(prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
            future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
            self.pending[index] = (prompt_ids, sampling, future)
            self._maybe_flush()
            return await future

        return generate

    def finished(self) -> None:
        """An episode ended: later batches no longer wait for it."""
        self.active -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if not self.pending or len(self.pending) < self.active:
            return
        waiting = sorted(self.pending.items())
        self.pending = {}
        by_params: dict[SamplingParams, list[tuple[list[int], asyncio.Future[list[int]]]]] = {}
        for _, (prompt, sampling, future) in waiting:
            by_params.setdefault(sampling, []).append((prompt, future))
        for sampling, items in by_params.items():
            try:
                outputs = self.policy.sample([p for p, _ in items], sampling, self.generator)
            except Exception as exc:  # hand the failure to every waiting episode
                for _, future in items:
                    future.set_exception(exc)
                continue
            for (_, future), tokens in zip(items, outputs):
                future.set_result(tokens)
        self.batches += 1
        now = time.monotonic()
        if now - self.last_report >= PROGRESS_EVERY_S:  # a heartbeat of real progress (see PROGRESS_EVERY_S)
            self.last_report = now
            print(f"rollout: {self.batches} batches sampled, {self.total - self.active}/{self.total} episodes "
                  f"finished in {now - self.started:.0f} s", flush=True)


@dataclass(frozen=True)
class EpisodeTask:
    """One episode to play: environment, config, seed, turn budget and GRPO group."""

    env_name: str
    config: dict[str, Any]
    seed: int
    max_turns: int
    group: int


def play_episodes(
    policy: HFPolicy,
    tokenizer: Any,
    tasks: Sequence[EpisodeTask],
    sampling: SamplingParams,
    max_model_len: int,
    generator: Any,
) -> list[Episode]:
    """Play all ``tasks`` concurrently (batched generation); results in task order."""

    async def play_all() -> list[Episode]:
        batcher = LockstepBatcher(policy, generator, len(tasks))

        async def play(index: int, task: EpisodeTask) -> Episode:
            try:
                env = make_env(task.env_name, task.config)
                return await run_episode(
                    env, task.seed, tokenizer, batcher.generate_fn(index), sampling,
                    task.max_turns, max_model_len, eos_token_ids=policy.stop_ids,
                )
            finally:
                batcher.finished()

        return list(await asyncio.gather(*(play(i, t) for i, t in enumerate(tasks))))

    return asyncio.run(play_all())


# --------------------------------------------------------------------------------------------
# GRPO update
# --------------------------------------------------------------------------------------------


def grpo_advantages(rewards: Sequence[float], groups: Sequence[int], eps: float = 1e-6) -> list[float]:
    """Group-relative advantages ``(r - mean) / (std + eps)`` (unbiased std, as verl).

    A group with a single episode gets 0 (verl would use the raw reward there), as does a group
    whose rewards are all equal.
    """
    members: dict[int, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    advantages = [0.0] * len(rewards)
    for indices in members.values():
        if len(indices) < 2:
            continue
        values = [float(rewards[i]) for i in indices]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for i in indices:
            advantages[i] = (float(rewards[i]) - mean) / (std + eps)
    return advantages


@dataclass
class _TokenBatch:
    """The generated (mask 1) response tokens of some episodes, flattened for the loss."""

    input_ids: Any  # (B, T) right-padded prompt + response
    attention: Any  # (B, T)
    rows: Any  # (N,) batch row of each generated token
    cols: Any  # (N,) position whose output predicts it
    targets: Any  # (N,) the generated token ids
    token_episode: Any  # (N,) index into the episode list


def _token_batch(episodes: Sequence[Episode], indices: Sequence[int], pad_id: int) -> _TokenBatch:
    import torch

    width = max(len(episodes[i].prompt_ids) + len(episodes[i].response_ids) for i in indices)
    input_ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(indices), width), dtype=torch.long)
    rows, cols, targets, owners = [], [], [], []
    for row, index in enumerate(indices):
        episode = episodes[index]
        sequence = episode.prompt_ids + episode.response_ids
        input_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention[row, : len(sequence)] = 1
        offset = len(episode.prompt_ids)
        for k, (token, mask) in enumerate(zip(episode.response_ids, episode.response_mask)):
            if mask:
                rows.append(row)
                cols.append(offset + k - 1)
                targets.append(token)
                owners.append(index)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return _TokenBatch(input_ids, attention, as_long(rows), as_long(cols), as_long(targets), as_long(owners))


def _token_logprobs(
    model: Any, batch: _TokenBatch, temperature: float, with_entropy: bool, compute_dtype: Any = None
) -> tuple[Any, Any]:
    """Log-probabilities (and entropies) of the generated tokens under ``model``.

    Only the positions that predict generated tokens go through the output layer, which keeps
    the (tokens x vocabulary) logits small. Logits are divided by the sampling temperature, as
    verl's actor does, so the ratio compares the distributions that were sampled from.
    """
    import torch

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype == torch.bfloat16):
        hidden = model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention,
                                  use_cache=False).last_hidden_state
        logits = model.get_output_embeddings()(hidden[batch.rows, batch.cols])
    logits = logits.float()  # softmax, entropy and the loss stay in fp32
    if temperature > 0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    token_logp = log_probs.gather(-1, batch.targets[:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return token_logp, entropy


def _micro_batches(indices: Sequence[int], size: int) -> list[list[int]]:
    return [list(indices[i:i + size]) for i in range(0, len(indices), size)]


@dataclass
class UpdateStats:
    """Averages over the optimiser steps of one update (loss includes the FedProx term)."""

    loss: float
    kl: float
    entropy: float
    grad_norm: float
    tokens: int
    rule_value: float = 0.0  # what the client rule returned, averaged over the steps


def grpo_update(
    model: Any,
    ref_model: Any | None,
    optimizer: Any,
    episodes: Sequence[Episode],
    advantages: Sequence[float],
    cfg: GRPOConfig,
    proximal_mu: float,
    pad_id: int,
    client_rule: ClientRule | None = None,
) -> UpdateStats:
    """``ppo_epochs`` optimiser steps of the clipped GRPO objective over all episodes.

    Loss = token-mean over generated tokens of ``max(-A r, -A clip(r, 1-e, 1+e))
    - entropy_coeff * H + kl_coef * KL_k3(ref || pi)``, plus ``mu/2 * ||w - w_start||^2``.
    """
    import torch

    trainable = [i for i, e in enumerate(episodes) if any(e.response_mask)]
    if not trainable:
        return UpdateStats(0.0, 0.0, 0.0, 0.0, 0)
    chunks = [_token_batch(episodes, idx, pad_id) for idx in _micro_batches(trainable, cfg.micro_batch_size)]
    total_tokens = sum(int(c.targets.numel()) for c in chunks)
    adv = torch.tensor(list(advantages), dtype=torch.float32)
    temperature = cfg.temperature
    dtype = cfg.torch_compute_dtype()

    # Old log-probabilities (and the reference's) are fixed before any update. With a single
    # epoch the weights cannot change before the one optimiser step, so the old log-probs are the
    # training forward's own values (detached): same numbers, one forward pass fewer.
    with torch.no_grad():
        old_logp = ([_token_logprobs(model, c, temperature, False, dtype)[0] for c in chunks]
                    if cfg.ppo_epochs > 1 else None)
        ref_logp = ([_token_logprobs(ref_model, c, temperature, False, dtype)[0] for c in chunks]
                    if ref_model is not None and cfg.kl_coef > 0 else None)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    anchor = None
    if ref_model is not None and proximal_mu > 0:
        frozen = dict(ref_model.named_parameters())
        anchor = [frozen[name] for name, _ in named]

    model.train()
    losses, kls, entropies, norms, rule_values = [], [], [], [], []
    for _ in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        epoch_loss = epoch_kl = epoch_entropy = 0.0
        for k, chunk in enumerate(chunks):
            logp, entropy = _token_logprobs(model, chunk, temperature, True, dtype)
            token_adv = adv[chunk.token_episode]
            old = old_logp[k] if old_logp is not None else logp.detach()
            ratio = torch.exp(logp - old)
            clipped = torch.clamp(ratio, 1.0 - cfg.clip_ratio, 1.0 + cfg.clip_ratio)
            per_token = torch.maximum(-token_adv * ratio, -token_adv * clipped) - cfg.entropy_coeff * entropy
            if ref_logp is not None:
                # verl's "low_var_kl" (k3): exp(ref - logp) - (ref - logp) - 1, clamped.
                log_ratio = ref_logp[k] - logp
                kl = torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)
                per_token = per_token + cfg.kl_coef * kl
                epoch_kl += float(kl.detach().sum()) / total_tokens
            loss = per_token.sum() / total_tokens
            loss.backward()
            epoch_loss += float(loss.detach())
            epoch_entropy += float(entropy.detach().sum()) / total_tokens
        if anchor is not None:
            # FedProx (Li et al., 2020): pull the local weights towards the round's global model.
            prox = 0.5 * proximal_mu * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
            prox.backward()
            epoch_loss += float(prox.detach())
        if client_rule is not None:
            rule_values.append(float(client_rule.apply(named)))
        if cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        else:
            norm = torch.sqrt(sum((p.grad.detach() ** 2).sum() for p in params if p.grad is not None))
        optimizer.step()
        losses.append(epoch_loss)
        kls.append(epoch_kl)
        entropies.append(epoch_entropy)
        norms.append(float(norm))
    model.eval()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return UpdateStats(mean(losses), mean(kls), mean(entropies), mean(norms), total_tokens,
                       mean(rule_values) if rule_values else 0.0)


# --------------------------------------------------------------------------------------------
# Checkpoint
# --------------------------------------------------------------------------------------------


def write_fsdp_checkpoint(model: Any, tokenizer: Any, step_dir: Path) -> Path:
    """Write ``step_dir/actor`` in verl's FSDP layout (world size 1); return the actor dir.

    Written into a temporary sibling and renamed, so a reader never sees a partial checkpoint.
    """
    import torch

    step_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_dir(step_dir.parent, f".{step_dir.name}.tmp-")  # 0755 as a result, not mkdtemp's 0700
    try:
        actor = staging / "actor"
        (actor / "huggingface").mkdir(parents=True)
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
        torch.save(state, actor / ACTOR_SHARD)
        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}, indent=2))
        model.config.save_pretrained(str(actor / "huggingface"))
        model.generation_config.save_pretrained(str(actor / "huggingface"))
        tokenizer.save_pretrained(str(actor / "huggingface"))
        if step_dir.exists():
            shutil.rmtree(step_dir)
        os.replace(staging, step_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return step_dir / "actor"


# --------------------------------------------------------------------------------------------
# Train / evaluate
# --------------------------------------------------------------------------------------------


def load_model(path: Path, num_threads: int) -> tuple[Any, Any]:
    """Tokenizer and fp32 model from a resolved local model directory."""
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


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "float": (int, float), "dict": (dict,), "list": (list,),
}


def _check_field_types(job: TrainJob | EvalJob) -> None:
    """Refuse job fields of the wrong JSON type (``load`` checks names, not types)."""
    for f in fields(job):
        annotation = str(f.type)
        allowed = _FIELD_TYPES.get(annotation.split("[", 1)[0])
        value = getattr(job, f.name)
        if allowed and (isinstance(value, bool) or not isinstance(value, allowed)):
            raise InputError(f"job field '{f.name}' must be of type {annotation}, got {value!r}")


def check_train_job(job: TrainJob) -> tuple[EnvSpec, GRPOConfig, Path, ClientRule | None]:
    """Validate everything about a TrainJob that can be checked before loading the model."""
    _check_field_types(job)
    if job.algorithm.lower() != "grpo":
        raise InputError(f"algorithm {job.algorithm!r}: the reference trainer only does 'grpo'")
    if job.local_steps < 1:
        raise InputError(f"local_steps must be >= 1, got {job.local_steps}")
    if job.proximal_mu < 0:
        raise InputError(f"proximal_mu must be >= 0, got {job.proximal_mu}")
    if not 0 <= job.client_id < job.num_clients:
        raise InputError(f"client_id {job.client_id} is out of range for num_clients {job.num_clients}")
    cfg, ignored = GRPOConfig.from_mapping(without_rule_keys(job.trainer))
    if ignored:
        print(f"{PROG}: note: ignoring trainer keys {ignored}", file=sys.stderr)
    rule = load_client_rule(job.trainer)
    spec = partition_env_spec(job.env_spec, job.partition, job.client_id, job.num_clients,
                              base_seed=job.base_seed)
    if len(spec.envs) > 1 and any(e.n_envs * job.local_steps > SEEDS_PER_ENTRY for e in spec.envs):
        print(f"{PROG}: note: more than {SEEDS_PER_ENTRY} env seeds per spec entry; later entries "
              "reuse some of the seeds of earlier ones", file=sys.stderr)
    for entry in spec.envs:
        make_env(entry.name, entry.env_config())  # config errors surface now, not mid-rollout
    return spec, cfg, resolve_model_path(job.model_path), rule


def train(job: TrainJob) -> TrainResult:
    """Run ``job.local_steps`` GRPO steps and write the checkpoint and ``train_result.json``."""
    spec, cfg, model_path, rule = check_train_job(job)  # before importing torch: bad input fails fast
    started = time.monotonic()
    model, tokenizer = load_model(model_path, cfg.num_threads)
    return train_loaded(job, spec, cfg, rule, model, tokenizer, started)


def train_loaded(job: TrainJob, spec: EnvSpec, cfg: GRPOConfig, rule: ClientRule | None, model: Any,
                  tokenizer: Any, started: float) -> TrainResult:
    """Train ``model`` (the job's starting weights, loaded) in place; the rest of :func:`train`.

    Seeded here, after loading, so a fresh process and a persistent session that only reloaded
    the weights train bit-identically.
    """
    import torch

    seed_everything(job.data_seed)
    compute_dtype = cfg.torch_compute_dtype()
    # Sampling uses a copy in the compute dtype, refreshed after every update (like verl syncing
    # the trained weights into vLLM); in fp32 the trained model samples itself.
    sampler = model if compute_dtype == torch.float32 else copy.deepcopy(model).to(compute_dtype)
    policy = HFPolicy(sampler, tokenizer, cfg.gen_batch_size)
    # One frozen copy of the starting (global) weights serves as KL reference and FedProx anchor.
    ref_model = None
    if cfg.kl_coef > 0 or job.proximal_mu > 0:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    sampling = cfg.sampling()

    all_episodes: list[Episode] = []
    losses, kls, rule_values, flat_shares = [], [], [], []
    for step in range(job.local_steps):
        step_started = time.monotonic()
        tasks: list[EpisodeTask] = []
        for j, entry in enumerate(spec.envs):
            for i in range(entry.n_envs):
                seed = train_env_seed(job.data_seed, j, step, entry.n_envs, i)
                # The env seed names the GRPO group: unique within a step by construction.
                tasks += [EpisodeTask(entry.name, entry.env_config(), seed, entry.max_turns, seed)
                          for _ in range(cfg.rollout_n)]
        generator = torch.Generator().manual_seed(derive_seed("rollout", job.data_seed, step))
        episodes = play_episodes(policy, tokenizer, tasks, sampling, cfg.max_model_len, generator)
        rollout_seconds = time.monotonic() - step_started
        advantages = grpo_advantages([e.reward for e in episodes], [t.group for t in tasks])
        flat_shares.append(zero_variance_group_share([e.reward for e in episodes], [t.group for t in tasks]))
        stats = grpo_update(model, ref_model, optimizer, episodes, advantages, cfg, job.proximal_mu,
                            policy.pad_id, rule)
        if sampler is not model:
            sampler.load_state_dict(model.state_dict())  # copies and casts to the sampler's dtype
        all_episodes += episodes
        losses.append(stats.loss)
        kls.append(stats.kl)
        rule_values.append(stats.rule_value)
        print(
            f"step {step + 1}/{job.local_steps} episodes {len(episodes)} "
            f"reward_mean {_mean([e.reward for e in episodes]):.4f} "
            f"success_rate {_mean([float(e.success) for e in episodes]):.4f} "
            f"loss {stats.loss:.6f} seconds {time.monotonic() - step_started:.2f} "
            f"(rollout {rollout_seconds:.2f})",
            flush=True,
        )

    output_dir = Path(job.output_dir)
    actor_dir = write_fsdp_checkpoint(
        model, tokenizer, output_dir / "checkpoints" / f"global_step_{job.local_steps}"
    )
    metrics = _episode_metrics(all_episodes)
    metrics.update(
        loss=_mean(losses),
        kl=_mean(kls),
        zero_variance_group_share=_mean(flat_shares),
        train_seconds=time.monotonic() - started,
        proximal_mu=float(job.proximal_mu),
    )
    if rule is not None:
        metrics["client_rule_value"] = _mean(rule_values)
    result = TrainResult(
        actor_dir=str(actor_dir.resolve()),
        actor_format="fsdp-shards",
        num_episodes=len(all_episodes),
        metrics=metrics,
        world_size=1,
    )
    save(result, output_dir / TRAIN_RESULT)
    return result


def evaluate(job: EvalJob) -> EvalResult:
    """One episode per seed (in every env of the full, unpartitioned spec) at val temperature."""
    spec, cfg, model_path = check_eval_job(job)
    started = time.monotonic()
    model, tokenizer = load_model(model_path, cfg.num_threads)
    return evaluate_loaded(job, spec, cfg, model, tokenizer, started)


def check_eval_job(job: EvalJob) -> tuple[EnvSpec, GRPOConfig, Path]:
    """Validate an EvalJob before any model is loaded."""
    _check_field_types(job)
    spec = load_env_spec(job.env_spec)
    cfg, ignored = GRPOConfig.from_mapping(without_rule_keys(job.trainer))
    if ignored:
        print(f"{PROG}: note: ignoring trainer keys {ignored}", file=sys.stderr)
    if not job.seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in job.seeds):
        raise InputError(f"seeds must be a non-empty list of integers, got {job.seeds!r}")
    for entry in spec.envs:
        make_env(entry.name, entry.env_config())
    return spec, cfg, resolve_model_path(job.model_path)


def evaluate_loaded(job: EvalJob, spec: EnvSpec, cfg: GRPOConfig, model: Any, tokenizer: Any,
                     started: float) -> EvalResult:
    """Play the validation episodes with ``model`` (fp32, loaded; moved to the device here)."""
    import torch

    seed_everything(derive_seed("eval", job.round))
    device = cfg.torch_device()
    policy = HFPolicy(model.to(device=device, dtype=cfg.torch_compute_dtype(device)), tokenizer, cfg.gen_batch_size)
    tasks = [EpisodeTask(e.name, e.env_config(), int(s), e.max_turns, k)
             for e in spec.envs for k, s in enumerate(job.seeds)]
    generator = torch.Generator(device=device).manual_seed(derive_seed("eval", job.round))
    episodes = play_episodes(policy, tokenizer, tasks, cfg.sampling(validate=True), cfg.max_model_len, generator)
    metrics = _episode_metrics(episodes)
    for j, entry in enumerate(spec.envs):
        mine = episodes[j * len(job.seeds):(j + 1) * len(job.seeds)]
        metrics[f"success_rate/{entry.name}"] = _mean([float(e.success) for e in mine])
    metrics["eval_seconds"] = time.monotonic() - started
    print(f"evaluate: {len(episodes)} episodes on {device}: success_rate {metrics['success_rate']:.4f} "
          f"reward_mean {metrics['reward_mean']:.4f} in {metrics['eval_seconds']:.1f} s", flush=True)
    result = EvalResult(
        num_episodes=len(episodes),
        success_rate=metrics["success_rate"],
        reward_mean=metrics["reward_mean"],
        metrics=metrics,
    )
    save(result, Path(job.output_dir) / EVAL_RESULT)
    return result


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    return {
        "reward_mean": _mean([e.reward for e in episodes]),
        "success_rate": _mean([float(e.success) for e in episodes]),
        "num_turns_mean": _mean([float(e.num_turns) for e in episodes]),
        "truncated_rate": _mean([float(e.truncated) for e in episodes]),
        "response_tokens_mean": _mean([float(sum(e.response_mask)) for e in episodes]),
    }


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

_BAD_INPUT = (InputError, JobFileError, EnvSpecError, UnknownEnvError, PartitionError, EnvConfigError,
              ModelResolutionError, ClientRuleError)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input)."""
    from fedagent_flwr.clientapp.reference_session import ReferenceSession

    return backend_main(PROG, argv, train, evaluate, _BAD_INPUT, session_factory=ReferenceSession)


if __name__ == "__main__":
    sys.exit(main())
