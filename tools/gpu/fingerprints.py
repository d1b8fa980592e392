"""Where do two runs of one config part? Compare their request fingerprints (``trainer.request_fingerprints``).

Each client-round with the setting on leaves ``<output>/verl/request_fingerprints.jsonl`` (kept by
tools/gpu/collect.sh as ``results/<run>/fingerprints/round_<r>-client_<c>.jsonl``): one line per vLLM
request with its seed, env seed, row, turn, verl step and place in the GRPO group, and digests of its
prompt, returned tokens and log-probabilities. With ``trainer.request_seeds`` on, the seed names the
request (step, row, place in the group, turn), so two runs' files join on it; the join key is
``(seed, env_seed, index, turn)``, so that two requests which only share a seed are never paired.
Each joined request falls in one class:

* ``same``: prompt, tokens and log-probs bit-identical;
* ``logprobs``: same prompt and tokens, other log-probs (the logits differed, no token flipped yet);
* ``tokens``: same prompt and seed, other tokens (the server gave this request other logits);
* ``prompt``: other prompt (an earlier turn of the rollout parted, or the data/env differ at turn 0).

Only step 1 of a run's first round is generated with the same weights in both runs: every later
step follows an update computed from that run's own rollouts, so its requests differ as soon as one
earlier token did. Differences at step 1 of round 1 therefore speak of vLLM's numerics (the earliest
``logprobs`` or ``tokens`` request there whose prompt matches is where they first differ); later
ones are expected from training. The output counts each class overall and per step (by run A's
``step``; "none" for files written without ``trainer.request_seeds``' worker), and per step and
turn (turn 0's prompts come from the data and the environment alone, so at step 1 they must all
match), names the first request of each class in run A's start order, with its step, and gives, per
step, turn and class, the median number of other requests of the same run and step that overlapped each
request in time in run A and in run B (``in_flight_by_step_turn``: how crowded the server was while the
request ran, the load a batch-dependent numeric difference would follow), and per step, turn and
class the median ``output_len`` in run A and in run B (``output_len_by_step_turn``, same shape).

The in-flight read-out is confounded by output length: a request that generates more tokens runs
longer, so more requests overlap it, and every generated token is one more draw that can part. In
batch 19's pair the in-flight count correlated with ``output_len`` at r≈0.93 and the bit-identical
requests were the short ones, so a class that ran "more crowded" may only have run longer; read
``in_flight_by_step_turn`` beside ``output_len_by_step_turn`` (or compare requests of like length)
before taking load as the cause.

usage: python3 tools/gpu/fingerprints.py A.jsonl B.jsonl
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

CLASSES = ("same", "logprobs", "tokens", "prompt")
#: what two runs' requests are joined on
JOIN_KEYS = ("seed", "env_seed", "index", "turn")
#: what :func:`classify` compares
DIGEST_KEYS = ("prompt_sha256", "output_sha256", "logprobs_sha256")

JoinKey = tuple[Any, ...]


def load(path: Path) -> dict[JoinKey, dict[str, Any]]:
    """A fingerprint file's records by join key (:data:`JOIN_KEYS`). ValueError naming the file and
    line if a line is not a JSON object, lacks a join or digest key, has no seed (the file then
    comes from a run without ``trainer.request_seeds``, which this cannot join), has a join key
    that is not an integer (or null) or repeats a join key."""
    records: dict[JoinKey, dict[str, Any]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: not a JSON object")
        for name in (*JOIN_KEYS, *DIGEST_KEYS):
            if name not in record:
                raise ValueError(f"{path}:{number}: missing {name} (not a request fingerprint line?)")
        if record["seed"] is None:
            raise ValueError(f"{path}:{number}: a request without a seed (was trainer.request_seeds on?)")
        key = tuple(record[k] for k in JOIN_KEYS)
        if not all(v is None or isinstance(v, int) for v in key):
            raise ValueError(f"{path}:{number}: {dict(zip(JOIN_KEYS, key))} are not all integers (or null)")
        if key in records:
            raise ValueError(f"{path}:{number}: request {dict(zip(JOIN_KEYS, key))} repeats, so requests "
                             "cannot be joined")
        records[key] = record
    return records


def classify(a: dict[str, Any], b: dict[str, Any]) -> str:
    """How request ``b`` differs from ``a`` (one of :data:`CLASSES`)."""
    if a["prompt_sha256"] != b["prompt_sha256"]:
        return "prompt"
    if a["output_sha256"] != b["output_sha256"]:
        return "tokens"
    return "same" if a["logprobs_sha256"] == b["logprobs_sha256"] else "logprobs"


def _step_name(record: dict[str, Any]) -> str:
    """A record's step as a JSON object key: the number, or "none" where the file has none."""
    step = record.get("step")
    return "none" if step is None else str(step)


def in_flight(records: dict[JoinKey, dict[str, Any]]) -> dict[JoinKey, int]:
    """For each request, how many other requests of the same run and step overlapped it in time
    (``started`` to ``started + seconds``); 0 for a request without its timing. Quadratic in a
    step's requests, a few hundred here."""
    spans: dict[str, list[tuple[JoinKey, float, float]]] = {}
    for key, record in records.items():
        start, seconds = record.get("started"), record.get("seconds")
        if isinstance(start, (int, float)) and isinstance(seconds, (int, float)):
            spans.setdefault(_step_name(record), []).append((key, float(start), float(start) + float(seconds)))
    counts = dict.fromkeys(records, 0)
    for group in spans.values():
        for key, start, end in group:
            counts[key] = sum(1 for other, s, e in group if other != key and s < end and e > start)
    return counts


def _median(values: list[int]) -> float | None:
    """The median of a list (the mean of the middle two for an even count); None for an empty one
    (a class none of whose requests carries the value, e.g. ``output_len`` in an old file)."""
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    return float(ordered[middle]) if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def compare(a: dict[JoinKey, dict[str, Any]], b: dict[JoinKey, dict[str, Any]]) -> dict[str, Any]:
    """Counts of each class over the requests in both runs, overall, per step (run A's) and per step
    and turn, the requests in one run only, the first request of each class in A's start order (ties
    by join key): its step and place in the group, its place in that order, and both runs'
    prefix-cache hits and log-prob sums (a tiny gap is rounding, a large one other weights or another
    prompt), and per step, turn and class the median of :func:`in_flight` and of ``output_len`` (the
    tokens the request generated; the in-flight count grows with it) in run A and in run B."""
    both = sorted(set(a) & set(b), key=lambda k: (float(a[k].get("started", 0.0)), repr(k)))
    counts = dict.fromkeys(CLASSES, 0)
    by_step: dict[str, dict[str, int]] = {}
    by_turn: dict[str, dict[str, dict[str, int]]] = {}
    crowd_a, crowd_b = in_flight(a), in_flight(b)
    crowds: dict[tuple[str, str], dict[str, tuple[list[int], list[int]]]] = {}
    lengths: dict[tuple[str, str], dict[str, tuple[list[int], list[int]]]] = {}
    first: dict[str, dict[str, Any]] = {}
    for rank, key in enumerate(both):
        x, y = a[key], b[key]
        kind = classify(x, y)
        counts[kind] += 1
        step = _step_name(x)
        by_step.setdefault(step, dict.fromkeys(CLASSES, 0))[kind] += 1
        turn = str(x["turn"])
        by_turn.setdefault(step, {}).setdefault(turn, dict.fromkeys(CLASSES, 0))[kind] += 1
        pair = crowds.setdefault((step, turn), {}).setdefault(kind, ([], []))
        pair[0].append(crowd_a[key])
        pair[1].append(crowd_b[key])
        sizes = lengths.setdefault((step, turn), {}).setdefault(kind, ([], []))
        for record, values in ((x, sizes[0]), (y, sizes[1])):
            if isinstance(record.get("output_len"), int):
                values.append(record["output_len"])
        if kind not in first:
            first[kind] = {**dict(zip(JOIN_KEYS, key)), "step": x.get("step"), "rollout_n": x.get("rollout_n"),
                           "started_rank": rank, "cached_tokens": [x.get("cached_tokens"), y.get("cached_tokens")],
                           "logprob_sum": [x.get("logprob_sum"), y.get("logprob_sum")]}
    medians: dict[str, dict[str, dict[str, list[float | None]]]] = {}
    for (step, turn), kinds in crowds.items():
        medians.setdefault(step, {})[turn] = {kind: [_median(xs), _median(ys)] for kind, (xs, ys) in kinds.items()}
    length_medians: dict[str, dict[str, dict[str, list[float | None]]]] = {}
    for (step, turn), kinds in lengths.items():
        length_medians.setdefault(step, {})[turn] = {kind: [_median(xs), _median(ys)]
                                                     for kind, (xs, ys) in kinds.items()}
    return {"joined": len(both), "only_a": len(set(a) - set(b)), "only_b": len(set(b) - set(a)),
            "counts": counts, "counts_by_step": by_step, "counts_by_step_turn": by_turn, "first": first,
            "in_flight_by_step_turn": medians, "output_len_by_step_turn": length_medians}


def main(argv: list[str] | None = None) -> int:
    """Print the comparison of two fingerprint files as one JSON object; 0 if they agree, 1 if not, 2 on
    bad input (a missing or unreadable file, or a line :func:`load` refuses: one line on stderr)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    try:
        result = compare(load(Path(args[0])), load(Path(args[1])))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        print(f"fingerprints: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, sort_keys=True))
    agree = result["counts"]["same"] == result["joined"] and not result["only_a"] and not result["only_b"]
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
