"""WebShop prompts and FedAgent's action projection (spec §7).

Two prompt styles exist in FedAgent:

* "concat" (this project's episode runner): a fixed system message, then one user turn per
  observation (:func:`concat_user_turn`);
* "windowed" (the paper's verl-agent 0.3.1 default): one self-contained user message per step
  carrying the last two (observation, action) pairs (:func:`windowed_prompt`).

The observation text is FedAgent 0.8's raw env observation by default; :func:`baseline_observation`
gives the 0.3.1 baseline's quoted form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# The projection is shared with ALFWorld; WebShop code and tests import it from here too.
from fedagent_flwr.envs.projection import project_action  # noqa: F401
from fedagent_flwr.envs.window import Window, action_history

SEP = " [SEP] "

CONCAT_SYSTEM_PROMPT = (
    "You are an expert autonomous agent operating in the WebShop e-commerce environment. Each turn, "
    "first reason step-by-step about the current situation inside <think> </think> tags, then choose exactly "
    "one admissible action and present it inside <action> </action> tags."
)

# U+2011 in "e‑commerce" and the trailing spaces after "environment." (no-history template only),
# "are:" and "tags." are upstream's (verl-agent 0.3.1 prompts/webshop.py, FedAgent legacy_prompts.py).
_WINDOWED_INTRO = "You are an expert autonomous agent operating in the WebShop e\u2011commerce environment."
_WINDOWED_TAIL = (
    "Your admissible actions of the current situation are: \n[\n{available_actions}\n].\n\n"
    "Now it's your turn to take one action for the current step.\n"
    "You should first reason step-by-step about the current situation, then think carefully which "
    "admissible action best advances the shopping goal. This reasoning process MUST be enclosed within "
    "<think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and "
    "present it within <action> </action> tags.\n"
)
WEBSHOP_TEMPLATE_NO_HIS = (
    "\n" + _WINDOWED_INTRO + " \nYour task is to: {task_description}.\n"
    "Your current observation is: {current_observation}.\n" + _WINDOWED_TAIL
)
WEBSHOP_TEMPLATE = (
    "\n" + _WINDOWED_INTRO + "\nYour task is to: {task_description}.\n"
    "Prior to this step, you have already taken {step_count} step(s). Below are the most recent "
    "{history_length} observations and the corresponding actions you took: {action_history}\n"
    "You are now at step {current_step} and your current observation is: {current_observation}.\n"
    + _WINDOWED_TAIL
)
#: Windowed prompts longer than this fall back to the no-history template.
MAX_WINDOWED_CHARS = 13000


def admissible_actions_text(available: Mapping[str, Any]) -> str:
    """``'search[<your query>]',`` (if there is a search bar) and ``'click[x]',`` lines, newline-joined."""
    actions = ["search[<your query>]"] if available.get("has_search_bar") else []
    actions += [f"click[{c}]" for c in available.get("clickables", [])]
    return "\n".join(f"'{a}'," for a in actions)


def task_from_observation(observation: str) -> str:
    """The task: the first non-empty segment after "Instruction:" (FedAgent 0.8 client)."""
    parts = observation.split(SEP)
    if "Instruction:" in parts:
        for part in parts[parts.index("Instruction:") + 1:]:
            if part.strip():
                return part.strip()
    return observation


def baseline_observation(observation: str) -> str:
    """The 0.3.1 baseline's ``format_obs``: quoted segments after the instruction (raw if none)."""
    parts = observation.split(SEP)
    if "Instruction:" not in parts:
        return observation
    rest = parts[parts.index("Instruction:") + 2:]
    return SEP.join(f"'{p}'" for p in rest)


def concat_user_turn(observation: str, available: Mapping[str, Any], task: str | None = None) -> str:
    """One user turn of concat mode; the first turn (``task`` given) starts with the task line."""
    body = (
        f"Your current observation is: {observation}.\n"
        f"Your admissible actions of the current situation are:\n[\n{admissible_actions_text(available)}\n]."
    )
    return f"Your task is to: {task}.\n{body}" if task is not None else body


def windowed_prompt(
    task: str,
    observation: str,
    available: Mapping[str, Any],
    memory: Sequence[tuple[str, str]],
    history_length: int,
) -> str:
    """The windowed single-message prompt (FedAgent's ``build_webshop_obs``).

    ``memory`` = (observation before, projected action) of every step so far. The first turn, or
    ``history_length <= 0``, uses the no-history template; later turns show the last
    ``history_length`` pairs, and the count printed is the number of pairs actually shown. A prompt
    over :data:`MAX_WINDOWED_CHARS` falls back to the no-history template.
    """
    actions = admissible_actions_text(available)
    no_history = WEBSHOP_TEMPLATE_NO_HIS.format(
        task_description=task, current_observation=observation, available_actions=actions)
    if not memory or history_length <= 0:
        return no_history
    recent = list(memory[-history_length:])
    prompt = WEBSHOP_TEMPLATE.format(
        task_description=task, step_count=len(memory), history_length=len(recent),
        action_history=action_history(recent, len(memory) - len(recent) + 1), current_step=len(memory) + 1,
        current_observation=observation, available_actions=actions)
    return prompt if len(prompt) <= MAX_WINDOWED_CHARS else no_history


def render_window(window: Window) -> str:
    """:func:`windowed_prompt` for a :class:`~fedagent_flwr.envs.window.Window` of WebShop steps.

    Reads what :class:`~fedagent_flwr.envs.webshop.env.WebShopEnv` puts in every info: the task
    (reset), the observation as formatted for the model (``observation``), the page's
    ``available_actions``, and each step's projected ``action``.
    """
    task = str(window.initial_info.get("task") or task_from_observation(window.initial_observation))
    memory = [(str(step.info["observation"]), str(step.step_info.get("action", step.reply)))
              for step in window.history]
    return windowed_prompt(task, str(window.info["observation"]), window.info.get("available_actions") or {},
                           memory, window.history_length)
