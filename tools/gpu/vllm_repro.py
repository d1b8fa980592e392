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

``async-probe`` asks the way verl 0.9.1 does (batch 19's request fingerprints found only 28/128
step-1 first turns bit-identical between two verl runs, which ``probe`` did not reproduce): vLLM's
``AsyncLLM`` with verl's engine arguments, the TinyGuess episodes of ``recipe=tinyguess_verl``'s
step 1 played by the project's own episode runner (chat-templated prompts, later turns extending
them, so prefix caching serves them), with the very seeds ``trainer.request_seeds`` gave them, each
episode starting at its place in a seeded arrival schedule. One engine plays the same episodes
under several schedules (the prefix cache reset before each); flags switch off prefix caching,
chunked prefill or async scheduling, each setting in its own process. Besides its JSON it writes
one ``request_fingerprints``-style JSON-lines file per schedule, which ``tools/gpu/fingerprints.py``
joins with a verl run's file (same requests, same seeds, same base weights).
    python3 tools/gpu/vllm_repro.py async-probe --label default --out $OUT/async/default.json
    python3 tools/gpu/vllm_repro.py compare $OUT/async/*.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
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


# --- async-probe: verl's serving conditions -------------------------------------------------------

#: The episodes of ``recipe=tinyguess_verl``'s step 1 in batch 19's fingerprint pair (client 0 of the
#: ``local`` arm, seed 5): rows 0-7 with env seeds 10500000-10500007, 16 rollouts each, 3 turns.
ENV_SEED_BASE = 10_500_000
ROWS = 8
ROLLOUTS = 16  # trainer.rollout_n
MAX_TURNS = 3
#: The recipe's TinyGuess config. Client 0's secrets are 1-5 (the recipe's split); only turns after
#: the first depend on them, and only through the "higher"/"lower" answers.
ENV_CONFIG: dict[str, Any] = {"lo": 1, "hi": 10, "max_turns": MAX_TURNS, "targets": [1, 2, 3, 4, 5]}
PROMPT_LENGTH = RESPONSE_LENGTH = 512  # trainer.max_prompt_length / max_response_length (defaults)
#: JSON-lines keys that tools/gpu/fingerprints.py joins and compares, as trainer.request_fingerprints writes them
FINGERPRINT_KEYS = ("env_seed", "index", "turn", "seed", "step", "rollout_n", "prompt_len", "prompt_sha256",
                    "output_len", "output_sha256", "logprobs_len", "logprobs_sha256", "logprob_sum",
                    "cached_tokens", "stop_reason", "started", "seconds", "pid")


def episodes() -> list[tuple[int, int, int]]:
    """(env seed, row index, place in the GRPO group) of every episode, rows in order."""
    return [(ENV_SEED_BASE + row, row, n) for row in range(ROWS) for n in range(ROLLOUTS)]


def arrival_schedule(count: int, seed: int | None, mean_gap_s: float) -> list[float]:
    """When each of ``count`` episodes starts, in seconds after the first: 0 for all when ``seed`` is
    None (all at once), else the episodes in a shuffled order with exponential gaps of mean
    ``mean_gap_s`` between them, both drawn from ``random.Random(seed)`` (the same in every process
    and Python version that keeps Mersenne Twister seeding by int)."""
    if seed is None:
        return [0.0] * count
    if mean_gap_s <= 0:
        raise ValueError(f"mean_gap_s must be > 0, got {mean_gap_s}")
    rng = random.Random(seed)
    order = list(range(count))
    rng.shuffle(order)
    starts = [0.0] * count
    clock = 0.0
    for place, episode in enumerate(order):
        if place:
            clock += rng.expovariate(1.0 / mean_gap_s)
        starts[episode] = clock
    return starts


def engine_args(model: str, max_model_len: int, *, prefix_caching: bool = True, chunked_prefill: bool = True,
                async_scheduling: bool | None = None, max_num_seqs: int = 256,
                max_num_batched_tokens: int = 8192) -> dict[str, Any]:
    """vLLM 0.24 ``AsyncEngineArgs`` as verl 0.9.1's ``vLLMHttpServer`` builds them for this project's
    verl jobs (rollout.yaml defaults: bf16, chunked prefill and prefix caching on, 256 sequences and
    8192 tokens a step, processed log-probs, FCFS, seed 42, the ``mp`` executor; the project's
    ``enforce_eager`` and 4 GiB ``kv_cache_gib``; ``max_model_len`` the model's maximum, which verl puts
    for its None). ``async_scheduling`` None leaves vLLM's own choice, as verl does. Without chunked
    prefill verl raises ``max_num_batched_tokens`` to ``max_model_len`` (vLLM refuses less); so here."""
    if not chunked_prefill:
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    args: dict[str, Any] = {
        "model": model, "max_model_len": max_model_len, "dtype": "bfloat16", "skip_tokenizer_init": False,
        "distributed_executor_backend": "mp",
        "max_num_seqs": max_num_seqs, "enable_chunked_prefill": chunked_prefill,
        "max_num_batched_tokens": max_num_batched_tokens, "enable_prefix_caching": prefix_caching,
        "logprobs_mode": "processed_logprobs", "enforce_eager": True, "gpu_memory_utilization": 0.17,
        "kv_cache_memory_bytes": 4 * 2**30, "disable_log_stats": True, "tensor_parallel_size": 1,
        "seed": 42, "scheduling_policy": "fcfs",
    }
    if async_scheduling is not None:
        args["async_scheduling"] = async_scheduling
    return args


def fingerprint(*, env_seed: int, index: int, turn: int, seed: int, rollout_n: int, prompt_ids: list[int],
                tokens: list[int], logprobs: list[float], cached_tokens: int | None, stop_reason: Any,
                started: float, seconds: float) -> dict[str, Any]:
    """One request as ``trainer.request_fingerprints`` records it (the agent loop's own
    :func:`request_fingerprint`, at verl step 1), plus its token ids and log-probs."""
    from types import SimpleNamespace

    from fedagent_flwr.trainers.verl.agent_loop import request_fingerprint

    output = SimpleNamespace(token_ids=tokens, log_probs=logprobs, extra_fields={"num_cached_tokens": cached_tokens},
                             stop_reason=None if stop_reason is None else str(stop_reason))
    return {**request_fingerprint(env_seed=env_seed, index=index, turn=turn, seed=seed, step=1, rollout_n=rollout_n,
                                  prompt_ids=prompt_ids, output=output, started=started, seconds=seconds),
            "token_ids": tokens, "logprobs": logprobs}


#: one request to the server: (prompt ids, seed) -> (token ids, their log-probs, prompt tokens served
#: from the prefix cache or None, stop reason)
Ask = Callable[[list[int], int], Awaitable[tuple[list[int], list[float], int | None, Any]]]


async def play(ask: Ask, tokenizer: Any, starts: list[float]) -> list[dict[str, Any]]:
    """Every episode of :func:`episodes`, each started at its ``starts`` offset (seconds), played by the
    project's ``run_episode`` as verl's agent loop plays it, each turn asked with the seed
    ``trainer.request_seeds`` gives it at verl step 1; a :func:`fingerprint` per request, sorted by
    row, place in the group and turn."""
    from fedagent_flwr.envs.registry import make_env
    from fedagent_flwr.rollout.episode import SamplingParams, run_episode
    from fedagent_flwr.trainers.verl.request_seeds import request_seed, seed_base

    records: list[dict[str, Any]] = []

    async def episode(env_seed: int, index: int, rollout_n: int, start: float) -> None:
        await asyncio.sleep(start)
        base = seed_base(env_seed, 1, index, rollout_n, False)
        turn = 0

        async def generate(prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
            nonlocal turn
            seed = request_seed(base, turn)
            wall, began = time.time(), time.monotonic()
            tokens, logprobs, cached, stop = await ask(list(prompt_ids), seed)
            records.append(fingerprint(env_seed=env_seed, index=index, turn=turn, seed=seed, rollout_n=rollout_n,
                                       prompt_ids=list(prompt_ids), tokens=tokens, logprobs=logprobs,
                                       cached_tokens=cached, stop_reason=stop, started=wall,
                                       seconds=time.monotonic() - began))
            turn += 1
            return tokens

        await run_episode(make_env("TinyGuess", dict(ENV_CONFIG)), env_seed, tokenizer, generate,
                          SamplingParams(MAX_TOKENS, 1.0, 1.0), MAX_TURNS, PROMPT_LENGTH + RESPONSE_LENGTH,
                          max_response_len=RESPONSE_LENGTH)

    await asyncio.gather(*(episode(e, i, n, start) for (e, i, n), start in zip(episodes(), starts, strict=True)))
    return sorted(records, key=lambda r: (r["index"], r["rollout_n"], r["turn"]))


def engine_ask(engine: Any) -> Ask:
    """:data:`Ask` on a vLLM ``AsyncLLM``, with the sampling parameters verl's server builds for a
    training request (temperature and top-p 1, top-k off, the sampled token's log-prob, no
    repetition penalty, EOS honoured) and ``MAX_TOKENS`` (the recipe's ``trainer.max_new_tokens``)."""
    from vllm import SamplingParams  # type: ignore[import-not-found]
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    async def ask(prompt_ids: list[int], seed: int) -> tuple[list[int], list[float], int | None, Any]:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=-1, logprobs=0,
                                repetition_penalty=1.0, ignore_eos=False, seed=seed)
        final = None
        async for output in engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                            request_id=uuid.uuid4().hex):
            final = output
        if final is None:
            raise RuntimeError("vLLM returned no output for a request")
        done = final.outputs[0]
        tokens = [int(t) for t in done.token_ids]
        logprobs = [float(step[t].logprob) for step, t in zip(done.logprobs or [], tokens)]
        return tokens, logprobs, final.num_cached_tokens, done.stop_reason

    return ask


def schedules(seeds: list[int], mean_gap_s: float) -> dict[str, list[float]]:
    """The schedules one process plays, in order: all at once, each seed's, the first seed's again
    (same schedule, other moment: how repeatable the engine is with timing alone varying)."""
    count = len(episodes())
    named = {"at-once": arrival_schedule(count, None, mean_gap_s)}
    for seed in seeds:
        named[f"stagger-{seed}"] = arrival_schedule(count, seed, mean_gap_s)
    if seeds:
        named[f"stagger-{seeds[0]}-again"] = arrival_schedule(count, seeds[0], mean_gap_s)
    return named


def async_probe(label: str, out: Path, *, seeds: list[int], mean_gap_s: float, **settings: Any) -> None:
    """Start one ``AsyncLLM`` with :func:`engine_args` (``settings`` its keywords) and play every
    schedule of :func:`schedules` on it (:func:`play_schedules`): as each schedule finishes, its
    fingerprint JSON-lines file (``<stem>-<schedule>.jsonl``) is written beside ``out`` and the
    record so far replaces the JSON at ``out``. Arguments are checked by :func:`check_async_args`
    first (``main`` does so before this is called)."""
    from transformers import AutoTokenizer
    from vllm.engine.arg_utils import AsyncEngineArgs  # type: ignore[import-not-found]
    from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found]

    from fedagent_flwr.models.smollm2 import default_model_dir

    model = default_model_dir()
    longest = int(json.loads((model / "config.json").read_text())["max_position_embeddings"])
    args = engine_args(str(model), longest, **settings)
    tokenizer = AutoTokenizer.from_pretrained(str(model))

    async def run() -> dict[str, Any]:
        started = time.time()
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        ready = time.time() - started
        config = engine.vllm_config
        resolved = {"enable_prefix_caching": config.cache_config.enable_prefix_caching,
                    "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
                    "async_scheduling": config.scheduler_config.async_scheduling,
                    "max_num_seqs": config.scheduler_config.max_num_seqs,
                    "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens}
        record = {"label": label, "kind": "async", "engine_args": {k: v for k, v in args.items() if k != "model"},
                  "resolved": resolved, "mean_gap_s": mean_gap_s, "schedule_seeds": seeds,
                  "engine_ready_s": round(ready, 1),
                  "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")}}
        try:
            # each schedule starts cold: verl's wake_up resets the prefix cache too
            return await play_schedules(engine_ask(engine), engine.reset_prefix_cache, tokenizer,
                                        schedules(seeds, mean_gap_s), record, out)
        finally:
            engine.shutdown()

    record = asyncio.run(run())
    print(f"{label}: engine ready in {record['engine_ready_s']} s, schedules took {record['schedule_seconds']} s, "
          f"resolved {record['resolved']}", flush=True)
    for line in _async_within(record):
        print(line, flush=True)


async def play_schedules(ask: Ask, reset: Callable[[], Awaitable[Any]], tokenizer: Any,
                         named: dict[str, list[float]], record: dict[str, Any], out: Path) -> dict[str, Any]:
    """Play each schedule of ``named`` in turn (``reset`` the prefix cache first, then :func:`play`)
    and write what is done as soon as a schedule finishes (:func:`write_schedule`), so a label cut
    short by a timeout keeps its finished schedules. ``record`` (the label's settings) gains
    ``schedules_planned``, ``schedules``, ``schedule_seconds`` and ``prefix_cache_reset``
    (:func:`cache_reset_result`); returns it."""
    record.update({"schedules_planned": list(named), "schedules": {}, "schedule_seconds": {},
                   "prefix_cache_reset": {}})
    for name, starts in named.items():
        cold = cache_reset_result(await reset())
        record["prefix_cache_reset"][name] = cold
        if cold is not True:
            print(f"{record['label']}: {name}: the prefix cache could not be reset (reset_prefix_cache returned "
                  f"{cold!r}), so this schedule does not start cold", flush=True)
        began = time.monotonic()
        rows = await play(ask, tokenizer, starts)
        record["schedule_seconds"][name] = round(time.monotonic() - began, 2)
        record["schedules"][name] = rows
        write_schedule(record, name, out)
    return record


def cache_reset_result(result: Any) -> bool | None:
    """What ``reset_prefix_cache()`` answered, as recorded per schedule: True (reset: the schedule
    starts cold), False (vLLM could not reset it, e.g. while requests still hold blocks: the schedule
    starts with the previous one's cache), None where it answered no bool (unknown)."""
    return result if isinstance(result, bool) else None


def write_schedule(record: dict[str, Any], name: str, out: Path) -> None:
    """Schedule ``name`` of an ``async-probe`` record, just finished: its requests, with the keys
    ``trainer.request_fingerprints`` writes (:data:`FINGERPRINT_KEYS`), as JSON lines at
    ``<stem>-<name>.jsonl`` beside ``out`` (for tools/gpu/fingerprints.py), then the whole record so
    far as JSON at ``out``; each via a temp name and rename, so a reader never sees half a file."""
    from fedagent_flwr.atomic import write_text_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    rows = record["schedules"][name]
    write_text_atomic(out.with_name(f"{out.stem}-{name}.jsonl"),
                  "".join(json.dumps({k: row[k] for k in FINGERPRINT_KEYS}) + "\n" for row in rows))
    write_text_atomic(out, json.dumps(record))


def write_async(record: dict[str, Any], out: Path) -> None:
    """A whole ``async-probe`` record at once: :func:`write_schedule` for each of its schedules."""
    for name in record["schedules"]:
        write_schedule(record, name, out)


def agreement(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, int]:
    """Two schedules' requests joined on (env seed, row, place in the group, turn): ``joined``, those
    with the same prompt (``same_prompt``), of those the ones with the same tokens (``tokens``) and
    bit-identical log-probs too (``logprobs``), and the same counts for turn 0 alone (whose prompts
    never depend on earlier draws). ValueError when a side repeats a request."""
    def keyed(rows: list[dict[str, Any]]) -> dict[tuple[int, int, int, int], dict[str, Any]]:
        table = {(r["env_seed"], r["index"], r["rollout_n"], r["turn"]): r for r in rows}
        if len(table) != len(rows):
            raise ValueError(f"{len(rows) - len(table)} repeated requests (same row, place and turn)")
        return table

    left, right = keyed(a), keyed(b)
    counts = dict.fromkeys(("joined", "same_prompt", "tokens", "logprobs",
                            "turn0", "turn0_tokens", "turn0_logprobs"), 0)
    for key in left.keys() & right.keys():
        x, y = left[key], right[key]
        first = key[3] == 0
        counts["joined"] += 1
        counts["turn0"] += first
        if x["prompt_sha256"] != y["prompt_sha256"]:
            continue
        counts["same_prompt"] += 1
        if x["output_sha256"] == y["output_sha256"]:
            counts["tokens"] += 1
            counts["turn0_tokens"] += first
            if x["logprobs_sha256"] == y["logprobs_sha256"]:
                counts["logprobs"] += 1
                counts["turn0_logprobs"] += first
    return counts


def _agreement_line(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> str:
    c = agreement(a, b)
    return (f"turn 0: {c['turn0_tokens']}/{c['turn0']} requests identical (tokens), "
            f"{c['turn0_logprobs']}/{c['turn0']} bit-identical log-probs; all turns: "
            f"{c['tokens']}/{c['same_prompt']} of the requests with the same prompt identical (tokens), "
            f"{c['logprobs']}/{c['same_prompt']} bit-identical log-probs ({c['joined']} joined)")


def _async_within(record: dict[str, Any]) -> list[str]:
    """One process's schedules against each other, every pair once, in the order they were played."""
    played = record["schedules"]
    names = list(played)
    return [f"{record['label']}: {a} vs {b}: {_agreement_line(played[a], played[b])}"
            for i, a in enumerate(names) for b in names[i + 1:]]


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
    :func:`_same`) on runs of different lengths. ``async-probe`` records (``kind`` "async") likewise:
    each one's schedules against each other, then every pair of them schedule by schedule (settings
    compared under the same arrivals); a label cut short (fewer schedules than ``schedules_planned``)
    is compared on the schedules it finished, after a line naming the missing ones; a schedule whose
    prefix cache could not be reset is named too. ValueError (from :func:`agreement`) on a repeated
    request."""
    loaded = [json.loads(f.read_text()) for f in files]
    records = [r for r in loaded if r.get("kind") != "async"]
    for record in records:
        print(f"{record['label']} (VLLM_BATCH_INVARIANT={record['batch_invariant_env']!r}): {_within(record)}")
    for i, first in enumerate(records):
        for second in records[i + 1:]:
            print(f"{first['label']} vs {second['label']}, one batch each: "
                  f"{_same(first['runs']['one-batch'], second['runs']['one-batch'])}")
    probes = [r for r in loaded if r.get("kind") == "async"]
    for record in probes:
        missing = [n for n in record.get("schedules_planned", []) if n not in record["schedules"]]
        if missing:
            print(f"{record['label']}: cut short: {len(record['schedules'])} of "
                  f"{len(record['schedules_planned'])} schedules finished (missing: {', '.join(missing)})")
        cold = [n for n, ok in record.get("prefix_cache_reset", {}).items() if ok is not True]
        if cold:
            print(f"{record['label']}: prefix cache not reset before: {', '.join(cold)}")
        for line in _async_within(record):
            print(line)
    for i, first in enumerate(probes):
        for second in probes[i + 1:]:
            for name in [n for n in first["schedules"] if n in second["schedules"]]:
                print(f"{first['label']} vs {second['label']}, {name}: "
                      f"{_agreement_line(first['schedules'][name], second['schedules'][name])}")


def check_async_args(*, seeds: list[int], mean_gap_ms: float, max_num_seqs: int,
                     max_num_batched_tokens: int) -> str | None:
    """Why ``async-probe``'s arguments cannot run (one line), or None: checked before the engine starts
    so that a bad value costs no engine start. The gap must be a positive finite number of ms, the
    schedule seeds distinct (a repeated one would overwrite its schedule), ``max_num_seqs`` at least 1
    and ``max_num_batched_tokens`` at least ``max_num_seqs`` (vLLM refuses less)."""
    if not (math.isfinite(mean_gap_ms) and mean_gap_ms > 0):
        return f"--mean-gap-ms must be > 0, got {mean_gap_ms}"
    if len(set(seeds)) != len(seeds):
        return f"--schedule-seeds must be distinct, got {seeds}"
    if max_num_seqs < 1:
        return f"--max-num-seqs must be >= 1, got {max_num_seqs}"
    if max_num_batched_tokens < max_num_seqs:
        return (f"--max-num-batched-tokens must be >= --max-num-seqs ({max_num_seqs}), "
                f"got {max_num_batched_tokens}")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("probe")
    one.add_argument("--label", required=True)
    one.add_argument("--out", type=Path, required=True)
    live = sub.add_parser("async-probe", help="verl's serving conditions: AsyncLLM, staggered arrivals")
    live.add_argument("--label", required=True)
    live.add_argument("--out", type=Path, required=True)
    live.add_argument("--schedule-seeds", type=int, nargs="*", default=[1, 2])
    live.add_argument("--mean-gap-ms", type=float, default=20.0,
                      help="mean gap between episode starts (batch 19's 128 first turns arrived over 2.7 s)")
    live.add_argument("--no-prefix-caching", action="store_true")
    live.add_argument("--no-chunked-prefill", action="store_true")
    live.add_argument("--no-async-scheduling", action="store_true")
    live.add_argument("--max-num-seqs", type=int, default=256)
    live.add_argument("--max-num-batched-tokens", type=int, default=8192)
    many = sub.add_parser("compare")
    many.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "probe":
        probe(args.label, args.out)
        return 0
    if args.command == "async-probe":
        problem = check_async_args(seeds=args.schedule_seeds, mean_gap_ms=args.mean_gap_ms,
                                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
        if problem is not None:
            print(f"vllm_repro: {problem}", file=sys.stderr)
            return 2
        async_probe(args.label, args.out, seeds=args.schedule_seeds, mean_gap_s=args.mean_gap_ms / 1000,
                    prefix_caching=not args.no_prefix_caching, chunked_prefill=not args.no_chunked_prefill,
                    async_scheduling=False if args.no_async_scheduling else None,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
        return 0
    try:
        compare(args.files)
    except (OSError, ValueError) as exc:  # an unreadable file, not JSON, or runs of different lengths
        print(f"vllm_repro: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
