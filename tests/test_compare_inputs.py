"""``fedagent compare`` on bad input: summaries whose keys are not as the recorder writes them, and a
``--json`` that would overwrite an input. Driven through the real CLI on copies of the committed GPU
runs' summaries (docs/gpu-runs/2026-12-06/webshop-fed-vs-local), each altered in one key: every case
gets one line naming the file and the key or round, exit status 2, and leaves its input as it was."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr import cli

RUNS = Path(__file__).resolve().parents[1] / "docs" / "gpu-runs" / "2026-12-06" / "webshop-fed-vs-local"
SEEDS = (4, 5, 6)


def _copies(root: Path) -> dict[str, list[Path]]:
    """Each arm's committed summaries of ``SEEDS``, copied as run directories under ``root`` (arm name ->
    run directories), so that a test may alter one without touching the record in docs/."""
    arms: dict[str, list[Path]] = {}
    for arm in ("federated", "local"):
        for seed in SEEDS:
            run = root / f"{arm}-s{seed}"
            run.mkdir(parents=True)
            (run / "federated_summary.json").write_bytes((RUNS / f"{arm}-s{seed}-summary.json").read_bytes())
            arms.setdefault(arm, []).append(run)
    return arms


def _argv(arms: dict[str, list[Path]], *extra: str) -> list[str]:
    return ["compare", *(a for name, runs in arms.items() for a in ("--arm", name, *map(str, runs))), *extra]


def _alter(run: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """Apply ``change`` to ``run``'s summary (written back as JSON, NaN included) and return the file."""
    path = run / "federated_summary.json"
    summary = json.loads(path.read_text())
    change(summary)
    path.write_text(json.dumps(summary))
    return path


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI on input it must refuse: exit 2, nothing printed, one line on stderr (no traceback)."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("fedagent compare: ") and "Traceback" not in line
    return line


def _point(summary: dict[str, Any], round_: int) -> dict[str, Any]:
    return next(p for p in summary["val_curve"] if p["round"] == round_)


def _set(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda summary: summary.__setitem__(key, value)


def _set_rate(value: object) -> Callable[[dict[str, Any]], None]:
    return lambda summary: _point(summary, 4).__setitem__("success_rate", value)


@pytest.mark.parametrize(("change", "named"), [
    (_set("val_curve", "x"), 'val_curve is "x", not a list of validation points'),
    (_set("val_curve", [1, 2]), "val_curve[0] is 1, not a validation point (an object)"),
    (_set_rate("high"), 'val_curve round 4 has success_rate "high", not a number from 0 to 1'),
    (_set("total_rounds", "five"), 'total_rounds is "five", not a number of rounds'),
    (_set("last_completed_round", 4.5), "last_completed_round is 4.5, not a number of rounds"),
], ids=["val_curve-a-string", "val_curve-of-numbers", "success_rate-a-word", "total_rounds-a-word",
        "last_completed_round-a-fraction"])
def test_a_key_of_the_wrong_type_is_refused_naming_the_file_and_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Callable[[dict[str, Any]], None],
        named: str) -> None:
    """Where the old code raised TypeError or ValueError from ``int()``/``float()``, one line names the
    file and the key, and says what to do."""
    arms = _copies(tmp_path)
    path = _alter(arms["federated"][1], change)
    line = _refused(capsys, _argv(arms))
    assert f"{path}: {named}" in line
    assert line.endswith("restore the summary as its run wrote it, or leave the run out")


def test_a_point_without_success_rate_is_refused_rather_than_counted_zero(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The recorder writes a success rate on every point and no point for an evaluation that recorded
    nothing, so a point without one was altered: the old code read it as 0.0 and reported the arm's
    window mean lower (seed 5's rounds 3-5: 0.698 read as 0.458) with exit 0."""
    arms = _copies(tmp_path)
    assert cli.main(_argv(arms)) == 0  # the committed summaries as they are compare
    capsys.readouterr()
    path = _alter(arms["federated"][1], lambda summary: _point(summary, 4).pop("success_rate"))
    line = _refused(capsys, _argv(arms))
    assert f"{path}: val_curve round 4 has no success_rate" in line


@pytest.mark.parametrize("rate", [7.5, -0.25, math.nan, math.inf, True, None],
                         ids=["above-1", "below-0", "nan", "infinity", "boolean", "null"])
def test_a_success_rate_outside_0_to_1_is_refused_naming_the_round(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], rate: object) -> None:
    """A success rate is a share of episodes: 7.5, NaN or ``true`` is no reading of one."""
    arms = _copies(tmp_path)
    path = _alter(arms["local"][0], _set_rate(rate))
    line = _refused(capsys, _argv(arms))
    assert f"{path}: val_curve round 4 has success_rate {json.dumps(rate)}, not a number from 0 to 1" in line


@pytest.mark.parametrize("how", ["summary-file-given", "summary-of-run-directory-given", "link-to-a-summary-given",
                                 "hard-link-to-a-summary-given", "another-runs-record"])
def test_json_that_would_overwrite_an_input_is_refused_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str) -> None:
    """``--json`` naming an input summary (given as a file, as docs/gpu-runs commits them, or as its run
    directory, or reached through a link) or any run's record: refused naming the path and the input,
    and every summary keeps its bytes (the old code replaced the input with the comparison)."""
    arms = _copies(tmp_path / "runs")
    summary = arms["federated"][0] / "federated_summary.json"
    given = f"the summary of run {arms['federated'][0]}, an input of this comparison"
    if how == "summary-file-given":  # a committed copy's name, which no name check would catch
        out = summary.rename(tmp_path / "federated-s4-summary.json")
        arms["federated"][0] = out
        given = f"the summary of run {out}, an input of this comparison"
    elif how == "summary-of-run-directory-given":
        out = summary
    elif how == "link-to-a-summary-given":
        out = tmp_path / "cmp.json"
        out.symlink_to(summary)
    elif how == "hard-link-to-a-summary-given":
        out = tmp_path / "cmp.json"
        os.link(summary, out)
    else:  # a run not compared: its record is no place for a comparison either
        (tmp_path / "other-run").mkdir()
        out = tmp_path / "other-run" / "federated_summary.json"
        out.write_bytes((RUNS / "federated-s7-summary.json").read_bytes())
        given = "a run's record (a file named federated_summary.json)"
    before = {p: p.read_bytes() for p in tmp_path.rglob("*.json")}
    line = _refused(capsys, _argv(arms, "--json", str(out)))
    assert line == f"fedagent compare: --json {out} would overwrite {given}: name another file for the comparison"
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.json")} == before
