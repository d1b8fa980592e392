"""The Hugging Face sampler both backends evaluate with (and the reference trainer trains with).

:class:`HFPolicy` samples many prompts per batch with a KV cache; :class:`LockstepBatcher` turns
concurrent episodes' ``generate`` calls into such batches in a fixed order; :func:`play_episodes`
plays a list of :class:`EpisodeTask` through the shared episode runner
(:mod:`fedagent_flwr.rollout.episode`), so the token layout and masks are the ones verl's agent
loop trains on.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedagent_flwr.envs.registry import make_env
from fedagent_flwr.rollout.episode import Episode, GenerateFn, SamplingParams, model_stop_ids, run_episode
from fedagent_flwr.rollout.windowed import DEFAULT_HISTORY_LENGTH, ROLLOUT_MODES, run_windowed_episode
from fedagent_flwr.schema.trainer import Rollout
from fedagent_flwr.trainers.common.prefix_cache import (
    PrefixCache,
    RowCache,
    common_prefix,
    left_padded_past,
    plain_layers,
    take_rows,
)

# A rollout prints how far it got at most this often: long CPU rollouts print nothing else for
# minutes, and the ClientApp's progress watchdog (trainer.stall_timeout_s) judges by output lines.
PROGRESS_EVERY_S = 30.0


class HFPolicy:
    """Samples continuations from a causal LM with a KV cache, many prompts per batch.

    Prompts are left-padded (with matching position ids) so one prefill plus one forward per new
    token serves the whole batch. A seeded ``torch.Generator`` drives all sampling, so a run is
    reproducible independently of the global torch RNG.

    With ``kv_reuse`` (the default; ``trainer.prefill=incremental``) a caller that names its rows
    (``keys``) and passes a :class:`PrefixCache` gets each row's keys and values kept after the
    call, and the row's next prompt prefills only what follows the longest prefix it shares with
    them (:mod:`fedagent_flwr.trainers.common.prefix_cache`); rows without a kept cache and the
    same prompt (a GRPO group's first turn) are prefilled once. Without it every call prefills
    every prompt, as before the option existed (``trainer.prefill=full``).
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int, kv_reuse: bool = True) -> None:
        self.model = model
        self.batch_size = batch_size
        self.kv_reuse = kv_reuse
        self.prefilled_tokens = 0  # prompt tokens run through prefills so far (what kv_reuse saves)
        self.stop_ids = model_stop_ids(tokenizer, getattr(model.generation_config, "eos_token_id", None))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad if pad is not None else 0)
        # transformers 5.2x renamed ``past_key_values`` to ``cache``; accept either.
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def sample(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, generator: Any,
        keys: Sequence[int] | None = None, kept: PrefixCache | None = None,
    ) -> list[list[int]]:
        """New token ids for every prompt (stopping at an EOS, which is kept).

        ``keys`` name the rows in ``kept`` (the caches kept between calls); both or neither.
        """
        if (keys is None) != (kept is None) or (keys is not None and len(keys) != len(prompts)):
            raise ValueError("HFPolicy.sample needs one key per prompt together with a PrefixCache, or neither")
        if isinstance(generator, (list, tuple)) and len(generator) != len(prompts):
            raise ValueError("HFPolicy.sample needs one generator, or one per prompt")
        results: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start:start + self.batch_size]
            rows_generator = (generator[start:start + self.batch_size] if isinstance(generator, (list, tuple))
                              else generator)
            if keys is None or kept is None or not self.kv_reuse:
                results += self._sample_chunk(chunk, sampling, rows_generator, None)[0]
                continue
            chunk_keys = keys[start:start + self.batch_size]
            outputs, caches = self._sample_chunk(chunk, sampling, rows_generator, [kept.get(k) for k in chunk_keys])
            for key, cache in zip(chunk_keys, caches or []):
                kept.put(key, cache)
            results += outputs
        return results

    def _sample_chunk(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, generator: Any,
        kept: list[RowCache | None] | None,
    ) -> tuple[list[list[int]], list[RowCache] | None]:
        """Sample one batch; with ``kept`` (reuse on) also return each row's cache to keep."""
        import torch

        batch = len(prompts)
        device = self.model.device
        # Kept positions each row reuses (at least its last prompt token is prefilled, for logits),
        # and the rows actually prefilled: one per distinct prompt among rows that reuse nothing.
        reused = [0] * batch
        unique_of, uniques = list(range(batch)), list(range(batch))
        if kept is not None:
            reused = [0 if entry is None else min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
                      for entry, prompt in zip(kept, prompts)]
            first: dict[tuple[int, ...], int] = {}
            uniques = []
            for row, prompt in enumerate(prompts):
                key = tuple(prompt) if reused[row] == 0 else None
                if key is not None and key in first:
                    unique_of[row] = first[key]
                    continue
                if key is not None:
                    first[key] = len(uniques)
                unique_of[row] = len(uniques)
                uniques.append(row)
        past = max(reused[row] for row in uniques)
        width = max(len(prompts[row]) - reused[row] for row in uniques)
        input_ids = torch.full((len(uniques), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(uniques), past + width), dtype=torch.long)
        positions = torch.zeros((len(uniques), width), dtype=torch.long)
        for u, row in enumerate(uniques):
            start, suffix = reused[row], list(prompts[row][reused[row]:])
            input_ids[u, width - len(suffix):] = torch.tensor(suffix, dtype=torch.long)
            attention[u, past - start:past] = 1
            attention[u, past + width - len(suffix):] = 1
            positions[u, width - len(suffix):] = torch.arange(start, start + len(suffix))
        self.prefilled_tokens += sum(len(prompts[row]) - reused[row] for row in uniques)
        input_ids, attention, positions = input_ids.to(device), attention.to(device), positions.to(device)
        extra: dict[str, Any] = {}
        if past > 0 and kept is not None:
            extra[self._cache_kw] = left_padded_past([kept[row] for row in uniques], [reused[row] for row in uniques])
        stop = torch.tensor(self.stop_ids, dtype=torch.long, device=device)
        outputs: list[list[int]] = [[] for _ in range(batch)]
        alive = torch.ones(batch, dtype=torch.bool, device=device)
        with torch.no_grad():
            out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                             use_cache=True, logits_to_keep=1, **extra)
            next_position = positions[:, -1:] + 1
            cache = _cache_of(out)
            if len(uniques) < batch:  # copy each distinct prompt's state to the rows that share it
                index = torch.tensor(unique_of, dtype=torch.long, device=device)
                cache.batch_select_indices(index)
                logits, attention, next_position = out.logits[index], attention[index], next_position[index]
            else:
                logits = out.logits
            for t in range(sampling.max_new_tokens):
                tokens = _pick_tokens(logits[:, -1, :].float(), sampling, generator)
                chosen = tokens.tolist()
                for row in torch.nonzero(alive).flatten().tolist():
                    outputs[row].append(int(chosen[row]))
                alive &= ~torch.isin(tokens, stop)
                if not bool(alive.any()) or t + 1 == sampling.max_new_tokens:
                    break
                attention = torch.cat([attention, torch.ones((batch, 1), dtype=torch.long, device=device)], dim=1)
                out = self.model(input_ids=tokens[:, None], attention_mask=attention,
                                 position_ids=next_position, use_cache=True, **{self._cache_kw: cache})
                cache = _cache_of(out)
                logits = out.logits
                next_position = next_position + 1
            if kept is None:
                return outputs, None
            layers = plain_layers(cache)
            if layers is None:  # a cache this code does not take apart: reuse nothing from here on
                self.kv_reuse = False
                return outputs, None
            # Each row holds its prompt and every sampled token but the last (never fed back).
            contexts = [list(prompt) + new[:-1] for prompt, new in zip(prompts, outputs)]
            return outputs, take_rows(layers, attention, contexts)


def _cache_of(out: Any) -> Any:
    """The KV cache a forward returned (``cache`` in newer transformers, else ``past_key_values``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def _pick_tokens(logits: Any, sampling: SamplingParams, generator: Any) -> Any:
    """One token per row: greedy at temperature <= 0, else temperature + nucleus sampling.

    ``generator`` is one ``torch.Generator`` for the whole batch, or a list with one per row
    (each row then draws only from its own, so what it samples does not depend on its batch).
    """
    import torch

    if sampling.temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    order = None
    if sampling.top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token once the mass before it already reaches top_p; the top token always stays.
        drop = probs.cumsum(dim=-1) - probs >= sampling.top_p
        probs = probs.masked_fill(drop, 0.0)
    if isinstance(generator, (list, tuple)):
        choice = torch.cat([torch.multinomial(probs[row:row + 1], 1, generator=g) for row, g in enumerate(generator)])
    else:
        choice = torch.multinomial(probs, 1, generator=generator)
    return (order.gather(-1, choice) if order is not None else choice).squeeze(-1)


class LockstepBatcher:
    """Turns many concurrent episodes' ``generate`` calls into batched sampling.

    A batch is sampled once *every* unfinished episode is waiting for tokens, and its rows are
    ordered by episode index. The batches therefore do not depend on when environment steps
    return (in-process or over HTTP), which keeps sampling reproducible. Each episode's keys and
    values are kept between its turns (when the policy reuses them) and freed when it ends.
    """

    def __init__(self, policy: HFPolicy, generator: Any, num_episodes: int) -> None:
        self.policy = policy
        self.generator = generator
        self.kept = PrefixCache()
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

    def finished(self, index: int) -> None:
        """Episode ``index`` ended: later batches no longer wait for it, and its cache is freed."""
        self.active -= 1
        self.kept.drop(index)
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if not self.pending or len(self.pending) < self.active:
            return
        waiting = sorted(self.pending.items())
        self.pending = {}
        by_params: dict[SamplingParams, list[tuple[int, list[int], asyncio.Future[list[int]]]]] = {}
        for index, (prompt, sampling, future) in waiting:
            by_params.setdefault(sampling, []).append((index, prompt, future))
        for sampling, items in by_params.items():
            try:
                generator = ([self.generator[i] for i, _, _ in items]
                             if isinstance(self.generator, (list, tuple)) else self.generator)
                outputs = self.policy.sample([p for _, p, _ in items], sampling, generator,
                                             keys=[i for i, _, _ in items], kept=self.kept)
            except Exception as exc:  # hand the failure to every waiting episode
                for _, _, future in items:
                    future.set_exception(exc)
                continue
            for (_, _, future), tokens in zip(items, outputs):
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
    rollout_mode: str = Rollout.mode,
    history_length: int = DEFAULT_HISTORY_LENGTH,
    *,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[Episode]:
    """Play all ``tasks`` concurrently (batched generation); results in task order.

    ``generator`` seeds the sampling: one ``torch.Generator`` shared by all episodes (consumed in
    batch order), or a list with one per task, so that each episode's tokens depend only on its
    own generator, not on which other episodes share its batches.

    ``rollout_mode`` "concat" plays each episode as one growing conversation, "windowed" as one
    fresh prompt per turn showing the last ``history_length`` steps (:mod:`fedagent_flwr.rollout.windowed`).

    ``max_model_len`` bounds every turn's context; ``max_prompt_len`` and ``max_response_len``, where
    given, bound the prompt and the response as verl's agent loop bounds them (their meaning in each
    mode: :mod:`fedagent_flwr.rollout.bounds`), so a verl model's validation cuts its episodes where its
    training did. The reference trainer has one budget, ``trainer.max_model_len``, and passes neither:
    it trains and validates under that one bound.

    ``chat_template_kwargs`` (``model.chat_template_kwargs``) go to every rendering of the chat template,
    as verl's agent loop passes ``data.apply_chat_template_kwargs``.
    """
    if rollout_mode not in ROLLOUT_MODES:
        raise ValueError(f"rollout mode must be one of {ROLLOUT_MODES}, got {rollout_mode!r}")

    if isinstance(generator, (list, tuple)) and len(generator) != len(tasks):
        raise ValueError(f"play_episodes needs one generator, or one per task ({len(tasks)}), got {len(generator)}")

    async def play_all() -> list[Episode]:
        batcher = LockstepBatcher(policy, generator, len(tasks))

        async def play(index: int, task: EpisodeTask) -> Episode:
            try:
                env = make_env(task.env_name, task.config)
                if rollout_mode == "windowed":
                    return await run_windowed_episode(
                        env, task.seed, tokenizer, batcher.generate_fn(index), sampling, task.max_turns,
                        max_model_len, history_length=history_length, eos_token_ids=policy.stop_ids,
                        max_prompt_len=max_prompt_len, max_response_len=max_response_len,
                        chat_template_kwargs=chat_template_kwargs,
                    )
                return await run_episode(
                    env, task.seed, tokenizer, batcher.generate_fn(index), sampling,
                    task.max_turns, max_model_len, eos_token_ids=policy.stop_ids,
                    max_prompt_len=max_prompt_len, max_response_len=max_response_len,
                    chat_template_kwargs=chat_template_kwargs,
                )
            finally:
                batcher.finished(index)

        return list(await asyncio.gather(*(play(i, t) for i, t in enumerate(tasks))))

    return asyncio.run(play_all())

