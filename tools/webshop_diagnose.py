"""Play WebShop episodes with a local model through the project's own rollout path and tabulate them.

Why: the 2026-12-02 GPU run (conf/recipe/webshop_verl.yaml) scored every episode -0.6. This plays
the same episodes on CPU (the reference trainer's batched sampler, :func:`play_episodes`, running the
shared concat-mode runner that verl's agent loop also runs) and counts, per turn, whether the reply
has FedAgent's tags, whether the projected action is format-valid and whether the engine applied it.

    PYTHONPATH=. .venv/bin/python tools/webshop_diagnose.py --data-dir .gpu-data/webshop --episodes 16

Prints a few transcripts and a table; ``--json`` writes every turn for later inspection.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
from pathlib import Path
from typing import Any

_ACTION_LIKE = re.compile(r"\b(search|click)\s*\[[^\]]*\]", re.IGNORECASE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--model", default="", help="model dir; '' = the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--first-seed", type=int, default=0, help="episodes use seeds first-seed, first-seed+1, ...")
    parser.add_argument("--split", default="val")
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=512 + 2560)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=3, help="episodes whose transcript is printed")
    parser.add_argument("--mode", default="concat", choices=("concat", "windowed"),
                        help="rollout mode (the GPU run used concat; FedAgent's paper default is windowed)")
    parser.add_argument("--system", default="", help="replace the system prompt (experiments only)")
    parser.add_argument("--json", default="", help="write every turn as JSON lines here")
    args = parser.parse_args()

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
    policy = HFPolicy(model, tokenizer, batch_size=args.episodes)
    config = {"split": args.split, "data_dir": args.data_dir, "search_return_n": 50}
    tasks = [EpisodeTask("WebShop", dict(config), seed, args.max_turns, seed)
             for seed in range(args.first_seed, args.first_seed + args.episodes)]
    generators = [torch.Generator().manual_seed(args.seed * 100_003 + t.seed) for t in tasks]
    sampling = SamplingParams(args.max_new_tokens, args.temperature, 1.0)
    with torch.no_grad():
        episodes = play_episodes(policy, tokenizer, tasks, sampling, args.max_model_len, generators,
                                 rollout_mode=args.mode)

    counts: collections.Counter[str] = collections.Counter()
    scores: collections.Counter[float] = collections.Counter()
    rows: list[dict[str, Any]] = []
    for ep in episodes:
        invalid = sum(1 for t in ep.turns if not t.info.get("is_action_valid"))
        score = round(ep.reward - 0.1 * invalid, 3)  # the agent loop's reward_score (concat mode)
        scores[score] += 1
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
    if args.json:
        tmp = Path(args.json + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
