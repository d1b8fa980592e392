"""``fedagent compare`` on bad input: summaries whose keys are not as the recorder writes them (a key of
the wrong type, a round with two validation points, a ``base_seed`` that is no whole number), and a
``--json`` that would overwrite an input or a file that is not an earlier comparison. Driven through
the real CLI on copies of the committed GPU runs' summaries (docs/gpu-runs/2026-12-06/webshop-fed-vs-local),
each altered in one key: every case gets one line naming the file and the key or round, exit status 2,
and leaves its input as it was."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr import cli, compare_report
from fedagent_flwr.compare import CompareError, compare, validation_by_round

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


def _twice(round_: int, rate: float | None) -> Callable[[dict[str, Any]], None]:
    """Append a second point of ``round_`` to the curve: a copy of its own, with ``rate`` if one is given."""
    def change(summary: dict[str, Any]) -> None:
        point = dict(_point(summary, round_))
        if rate is not None:
            point["success_rate"] = rate
        summary["val_curve"].append(point)
    return change


@pytest.mark.parametrize(("round_", "rate"), [(5, 0.0), (4, None), (0, 1.0)],
                         ids=["final-round-another-value", "window-round-same-point", "base-round"])
def test_a_round_with_two_validation_points_is_refused_naming_the_file_and_the_round(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], round_: int, rate: float | None) -> None:
    """The recorder writes one point a round. The old code read the curve by round, so a round's later
    point won without a word: seed 5's round 5 given again as 0.0 made its window 0.469 instead of 0.698
    and its final 0.000, exit 0. Now one line names the file and the round, and the summary is unchanged."""
    arms = _copies(tmp_path)
    path = _alter(arms["federated"][1], _twice(round_, rate))
    before = path.read_bytes()
    line = _refused(capsys, _argv(arms))
    assert line == (f"fedagent compare: {path}: val_curve has round {round_} twice (val_curve[{round_}] and "
                    "val_curve[6]; the recorder writes one point a round): restore the summary as its run wrote "
                    "it, or leave the run out")
    assert path.read_bytes() == before


def test_the_curve_reading_the_gpu_tables_share_refuses_a_round_given_twice(tmp_path: Path) -> None:
    """``validation_by_round`` (also ``arms_dynamics``'s and ``window_mean``'s reading) refuses the second
    point of a round rather than keeping it, so that no table built on it takes the later point either."""
    curve = json.loads((RUNS / "federated-s5-summary.json").read_text())["val_curve"]
    assert validation_by_round(curve)[5] == 0.6875
    twice = [*curve, {**curve[5], "success_rate": 0.0}]
    with pytest.raises(CompareError, match=r"^val_curve has round 5 twice \(val_curve\[5\] and val_curve\[6\];"):
        validation_by_round(twice)


@pytest.mark.parametrize(("seed", "paired"), [(True, True), (False, True), (True, False), ("4", True), (4.0, True),
                                              ([4], True)],
                         ids=["true-paired", "false-paired", "true-unpaired", "a-string", "a-fraction", "a-list"])
def test_a_base_seed_that_is_no_whole_number_is_refused_naming_the_file_and_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], seed: object, paired: bool) -> None:
    """``true`` is an int to Python: the old code took it as seed 1 (0 for ``false``), paired it under
    ``--paired`` with another arm's seed-1 run and printed it as seed 1, exit 0; a string or a fraction
    it read as no seed, refused as "has no base_seed in its summary", which it has. Now one line names
    the file and the key, with or without ``--paired``."""
    arms = _copies(tmp_path)
    _alter(arms["local"][0], _set("base_seed", int(seed) if isinstance(seed, (bool, float)) else 4))
    path = _alter(arms["federated"][0], _set("base_seed", seed))
    line = _refused(capsys, _argv(arms, *(["--paired"] if paired else [])))
    assert line == (f"fedagent compare: {path}: base_seed is {json.dumps(seed)}, not a seed (a whole number, as the "
                    "run's seed setting): restore the summary as its run wrote it, or leave the run out")


def _existing(tmp_path: Path, what: str) -> Path:
    """A file that ``--json`` must not replace: ``what`` names which (see the test's ids)."""
    out = tmp_path / "out" / f"{what}.json"
    out.parent.mkdir()
    if what == "a-runs-metrics":  # beside a run's record, in its run directory
        out = tmp_path / "runs" / "federated-s4" / "metrics.jsonl"
        out.write_bytes((RUNS / "federated-s4-metrics.jsonl").read_bytes())
    elif what == "notes":
        out.write_text("seed 7 ran out of memory in round 3; rerun it\n")
    elif what == "empty":
        out.write_bytes(b"")
    elif what == "other-json":  # JSON with some of the report's keys, not its shape
        out.write_text(json.dumps({"statistic": "window", "runs": [], "arms": {}, "notes": ["mine"]}))
    elif what == "report-with-a-key-more":  # a report someone added to: not what compare writes
        report = compare({name: [str(r) for r in runs] for name, runs in _copies(tmp_path / "other").items()})
        out.write_text(json.dumps({**report, "reviewed_by": "me"}))
    elif what == "fifo":  # not read: reading a FIFO would wait for a writer
        os.mkfifo(out)
    else:  # a link to a file that is not there: the write would replace the link
        out.symlink_to(tmp_path / "gone" / "cmp.json")
    return out


@pytest.mark.parametrize("what", ["a-runs-metrics", "notes", "empty", "other-json", "report-with-a-key-more", "fifo",
                                  "broken-link"])
def test_json_that_would_overwrite_a_file_that_is_not_an_earlier_comparison_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str) -> None:
    """The old code replaced whatever ``--json`` named (a run's metrics.jsonl, notes, a FIFO, a link),
    exit 0. Now an existing file is replaced only if it is an earlier comparison; otherwise one line names
    the path and says to name another file or delete it, before the runs are read, and nothing changes."""
    arms = _copies(tmp_path / "runs")
    out = _existing(tmp_path, what)
    before = {p: (p.is_symlink(), p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*")}
    line = _refused(capsys, _argv(arms, "--json", str(out)))
    existing = ("a broken symbolic link" if what == "broken-link" else
                "an existing file that is not an earlier comparison (the JSON report fedagent compare writes)")
    assert line == (f"fedagent compare: --json {out} would overwrite {existing}: name another file for the "
                    f"comparison, or delete {out} first")
    assert {p: (p.is_symlink(), p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*")} == before


def test_json_replaces_an_earlier_comparison_atomically(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rerunning a comparison to the same file works as before: a report with or without ``--paired``
    is replaced by the new one, through a temporary name (none is left), and is a report by
    ``is_report``'s reading (which ``compare``'s own reports must pass, or none could be replaced)."""
    arms = _copies(tmp_path / "runs")
    out = tmp_path / "cmp.json"
    assert cli.main(_argv(arms, "--json", str(out))) == 0
    first = json.loads(out.read_text())
    assert compare_report.is_report(first) and "paired" not in first
    assert cli.main(_argv(arms, "--paired", "--json", str(out))) == 0
    second = json.loads(out.read_text())
    assert compare_report.is_report(second) and "paired" in second
    assert cli.main(_argv(arms, "--statistic", "final", "--json", str(out))) == 0
    assert json.loads(out.read_text())["statistic"] == "final"
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmp.json", "runs"]  # no temporary left beside it
