"""An expert (oracle) policy for WebShop, and ``fedagent webshop-expert``, which writes its episodes as SFT data.

Why: the only model on the GPU node, SmolLM2-135M-Instruct, never writes FedAgent's reply format
``<think>…</think><action>…</action>``, so every WebShop episode scores the same and GRPO has no
signal (docs/gpu-runs/2026-12-02/webshop-diagnosis.md). A supervised warm start on valid, successful
trajectories teaches the format (and the shopping routine) before RL. This module makes those
trajectories through the project's own rollout path: :class:`WebShopExpert` is a
:data:`~fedagent_flwr.rollout.episode.GenerateFn` (token ids in, token ids out) that plays
:class:`~fedagent_flwr.envs.webshop.env.WebShopEnv` episodes with
:func:`~fedagent_flwr.rollout.episode.run_episode` (or the windowed runner), so ``Episode.messages``
is the conversation exactly as a model would see it and produce it.

The expert reads the goal from the env's engine (``env.engine.goal``: target ASIN, goal options) and
follows a fixed recipe, always choosing an action the env lists as admissible:

* search page: ``search[<the instruction without "Find me" and the price clause>]`` (a second search,
  after an empty result page, drops the option clause too);
* results: ``click[<target asin>]`` if listed; else ``click[next >]`` while the turn budget still
  allows the whole purchase and fewer than ``max_pages`` pages were seen; else the listed product
  whose title shares most words with the instruction (the first on ties);
* item page: each goal option value the item offers and that is not selected yet, then ``click[buy now]``
  (at once when only one turn is left); description/features/reviews pages: ``click[< prev]``.

Nothing is random, so the same seeds give the same file. Only training goals are played: the val split
(``goals[:500]``) is FedAgent's held-out evaluation set and is refused.

The command, ``fedagent webshop-expert``, is :mod:`fedagent_flwr.envs.webshop.expert_cli`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedagent_flwr.envs.projection import project_action
from fedagent_flwr.envs.webshop.engine import ITEM, PRODUCTS_PER_PAGE, RESULTS, SEARCH
from fedagent_flwr.envs.webshop.env import WebShopEnv
from fedagent_flwr.rollout.bounds import TokenBounds
from fedagent_flwr.rollout.episode import (
    ConversationError,
    Episode,
    SamplingParams,
    run_episode,
    windowed_turns,
)

# Defaults from conf/recipe/webshop_verl.yaml (the WebShop GPU recipe this data warm-starts) and
# conf/env/webshop.yaml; tests/envs/webshop/test_expert.py checks that they still agree.
DEFAULT_MAX_TURNS = 6
DEFAULT_SEARCH_RETURN_N = 50
DEFAULT_MAX_NEW_TOKENS = 96
DEFAULT_MAX_PROMPT_LENGTH = 512
DEFAULT_MAX_RESPONSE_LENGTH = 2560
# Windowed mode's, from conf/recipe/webshop_windowed_verl.yaml (FedAgent's windowed budgets): a window
# is a whole prompt, so the concat budgets above would cut every episode at its first long window.
WINDOWED_MAX_PROMPT_LENGTH = 4096
WINDOWED_MAX_RESPONSE_LENGTH = 512
#: Result pages the expert looks at before it settles for the best listed product.
DEFAULT_MAX_PAGES = 3
#: The only split the expert plays: its output is training data.
EXPERT_SPLIT = "train"
MODES = ("concat", "windowed")

_PRICE_CLAUSE = re.compile(r",? and price lower than [\d.]+ dollars\s*$", re.IGNORECASE)
_LEAD = re.compile(r"^\s*find me\s+", re.IGNORECASE)
_WORD = re.compile(r"[a-z0-9]+")


class ExpertInputError(ValueError):
    """A request the expert refuses (a split other than train, a bad count, a missing data directory, ...)."""


class ReplyTooLongError(ExpertInputError):
    """An expert reply that does not fit ``max_new_tokens`` even in its shortest form: the limit is too
    small for this episode's actions (raise ``--max-new-tokens``)."""


#: The expert's shortest reasoning, which every reply falls back to when its own does not fit.
SHORT_THINK = "I take the next step towards the purchase."
#: Actions whose text does not depend on the goal (clicking a product or an option, or a search,
#: names the goal's own words, so those need at least as many tokens as the shortest of these).
FIXED_ACTIONS = ("click[buy now]", "click[< prev]", "click[next >]", "click[back to search]")


def _strip_options(instruction: str, goal_options: Mapping[str, str]) -> str:
    """The instruction without its trailing " with k: v, and k: v" clause (built from the goal's options)."""
    if not goal_options:
        return instruction
    tail = " with " + ", and ".join(f"{k}: {v}" for k, v in goal_options.items())
    return instruction[: -len(tail)] if instruction.endswith(tail) else instruction


def search_query(instruction: str, goal_options: Mapping[str, str] | None = None) -> str:
    """The expert's search text: the instruction, lowercased, without "Find me" and the price clause.

    With ``goal_options`` the option clause is dropped too (the shorter second query). Square
    brackets, which would break the ``search[...]`` syntax, become spaces. Measured on 1,000 training
    goals (search_return_n 50): the full form lists the target on the first result page for 91% of
    them (the option values are distinctive words); without the option clause it was about half.
    """
    text = _PRICE_CLAUSE.sub("", instruction)
    if goal_options is not None:
        text = _strip_options(text, goal_options)
    text = _LEAD.sub("", text)
    return " ".join(re.sub(r"[\[\]]", " ", text).split()).lower()


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


@dataclass(frozen=True)
class ExpertMove:
    """One expert turn: a short reason (the ``<think>`` text) and the admissible action."""

    think: str
    action: str

    def reply(self) -> str:
        """The turn in FedAgent's format, ``<think>…</think><action>…</action>``."""
        return f"<think>{self.think}</think><action>{self.action}</action>"


class WebShopExpert:
    """A deterministic oracle policy for one WebShop episode, usable as a ``GenerateFn``.

    Build one per episode, over the env that episode runs (it reads ``env.engine``: the goal, the
    page, the listed products, the selected options). ``max_turns`` must be the episode's cap so
    the expert can keep a purchase within it. Each call returns the reply's token ids followed by
    the tokenizer's EOS, at most ``sampling.max_new_tokens`` of them (a long reply first loses its
    reasoning detail, then trailing search words).
    """

    def __init__(self, env: WebShopEnv, tokenizer: Any, max_turns: int, max_pages: int = DEFAULT_MAX_PAGES) -> None:
        if tokenizer.eos_token_id is None:
            raise ExpertInputError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no EOS token")
        self.env = env
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.max_pages = max_pages
        self.turn = 0
        self.searches = 0
        self.pages_seen = 0
        self.moves: list[ExpertMove] = []

    # --- the recipe --------------------------------------------------------------------------

    def next_move(self) -> ExpertMove:
        """The move for the engine's current page (does not advance the turn count)."""
        engine = self.env.engine
        if engine.goal is None:
            raise RuntimeError("WebShopExpert called before the env was reset")
        turns_left = self.max_turns - self.turn  # including this one
        if engine.page == SEARCH:
            return self._search(engine.goal)
        if engine.page == RESULTS:
            return self._results(engine, turns_left)
        if engine.page == ITEM:
            return self._item(engine, turns_left)
        return ExpertMove("This page only describes the item, so I go back to it.", "click[< prev]")

    def _search(self, goal: Mapping[str, Any]) -> ExpertMove:
        instruction = str(goal["instruction_text"])
        if self.searches == 0:
            return ExpertMove("I am on the search page, so I search for the product the task describes.",
                              f"search[{search_query(instruction)}]")
        return ExpertMove("The last search listed nothing, so I search again with fewer words.",
                          f"search[{search_query(instruction, goal.get('goal_options') or {})}]")

    def _results(self, engine: Any, turns_left: int) -> ExpertMove:
        goal = engine.goal
        clickables = engine.clickables()
        listed = [text for text, (kind, _) in clickables.items() if kind == "asin"]
        target = str(goal["asin"]).lower()
        if target in listed:
            return ExpertMove(f"Item {target} matches what the task asks for, so I open it.", f"click[{target}]")
        options_needed = len(goal.get("goal_options") or {})
        more = engine.page_num * PRODUCTS_PER_PAGE < len(engine.results)  # the next page lists products
        # After "next >": open the item, select its options, buy.
        if listed and more and "next >" in clickables and self.pages_seen + 1 < self.max_pages \
                and turns_left >= 3 + options_needed:
            self.pages_seen += 1
            return ExpertMove("None of the listed items matches the task well, so I look at the next page.",
                              "click[next >]")
        if listed:
            wanted = _words(str(engine.instruction))
            titles = {a: str(engine.world.by_asin[a.upper()].get("Title") or "") for a in listed}
            best = max(listed, key=lambda a: (len(_words(titles[a]) & wanted), -listed.index(a)))
            return ExpertMove(f"Item {best} is the closest match to the task on this page, so I open it.",
                              f"click[{best}]")
        # Nothing listed: back to the search page, where the next search drops the option words.
        return ExpertMove("The search listed no items, so I go back and try other words.", "click[back to search]")

    def _item(self, engine: Any, turns_left: int) -> ExpertMove:
        clickables = engine.clickables()
        chosen = set(engine.options.values())
        for name, value in (engine.goal.get("goal_options") or {}).items():
            kind = clickables.get(value, ("", None))[0]
            if kind == "option" and value not in chosen and turns_left >= 2:
                return ExpertMove(f"The task asks for {name}: {value}, and this item offers it, so I select it.",
                                  f"click[{value}]")
        return ExpertMove("This item fits the task and the requested options are selected, so I buy it.",
                          "click[buy now]")

    # --- GenerateFn --------------------------------------------------------------------------

    @staticmethod
    def min_new_tokens(tokenizer: Any) -> int:
        """The fewest new tokens every episode needs: the longest goal-independent action
        (:data:`FIXED_ACTIONS`) with the shortest reasoning, plus EOS. A smaller ``max_new_tokens``
        cannot work for any goal, so the command refuses it up front; a larger one can still be too
        small for a goal's long product or option name (:class:`ReplyTooLongError` then)."""
        return max(len(tokenizer.encode(ExpertMove(SHORT_THINK, action).reply(), add_special_tokens=False)) + 1
                   for action in FIXED_ACTIONS)

    def _encode(self, move: ExpertMove) -> list[int]:
        ids = list(self.tokenizer.encode(move.reply(), add_special_tokens=False))
        return ids + [int(self.tokenizer.eos_token_id)]

    def _fit(self, move: ExpertMove, limit: int) -> tuple[ExpertMove, list[int]]:
        """``move`` as token ids within ``limit``: shorter reasoning, then fewer search words."""
        ids = self._encode(move)
        if len(ids) <= limit:
            return move, ids
        move = ExpertMove(SHORT_THINK, move.action)
        ids = self._encode(move)
        while len(ids) > limit and move.action.startswith("search[") and len(move.action[7:-1].split()) > 1:
            move = ExpertMove(move.think, "search[" + " ".join(move.action[7:-1].split()[:-1]) + "]")
            ids = self._encode(move)
        if len(ids) > limit:
            raise ReplyTooLongError(f"the expert's reply {move.action!r} needs {len(ids)} tokens even in its shortest "
                                    f"form, more than max_new_tokens={limit}: raise --max-new-tokens")
        return move, ids

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
        """The next reply's token ids (EOS last); ``prompt_ids`` are not needed, the env state is read."""
        move = self.next_move()
        move, ids = self._fit(move, sampling.max_new_tokens)
        if move.action.startswith("search["):
            self.searches += 1
        self.turn += 1
        self.moves.append(move)
        return ids


# --- playing episodes and the SFT file --------------------------------------------------------


def expert_env_config(
    data_dir: str | Path | None,
    split: str = EXPERT_SPLIT,
    max_turns: int = DEFAULT_MAX_TURNS,
    search_return_n: int = DEFAULT_SEARCH_RETURN_N,
) -> dict[str, Any]:
    """The WebShop env config the expert plays; only ``split="train"`` is accepted.

    The val split (``goals[:500]``) is FedAgent's held-out evaluation set: trajectories on it would
    leak the evaluation goals into the warm start.
    """
    if split != EXPERT_SPLIT:
        raise ExpertInputError(f"split must be {EXPERT_SPLIT!r}, got {split!r}: expert trajectories are "
                               "training data, and the val goals (goals[:500]) are held out for evaluation")
    for name, value in (("max_turns", max_turns), ("search_return_n", search_return_n)):
        if value < 1:
            raise ExpertInputError(f"{name} must be >= 1, got {value}")
    config: dict[str, Any] = {"split": split, "max_turns": max_turns, "search_return_n": search_return_n}
    if data_dir is not None:
        config["data_dir"] = str(data_dir)
    return config


@dataclass(frozen=True)
class EpisodeSettings:
    """How the expert's episodes are played: rollout mode and the recipe's length limits. A prompt
    or response budget left at 0 is the mode's recipe's (concat webshop_verl's, windowed
    webshop_windowed_verl's: a window is a whole prompt, so concat's 512 would cut every episode)."""

    mode: str = "concat"
    max_turns: int = DEFAULT_MAX_TURNS
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_prompt_length: int = 0
    max_response_length: int = 0
    history_length: int = 2

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ExpertInputError(f"mode must be one of {MODES}, got {self.mode!r}")
        windowed = self.mode == "windowed"
        if self.max_prompt_length == 0:
            object.__setattr__(self, "max_prompt_length",
                               WINDOWED_MAX_PROMPT_LENGTH if windowed else DEFAULT_MAX_PROMPT_LENGTH)
        if self.max_response_length == 0:
            object.__setattr__(self, "max_response_length",
                               WINDOWED_MAX_RESPONSE_LENGTH if windowed else DEFAULT_MAX_RESPONSE_LENGTH)
        for name in ("max_turns", "max_new_tokens", "max_prompt_length", "max_response_length"):
            if getattr(self, name) < 1:
                raise ExpertInputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.history_length < 0:
            raise ExpertInputError(f"history_length must be >= 0, got {self.history_length}")


async def play_expert_episode(
    env: WebShopEnv, seed: int, tokenizer: Any, settings: EpisodeSettings
) -> tuple[Episode, dict[str, Any]]:
    """Play one episode of ``env`` with a fresh :class:`WebShopExpert`; return it and its SFT record.

    The record: env, split, seed, goal_index (absolute, into the shuffled goal list), asin, mode,
    reward (the env's: 10 iff the purchase scored exactly 1.0), task_score (the purchase's score in
    [0, 1], 0 without one), success, num_turns, truncated, valid_replies (turns the projection
    accepted), messages (``Episode.messages``).
    """
    if env.split != EXPERT_SPLIT:
        raise ExpertInputError(f"the expert plays only the {EXPERT_SPLIT!r} split, not {env.split!r}")
    expert = WebShopExpert(env, tokenizer, settings.max_turns)
    sampling = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=0.0)
    # The bounds verl's agent loop plays under, so the expert's episodes are cut where training's are.
    bounds = TokenBounds.prompt_response(settings.max_prompt_length, settings.max_response_length)
    if settings.mode == "windowed":
        from fedagent_flwr.rollout.windowed import run_windowed_episode

        episode = await run_windowed_episode(env, seed, tokenizer, expert, sampling, settings.max_turns,
                                             bounds.max_model_len, history_length=settings.history_length,
                                             max_prompt_len=bounds.max_prompt_len,
                                             max_response_len=bounds.max_response_len)
    else:
        episode = await run_episode(env, seed, tokenizer, expert, sampling, settings.max_turns, bounds.max_model_len,
                                    max_response_len=bounds.max_response_len, max_prompt_len=bounds.max_prompt_len)
    last = episode.turns[-1].info if episode.turns else {}
    record = {
        "env": "webshop",
        "split": env.split,
        "seed": seed,
        "goal_index": env.goal_index,
        "asin": env.engine.goal["asin"] if env.engine.goal else None,
        "mode": settings.mode,
        "reward": episode.reward,
        "task_score": float(last.get("task_score", 0.0)) if last.get("reward_info") is not None else 0.0,
        "success": episode.success,
        "num_turns": episode.num_turns,
        "truncated": episode.truncated,
        "valid_replies": sum(1 for t in episode.turns if t.info.get("is_action_valid")),
        "messages": episode.messages,
    }
    return episode, record


@dataclass
class ExpertSummary:
    """Totals over the written episodes (what the command prints last)."""

    episodes: int = 0
    successes: int = 0
    score_sum: float = 0.0
    turns: int = 0  # one reply a turn
    valid_replies: int = 0
    truncated: int = 0

    def add(self, record: Mapping[str, Any]) -> None:
        self.episodes += 1
        self.successes += bool(record["success"])
        self.score_sum += float(record["task_score"])
        self.turns += int(record["num_turns"])
        self.valid_replies += int(record["valid_replies"])
        self.truncated += bool(record["truncated"])

    def line(self) -> str:
        n = max(self.episodes, 1)
        return (f"episodes {self.episodes}, success rate {self.successes / n:.3f} ({self.successes}/{self.episodes}), "
                f"mean task score {self.score_sum / n:.3f}, mean turns {self.turns / n:.2f}, "
                f"format-valid replies {self.valid_replies}/{self.turns}, "
                f"truncated {self.truncated} (stopped by the length limits before a purchase)")


def sft_lines(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The lines one episode's record becomes in the SFT file.

    Concat mode: the record itself (its ``messages`` are the conversation as the concat rollout lays
    it out). Windowed mode: one line per turn, its ``messages`` that turn's window (one user message)
    and the reply, plus ``turn``: each windowed turn is a prompt of its own, which is how
    ``fedagent warm-start`` reads a one-user-message conversation; the episode's other fields repeat.
    """
    if record["mode"] != "windowed":
        return [dict(record)]
    try:
        pairs = windowed_turns(record["messages"])
    except ConversationError as exc:
        raise ValueError(f"seed {record['seed']}: {exc}") from None
    return [{**record, "turn": turn, "messages": [dict(user), dict(reply)]} for turn, (user, reply) in enumerate(pairs)]


def write_expert_file(
    out: str | Path,
    env_config: Mapping[str, Any],
    tokenizer: Any,
    seeds: Sequence[int],
    settings: EpisodeSettings,
    log: Callable[[str], None] | None = None,
) -> ExpertSummary:
    """Play one expert episode per seed and write its :func:`sft_lines` to ``out`` (temp name + rename).

    ``log`` (a callable taking a line) gets one progress line per episode. Also checks every reply
    with FedAgent's projection: a reply it does not accept is a bug here, so it stops the run.
    """
    from fedagent_flwr.atomic import atomic_path

    env = WebShopEnv(env_config)
    summary = ExpertSummary()
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for i, seed in enumerate(seeds):
            episode, record = asyncio.run(play_expert_episode(env, int(seed), tokenizer, settings))
            for message in record["messages"]:
                if message["role"] == "assistant" and not project_action(message["content"])[1]:
                    raise RuntimeError(f"seed {seed}: the projection refuses the expert reply {message['content']!r}")
            handle.writelines(json.dumps(line, ensure_ascii=False) + "\n" for line in sft_lines(record))
            summary.add(record)
            if log is not None:
                log(f"episode {i + 1}/{len(seeds)} seed {seed} goal {record['goal_index']}: "
                    f"{'success' if record['success'] else 'no success'}, task score {record['task_score']:.3f}, "
                    f"{record['num_turns']} turns")
    return summary
