"""Where a CPU reference-trainer job's seconds go, in CPU seconds of this process.

    python benchmarks/cpu_job_phases.py [--threads 1] [--repeats 2]

Prints, cumulatively: importing torch, importing the rest (transformers and the package), loading
SmolLM2-135M (the default job's model, converted into ``~/.cache/fedagent-flwr`` by ``make run``),
then per repeat the 4-episode TinyGuess evaluation of the default job (round 0's seeds, 32 new
tokens, temperature 0.4) with its decoding steps counted and timed. CPU seconds (user + system)
hold under the load of other processes where wall seconds do not; ``--threads 1`` keeps them
comparable. docs/performance.md ("CPU reference path") quotes its output.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path
from typing import Any

MODEL = Path(os.path.expanduser("~/.cache/fedagent-flwr/smollm2-0.1.2-135m-instruct-hf-v2"))


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    """Time the phases of one evaluation job and print one line per phase."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=2, help="evaluations after the model is loaded")
    args = parser.parse_args()

    start = time.monotonic()
    import torch
    print(f"import torch {time.monotonic() - start:.2f}s cpu {cpu_seconds():.2f}", flush=True)
    mark = time.monotonic()
    from fedagent_flwr.rollout.episode import SamplingParams
    from fedagent_flwr.seeding import validation_seeds
    from fedagent_flwr.trainers.common.evaluator import load_model
    from fedagent_flwr.trainers.common.sampler import EpisodeTask, HFPolicy, play_episodes
    print(f"import rest {time.monotonic() - mark:.2f}s cpu {cpu_seconds():.2f}", flush=True)
    mark = time.monotonic()
    model, tokenizer = load_model(MODEL, args.threads)
    print(f"load model {time.monotonic() - mark:.2f}s cpu {cpu_seconds():.2f} threads {torch.get_num_threads()}",
          flush=True)

    # Count and time the model's forward calls: a prefill feeds several tokens per row, a decoding
    # step one.
    stats = {"steps": 0, "step_s": 0.0, "prefills": 0, "prefill_s": 0.0}
    forward = model.forward

    def timed_forward(*a: Any, **k: Any) -> Any:
        began = time.monotonic()
        out = forward(*a, **k)
        ids = k.get("input_ids")
        kind = "prefill" if ids is not None and ids.shape[1] > 1 else "step"
        stats[f"{kind}s" if kind == "prefill" else "steps"] += 1
        stats[f"{kind}_s"] += time.monotonic() - began
        return out

    model.forward = timed_forward
    policy = HFPolicy(model, tokenizer, 32, True)
    tasks = [EpisodeTask("TinyGuess", {"lo": 1, "hi": 10}, seed, 3, k)
             for k, seed in enumerate(validation_seeds(7, 4))]
    for repeat in range(args.repeats):
        generators = [torch.Generator().manual_seed(i) for i in range(len(tasks))]
        began, cpu_before = time.monotonic(), cpu_seconds()
        episodes = play_episodes(policy, tokenizer, tasks, SamplingParams(32, 0.4, 1.0), 1024, generators)
        print(f"eval rep{repeat} {time.monotonic() - began:.2f}s cpu {cpu_seconds() - cpu_before:.2f} "
              f"decode {stats} turns {[e.num_turns for e in episodes]}", flush=True)
        stats.update(steps=0, step_s=0.0, prefills=0, prefill_s=0.0)


if __name__ == "__main__":
    main()
