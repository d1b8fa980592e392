"""tools/gpu/arms.py steps: collected runs' verl steps side by side, their first difference and step times."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from fedagent_flwr.trainers.verl.job import STEPS_FILE, keep_steps
from fedagent_flwr.trainers.verl.verl_log import FILE_LOGGER_ENV, StepFile
from testkit.gpu_tools import collected, gpu_tool

REPO = Path(__file__).resolve().parents[3]
COMMITTED = REPO / "docs" / "gpu-runs" / "2026-12-04" / "metrics" / "repro-rs-steps.jsonl"


def _arms_module():  # noqa: ANN202 - tools/gpu/arms.py
    return gpu_tool("arms")


def _results_from_committed(results: Path) -> dict[str, Path]:
    """Batch 17's pair as collected results folders: each (run, round)'s steps written by the
    trainer's own ``keep_steps`` into ``<run>/steps/round_<r>-client_0.jsonl`` (collect.sh's names),
    with two verl metrics more than the committed file keeps, as a real step has."""
    rounds: dict[tuple[str, int], dict[int, dict[str, float]]] = defaultdict(dict)
    for line in COMMITTED.read_text().splitlines():
        row = json.loads(line)
        data = {k: v for k, v in row.items() if k not in ("run", "round", "step")}
        rounds[(row["run"], row["round"])][row["step"]] = {**data, "actor/lr": 1e-6, "perf/throughput": 812.5}
    for (run, round_), steps in rounds.items():
        keep_steps(results / run / "steps" / f"round_{round_}-client_0.jsonl", steps)
    return {run: results / run for run, _ in rounds}


def test_the_committed_pair_file_is_what_the_command_writes(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """docs/gpu-runs/2026-12-04/metrics/repro-rs-steps.jsonl could have been made by ``steps
    --write`` with the default keys, byte for byte; the printout has the pair's first difference
    (round 1 step 1, docs/results.md §3's table) and the step times that docs/results.md quotes for
    it (steps after each run's first: 16.0-21.1 s, of which generation 2.5-4.4 s, 11 a run)."""
    arms = _arms_module()
    runs = _results_from_committed(tmp_path / "results")
    written = tmp_path / "pair" / "repro-steps.jsonl"
    written.parent.mkdir()
    written.write_text("an older file, replaced\n")
    assert arms.main(["steps", "--run", f"A={runs['A']}", "--run", f"B={runs['B']}", "--write", str(written)]) == 0
    assert written.read_bytes() == COMMITTED.read_bytes()
    assert [p.name for p in written.parent.iterdir()] == [written.name]  # renamed into place, no temporary left
    printed = capsys.readouterr().out
    assert ("A and B first differ at round 1 step 1: actor/entropy 2.647585 (A) vs 2.730029 (B); actor/grad_norm "
            "0.564952 (A) vs 0.57038 (B); actor/pg_loss 0.095759 (A) vs 0.083067 (B); critic/score/mean 0.140625 "
            "(A) vs 0.132812 (B); num_turns/mean 2.804688 (A) vs 2.820312 (B); response_length/mean 102.703125 (A) "
            "vs 102.0625 (B)\n") in printed
    assert ("- A: 11 steps after the first; timing_s/step median 19.48 s, range 17.84–20.96 s; timing_s/gen "
            "median 3.26 s, range 2.74–4.39 s\n") in printed
    assert ("- B: 11 steps after the first; timing_s/step median 18.78 s, range 16.01–21.07 s; timing_s/gen "
            "median 3.11 s, range 2.53–3.84 s\n") in printed
    assert "| 1 | 1 | 2.64758 | 2.73003 | 0.564952 | 0.57038 |" in printed
    assert "perf/throughput" not in printed


def _run_folder(out: Path, name: str, score_at: dict[tuple[int, int], float] | None = None) -> None:
    """A run of two clients, rounds 1, 2 and 10 of steps 1, 2 and 10 each, as the trainer leaves
    them (``round_<r>/client_<c>/verl/steps.jsonl``, by ``keep_steps``). Client 0's step time is
    100 s at its first step (start-up, generation 90 s) and 10, 11, ... 17 s at the eight after it,
    their generation 1 .. 8 s; client 1's are 50 s and 5 s throughout. Score 0.25 unless ``score_at`` says."""
    for round_ in (10, 2, 1):  # written out of order: the order must come from the numbers
        for client in (0, 1):
            steps = {}
            for step in (1, 2, 10):
                if client == 1:
                    step_time, gen = 50.0, 5.0
                elif (round_, step) == (1, 1):
                    step_time, gen = 100.0, 90.0
                else:
                    index = [(1, 2), (1, 10), (2, 1), (2, 2), (2, 10), (10, 1), (10, 2), (10, 10)].index((round_, step))
                    step_time, gen = 10.0 + index, 1.0 + index
                steps[step] = {"critic/score/mean": (score_at or {}).get((round_, step), 0.25) + client,
                               "response_length/mean": 100.0 + round_, "timing_s/step": step_time, "timing_s/gen": gen}
            keep_steps(out / "runs" / name / f"round_{round_}" / f"client_{client}" / "verl" / STEPS_FILE, steps)


def test_rounds_and_steps_in_numeric_order_client_0_by_default(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Round 10 comes after round 2 (and step 10 after step 2), in the table, in the written file
    and for the first difference; client 0 is read unless ``--client`` says; timing keys never make
    two runs differ; the step times leave the run's first step out."""
    arms = _arms_module()
    out = tmp_path / "out"
    _run_folder(out, "same-a")
    _run_folder(out, "same-b")
    # B differs at round 2 step 10 and round 10 step 1: the first is round 2's (file and string order
    # would put round_10 first, and step "10" before "2")
    _run_folder(out, "diff-b", score_at={(2, 10): 0.5, (10, 1): 0.75})
    results = collected(out, tmp_path)
    keys = ["--keys", "critic/score/mean", "timing_s/step"]
    written = tmp_path / "steps.jsonl"
    assert arms.main(["steps", "--run", f"A={results / 'same-a'}", "--run", f"B={results / 'diff-b'}", *keys,
                      "--write", str(written)]) == 0
    printed = capsys.readouterr().out
    assert ("A and B first differ at round 2 step 10: critic/score/mean 0.25 (A) vs 0.5 (B)\n") in printed
    rows = [line.split(" | ")[:2] for line in printed.splitlines() if line.startswith("| ") and line[2].isdigit()]
    order = [(1, 1), (1, 2), (1, 10), (2, 1), (2, 2), (2, 10), (10, 1), (10, 2), (10, 10)]
    assert rows == [[f"| {r}", str(s)] for r, s in order]
    assert "| 1 | 1 | 0.25 | 0.25 | 100 | 100 |" in printed
    assert ("- A: 8 steps after the first; timing_s/step median 13.50 s, range 10.00–17.00 s; timing_s/gen median "
            "4.50 s, range 1.00–8.00 s\n") in printed
    lines = [json.loads(line) for line in written.read_text().splitlines()]
    assert [(x["run"], x["round"], x["step"]) for x in lines] == [(run, r, s) for run in "AB" for r, s in order]
    assert lines[5] == {"run": "A", "round": 2, "step": 10, "critic/score/mean": 0.25, "timing_s/step": 14.0}
    assert lines[9 + 5]["critic/score/mean"] == 0.5
    # the same config twice, step times aside: identical
    assert arms.main(["steps", "--run", f"A={results / 'same-a'}", "--run", f"B={results / 'same-b'}"]) == 0
    printed = capsys.readouterr().out
    assert "A and B: identical in every step shown (critic/score/mean, response_length/mean)\n" in printed
    assert printed.endswith("Default keys no step has, left out: actor/entropy, actor/grad_norm, actor/pg_loss, "
                            "num_turns/mean\n")
    # client 1, on request
    assert arms.main(["steps", "--run", f"A={results / 'same-a'}", "--run", f"B={results / 'diff-b'}",
                      "--client", "1"]) == 0
    printed = capsys.readouterr().out
    assert "first differ at round 2 step 10: critic/score/mean 1.25 (A) vs 1.5 (B)" in printed
    assert "- B: 8 steps after the first; timing_s/step median 50.00 s, range 50.00–50.00 s;" in printed
    assert arms.main(["steps", "--run", f"A={results / 'same-a'}", "--client", "2"]) == 2
    assert "has no steps of client 2 (clients: 0, 1)" in capsys.readouterr().err


def test_a_run_without_steps_is_refused_naming_the_folder(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A folder without ``steps/`` (a results folder collected before collect.sh kept steps, or a
    wrong path), an empty one, a misspelt key and a label given twice are errors, with nothing written."""
    arms = _arms_module()
    runs = _results_from_committed(tmp_path / "results")
    old = tmp_path / "old-run"
    old.mkdir()
    written = tmp_path / "w.jsonl"
    assert arms.main(["steps", "--run", f"A={runs['A']}", "--run", f"B={old}", "--write", str(written)]) == 2
    err = capsys.readouterr().err
    assert f"{old / 'steps'} does not exist: tools/gpu/collect.sh writes it" in err
    (old / "steps").mkdir()
    (old / "steps" / "notes.txt").write_text("x")
    assert arms.main(["steps", "--run", f"B={old}"]) == 2
    assert f"{old / 'steps'} holds no round_<r>-client_<c>.jsonl: tools/gpu/collect.sh" in capsys.readouterr().err
    assert arms.main(["steps", "--run", f"A={runs['A']}", "--keys", "critic/score/maen"]) == 2
    assert "no step of A has critic/score/maen (keys present: actor/entropy," in capsys.readouterr().err
    assert arms.main(["steps", "--run", f"A={runs['A']}", "--run", f"A={runs['B']}"]) == 2
    assert "--run label(s) A given twice" in capsys.readouterr().err
    assert not written.exists()


def _verl_logs(tracking: Any) -> None:
    """Two steps as verl's trainer logs them: NumPy scalars, an integer, NaN, infinity, a string,
    a list and a non-ASCII string alongside the numbers."""
    tracking.log({"critic/score/mean": np.float32(0.25), "actor/entropy": float("nan"), "timing_s/step": 12.5,
                  "training/global_step": 1, "actor/grad_norm": float("inf"), "note": "stopped é",
                  "hist": [1, 2], "response_length/mean": np.float64(101.5)}, step=1)
    tracking.log({"critic/score/mean": 0.5, "actor/entropy": np.float64(2.5), "timing_s/step": 10.0,
                  "training/global_step": 2, "note": "1.5", "actor/grad_norm": 0.5,
                  "response_length/mean": 99.0}, step=2)


def test_a_killed_jobs_raw_verl_lines_read_as_keep_steps_would_have_kept_them(
        tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A subprocess job killed by SIGTERM leaves ``verl/steps.jsonl`` as verl's own file logger
    wrote it (NaN and infinity as null, strings, lists, integers) and its last line cut off mid-write
    (here inside a multi-byte character): arms.py steps reads it as ``keep_steps`` would have kept
    the same steps, finite numbers only, so it compares identical with such a run; the cut-off line
    is skipped with a note naming the file and line; a value left out shows as missing."""
    from verl.utils.tracking import Tracking

    arms = _arms_module()
    out = tmp_path / "out"
    killed = out / "runs" / "killed" / "round_1" / "client_0" / "verl" / STEPS_FILE
    killed.parent.mkdir(parents=True)
    monkeypatch.setenv(FILE_LOGGER_ENV, str(killed))
    tracking = Tracking(project_name="p", experiment_name="e", default_backend=["file"])
    _verl_logs(tracking)
    # step 3's write, cut off by the kill two bytes into the "é" (two bytes in UTF-8) of its last value
    line = orjson.dumps({"step": 3, "data": {"critic/score/mean": 0.75, "note": "é"}},
                        option=orjson.OPT_SERIALIZE_NUMPY)
    tracking.logger["file"].fp.write(line[:line.index("é".encode()) + 1])
    tracking.logger["file"].finish()
    # the same steps where the job ended: the trainer's own reader, then keep_steps
    whole = tmp_path / "whole.jsonl"
    monkeypatch.setenv(FILE_LOGGER_ENV, str(whole))
    tracking = Tracking(project_name="p", experiment_name="e", default_backend=["file"])
    _verl_logs(tracking)
    tracking.logger["file"].finish()
    reader = StepFile(whole)
    reader.poll()
    keep_steps(out / "runs" / "kept" / "round_1" / "client_0" / "verl" / STEPS_FILE, reader.steps)
    results = collected(out, tmp_path)
    written = tmp_path / "pair.jsonl"
    keys = ["critic/score/mean", "actor/entropy", "actor/grad_norm", "training/global_step", "note", "timing_s/step"]
    assert arms.main(["steps", "--run", f"K={results / 'killed'}", "--run", f"W={results / 'kept'}",
                      "--keys", *keys, "--write", str(written)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"arms.py steps: note: {results / 'killed' / 'steps' / 'round_1-client_0.jsonl'}:3: "
                            "last line cut off (a killed job's half-written step), skipped\n")
    assert ("K and W: identical in every step shown (critic/score/mean, actor/entropy, actor/grad_norm, "
            "training/global_step, note)\n") in captured.out
    # NaN, infinity and text are missing: a dash; a numeric string and an integer are numbers
    assert "| 1 | 1 | 0.25 | 0.25 | – | – | – | – | 1 | 1 | – | – | 12.5 | 12.5 |" in captured.out
    assert "| 1 | 2 | 0.5 | 0.5 | 2.5 | 2.5 | 0.5 | 0.5 | 2 | 2 | 1.5 | 1.5 | 10 | 10 |" in captured.out
    flat = [json.loads(line) for line in written.read_text().splitlines()]
    assert [{k: v for k, v in row.items() if k != "run"} for row in flat[:2]] == \
        [{k: v for k, v in row.items() if k != "run"} for row in flat[2:]]
    assert flat[0] == {"run": "K", "round": 1, "step": 1, "critic/score/mean": 0.25, "training/global_step": 1.0,
                       "timing_s/step": 12.5}


def _steps_folder(tmp_path: Path, lines: bytes) -> Path:
    run = tmp_path / "run"
    (run / "steps").mkdir(parents=True)
    (run / "steps" / "round_1-client_0.jsonl").write_bytes(lines)
    return run


@pytest.mark.parametrize(("lines", "where", "why"), [
    # a cut-off line that is not the last: the file was not just killed mid-write
    (b'{"step":1,"data":{"a":1.0}}\n{"step":2,"da\n{"step":3,"data":{"a":2.0}}\n', 2, "Unterminated string"),
    # the last line whole (its newline written) but not JSON
    (b'{"step":1,"data":{"a":1.0}}\n{"step":2,"da\n', 2, "Unterminated string"),
    (b'{"step":1,"data":{"a":1.0}}\n{"step":2}\n', 2, "KeyError: 'data'"),
    (b'{"step":1,"data":[1.0]}\n{"step":2,"data":{"a":2.0}}\n', 1, "TypeError: data is list, not an object"),
    (b'{"step":"one","data":{"a":1.0}}\n', 1, "TypeError: step is 'one', not an integer"),
    # what int() would have taken, and the trainer's reader refuses
    (b'{"step":"3","data":{"a":1.0}}\n', 1, "TypeError: step is '3', not an integer"),
    (b'{"step":1.5,"data":{"a":1.0}}\n', 1, "TypeError: step is 1.5, not an integer"),
    (b'{"step":true,"data":{"a":1.0}}\n', 1, "TypeError: step is True, not an integer"),
])
def test_any_other_line_that_is_no_step_fails_naming_the_file_and_line(
        lines: bytes, where: int, why: str, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Only the last line without its newline may be cut off; any other line that is not a
    ``{"step": n, "data": {...}}`` record stops the command with one message naming the file and line."""
    run = _steps_folder(tmp_path, lines)
    assert _arms_module().main(["steps", "--run", f"A={run}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'arms.py steps: {run / "steps" / "round_1-client_0.jsonl"}:{where}: not a step line '
                          '({"step": n, "data": {...}}): ')
    assert why in err and err.count("\n") == 1
