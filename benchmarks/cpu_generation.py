"""CPU generation speed: plain per-episode ``model.generate`` against the batched KV-cached sampler.

    python benchmarks/cpu_generation.py --episodes 8 --repeats 2

Plays the same TinyGuess episodes (``lo=1, hi=10``, 3 turns, the default job's environment; one
per validation seed) through the rollout runner the trainers use (``rollout.mode`` concat unless
``--mode windowed``), with the model of ``make run`` (SmolLM2-135M-Instruct, converted once into
the user cache) unless ``--model`` names another model directory (``tiny``: the tests' tiny
random-weight model, built in a temp dir). Each repeat times three ways of sampling the turns,
with the same sampling parameters (``--max-new-tokens``, ``--temperature``, top-p 1, no top-k):

* ``plain``: the episodes one after the other, each turn one
  ``model.generate(..., do_sample=True, use_cache=True)`` call on the turn's whole prompt (how a
  trainer without batching samples);
* ``batched``: all episodes together, turn by turn, through
  :class:`fedagent_flwr.trainers.common.sampler.HFPolicy` with ``trainer.prefill=full`` (left
  padding, an attention mask, one prefill and one forward per new token for the batch; every turn
  prefills its whole prompt): the sampler before ``trainer.prefill`` existed;
* ``batched+kv``: the same with ``trainer.prefill=incremental`` (the default): each episode's keys and values are
  kept between its turns, so a turn prefills only its new tokens, and a shared first prompt once.

Both call paths run once untimed first (first-call allocations). Tokens are the sampled tokens of all
turns (up to and including each EOS). The output lists, per pass, tokens, prompt tokens prefilled,
seconds, tokens/s and the load averages (the 2-core machine this was written on is shared, so read
the load beside the numbers). The last line is ``speedup=<batched+kv tokens/s / plain tokens/s>``
(medians over repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def tasks_for(episodes: int, mode: str) -> list[Any]:
    """TinyGuess episodes of the default job's shape, one per validation seed."""
    from fedagent_flwr.seeding import validation_seeds
    from fedagent_flwr.trainers.common.sampler import EpisodeTask

    return [EpisodeTask("TinyGuess", {"lo": 1, "hi": 10}, s, 3, k) for k, s in enumerate(validation_seeds(7, episodes))]


def plain(model: Any, tokenizer: Any, tasks: list[Any], sampling: Any, stop_ids: list[int], pad_id: int,
          mode: str, seed: int, sampled: list[list[int]]) -> tuple[int, int]:
    """Each episode alone, each turn one ``generate`` call; (sampled tokens, prompt tokens).
    Appends every turn's tokens to ``sampled``."""
    from fedagent_flwr.envs.registry import make_env
    from fedagent_flwr.rollout.episode import run_episode
    from fedagent_flwr.rollout.windowed import run_windowed_episode

    counts = [0, 0]
    how: dict[str, Any] = {"do_sample": False}
    if sampling.temperature > 0:  # the sampler's distribution: temperature and top-p only
        how = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}

    async def generate(prompt: list[int], params: Any) -> list[int]:
        ids = torch.tensor([prompt], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_new_tokens,
                                 use_cache=True, pad_token_id=pad_id, eos_token_id=stop_ids, **how)
        new = out[0, len(prompt):].tolist()
        cut = next((k + 1 for k, t in enumerate(new) if t in stop_ids), len(new))  # generate pads after EOS
        counts[0] += cut
        counts[1] += len(prompt)
        sampled.append(new[:cut])
        return new[:cut]

    for i, task in enumerate(tasks):
        torch.manual_seed(seed + i)
        env = make_env(task.env_name, task.config)
        if mode == "windowed":
            asyncio.run(run_windowed_episode(env, task.seed, tokenizer, generate, sampling, task.max_turns, 1024,
                                             eos_token_ids=stop_ids))
        else:
            asyncio.run(run_episode(env, task.seed, tokenizer, generate, sampling, task.max_turns, 1024,
                                    eos_token_ids=stop_ids))
    return counts[0], counts[1]


def _turn_tokens(episode: Any) -> list[list[int]]:
    """A concat episode's sampled tokens, turn by turn (the mask-1 runs of its response)."""
    turns, current = [], []
    for token, mask in zip(episode.response_ids, episode.response_mask):
        if mask:
            current.append(token)
        elif current:
            turns.append(current)
            current = []
    return turns + ([current] if current else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="model directory; '' = make run's SmolLM2-135M-Instruct, "
                                                    "'tiny' = the tests' tiny random model")
    parser.add_argument("--episodes", type=int, default=8, help="episodes (make run evaluates 8, trains 4 per step)")
    parser.add_argument("--mode", default="concat", choices=["concat", "windowed"], help="rollout.mode")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="the reference trainer's default")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy, every mode samples the same tokens (equal work); 1: training; 0.4: validation")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from fedagent_flwr.models.smollm2 import resolve_model_path
    from fedagent_flwr.models.tiny import make_tiny_model
    from fedagent_flwr.rollout.episode import SamplingParams
    from fedagent_flwr.trainers.common.evaluator import load_model
    from fedagent_flwr.trainers.common.sampler import HFPolicy, play_episodes

    work = Path(tempfile.mkdtemp(prefix="genbench_"))
    try:
        model_dir = make_tiny_model(work / "tiny") if args.model == "tiny" else resolve_model_path(args.model)
        model, tokenizer = load_model(model_dir, args.threads)
        tasks = tasks_for(args.episodes, args.mode)
        sampling = SamplingParams(args.max_new_tokens, args.temperature, 1.0)
        probe = HFPolicy(model, tokenizer, 1)
        stop, pad = list(probe.stop_ids), probe.pad_id
        print(f"model {model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, fp32); "
              f"{len(tasks)} TinyGuess episodes (lo 1, hi 10, 3 turns, {args.mode}); max_new_tokens "
              f"{args.max_new_tokens}, temperature {args.temperature}; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs")

        def run(mode: str, rep: int, sampled: list[list[int]]) -> tuple[int, int]:
            seed = args.seed + 1000 * rep
            if mode == "plain":
                return plain(model, tokenizer, tasks, sampling, stop, pad, args.mode, seed, sampled)
            policy = HFPolicy(model, tokenizer, batch_size=max(1, len(tasks)), kv_reuse=mode == "batched+kv")
            episodes = play_episodes(policy, tokenizer, tasks, sampling, 1024, torch.Generator().manual_seed(seed),
                                     args.mode)
            for episode in episodes:  # in the order plain plays them: episode by episode, turn by turn
                sampled += [w.response_ids for w in episode.windows] or _turn_tokens(episode)
            return sum(sum(t.num_tokens for t in e.turns) for e in episodes), policy.prefilled_tokens

        modes = ("plain", "batched", "batched+kv")
        warm = torch.tensor([[pad] * 16])  # untimed warm-up of both call paths (first-call allocations)
        with torch.no_grad():
            model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False,
                           pad_token_id=pad)
        probe.sample([warm[0].tolist()], SamplingParams(2, 0.0), None)
        rows, outputs = [], {}
        for rep in range(1, args.repeats + 1):
            for mode in modes:
                load_before = load()
                started = time.perf_counter()
                sampled: list[list[int]] = []
                tokens, prefilled = run(mode, rep, sampled)
                seconds = time.perf_counter() - started
                outputs[mode, rep] = sampled
                rows.append({"rep": rep, "mode": mode, "episodes": len(tasks), "new_tokens": tokens,
                             "prefilled": prefilled, "seconds": round(seconds, 3),
                             "tok_s": round(tokens / seconds, 1), "load_before": load_before, "load_after": load()})
        header = ("rep", "mode", "episodes", "new_tokens", "prefilled", "seconds", "tok_s", "load_before",
                  "load_after")
        widths = [max(10, len(h)) for h in header]
        print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
        for row in rows:
            print(" ".join(f"{row[h]!s:>{w}}" for h, w in zip(header, widths)))
        print(json.dumps({"benchmark": "cpu_generation", "model": str(model_dir), "mode": args.mode, "rows": rows}))
        if args.temperature <= 0:  # greedy: the modes must have done the very same work
            same = all(outputs[m, r] == outputs["plain", r] for m in modes for r in range(1, args.repeats + 1))
            print(f"same_tokens_in_every_mode={same}")
        median = {m: statistics.median(r["tok_s"] for r in rows if r["mode"] == m) for m in modes}
        print(f"batched_vs_plain={median['batched'] / median['plain']:.2f} "
              f"kv_vs_batched={median['batched+kv'] / median['batched']:.2f}")
        # Last line, for scripts: the sampler's tokens/s (batched, keys and values kept) over plain generate's.
        print(f"speedup={median['batched+kv'] / median['plain']:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
