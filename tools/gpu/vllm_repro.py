"""Does vLLM on this node give the same tokens for the same seeded request? A direct probe.

Two verl runs of one config with ``trainer.request_seeds`` and ``trainer.batch_invariant`` on still
differed from their first training step (docs/results.md §3, batch 18). This takes verl, Ray and
the agent loop out of the question: it asks vLLM's offline engine, in the rollout's dtype, for the
same seeded requests three times in one process (twice as one batch, once reversed in batches of
16) and compares the token ids. Run once per ``VLLM_BATCH_INVARIANT`` value, each in its own
process (vLLM reads the variable at import), and twice with it on, to compare across processes as
two runs side by side would.

usage (on the GPU node, after tools/gpu/prepare_node.sh):
    VLLM_BATCH_INVARIANT=1 python3 tools/gpu/vllm_repro.py probe --label bi1a --out $OUT/bi1a.json
    python3 tools/gpu/vllm_repro.py compare $OUT/bi0.json $OUT/bi1a.json $OUT/bi1b.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

GROUPS = 8  # prompts, as GRPO groups
GROUP_SIZE = 16  # samples a prompt, each with its own seed (as trainer.rollout_n and request_seeds)
MAX_TOKENS = 48  # trainer.max_new_tokens


def _requests() -> list[tuple[str, int]]:
    """(prompt, seed) for every request: GROUPS prompts, GROUP_SIZE seeds each, fixed."""
    prompts = [
        f"I am thinking of a whole number from 1 to 10. Guess it in at most 3 tries. Attempt {g + 1}: "
        "reply with your guess only." for g in range(GROUPS)
    ]
    return [(prompt, 1000 * g + k) for g, prompt in enumerate(prompts) for k in range(GROUP_SIZE)]


def probe(label: str, out: Path) -> None:
    """Generate the fixed requests three ways in one vLLM engine; write their token ids as JSON."""
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]  # the node's vLLM; not on CPU machines

    from fedagent_flwr.models.smollm2 import default_model_dir

    started = time.time()
    llm = LLM(model=str(default_model_dir()), dtype="bfloat16", enforce_eager=True,
              gpu_memory_utilization=0.2, seed=0)
    ready = time.time() - started
    requests = _requests()

    def generate(order: list[int], batch: int) -> dict[int, list[int]]:
        tokens: dict[int, list[int]] = {}
        for start in range(0, len(order), batch):
            chunk = order[start:start + batch]
            params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=requests[i][1])
                      for i in chunk]
            outputs = llm.generate([requests[i][0] for i in chunk], params, use_tqdm=False)
            for i, output in zip(chunk, outputs):
                tokens[i] = list(output.outputs[0].token_ids)
        return tokens

    everything = list(range(len(requests)))
    runs = {
        "one-batch": generate(everything, len(everything)),
        "one-batch-again": generate(everything, len(everything)),
        "reversed-16s": generate(everything[::-1], GROUP_SIZE),
    }
    record = {
        "label": label, "batch_invariant_env": os.environ.get("VLLM_BATCH_INVARIANT", ""),
        "engine_ready_s": round(ready, 1), "requests": len(requests),
        "runs": {name: [tokens[i] for i in everything] for name, tokens in runs.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(out)
    print(f"{label}: VLLM_BATCH_INVARIANT={record['batch_invariant_env']!r}, engine ready in {ready:.1f} s; "
          + _within(record), flush=True)


def _same(a: list[list[int]], b: list[list[int]]) -> str:
    """How many requests two runs' token ids agree on; ValueError if the runs hold different numbers
    of requests (pairing them up would silently drop the extra ones)."""
    if len(a) != len(b):
        raise ValueError(f"runs of {len(a)} and {len(b)} requests cannot be compared request by request")
    equal = sum(x == y for x, y in zip(a, b, strict=True))
    return f"{equal}/{len(a)} requests identical"


def _within(record: dict[str, Any]) -> str:
    runs = record["runs"]
    return (f"one batch twice: {_same(runs['one-batch'], runs['one-batch-again'])}; "
            f"one batch vs reversed in 16s: {_same(runs['one-batch'], runs['reversed-16s'])}")


def compare(files: list[Path]) -> None:
    """Each probe's own comparisons, then every pair of probes' one-batch runs; ValueError (from
    :func:`_same`) on runs of different lengths."""
    records = [json.loads(f.read_text()) for f in files]
    for record in records:
        print(f"{record['label']} (VLLM_BATCH_INVARIANT={record['batch_invariant_env']!r}): {_within(record)}")
    for i, first in enumerate(records):
        for second in records[i + 1:]:
            print(f"{first['label']} vs {second['label']}, one batch each: "
                  f"{_same(first['runs']['one-batch'], second['runs']['one-batch'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("probe")
    one.add_argument("--label", required=True)
    one.add_argument("--out", type=Path, required=True)
    many = sub.add_parser("compare")
    many.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "probe":
        probe(args.label, args.out)
        return 0
    try:
        compare(args.files)
    except (OSError, ValueError) as exc:  # an unreadable file, not JSON, or runs of different lengths
        print(f"vllm_repro: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
