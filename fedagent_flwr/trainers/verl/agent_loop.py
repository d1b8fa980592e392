"""The verl agent loop: one environment episode per trajectory, played by the shared episode runner.

verl instantiates :class:`EnvAgentLoop` once per trajectory inside its Ray agent-loop workers
(registered through the ``agent_loop_config_path`` YAML the entry module writes, because the
``@register`` decorator only reaches processes that import this module). ``run`` receives the
dataset row (``env_name``, ``env_config``, ``seed``, ``max_turns``) and plays the episode with
:func:`fedagent_flwr.rollout.run_episode`, whose ``generate`` is verl's vLLM server
(``server_manager.generate``, token in / token out, one sticky request id per episode, which
verl uses to keep the episode's turns on one server replica; vLLM's prefix cache is keyed by content
and serves later turns either way). The CPU reference trainer runs the very same runner, so
both backends train on the same token layout: prompt = system + first observation, response = each
turn's sampled tokens (mask 1) and the template glue + next observation (mask 0).

The trajectory's ``reward_score`` is the episode return minus ``invalid_action_penalty`` per action
the environment flagged invalid (``info["is_action_valid"] is False``; FedAgent's rule), so verl's
reward workers never score it. Every finished episode is also appended, as one JSON line, to the
episode log, from which the entry module reports the client's success rate and reward: the row's
``episode_log`` (the round's own file; a persistent trainer's loops outlive the round), else the
one in the agent-loop YAML. The record carries the row's ``uid`` (the GRPO group verl's trainer
gave the row at this step) and, in windowed mode, the score of each turn row, so the share of flat
groups is measured on the groups and scores verl's GRPO used.

With ``request_fingerprints`` (``trainer.request_fingerprints``, a diagnostic) every call to the
server also appends one line to :data:`FINGERPRINT_FILE` beside the episode log: the request's
vLLM seed, env seed, dataset row and turn, verl step and place in the GRPO group (where
``trainer.request_seeds`` supplies them), and SHA-256 digests of its prompt token ids, of the token
ids vLLM returned and of their log-probabilities (:func:`request_fingerprint`). Two runs of one
config can then be joined request by request (on seed, env seed, row and turn when
``trainer.request_seeds`` is on) to find the first request whose prompt, tokens or log-probabilities differ.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from uuid import uuid4

from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput

from fedagent_flwr.envs.registry import make_env
from fedagent_flwr.rollout.bounds import TokenBounds
from fedagent_flwr.rollout.episode import Episode, SamplingParams, model_stop_ids, run_episode
from fedagent_flwr.rollout.groups import row_scores
from fedagent_flwr.rollout.windowed import DEFAULT_HISTORY_LENGTH, action_was_invalid, run_windowed_episode
from fedagent_flwr.schema.trainer import VerlKnobs
from fedagent_flwr.trainers.verl.dataset import FINGERPRINT_FILE
from fedagent_flwr.trainers.verl.phases import append_json_line
from fedagent_flwr.trainers.verl.request_seeds import (
    REQUEST_GROUP_PLACE_KEY,
    REQUEST_STEP_KEY,
    SEED_BASE_KEY,
    request_seed,
)


class PromptTooLongError(ValueError):
    """An episode's first prompt does not fit ``data.max_prompt_length``."""


def invalid_action_flags(episode: Episode) -> list[bool]:
    """Per turn, whether the environment flagged its action invalid: ``is_action_valid`` present and
    falsy (WebShop reports 0/1, ALFWorld booleans); environments without the key are never penalised."""
    return [action_was_invalid(turn.info) for turn in episode.turns]


def response_logprobs(response_mask: list[int], sampled_logprobs: list[float]) -> list[float]:
    """Log-probs aligned with the response: the sampled tokens' in order on mask-1 positions,
    0.0 on the glue/observation tokens the model did not generate."""
    values = iter(sampled_logprobs)
    aligned = [next(values) if m else 0.0 for m in response_mask]
    return aligned


def reward_extra_info(episode: Any, invalid: int) -> dict[str, Any]:
    """What verl's reward manager reports of an episode beside its score (either agent loop)."""
    return {"reward_extra_info": {"traj_success": float(episode.success), "env_reward": float(episode.reward),
                                  "invalid_actions": float(invalid)}}


def episode_log_path(row: dict[str, Any], default: str) -> str:
    """Where an episode of ``row`` is logged: the row's ``episode_log`` if it names one, else ``default``."""
    return str(row.get("episode_log") or default)


def grpo_group(row: dict[str, Any]) -> dict[str, str]:
    """The episode's GRPO group for its record: ``{"uid": ...}``, the id verl's trainer gives each
    row of a step before repeating it ``rollout.n`` times (and that its GRPO groups by), or nothing
    when the row has none (a loop driven outside verl's trainer)."""
    return {"uid": str(row["uid"])} if row.get("uid") is not None else {}


def fingerprint_log_path(row: dict[str, Any], default: str) -> str:
    """The request-fingerprint file of an episode of ``row``: :data:`FINGERPRINT_FILE` in the folder of
    its episode log (:func:`episode_log_path`), or "" when the episode is not logged."""
    episode_log = episode_log_path(row, default)
    return str(Path(episode_log).parent / FINGERPRINT_FILE) if episode_log else ""


def token_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 of token ids packed as little-endian signed 64-bit ints: equal exactly for equal ids, in
    any process (no Python ``hash``)."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *(int(t) for t in token_ids))).hexdigest()


def logprob_digest(logprobs: Sequence[float]) -> str:
    """SHA-256 of log-probabilities packed as little-endian float64: vLLM's float32 values convert to
    Python floats exactly, so two requests' digests are equal only if their values are bit-identical."""
    return hashlib.sha256(struct.pack(f"<{len(logprobs)}d", *(float(v) for v in logprobs))).hexdigest()


def _int_or_none(value: Any) -> int | None:
    """``value`` as an int, or None where it is None (a column the row does not carry)."""
    return None if value is None else int(value)


def request_fingerprint(*, env_seed: int | None, index: Any, turn: int, seed: int | None, step: int | None,
                        rollout_n: int | None, prompt_ids: Sequence[int], output: Any, started: float,
                        seconds: float) -> dict[str, Any]:
    """One vLLM request as two runs can compare it: what identifies it (the env seed, dataset row,
    turn and vLLM seed; each None where unknown), which verl ``step`` and place in the GRPO group
    (``rollout_n``) it served (None without ``trainer.request_seeds``, whose worker supplies them;
    two runs share weights only at step 1 of their first round), digests of its prompt, of the tokens
    the server returned and of their log-probabilities (before the agent loop trims anything) and the
    log-probs' sum (whose difference between two runs says whether logits moved by rounding or by
    more), the prompt tokens served from vLLM's prefix cache where the server reports them, and when
    it ran (wall clock start, seconds waited), so the requests in flight beside it can be reconstructed."""
    tokens = [int(t) for t in output.token_ids]
    logprobs = list(getattr(output, "log_probs", None) or [])
    extra = getattr(output, "extra_fields", None) or {}
    return {
        "env_seed": _int_or_none(env_seed), "index": _int_or_none(index), "turn": int(turn),
        "seed": seed, "step": _int_or_none(step), "rollout_n": _int_or_none(rollout_n),
        "prompt_len": len(prompt_ids), "prompt_sha256": token_digest(prompt_ids),
        "output_len": len(tokens), "output_sha256": token_digest(tokens),
        "logprobs_len": len(logprobs), "logprobs_sha256": logprob_digest(logprobs),
        "logprob_sum": math.fsum(float(v) for v in logprobs),  # how far apart, where the digests differ
        "cached_tokens": extra.get("num_cached_tokens"), "stop_reason": getattr(output, "stop_reason", None),
        "started": round(started, 6), "seconds": round(seconds, 6), "pid": os.getpid(),
    }


class ServerGenerate:
    """The episode runner's ``generate`` on verl's LLM server (``server_manager.generate``, token in,
    token out), for both agent-loop modes.

    ``request_id``: one id for every call (concat mode: the turns of an episode extend one prompt,
    so a sticky id keeps them on one server replica, where the content-keyed prefix cache serves
    each turn; verl 0.9.1 sends vLLM itself a fresh id per call), or None for a fresh id per
    call (windowed mode: each turn's prompt is new, there is no prefix to share). Each call's
    sampled-token log-probs (0.0 where the server returned none) are kept per turn in
    ``turn_logprobs`` and the time spent waiting for the server in ``seconds``. ``seed_base``: the
    rollout's seed base when ``trainer.request_seeds`` is on (the row's ``request_seed_base``), and
    then each call carries ``seed`` = :func:`~.request_seeds.request_seed` (base, turn); None sends no
    seed (vLLM samples unseeded). ``fingerprint_log``: when not "", each call appends its
    :func:`request_fingerprint` there (``fingerprint_row`` gives the row's env ``seed``, ``index``,
    ``step`` and ``rollout_n``; a missing or None value is recorded as None).
    """

    def __init__(self, server_manager: Any, sampling_params: dict[str, Any], request_id: str | None,
                 seed_base: int | None = None, fingerprint_log: str = "",
                 fingerprint_row: dict[str, Any] | None = None) -> None:
        self.server_manager = server_manager
        self.sampling_params = sampling_params
        self.request_id = request_id
        self.seed_base = seed_base
        self.fingerprint_log = fingerprint_log
        self.fingerprint_row = fingerprint_row or {}
        self.turn_logprobs: list[list[float]] = []
        self.seconds = 0.0

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
        params = dict(self.sampling_params)
        params["max_tokens"] = sampling.max_new_tokens
        if self.seed_base is not None:
            params["seed"] = request_seed(self.seed_base, len(self.turn_logprobs))  # this turn's own seed
        started, wall = time.monotonic(), time.time()
        output = await self.server_manager.generate(request_id=self.request_id or uuid4().hex,
                                                    prompt_ids=prompt_ids, sampling_params=params)
        waited = time.monotonic() - started
        self.seconds += waited
        if self.fingerprint_log:
            append_json_line(self.fingerprint_log, request_fingerprint(
                env_seed=self.fingerprint_row.get("seed"), index=self.fingerprint_row.get("index"),
                turn=len(self.turn_logprobs), seed=params.get("seed"), step=self.fingerprint_row.get("step"),
                rollout_n=self.fingerprint_row.get("rollout_n"), prompt_ids=prompt_ids, output=output,
                started=wall, seconds=waited))
        tokens = [int(t) for t in output.token_ids][: sampling.max_new_tokens]
        logprobs = list(output.log_probs or [])[: len(tokens)]
        self.turn_logprobs.append(logprobs + [0.0] * (len(tokens) - len(logprobs)))
        return tokens


def cut_replies(episode: Episode) -> int:
    """How many of the episode's replies ended without a stop id: cut at ``max_new_tokens``."""
    return sum(1 for turn in episode.turns if not turn.ended_with_eos)


@functools.cache
def generation_eos(model_path: str) -> int | tuple[int, ...] | None:
    """The ``eos_token_id`` of the model's generation config at ``model_path``: the ids vLLM adds to
    every request's stop ids. Like vLLM, a directory without ``generation_config.json`` falls back
    to the one its ``config.json`` implies; None when ``model_path`` is not a local directory (a
    hub name is never fetched from here). Read once per path and process, since verl builds an agent
    loop for every episode."""
    from transformers import AutoConfig, GenerationConfig

    if not Path(model_path).is_dir():
        print(f"agent loop: {model_path} is not a local model directory; a turn counts as finished only "
              "at the tokenizer's EOS", file=sys.stderr)
        return None
    try:
        value = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json there
        value = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path)).eos_token_id
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else value


class EnvAgentLoop(AgentLoopBase):
    """Plays one multi-turn text-environment episode and returns it as a verl trajectory.

    Extra constructor arguments come from the agent-loop YAML: ``max_new_tokens`` (per turn),
    ``invalid_action_penalty``, ``episode_log`` (a JSON-lines file; "" disables it),
    ``history_length`` (windowed mode: :meth:`run_windowed`, which the windowed worker calls) and
    ``request_fingerprints`` (a fingerprint line per server call, beside the episode log).
    """

    def __init__(self, *args: Any, max_new_tokens: int = VerlKnobs.max_new_tokens,
                 invalid_action_penalty: float = VerlKnobs.invalid_action_penalty,
                 episode_log: str = "", history_length: int = DEFAULT_HISTORY_LENGTH,
                 request_fingerprints: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_new_tokens = int(max_new_tokens)
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.episode_log = str(episode_log)
        self.history_length = int(history_length)
        self.request_fingerprints = bool(request_fingerprints)
        # The ids vLLM stops a reply at, so a turn's record says how it really ended.
        model_path = OmegaConf.select(self.config, "actor_rollout_ref.model.path")
        self.stop_ids = model_stop_ids(self.tokenizer, generation_eos(str(model_path)) if model_path else None)

    def _generate(self, sampling_params: dict[str, Any], request_id: str | None,
                  kwargs: dict[str, Any]) -> ServerGenerate:
        """The episode's :class:`ServerGenerate`: the row's seed base, and its fingerprint file when on
        (with what the fingerprints record of the row: env seed, index, and the step and place in the
        group that :class:`~.request_seeds.RequestSeedMixin` adds as columns, None without it)."""
        return ServerGenerate(self.server_manager, sampling_params, request_id=request_id,
                              seed_base=kwargs.get(SEED_BASE_KEY),
                              fingerprint_log=(fingerprint_log_path(kwargs, self.episode_log)
                                               if self.request_fingerprints else ""),
                              fingerprint_row={"seed": kwargs.get("seed"), "index": kwargs.get("index"),
                                               "step": kwargs.get(REQUEST_STEP_KEY),
                                               "rollout_n": kwargs.get(REQUEST_GROUP_PLACE_KEY)})

    def _episode_setup(self, kwargs: dict[str, Any]) -> tuple[str, int, Any, TokenBounds]:
        """A row's env name, seed and env, and the token bounds of the rollout's prompt and response
        budgets (``data.max_prompt_length`` and ``data.max_response_length``; the Hugging Face
        evaluator validates under the same, :meth:`VerlSettings.token_bounds`)."""
        env_name, seed = str(kwargs["env_name"]), int(kwargs["seed"])
        return (env_name, seed, make_env(env_name, dict(kwargs["env_config"])),
                TokenBounds.prompt_response(int(self.rollout_config.prompt_length),
                                            int(self.rollout_config.response_length)))

    def _sampling(self, sampling_params: dict[str, Any], max_new_tokens: int) -> SamplingParams:
        """verl's temperature and top-p for this request, with a turn's token budget."""
        return SamplingParams(max_new_tokens, float(sampling_params.get("temperature", SamplingParams.temperature)),
                              float(sampling_params.get("top_p") or SamplingParams.top_p))

    async def run_windowed(self, sampling_params: dict[str, Any], validate: bool = False,
                           **kwargs: Any) -> list[AgentLoopOutput]:
        """Windowed mode: play the episode with one fresh prompt per turn
        (:func:`~fedagent_flwr.rollout.windowed.run_windowed_episode`) and return one trajectory per turn.

        Every turn's ``reward_score`` is the episode return, minus ``invalid_action_penalty`` on the
        turns whose own action was invalid when training (FedAgent's windowed loop, reference §1.4);
        the response is the turn's sampled tokens only (mask 1). verl repeats the row's ``uid`` onto
        every turn (:mod:`.windowed`), so GRPO groups the turns of all rollouts of one env instance.
        """
        env_name, seed, env, bounds = self._episode_setup(kwargs)
        generate = self._generate(sampling_params, None, kwargs)  # a fresh request id per turn
        sampling = self._sampling(sampling_params, self.max_new_tokens)  # capped at the response budget
        episode = await run_windowed_episode(
            env, seed, self.tokenizer, generate, sampling, int(kwargs["max_turns"]), bounds.max_model_len,
            history_length=self.history_length, chat_template_kwargs=self.apply_chat_template_kwargs,
            max_prompt_len=bounds.max_prompt_len, max_response_len=bounds.max_response_len,
            eos_token_ids=self.stop_ids,
        )
        if not episode.windows:
            raise PromptTooLongError(
                f"{env_name} seed {seed}: the first windowed prompt does not fit data.max_prompt_length "
                f"({bounds.max_prompt_len}); raise trainer.max_prompt_length"
            )
        invalid = sum(1 for w in episode.windows if w.invalid)
        # Each turn row's score: the return, less the penalty on a turn whose own action was invalid.
        scores = row_scores(episode.reward, [w.invalid for w in episode.windows],
                            0.0 if validate else self.invalid_action_penalty, windowed=True)
        episode_log = episode_log_path(kwargs, self.episode_log)
        if episode_log:
            append_json_line(episode_log, {
                "env": env_name, "seed": seed, "reward": episode.reward,
                "score": episode.reward - self.invalid_action_penalty * invalid,
                "success": episode.success, "num_turns": episode.num_turns, "invalid": invalid,
                "truncated": episode.truncated, "response_tokens": episode.trained_tokens,
                "cut_replies": cut_replies(episode),
                "samples": len(episode.windows), "pid": os.getpid(),
                # what verl's GRPO groups and scores: the turn rows of this episode, under the row's uid
                "turn_scores": scores, **grpo_group(kwargs),
            })
        outputs = []
        for window, logprobs, score in zip(episode.windows, generate.turn_logprobs, scores, strict=True):
            outputs.append(AgentLoopOutput(
                prompt_ids=window.prompt_ids,
                response_ids=window.response_ids,
                response_mask=window.response_mask,
                response_logprobs=logprobs,
                reward_score=score,
                num_turns=1,
                metrics=AgentLoopMetrics(generate_sequences=generate.seconds / len(episode.windows)),
                extra_fields=reward_extra_info(episode, invalid),
            ))
        return outputs

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        env_name, seed, env, bounds = self._episode_setup(kwargs)
        generate = self._generate(sampling_params, uuid4().hex, kwargs)  # sticky
        sampling = self._sampling(sampling_params, self.max_new_tokens)
        episode = await run_episode(
            env, seed, self.tokenizer, generate, sampling, int(kwargs["max_turns"]), bounds.max_model_len,
            chat_template_kwargs=self.apply_chat_template_kwargs,
            max_response_len=bounds.max_response_len, max_prompt_len=bounds.max_prompt_len,
            eos_token_ids=self.stop_ids,
        )
        if bounds.max_prompt_len is not None and len(episode.prompt_ids) > bounds.max_prompt_len:
            # verl cannot pad such a prompt to data.max_prompt_length; the runner played no turn of it
            raise PromptTooLongError(
                f"{env_name} seed {seed}: the first prompt has {len(episode.prompt_ids)} tokens but "
                f"data.max_prompt_length is {bounds.max_prompt_len}; raise trainer.max_prompt_length"
            )
        flags = invalid_action_flags(episode)
        invalid = sum(flags)
        [score] = row_scores(episode.reward, flags, self.invalid_action_penalty, windowed=False)
        episode_log = episode_log_path(kwargs, self.episode_log)
        if episode_log:
            append_json_line(episode_log, {
                "env": env_name, "seed": seed, "reward": episode.reward, "score": score,
                "success": episode.success, "num_turns": episode.num_turns, "invalid": invalid,
                "truncated": episode.truncated, "response_tokens": sum(episode.response_mask),
                "cut_replies": cut_replies(episode),
                "pid": os.getpid(), **grpo_group(kwargs),
            })
        return AgentLoopOutput(
            prompt_ids=episode.prompt_ids,
            response_ids=episode.response_ids,
            response_mask=episode.response_mask,
            response_logprobs=response_logprobs(episode.response_mask,
                                                [lp for turn in generate.turn_logprobs for lp in turn]),
            reward_score=score,
            num_turns=episode.num_turns,
            metrics=AgentLoopMetrics(generate_sequences=generate.seconds),
            extra_fields=reward_extra_info(episode, invalid),
        )
