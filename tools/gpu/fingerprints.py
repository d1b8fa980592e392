"""Where do two runs of one config part? Compare their request fingerprints (``trainer.request_fingerprints``).

Each client-round with the setting on leaves ``<output>/verl/request_fingerprints.jsonl`` (kept by
tools/gpu/collect.sh as ``results/<run>/fingerprints/round_<r>-client_<c>.jsonl``): one line per vLLM
request with its seed and digests of its prompt, returned tokens and log-probabilities. With
``trainer.request_seeds`` on, the seed names the request (step, row, place in the GRPO group, turn),
so two runs' files join on it. Each joined request falls in one class:

* ``same``: prompt, tokens and log-probs bit-identical;
* ``logprobs``: same prompt and tokens, other log-probs (the logits differed, no token flipped yet);
* ``tokens``: same prompt and seed, other tokens (vLLM gave this request other logits);
* ``prompt``: other prompt (an earlier turn of the rollout parted, or the data/env differ at turn 0).

The first request of each class, in run A's start order, is printed: the earliest ``logprobs`` or
``tokens`` request with a turn-0 prompt that matches is where vLLM's numerics first differ.

usage: python3 tools/gpu/fingerprints.py A.jsonl B.jsonl
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

CLASSES = ("same", "logprobs", "tokens", "prompt")


def load(path: Path) -> dict[int, dict[str, Any]]:
    """A fingerprint file's records by seed; ValueError if a record has no seed or a seed repeats
    (the file then comes from a run without ``trainer.request_seeds``, which this cannot join)."""
    records: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        seed = record.get("seed")
        if seed is None:
            raise ValueError(f"{path}:{number}: a request without a seed (was trainer.request_seeds on?)")
        if seed in records:
            raise ValueError(f"{path}:{number}: seed {seed} repeats, so requests cannot be joined by seed")
        records[int(seed)] = record
    return records


def classify(a: dict[str, Any], b: dict[str, Any]) -> str:
    """How request ``b`` differs from ``a`` (one of :data:`CLASSES`)."""
    if a["prompt_sha256"] != b["prompt_sha256"]:
        return "prompt"
    if a["output_sha256"] != b["output_sha256"]:
        return "tokens"
    return "same" if a["logprobs_sha256"] == b["logprobs_sha256"] else "logprobs"


def compare(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Counts of each class over the seeds in both runs, the seeds in one only, and the first request
    of each class in A's start order (ties by seed): its place in that order, and both runs' prefix-cache
    hits and log-prob sums (a tiny gap is rounding, a large one other weights or another prompt)."""
    both = sorted(set(a) & set(b), key=lambda s: (float(a[s].get("started", 0.0)), s))
    counts = dict.fromkeys(CLASSES, 0)
    first: dict[str, dict[str, Any]] = {}
    for rank, seed in enumerate(both):
        kind = classify(a[seed], b[seed])
        counts[kind] += 1
        if kind not in first:
            first[kind] = {"seed": seed, "env_seed": a[seed].get("env_seed"), "index": a[seed].get("index"),
                           "turn": a[seed].get("turn"), "started_rank": rank,
                           "cached_tokens": [a[seed].get("cached_tokens"), b[seed].get("cached_tokens")],
                           "logprob_sum": [a[seed].get("logprob_sum"), b[seed].get("logprob_sum")]}
    return {"joined": len(both), "only_a": len(set(a) - set(b)), "only_b": len(set(b) - set(a)),
            "counts": counts, "first": first}


def main(argv: list[str] | None = None) -> int:
    """Print the comparison of two fingerprint files as one JSON object; 0 if they agree, 1 if not, 2 on bad input."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    try:
        result = compare(load(Path(args[0])), load(Path(args[1])))
    except (OSError, ValueError) as exc:
        print(f"fingerprints: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, sort_keys=True))
    agree = result["counts"]["same"] == result["joined"] and not result["only_a"] and not result["only_b"]
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
