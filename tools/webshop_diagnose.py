"""Play WebShop episodes with a local model through the project's own rollout path and tabulate them.

Why: the 2026-12-02 GPU run (conf/recipe/webshop_verl.yaml) scored every episode -0.6. This plays
the same episodes on CPU (the reference trainer's batched sampler, :func:`play_episodes`, running the
shared concat-mode runner that verl's agent loop also runs) and counts, per turn, whether the reply
has FedAgent's tags, whether the projected action is format-valid and whether the engine applied it.

    PYTHONPATH=. .venv/bin/python tools/webshop_diagnose.py --data-dir .gpu-data/webshop --episodes 16

Prints a few transcripts and a table; ``--json`` writes every turn for later inspection.

With ``--rollouts N`` every goal is played N times, each with a sampling stream of its own, as
verl's GRPO plays a goal ``rollout.n`` times, and the table adds how many of these groups would give
GRPO a gradient: the groups whose returns differ (a task signal), and the groups whose rows' scores
differ (what GRPO sees: in windowed mode a group's rows are every turn of its episodes, each scored
with the return less the invalid-action penalty when that turn's own action was invalid). Before a
GPU run this says, at the training temperature, whether the starting model's groups are mixed.

``--reward score`` plays under the env's graded reward (10 × the purchase's task score, a departure
from FedAgent's 10-iff-1.0; see the WebShop env's ``reward`` key). ``--reread TURNS.jsonl`` loads no
model: it re-reads a ``--json`` file of a grouped run (its goals' rollouts one after another) and
prints the groups' spread as that run would have had it under ``--reward`` (``--mode`` and
``--invalid-penalty`` as the run's), e.g. the 2026-12-05 CPU probe under the graded reward:

    tools/webshop_diagnose.py --mode windowed --reward score \
        --reread docs/gpu-runs/2026-12-05/warm-start-grpo-probe-cpu/probe-turns.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
from pathlib import Path
from typing import Any

from fedagent_flwr.envs.webshop.reward import REWARD_MODES, service_reward
from fedagent_flwr.rollout.bounds import TokenBounds
from fedagent_flwr.rollout.groups import row_scores as agent_loop_row_scores
from fedagent_flwr.rollout.windowed import action_was_invalid
from fedagent_flwr.schema.trainer import VerlKnobs

_ACTION_LIKE = re.compile(r"\b(search|click)\s*\[[^\]]*\]", re.IGNORECASE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="", help="the WebShop data (required unless --reread)")
    parser.add_argument("--model", default="", help="model dir; '' = the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--first-seed", type=int, default=0, help="episodes use seeds first-seed, first-seed+1, ...")
    parser.add_argument("--split", default="val")
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the context budget (default: --max-prompt-len + --max-response-len when both are "
                             "given, as verl's, else 512 + 2560)")
    parser.add_argument("--max-prompt-len", type=int, default=None,
                        help="verl's trainer.max_prompt_length: a window (or first prompt) over it is not played")
    parser.add_argument("--max-response-len", type=int, default=None,
                        help="verl's trainer.max_response_length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=3, help="episodes whose transcript is printed")
    parser.add_argument("--mode", default="concat", choices=("concat", "windowed"),
                        help="rollout mode (the GPU run used concat; FedAgent's paper default is windowed)")
    parser.add_argument("--system", default="", help="replace the system prompt (experiments only)")
    parser.add_argument("--json", default="", help="write every turn as JSON lines here")
    parser.add_argument("--rollouts", type=int, default=1,
                        help="episodes per goal (verl's rollout.n); above 1 the table adds the groups' spread")
    parser.add_argument("--invalid-penalty", type=float, default=VerlKnobs.invalid_action_penalty,
                        help="the agent loop's trainer.invalid_action_penalty, for the rows' scores")
    parser.add_argument("--reward", default="success", choices=REWARD_MODES,
                        help="the env's reward mode: 'success' (FedAgent's 10 iff score 1.0) or 'score' (10 x score)")
    parser.add_argument("--reread", default="",
                        help="a --json file of a grouped run: print its groups' spread under --reward, no model")
    args = parser.parse_args()
    if args.reread:
        reread(Path(args.reread), args.reward, args.mode, args.invalid_penalty)
        return
    if not args.data_dir:
        parser.error("--data-dir is required to play episodes")
    if args.rollouts < 1:
        parser.error(f"--rollouts must be at least 1, got {args.rollouts}")
    bounds = token_bounds(parser, args.max_model_len, args.max_prompt_len, args.max_response_len)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedagent_flwr.envs.webshop import env as webshop_env
    from fedagent_flwr.models.smollm2 import resolve_model_path
    from fedagent_flwr.rollout.episode import SamplingParams
    from fedagent_flwr.trainers.common.sampler import EpisodeTask, HFPolicy, play_episodes

    if args.system:
        webshop_env.CONCAT_SYSTEM_PROMPT = args.system  # read by WebShopEnv.system_prompt at call time
    torch.set_num_threads(int(os.environ.get("DIAG_THREADS", "2")))
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    policy = HFPolicy(model, tokenizer, batch_size=args.episodes * args.rollouts)
    config = {"split": args.split, "data_dir": args.data_dir, "search_return_n": 50, "reward": args.reward}
    seeds = [seed for seed in range(args.first_seed, args.first_seed + args.episodes) for _ in range(args.rollouts)]
    tasks = [EpisodeTask("WebShop", dict(config), seed, args.max_turns, seed) for seed in seeds]
    # A goal's first rollout keeps the sampling stream a single episode of it always had.
    generators = [torch.Generator().manual_seed(args.seed * 100_003 + t.seed + 1_000_003 * (i % args.rollouts))
                  for i, t in enumerate(tasks)]
    sampling = SamplingParams(args.max_new_tokens, args.temperature, 1.0)
    with torch.no_grad():
        episodes = play_episodes(policy, tokenizer, tasks, sampling, bounds.max_model_len, generators,
                                 rollout_mode=args.mode, max_prompt_len=bounds.max_prompt_len,
                                 max_response_len=bounds.max_response_len)

    counts: collections.Counter[str] = collections.Counter()
    scores: collections.Counter[float] = collections.Counter()
    rows: list[dict[str, Any]] = []
    returns: list[float] = []  # per episode, grouped by goal
    row_scores: list[float] = []  # per GRPO row: an episode (concat) or a turn (windowed)
    row_goals: list[int] = []
    for ep in episodes:
        invalid = [action_was_invalid(t.info) for t in ep.turns]
        # the agent loop's episode score (concat's one row)
        [score] = agent_loop_row_scores(ep.reward, invalid, args.invalid_penalty, windowed=False)
        scores[round(score, 3)] += 1
        returns.append(ep.reward)
        turn_scores = agent_loop_row_scores(ep.reward, invalid, args.invalid_penalty, windowed=args.mode == "windowed")
        row_scores += turn_scores
        row_goals += [ep.seed] * len(turn_scores)
        counts["episodes"] += 1
        counts["ep_item_page"] += any("buy now" in (t.info.get("available_actions") or {}).get("clickables", [])
                                      for t in ep.turns)
        counts["ep_bought"] += any(t.done and t.info.get("reward_info") is not None for t in ep.turns)
        counts["ep_truncated"] += ep.truncated
        for i, t in enumerate(ep.turns):
            text = t.action
            counts["turns"] += 1
            counts["has_action_tags"] += "<action>" in text.lower() and "</action>" in text.lower()
            counts["has_think_tags"] += "<think>" in text and "</think>" in text
            counts["format_valid"] += bool(t.info.get("is_action_valid"))
            counts["engine_applied"] += bool(t.info.get("action_applied"))
            counts["action_like_anywhere"] += _ACTION_LIKE.search(text) is not None
            counts["ended_with_eos"] += t.ended_with_eos
            counts["tokens"] += t.num_tokens
            rows.append({"seed": ep.seed, "turn": i + 1, "reply": text, "action": t.info.get("action"),
                         "format_valid": t.info.get("is_action_valid"), "applied": t.info.get("action_applied"),
                         "task_score": t.info.get("task_score"), "reward": t.reward, "done": t.done,
                         "episode_score": score, "num_tokens": t.num_tokens, "eos": t.ended_with_eos})

    for ep in episodes[: args.show]:
        first_user = next(m["content"] for m in ep.messages if m["role"] == "user")
        print(f"=== seed {ep.seed}: first user turn {first_user[:200]!r}")
        for i, t in enumerate(ep.turns):
            print(f"--- turn {i + 1} ({t.num_tokens} tok, eos={t.ended_with_eos}) reply: {t.action[:400]!r}")
            print(f"    projected action: {t.info.get('action')!r}  format_valid={t.info.get('is_action_valid')}"
                  f"  applied={t.info.get('action_applied')}  reward={t.reward}")
    n, e = counts["turns"], counts["episodes"]
    print("\n| measure | value |\n|---|---|")
    for key in ("has_action_tags", "has_think_tags", "format_valid", "engine_applied", "action_like_anywhere",
                "ended_with_eos"):
        print(f"| turns with {key} | {counts[key]}/{n} ({counts[key] / max(n, 1):.0%}) |")
    print(f"| mean tokens per reply | {counts['tokens'] / max(n, 1):.1f} |")
    for key in ("ep_item_page", "ep_bought", "ep_truncated"):
        print(f"| episodes {key} | {counts[key]}/{e} |")
    print(f"| score distribution | {dict(sorted(scores.items()))} |")
    if args.rollouts > 1:
        print_group_spread(returns, row_scores, row_goals, args.rollouts, [ep.seed for ep in episodes])
    if args.json:
        tmp = Path(args.json + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(args.json)


def token_bounds(parser: argparse.ArgumentParser, max_model_len: int | None, max_prompt_len: int | None,
                 max_response_len: int | None) -> TokenBounds:
    """The bounds the episodes are played under: verl's (:meth:`TokenBounds.prompt_response`) when
    both budgets are given, a context of ``max_model_len`` (default 512 + 2560) otherwise; a
    ``max_model_len`` that disagrees with the two budgets' sum is refused."""
    if max_prompt_len is not None and max_response_len is not None:
        bounds = TokenBounds.prompt_response(max_prompt_len, max_response_len)
        if max_model_len not in (None, bounds.max_model_len):
            parser.error(f"--max-model-len {max_model_len} is not --max-prompt-len + --max-response-len "
                         f"({bounds.max_model_len}); leave it out")
        return bounds
    return TokenBounds(max_model_len or 512 + 2560, max_prompt_len, max_response_len)


def print_group_spread(returns: list[float], row_scores: list[float], row_goals: list[int], rollouts: int,
                       episode_goals: list[int]) -> None:
    """Table rows: the goals' groups whose returns differ, and those whose GRPO rows' scores differ
    (by the project's own flatness test, the one ``zero-variance-group-share`` counts), each with
    its Wilson 95% interval over the groups of two rows or more."""
    from fedagent_flwr.intervals import wilson_interval
    from fedagent_flwr.rollout.groups import zero_variance_group_share

    for label, values, keys in (("returns differ (a task signal)", returns, episode_goals),
                                ("row scores differ (what GRPO sees)", row_scores, row_goals)):
        by_goal: dict[int, list[float]] = collections.defaultdict(list)
        for key, value in zip(keys, values, strict=True):
            by_goal[key].append(value)
        sized = [v for v in by_goal.values() if len(v) > 1]  # a group of one row has no spread
        mixed = sum(1 for v in sized if zero_variance_group_share(v, [0] * len(v)) == 0.0)
        low, high = wilson_interval(mixed, len(sized))
        print(f"| groups ({rollouts} rollouts a goal) whose {label} | {mixed}/{len(sized)} "
              f"(Wilson 95% [{low:.2f}, {high:.2f}]) |")


def reread(path: Path, reward_mode: str, mode: str, invalid_penalty: float) -> None:
    """Print the group-spread rows of a recorded ``--json`` run with its rewards re-mapped under
    ``reward_mode`` from each turn's recorded task score (an episode starts at its turn 1)."""
    episodes: list[list[dict[str, Any]]] = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["turn"] == 1 or not episodes:
            episodes.append([])
        episodes[-1].append(row)
    returns, row_scores, row_goals = [], [], []
    for turns in episodes:
        ret = sum(service_reward(float(t["task_score"] or 0.0), bool(t["done"]), reward_mode).reward for t in turns)
        invalid = [t["format_valid"] is not None and not t["format_valid"] for t in turns]
        returns.append(ret)
        scores = agent_loop_row_scores(ret, invalid, invalid_penalty, windowed=mode == "windowed")
        row_scores += scores
        row_goals += [turns[0]["seed"]] * len(scores)
    goals = [turns[0]["seed"] for turns in episodes]
    rollouts = max(collections.Counter(goals).values(), default=0)
    print(f"| episodes re-read (reward {reward_mode}) | {len(episodes)} |")
    print(f"| return distribution | {dict(sorted(collections.Counter(round(r, 3) for r in returns).items()))} |")
    print_group_spread(returns, row_scores, row_goals, rollouts, goals)


if __name__ == "__main__":
    main()
