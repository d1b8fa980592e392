"""ALFWorld's windowed prompts: FedAgent's templates (reference §3.4; ``fedagent/envs/legacy_prompts.py``,
which keeps verl-agent 0.3.1's ``prompts/alfworld.py`` verbatim).

* First turn (or ``history_length <= 0``): the no-history template, which has **no task line**
  (the task is inside the reset observation it shows);
* later turns: the task (the text after ``Your task is to: `` in the reset observation), the step
  count, the last ``history_length`` pairs of (raw observation before the action, projected action)
  as ``[Observation N: '...', Action N: '...']`` with N the absolute step, the current step number
  and observation, and the admissible commands;
* upstream's wording is kept to the character, the typo "observaitons" and the space after
  "tags." included.

Pure Python: the service venv and the trainer both import it.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedagent_flwr.envs.window import Window, action_history

_TAIL = (
    "Your admissible actions of the current situation are: [{admissible_actions}].\n\n"
    "Now it's your turn to take an action.\n"
    "You should first reason step-by-step about the current situation. This reasoning process MUST be "
    "enclosed within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and "
    "present it within <action> </action> tags.\n"
)
ALFWORLD_TEMPLATE_NO_HIS = (
    "\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
    "Your current observation is: {current_observation}\n" + _TAIL
)
ALFWORLD_TEMPLATE = (
    "\nYou are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {task_description}\n"
    "Prior to this step, you have already taken {step_count} step(s). Below are the most recent "
    "{history_length} observaitons and the corresponding actions you took: {action_history}\n"
    "You are now at step {current_step} and your current observation is: {current_observation}\n" + _TAIL
)
TASK_MARKER = "Your task is to: "


def admissible_text(commands: Sequence[str]) -> str:
    """The admissible commands as the ALFWorld client lists them: quoted, joined by ``"\\n "``."""
    return "\n ".join(f"'{c}'" for c in commands)


def task_from_observation(observation: str) -> str:
    """The task: the text after ``Your task is to: `` in the reset observation ("" if absent)."""
    _, found, task = observation.partition(TASK_MARKER)
    return task.strip() if found else ""


def windowed_prompt(task: str, observation: str, commands: Sequence[str],
                    memory: Sequence[tuple[str, str]], history_length: int) -> str:
    """FedAgent's ``build_alfworld_obs``; ``memory`` = (raw observation before, projected action) per
    step so far. The history count printed is the number of pairs actually shown."""
    actions = admissible_text(commands)
    if not memory or history_length <= 0:
        return ALFWORLD_TEMPLATE_NO_HIS.format(current_observation=observation, admissible_actions=actions)
    recent = list(memory[-history_length:])
    return ALFWORLD_TEMPLATE.format(
        task_description=task, step_count=len(memory), history_length=len(recent),
        action_history=action_history(recent, len(memory) - len(recent) + 1), current_step=len(memory) + 1,
        current_observation=observation, admissible_actions=actions,
    )


def render_window(window: Window) -> str:
    """:func:`windowed_prompt` for a window of ALFWorld steps, from the infos the env returns
    (``raw_observation``, ``admissible_commands``, each step's projected ``action``)."""
    task = task_from_observation(str(window.initial_info.get("raw_observation", window.initial_observation)))
    memory = [(str(step.info["raw_observation"]), str(step.step_info.get("action", step.reply)))
              for step in window.history]
    commands = list(window.info.get("admissible_commands") or [])
    return windowed_prompt(task, str(window.info["raw_observation"]), commands, memory, window.history_length)
