"""The windowed episode runner (FedAgent's paper setting): one training sample per turn.

Each turn's prompt is a fresh, single user message (no system message) that the environment
renders from the episode so far (:meth:`~fedagent_flwr.envs.base.BaseTextEnv.window_prompt`):
the task, the last ``history_length`` (observation, action) pairs and the current observation
(FedAgent's templates for WebShop and ALFWorld, reference §1.4 and §3.4). The turn's sample is
that prompt, chat-templated with the generation prompt, and the tokens sampled for it (all
trained, mask 1): no observation tokens are ever in a response.

Like the concat runner (:mod:`fedagent_flwr.rollout.episode`), nothing is truncated silently: a
turn whose prompt plus ``max_new_tokens`` exceeds ``max_model_len`` (or whose prompt exceeds
``max_prompt_len``) is not started and the episode ends ``truncated``. (FedAgent left-truncates
such prompts instead.) A turn's response is its reply alone, so ``max_response_len`` caps the
tokens a turn samples (as verl's windowed loop caps ``max_new_tokens`` at ``response_length``).
The bounds' meaning in both runners: :mod:`fedagent_flwr.rollout.bounds`.

How the samples are scored is the trainer's business: every turn carries its episode's group and
return (FedAgent broadcasts the episode return to every turn; its verl loop also subtracts the
invalid-action penalty on the turns whose own action was invalid, hence ``WindowSample.invalid``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from fedagent_flwr.envs.base import BaseTextEnv
from fedagent_flwr.envs.window import Window, WindowStep
from fedagent_flwr.rollout.episode import (
    ChatRenderer,
    Episode,
    GenerateFn,
    SamplingParams,
    TurnRecord,
    WindowSample,
    generate_turn,
    stop_token_ids,
)
from fedagent_flwr.schema.trainer import ROLLOUT_MODES, Rollout  # noqa: F401  # ROLLOUT_MODES: re-exported

# FedAgent's windowed_history_length (verl-agent's env.history_length); both declared with the setting
DEFAULT_HISTORY_LENGTH = Rollout.history_length


def action_was_invalid(info: Mapping[str, Any]) -> bool:
    """Whether the env flagged the step's action invalid: ``is_action_valid`` present and falsy
    (WebShop reports 0/1, ALFWorld booleans); envs without the key never flag one."""
    return "is_action_valid" in info and not info["is_action_valid"]


async def run_windowed_episode(
    env: BaseTextEnv,
    seed: int,
    tokenizer: Any,
    generate: GenerateFn,
    sampling: SamplingParams,
    max_turns: int,
    max_model_len: int,
    *,
    history_length: int = DEFAULT_HISTORY_LENGTH,
    eos_token_ids: Iterable[int] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
) -> Episode:
    """Play one episode of ``env`` (reset with ``seed``), one windowed prompt per turn.

    Returns an :class:`~fedagent_flwr.rollout.episode.Episode` whose ``windows`` are the per-turn
    samples; the environment is closed when the episode ends, also on error.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if history_length < 0:
        raise ValueError(f"history_length must be >= 0, got {history_length}")
    if max_response_len is not None and sampling.max_new_tokens > max_response_len:
        sampling = replace(sampling, max_new_tokens=max_response_len)
    stop_ids = stop_token_ids(tokenizer, eos_token_ids)
    renderer = ChatRenderer(tokenizer, chat_template_kwargs)
    try:
        system = await env.system_prompt()
        first_observation, first_info = await env.reset(seed)
        observation, info = first_observation, dict(first_info)
        history: list[WindowStep] = []
        samples: list[WindowSample] = []
        turns: list[TurnRecord] = []
        messages: list[dict[str, str]] = []
        reward, success, truncated = 0.0, False, False

        while len(turns) < max_turns:
            window = Window(system, first_observation, first_info, observation, info, tuple(history), history_length)
            text = env.window_prompt(window)
            _, prompt_ids = renderer.prompt([{"role": "user", "content": text}])
            if (len(prompt_ids) + sampling.max_new_tokens > max_model_len
                    or (max_prompt_len is not None and len(prompt_ids) > max_prompt_len)):
                truncated = True
                break
            new_ids = await generate_turn(generate, prompt_ids, sampling)
            reply = tokenizer.decode(new_ids, skip_special_tokens=True)
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
            next_observation, step_reward, done, step_info = await env.step(reply)
            reward += float(step_reward)
            success = success or bool(step_info.get("success", False))
            samples.append(WindowSample(prompt_ids, new_ids, [1] * len(new_ids), action_was_invalid(step_info)))
            turns.append(TurnRecord(reply, next_observation, float(step_reward), bool(done), dict(step_info),
                                    len(new_ids), bool(new_ids) and new_ids[-1] in stop_ids))
            history.append(WindowStep(observation, info, reply, dict(step_info)))
            observation, info = next_observation, dict(step_info)
            if done:
                break

        return Episode(seed=seed, prompt_ids=[], response_ids=[], response_mask=[], reward=reward,
                       success=success, num_turns=len(turns), truncated=truncated, messages=messages,
                       turns=turns, windows=samples)
    finally:
        await env.close()
