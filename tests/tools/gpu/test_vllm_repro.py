"""tools/gpu/vllm_repro.py compare: the counts docs/results.md quotes, from the committed probe outputs.

The probe itself needs the GPU node's vLLM; its comparison runs anywhere, on the token ids it wrote.
So do the async probe's schedules, the episodes it plays (checked against batch 19's fingerprints
of a verl run, with a stand-in for vLLM), its engine arguments and its comparison.
"""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from testkit.gpu_tools import gpu_tool
from testkit.vllm_source import STAGE_ROOTS, vllm_source_file

REPO = Path(__file__).resolve().parents[3]
PROBES = REPO / "docs" / "gpu-runs" / "2026-12-04" / "vllm-repro"
TOOL = REPO / "tools" / "gpu" / "vllm_repro.py"


def _compare(*files: Path) -> list[str]:
    done = subprocess.run([sys.executable, str(TOOL), "compare", *map(str, files)],
                          capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def test_compare_prints_the_committed_probes_counts() -> None:
    lines = _compare(PROBES / "bi0.json", PROBES / "bi1a.json", PROBES / "bi1b.json")
    assert lines == [
        "bi0 (VLLM_BATCH_INVARIANT='0'): one batch twice: 128/128 requests identical; "
        "one batch vs reversed in 16s: 128/128 requests identical",
        "bi1a (VLLM_BATCH_INVARIANT='1'): one batch twice: 128/128 requests identical; "
        "one batch vs reversed in 16s: 97/128 requests identical",
        "bi1b (VLLM_BATCH_INVARIANT='1'): one batch twice: 128/128 requests identical; "
        "one batch vs reversed in 16s: 97/128 requests identical",
        "bi0 vs bi1a, one batch each: 56/128 requests identical",
        "bi0 vs bi1b, one batch each: 54/128 requests identical",
        "bi1a vs bi1b, one batch each: 117/128 requests identical",
    ]


def test_compare_counts_a_request_that_differs_in_one_token(tmp_path: Path) -> None:
    record = json.loads((PROBES / "bi0.json").read_text())
    assert record["requests"] == 128 and all(len(run) == 128 for run in record["runs"].values())
    changed = json.loads(json.dumps(record))
    changed["label"] = "edited"
    changed["runs"]["one-batch"][5][-1] += 1  # the last token of one request
    changed["runs"]["reversed-16s"][7][0] += 1  # the first token of another
    (tmp_path / "edited.json").write_text(json.dumps(changed))
    lines = _compare(PROBES / "bi0.json", tmp_path / "edited.json")
    assert lines[1] == ("edited (VLLM_BATCH_INVARIANT='0'): one batch twice: 127/128 requests identical; "
                        "one batch vs reversed in 16s: 126/128 requests identical")
    assert lines[2] == "bi0 vs edited, one batch each: 127/128 requests identical"


def test_compare_refuses_runs_of_different_lengths(tmp_path: Path) -> None:
    """A run with a request missing is bad input (exit 2, one line naming both lengths), not a count
    over the requests both runs happen to reach (zip would stop at the shorter one)."""
    record = json.loads((PROBES / "bi0.json").read_text())
    short = json.loads(json.dumps(record))
    short["label"] = "short"
    del short["runs"]["one-batch"][-1]  # 127 requests in one run, 128 in the others
    (tmp_path / "short.json").write_text(json.dumps(short))
    done = subprocess.run([sys.executable, str(TOOL), "compare", str(tmp_path / "short.json")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "vllm_repro: runs of 127 and 128 requests cannot be compared request by request"
    with pytest.raises(ValueError, match="runs of 128 and 127 requests"):
        gpu_tool("vllm_repro")._same(record["runs"]["one-batch"], short["runs"]["one-batch"])


# --- async-probe: the parts that need no vLLM ------------------------------------------------------

FINGERPRINTS = REPO / "docs" / "gpu-runs" / "2026-12-04" / "fingerprints"


def test_arrival_schedule_is_fixed_by_its_seed() -> None:
    """One seed gives one schedule (in any process: random.Random, not hash()); another seed another
    order; no seed starts everything at once; the gaps average about the mean asked for."""
    tool = gpu_tool("vllm_repro")
    first = tool.arrival_schedule(128, 1, 0.02)
    assert first == gpu_tool("vllm_repro").arrival_schedule(128, 1, 0.02)
    second = tool.arrival_schedule(128, 2, 0.02)
    order = sorted(range(128), key=first.__getitem__)
    assert order != sorted(range(128), key=second.__getitem__)
    assert order != list(range(128))  # shuffled, not rows in order
    assert min(first) == 0.0 and len(set(first)) == 128
    assert 0.7 * 127 * 0.02 < max(first) < 1.3 * 127 * 0.02  # 127 exponential gaps: sd about 9% of the sum
    assert tool.arrival_schedule(128, None, 0.02) == [0.0] * 128
    with pytest.raises(ValueError, match="mean_gap_s must be > 0"):
        tool.arrival_schedule(4, 1, 0.0)


def _wrong_guesses(tokenizer: Any) -> Any:
    """An ``Ask`` that always answers 7 (above client 0's secrets 1-5, so every episode plays 3 turns),
    with made-up log-probs; it records the seeds asked for."""
    reply = tokenizer.encode("<answer>7</answer>") + [tokenizer.eos_token_id]

    async def ask(prompt_ids: list[int], seed: int) -> tuple[list[int], list[float], int | None, Any]:
        return list(reply), [-0.25] * len(reply), None, None

    return ask


def test_played_requests_are_batch_19s_step_1(smollm2_tokenizer: Any) -> None:
    """The episodes the probe plays ask vLLM what verl asked at step 1 of batch 19's fingerprint pair:
    every first turn has the prompt digest and the seed of run A's request with the same row, place in
    the group and turn, every later turn the seed run A gave it; episodes start in schedule order and a
    later turn extends its episode's prompt."""
    tool = gpu_tool("vllm_repro")
    starts = tool.arrival_schedule(128, 7, 0.004)
    before = time.time()
    records = asyncio.run(tool.play(_wrong_guesses(smollm2_tokenizer), smollm2_tokenizer, starts))
    assert len(records) == 128 * 3 and [r["turn"] for r in records[:3]] == [0, 1, 2]
    run_a = [json.loads(line) for line in
             (FINGERPRINTS / "pair-A-round_1-client_0.jsonl").read_text().splitlines()]
    step1 = {(r["env_seed"], r["index"], r["rollout_n"], r["turn"]): r for r in run_a if r["step"] == 1}
    joined = [(r, step1[k]) for r in records if (k := (r["env_seed"], r["index"], r["rollout_n"], r["turn"])) in step1]
    assert len(joined) == 362  # run A's step-1 requests: 128 first turns, then the episodes still going
    assert all(mine["seed"] == theirs["seed"] for mine, theirs in joined)
    first_turns = [(mine, theirs) for mine, theirs in joined if mine["turn"] == 0]
    assert len(first_turns) == 128
    assert all(mine["prompt_sha256"] == theirs["prompt_sha256"] and mine["prompt_len"] == 120
               for mine, theirs in first_turns)
    began = {(r["index"], r["rollout_n"]): r["started"] for r in records if r["turn"] == 0}
    wall = [began[row, place] - before for _, row, place in tool.episodes()]
    assert all(w >= s - 1e-6 for w, s in zip(wall, starts))  # none asked before its time (started: 6 decimals)
    assert all(wall[i] < wall[j] for i in range(128) for j in range(128) if starts[j] - starts[i] > 0.05)
    assert records[1]["prompt_len"] > 120 + len(records[0]["token_ids"])  # reply and observation appended
    assert records[0]["logprob_sum"] == -0.25 * len(records[0]["token_ids"])


def test_probe_fingerprints_join_with_a_verl_run(smollm2_tokenizer: Any, tmp_path: Path) -> None:
    """The JSON-lines file a schedule leaves is one tools/gpu/fingerprints.py reads and joins with a
    verl run's: with made-up replies, every step-1 first turn has run A's prompt and seed but other
    tokens."""
    tool = gpu_tool("vllm_repro")
    records = asyncio.run(tool.play(_wrong_guesses(smollm2_tokenizer), smollm2_tokenizer, [0.0] * 128))
    tool.write_async({"label": "fake", "kind": "async", "schedules": {"at-once": records}}, tmp_path / "fake.json")
    assert json.loads((tmp_path / "fake.json").read_text())["schedules"]["at-once"] == records
    done = subprocess.run([sys.executable, str(REPO / "tools" / "gpu" / "fingerprints.py"),
                           str(FINGERPRINTS / "pair-A-round_1-client_0.jsonl"), str(tmp_path / "fake-at-once.jsonl")],
                          capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["counts_by_step_turn"]["1"]["0"] == {
        "same": 0, "logprobs": 0, "tokens": 128, "prompt": 0}


def _request(index: int, turn: int, prompt: str = "p", output: str = "o", logprobs: str = "l") -> dict[str, Any]:
    return {"env_seed": 10_500_000 + index, "index": index, "rollout_n": 0, "turn": turn, "seed": index,
            "prompt_sha256": prompt, "output_sha256": output, "logprobs_sha256": logprobs}


def test_compare_counts_async_schedules_and_settings(tmp_path: Path) -> None:
    """compare on hand-made async-probe records: within a label, schedule against schedule (turn 0
    and all turns with the same prompt); across labels, schedule by schedule; old probe records
    beside them print as before."""
    at_once = [_request(0, 0), _request(1, 0), _request(2, 0), _request(0, 1), _request(1, 1)]
    stagger = [_request(0, 0), _request(1, 0, logprobs="l2"), _request(2, 0, output="o2", logprobs="l2"),
               _request(0, 1), _request(1, 1, prompt="p2")]  # turn 1 of row 1 after other log-probs
    default = {"label": "default", "kind": "async", "schedules": {"at-once": at_once, "stagger-1": stagger}}
    off = {"label": "no-prefix", "kind": "async", "schedules": {"at-once": at_once, "stagger-1": at_once[:4]}}
    for record in (default, off):
        (tmp_path / f"{record['label']}.json").write_text(json.dumps(record))
    lines = _compare(PROBES / "bi0.json", tmp_path / "default.json", tmp_path / "no-prefix.json")
    assert lines[0].startswith("bi0 (VLLM_BATCH_INVARIANT='0'): ")
    assert lines[1:] == [
        "default: at-once vs stagger-1: turn 0: 2/3 requests identical (tokens), 1/3 bit-identical log-probs; "
        "all turns: 3/4 of the requests with the same prompt identical (tokens), 2/4 bit-identical log-probs "
        "(5 joined)",
        "no-prefix: at-once vs stagger-1: turn 0: 3/3 requests identical (tokens), 3/3 bit-identical log-probs; "
        "all turns: 4/4 of the requests with the same prompt identical (tokens), 4/4 bit-identical log-probs "
        "(4 joined)",
        "default vs no-prefix, at-once: turn 0: 3/3 requests identical (tokens), 3/3 bit-identical log-probs; "
        "all turns: 5/5 of the requests with the same prompt identical (tokens), 5/5 bit-identical log-probs "
        "(5 joined)",
        "default vs no-prefix, stagger-1: turn 0: 2/3 requests identical (tokens), 1/3 bit-identical log-probs; "
        "all turns: 3/4 of the requests with the same prompt identical (tokens), 2/4 bit-identical log-probs "
        "(4 joined)",
    ]
    default["schedules"]["stagger-1"].append(_request(0, 0))
    (tmp_path / "default.json").write_text(json.dumps(default))
    done = subprocess.run([sys.executable, str(TOOL), "compare", str(tmp_path / "default.json")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip() == (
        "vllm_repro: 1 repeated requests (same row, place and turn)")


def test_engine_args_are_verl_s_defaults_with_the_flags_applied() -> None:
    """The engine arguments: verl's defaults with the flags applied, and without chunked prefill the
    token budget raised to the model length (as verl does). Runs everywhere; the check of the names
    against vLLM's own source is the next test."""
    tool = gpu_tool("vllm_repro")
    default = tool.engine_args("/m", 8192)
    assert {k: default[k] for k in ("enable_prefix_caching", "enable_chunked_prefill", "max_num_seqs",
                                    "max_num_batched_tokens", "enforce_eager", "dtype", "logprobs_mode",
                                    "seed", "scheduling_policy", "distributed_executor_backend",
                                    "kv_cache_memory_bytes")} == {
        "enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_seqs": 256,
        "max_num_batched_tokens": 8192, "enforce_eager": True, "dtype": "bfloat16",
        "logprobs_mode": "processed_logprobs", "seed": 42, "scheduling_policy": "fcfs",
        "distributed_executor_backend": "mp", "kv_cache_memory_bytes": 4 * 2**30}
    assert "async_scheduling" not in default
    changed = tool.engine_args("/m", 16384, prefix_caching=False, chunked_prefill=False, async_scheduling=False,
                               max_num_seqs=64)
    assert (changed["enable_prefix_caching"], changed["enable_chunked_prefill"], changed["async_scheduling"],
            changed["max_num_seqs"], changed["max_num_batched_tokens"]) == (False, False, False, 64, 16384)
    # with chunked prefill the budget asked for stays, however small
    assert tool.engine_args("/m", 16384, max_num_batched_tokens=256)["max_num_batched_tokens"] == 256


def test_engine_args_are_fields_of_vllm_s_engine_args() -> None:
    """Every key :func:`engine_args` gives is a field of vLLM 0.24's ``EngineArgs`` (a misspelt one
    would cost a GPU call): an optional cross-check, skipped where vLLM's source is not at hand."""
    arg_utils = vllm_source_file("engine/arg_utils.py")
    if arg_utils is None:
        pytest.skip("vLLM's source is not on this machine (not installed, not staged under "
                    f"{' or '.join(str(root) for root in STAGE_ROOTS)})")
    tool = gpu_tool("vllm_repro")
    changed = tool.engine_args("/m", 16384, prefix_caching=False, chunked_prefill=False, async_scheduling=False)
    tree = ast.parse(arg_utils.read_text())
    fields = {node.target.id for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name == "EngineArgs"
              for node in cls.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    assert set(changed) <= fields, set(changed) - fields


@pytest.mark.parametrize(("args", "message"), [
    (["--mean-gap-ms", "0"], "--mean-gap-ms must be > 0, got 0.0"),
    (["--mean-gap-ms", "-5"], "--mean-gap-ms must be > 0, got -5.0"),
    (["--mean-gap-ms", "nan"], "--mean-gap-ms must be > 0, got nan"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"],
     "--max-num-batched-tokens must be >= --max-num-seqs (64), got 32"),
    (["--schedule-seeds", "1", "1"], "--schedule-seeds must be distinct, got [1, 1]"),
])
def test_async_probe_refuses_bad_arguments_before_it_starts_the_engine(
        args: list[str], message: str, tmp_path: Path) -> None:
    """One line and exit 2, before vLLM is imported (it is not installed here, so reaching the engine
    would be a ModuleNotFoundError traceback), and nothing written."""
    done = subprocess.run([sys.executable, str(TOOL), "async-probe", "--label", "x", "--out",
                           str(tmp_path / "x.json"), *args], capture_output=True, text=True)
    assert (done.returncode, done.stderr, done.stdout) == (2, f"vllm_repro: {message}\n", "")
    assert list(tmp_path.iterdir()) == []


def test_a_label_cut_short_keeps_the_schedules_it_finished(smollm2_tokenizer: Any, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Each schedule is written as soon as it finishes: when the third schedule dies (as a timeout
    would stop it), the label's JSON holds the first two and their JSON-lines files exist, with no
    temporary files; a prefix cache that could not be reset is recorded per schedule and printed;
    compare reads the cut-short label, says what is missing and compares what is there."""
    tool = gpu_tool("vllm_repro")
    wrong = _wrong_guesses(smollm2_tokenizer)
    asked = []

    async def ask(prompt_ids: list[int], seed: int) -> tuple[list[int], list[float], int | None, Any]:
        asked.append(seed)
        if len(asked) > 2 * 128 * 3:  # the third schedule's first request
            raise RuntimeError("killed by the timeout")
        return await wrong(prompt_ids, seed)

    answers = iter([True, False, True])

    async def reset() -> bool:
        return next(answers)

    out = tmp_path / "cut.json"
    named = {"at-once": [0.0] * 128, "again": [0.0] * 128, "third": [0.0] * 128}
    with pytest.raises(RuntimeError, match="killed by the timeout"):
        asyncio.run(tool.play_schedules(ask, reset, smollm2_tokenizer, named, {"label": "cut", "kind": "async"},
                                        out))
    assert capsys.readouterr().out == ("cut: again: the prefix cache could not be reset (reset_prefix_cache "
                                       "returned False), so this schedule does not start cold\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut-again.jsonl", "cut-at-once.jsonl", "cut.json"]
    record = json.loads(out.read_text())
    assert list(record["schedules"]) == ["at-once", "again"] and len(record["schedules"]["again"]) == 128 * 3
    assert record["schedules_planned"] == ["at-once", "again", "third"]
    assert record["prefix_cache_reset"] == {"at-once": True, "again": False}
    assert list(record["schedule_seconds"]) == ["at-once", "again"]
    lines = (tmp_path / "cut-again.jsonl").read_text().splitlines()
    assert len(lines) == 128 * 3 and set(json.loads(lines[0])) == set(tool.FINGERPRINT_KEYS)
    assert _compare(out) == [
        "cut: cut short: 2 of 3 schedules finished (missing: third)",
        "cut: prefix cache not reset before: again",
        "cut: at-once vs again: turn 0: 128/128 requests identical (tokens), 128/128 bit-identical log-probs; "
        "all turns: 384/384 of the requests with the same prompt identical (tokens), 384/384 bit-identical "
        "log-probs (384 joined)"]


def test_a_reset_answer_is_recorded_as_a_bool_or_unknown() -> None:
    """True and False as vLLM answers them; anything else (an engine that answers None) is unknown."""
    tool = gpu_tool("vllm_repro")
    assert [tool.cache_reset_result(x) for x in (True, False, None, 1)] == [True, False, None, None]
