"""``fedagent compare``: arms compared over their runs from real run records (summaries written by
the ServerApp's own ``RunRecorder`` in-process, and the GPU runs committed under docs/gpu-runs), with
the numbers docs/results.md and the README state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedagent_flwr import cli
from fedagent_flwr.compare import CompareError, compare, markdown, seed_difference, window_mean
from fedagent_flwr.serverapp.recorder import RunRecorder

REPO = Path(__file__).resolve().parents[1]
GPU_RUNS = REPO / "docs" / "gpu-runs"

#: docs/results.md's declared federated − local comparison: each seed's rounds 8-10 mean (seeds 4-9),
#: as the committed runs give them (results.md prints them to 3 places: 0.531, 0.464, ...).
FEDERATED = [0.5312, 0.4635, 0.2865, 0.4427, 0.5208, 0.401]
LOCAL = [0.1667, 0.4167, 0.349, 0.2083, 0.3646, 0.2552]


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorder redraws learning_curve.png on every write (seconds each with matplotlib); these
    tests read the summary only, which it writes all the same."""
    monkeypatch.setattr("fedagent_flwr.serverapp.recorder.plot_learning_curve", lambda summary, path: None)


def _run(run_dir: Path, rates: list[float | None], *, seed: int = 1, total_rounds: int | None = None,
         status: str | None = "completed", n: int = 64, mode: str = "federated", lacking: tuple[int, ...] = (),
         start: str | None = None) -> Path:
    """A run record written by the recorder: validation ``rates`` from round 0 on (None: that round's
    evaluation recorded nothing; a round in ``lacking``: its point lacks client 1's episodes), each
    round committed; ``status`` None leaves it running (a ServerApp killed mid-run); ``start``: the
    starting model's content hash, recorded as ``base_model_sha256``."""
    total = len(rates) - 1 if total_rounds is None else total_rounds
    recorder = RunRecorder(run_dir, {"run_id": f"{run_dir.name}", "base_model": "/m", "env_kind": "tinyguess",
                                     "mode": mode, "strategy": "fedavg", "total_rounds": total,
                                     "base_seed": seed, **({"base_model_sha256": start} if start else {})})
    for r, rate in enumerate(rates):
        if rate is None:
            recorder.record_eval_failure(server_round=r, model=f"/m{r}", failed={0: "killed"})
        else:
            recorder.record_eval(server_round=r, model=f"/m{r}", metrics={"num-examples": n, "success-rate": rate},
                                 failed={1: "killed"} if r in lacking else None)
        recorder.complete_round(r)
    if status is not None:
        recorder.finish(status, "" if status == "completed" else "for the test")
    return run_dir


def _arm(root: Path, name: str, windows: list[float], rounds: int = 10) -> list[Path]:
    """One run a seed whose last 3 of ``rounds`` rounds all score that seed's window value (so its
    window mean is the value) and whose earlier rounds score the base model's 0.0625."""
    return [_run(root / f"{name}-s{seed}", [0.0625] * (rounds - 2) + [w] * 3, seed=seed)
            for seed, w in enumerate(windows, start=4)]


def _refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert cli.main(["compare", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()  # one readable line, no traceback
    assert line.startswith("fedagent compare: ")
    return line


def test_the_declared_federated_local_comparison_of_results_md(tmp_path: Path) -> None:
    """The README's first row: federated − local +0.147, 95% over seeds [+0.025, +0.271] (Welch: means
    0.4410 and 0.2934, sds 0.0900 and 0.0981, se 0.0543, df 9.9 rounded down to 9, t 2.262: ±0.1229),
    federated ahead. From results.md's 3-place values the same sums give [+0.024, +0.271]."""
    report = compare({"federated": _arm(tmp_path, "federated", FEDERATED), "local": _arm(tmp_path, "local", LOCAL)})
    (pair,) = [p for p in report["pairs"] if p["statistic"] == "window"]
    assert pair["arms"] == ["federated", "local"]
    assert pair["difference"] == pytest.approx(0.1475, abs=1e-4)
    assert pair["ci95"] == pytest.approx([0.0246, 0.2705], abs=1e-4)
    assert f"{pair['ci95'][0]:+.3f}, {pair['ci95'][1]:+.3f}" == "+0.025, +0.271"
    assert pair["reading"] == "federated ahead"
    # Runs an arm for this gap at these spreads (variance sum 0.0177): 8 give df 13.9 -> 13, (2.160 + 0.870)
    # * sqrt(0.0177 / 8) = 0.143 <= 0.1475; 7 give df 11.9 -> 11, (2.201 + 0.876) * sqrt(0.0177 / 7) = 0.155.
    assert pair["seeds_needed"] == 8
    assert report["arms"]["federated"]["window"]["per_run"] == FEDERATED
    assert report["arms"]["local"]["runs"] == 6 and report["window_rounds"] == [8, 10]
    rounded = seed_difference([0.531, 0.464, 0.286, 0.443, 0.521, 0.401], [0.167, 0.417, 0.349, 0.208, 0.365, 0.255])
    assert rounded is not None and (rounded.difference, rounded.low, rounded.high) == pytest.approx(
        (0.1475, 0.0244, 0.2706), abs=1e-4)
    text = markdown(report)
    assert "| federated − local | 0.441 | 0.293 | +0.147 | [+0.025, +0.271] | federated ahead | 8 |" in text
    assert "| federated | 6 | 0.441 |" in text


def test_the_committed_gpu_runs_give_the_readmes_table() -> None:
    """The GPU runs' own summaries (docs/gpu-runs, written by the recorder on the GPU node), read as
    files: the README's three declared comparisons and their round-10 secondaries."""
    def runs(arm: str) -> list[Path]:
        return sorted(GPU_RUNS.glob(f"*/recipe10r-{arm}-s[4-9]-summary.json"))

    report = compare({arm: runs(arm) for arm in ("federated", "local", "centralized", "fedprox")})
    found = {(p["statistic"], *p["arms"]): (p["difference"], p["ci95"], p["reading"]) for p in report["pairs"]}
    diff, ci, reading = found["window", "federated", "local"]
    assert (round(diff, 3), [round(x, 3) for x in ci], reading) == (0.147, [0.025, 0.271], "federated ahead")
    diff, ci, reading = found["window", "federated", "centralized"]
    assert (round(diff, 3), [round(x, 3) for x in ci]) == (-0.047, [-0.244, 0.151])
    assert reading == "no difference shown at 6 runs an arm"
    diff, ci, _ = found["window", "federated", "fedprox"]  # the README's FedProx − federated, negated
    assert (round(diff, 3), [round(x, 3) for x in ci]) == (0.050, [-0.065, 0.165])
    diff, ci, _ = found["final", "federated", "local"]
    assert (round(diff, 3), [round(x, 3) for x in ci]) == (0.190, [0.085, 0.295])
    assert [r["seed"] for r in report["runs"][:6]] == [4, 5, 6, 7, 8, 9]
    # results.md's named deviations: federated seed 4 (its status predates the rule that makes it
    # degraded), FedProx seeds 8 and 9
    notes = "\n".join(report["notes"])
    assert ("recipe10r-federated-s4-summary.json (federated) did not run as planned, and its values include these "
            "rounds: round 9 trained without client(s) [1]") in notes
    assert "recipe10r-fedprox-s8-summary.json (fedprox) did not run as planned" in notes
    assert "recipe10r-fedprox-s9-summary.json (fedprox) did not run as planned, and its values include these " \
           "rounds: round 1 aggregated nothing" in notes
    assert len(report["notes"]) == 3


def test_seeds_needed_and_the_readings_each_way() -> None:
    """A hand-checked pair: [0.5, 0.6] − [0.1, 0.2] = +0.4, sds 0.0707 each, se 0.0707, df 2 (t 4.303):
    [+0.096, +0.704]; seeds needed: 2 a side give (4.303 + 1.061) * 0.0707 = 0.38 <= 0.4."""
    found = seed_difference([0.5, 0.6], [0.1, 0.2])
    assert found is not None
    assert (found.difference, found.low, found.high) == pytest.approx((0.4, 0.0957, 0.7043), abs=1e-4)
    assert found.seeds_needed == 2
    assert seed_difference([0.5], [0.1, 0.2]) is None


def test_the_reading_says_which_arm_is_ahead_or_that_none_is_shown(tmp_path: Path) -> None:
    low, high = _arm(tmp_path, "low", [0.1, 0.2, 0.15]), _arm(tmp_path, "high", [0.5, 0.6, 0.55])
    mixed = _arm(tmp_path, "mixed", [0.1, 0.6])
    report = compare({"low": low, "high": high, "mixed": mixed})
    readings = {tuple(p["arms"]): p["reading"] for p in report["pairs"] if p["statistic"] == "window"}
    assert readings == {("low", "high"): "high ahead", ("low", "mixed"): "no difference shown at 3 and 2 runs an arm",
                        ("high", "mixed"): "no difference shown at 3 and 2 runs an arm"}
    report = compare({"high": high, "low": low})
    assert [p["reading"] for p in report["pairs"] if p["statistic"] == "window"] == ["high ahead"]
    # no spread in either arm (deterministic runs, arms stuck at one value): no interval, no direction
    flat_a, flat_b = _arm(tmp_path / "a", "a", [0.3, 0.3]), _arm(tmp_path / "b", "b", [0.29, 0.29])
    (pair,) = [p for p in compare({"a": flat_a, "b": flat_b})["pairs"] if p["statistic"] == "window"]
    assert (pair["reading"], pair["ci95"], pair["seeds_needed"]) == (
        "no spread between runs: no interval, so no direction shown", None, None)


def test_the_window_and_the_primary_statistic_are_options(tmp_path: Path) -> None:
    """Rounds 1-4 of 4: the window is the last ``window`` planned rounds; ``final`` is round 4."""
    a = [_run(tmp_path / f"a{s}", [0.0, 0.2, 0.4, 0.6, 0.8 + s / 100], seed=s) for s in (1, 2)]
    b = [_run(tmp_path / f"b{s}", [0.0, 0.2, 0.2, 0.2, 0.2 + s / 100], seed=s) for s in (1, 2)]
    assert window_mean([{"round": r, "success_rate": r / 10} for r in range(5)], 4, 2) == 0.35
    report = compare({"a": a, "b": b}, window=2, statistic="final")
    assert report["statistic"] == "final" and report["window_rounds"] == [3, 4]
    assert report["arms"]["a"]["window"]["per_run"] == [0.705, 0.71]
    assert report["pairs"][0]["statistic"] == "final" and report["pairs"][0]["difference"] == pytest.approx(0.6)
    text = markdown(report)
    assert text.startswith("Primary statistic (final): round 4, validation success at the last of 4 rounds")
    assert text.index("round 4 (primary)") < text.index("rounds 3–4 (secondary)")
    with pytest.raises(CompareError, match="--window 5: must be 1 to the runs' 4 rounds"):
        compare({"a": a, "b": b}, window=5)


def test_an_arm_of_one_run_gets_wilson_intervals_and_no_interval_over_runs(tmp_path: Path) -> None:
    """With one run an arm there is no spread between runs: no interval over them, said so; each
    run's final round keeps its Wilson interval over its episodes (16 of 64: centre 0.2800 / 1.0600 =
    0.2642, half 1.96 * 0.05625 / 1.0600 = 0.1040: [0.160, 0.368])."""
    one = [_run(tmp_path / "one", [0.0, 0.25, 0.25, 0.25], seed=3)]
    two = _arm(tmp_path, "two", [0.5, 0.6], rounds=3)
    report = compare({"one": one, "two": two})
    pair = report["pairs"][0]
    assert pair["ci95"] is None and pair["seeds_needed"] is None
    assert pair["reading"] == "no interval over runs: needs 2 or more runs an arm (here 1 and 2)"
    assert report["runs"][0]["final_ci95"] == pytest.approx([0.1601, 0.3682], abs=1e-4)
    text = markdown(report)
    assert "| one | " + str(tmp_path / "one") + " | 3 | completed | 0.250 | 0.250 | [0.160, 0.368] | 64 |" in text
    assert "- arm one has 1 run: no interval over runs can be given" in text


def test_unfinished_runs_are_refused_unless_asked_for_and_then_flagged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done = _arm(tmp_path, "done", [0.3, 0.4])
    running = _run(tmp_path / "running", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], total_rounds=10, status=None)
    line = _refusal(capsys, ["--arm", "done", *map(str, done), "--arm", "late", str(running), str(done[0])])
    assert line == (f"fedagent compare: {running} is not finished (status running, round 5 of 10): wait for it to end, "
                    "or pass --allow-unfinished to include it, flagged, on the rounds it has")
    failed = _run(tmp_path / "failed", [0.1] * 11, status="failed")
    assert "is not finished (status failed, round 10 of 10)" in _refusal(
        capsys, ["--arm", "done", *map(str, done), "--arm", "f", str(failed)])
    other = _arm(tmp_path / "more", "other", [0.2, 0.3])
    assert cli.main(["compare", "--arm", "done", *map(str, done), "--arm", "late", str(running), *map(str, other),
                     "--allow-unfinished"]) == 0
    out = capsys.readouterr().out
    # its last 3 rounds, 3-5, and its round 5, each named as such
    assert (f"| late | {running} | 1 | running (unfinished: status running, round 5 of 10) | 0.500 (rounds 3–5) | "
            "0.600 (round 5) | [0.478, 0.711] (round 5) | 64 |") in out
    assert f"- {running} (late) is unfinished (status running, round 5 of 10): included on request" in out


def test_an_unfinished_runs_values_are_not_put_under_rounds_they_do_not_cover(tmp_path: Path) -> None:
    """A run stopped at round 5 of 10 has its window over rounds 3-5 and its final value at round 5:
    its cells say so, and its arm's means (arms and pairs tables) are marked, rather than standing
    under 'rounds 8–10' and 'round 10' as if they were those rounds'."""
    done = _arm(tmp_path, "done", [0.3, 0.4])
    running = _run(tmp_path / "running", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], total_rounds=10, status=None)
    report = compare({"done": done, "late": [running]}, allow_unfinished=True)
    assert [(r["window_rounds"], r["final_round"]) for r in report["runs"]] == [([8, 10], 10)] * 2 + [([3, 5], 5)]
    text = markdown(report)
    assert (f"| late | {running} | 1 | running (unfinished: status running, round 5 of 10) | 0.500 (rounds 3–5) | "
            "0.600 (round 5) | [0.478, 0.711] (round 5) | 64 |") in text
    assert f"| done | {done[0]} | 4 | completed | 0.300 | 0.300 | [0.202, 0.421] | 64 |" in text
    assert "| late† | 1 | 0.500 | – | 0.600 | – |" in text and "| done | 2 | 0.350 |" in text
    assert text.count("| done − late† | ") == 2  # the primary and the secondary pair
    assert ("† the arm's means include an unfinished run's values, which cover the rounds that run has (named in "
            "its row of the runs table), not the headings' rounds.") in text
    # failed at its last planned round: its values are the headings' rounds, nothing to mark
    failed = _run(tmp_path / "failed", [0.1] * 11, status="failed")
    text = markdown(compare({"done": done, "f": [failed]}, allow_unfinished=True))
    assert "†" not in text and "| f | 1 | 0.100 | – | 0.100 | – |" in text


def test_an_unfinished_runs_deviations_are_listed_as_a_finished_runs_are(tmp_path: Path) -> None:
    """Round 4's evaluation lacked client 1: said under the tables whether or not the run finished
    (its status is in its unfinished note already, so it is not repeated)."""
    done = _arm(tmp_path, "done", [0.3, 0.4])
    running = _run(tmp_path / "running", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], total_rounds=10, status=None, lacking=(4,))
    finished = _run(tmp_path / "finished", [0.1] * 11, seed=2, lacking=(4,))
    notes = compare({"done": done, "late": [running, finished]}, allow_unfinished=True)["notes"]
    assert notes == [
        f"{running} (late) is unfinished (status running, round 5 of 10): included on request (--allow-unfinished), "
        "on the rounds it has",
        f"{running} (late) did not run as planned, and its values include these rounds: round 4's evaluation lacks "
        "client(s) [1]",
        f"{finished} (late) did not run as planned, and its values include these rounds: round 4's evaluation lacks "
        "client(s) [1]"]


def test_a_window_of_one_round_is_the_final_round_shown_once(tmp_path: Path) -> None:
    """``--window 1`` makes the window the final round: the two statistics are one, so it is shown once
    (no two columns both headed 'round 10', no secondary table repeating the primary) and said so."""
    report = compare({"a": _arm(tmp_path, "a", [0.3, 0.4]), "b": _arm(tmp_path, "b", [0.1, 0.2])}, window=1)
    text = markdown(report)
    headers = [line.split(" | ") for line in text.splitlines() if line.startswith("| arm | ")]
    assert len(headers) == 2 and all(len(cells) == len(set(cells)) for cells in headers)
    assert "| arm | run | seed | status | round 10 | 95% Wilson (round 10) | n episodes |" in text
    assert "| a | 2 | 0.350 | 0.071 |" in text.splitlines()
    assert "--window 1 makes the window the final round, so the two statistics are one: no secondary is shown." in text
    assert "(secondary)" not in text and text.count("| a − b | ") == 1
    assert [p["statistic"] for p in report["pairs"]] == ["window", "final"]  # the JSON keeps both


def test_runs_that_cannot_be_compared_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = [str(p) for p in _arm(tmp_path, "good", [0.3, 0.4])]
    empty = _run(tmp_path / "empty", [], total_rounds=3)
    assert _refusal(capsys, ["--arm", "a", *good, "--arm", "b", str(empty)]) == (
        f"fedagent compare: {empty} has no validation curve (val_curve is empty: the run evaluated nothing); "
        "leave it out")
    short = [str(p) for p in _arm(tmp_path, "short", [0.3, 0.4], rounds=8)]
    line = _refusal(capsys, ["--arm", "a", *good, "--arm", "b", *short])
    assert "the runs were planned for different numbers of rounds (" in line and f"{good[0]} (a): 10" in line
    assert f"{short[0]} (b): 8" in line and line.endswith("compare runs of one plan (the same num_rounds)")
    gap = _run(tmp_path / "gap", [0.1] * 9 + [None, 0.5], seed=7)  # round 9's evaluation recorded nothing
    assert _refusal(capsys, ["--arm", "a", *good, "--arm", "b", str(gap)]) == (
        f"fedagent compare: {gap} has no validation point for every one of rounds 8-10, which its window statistic "
        "needs (an evaluation recorded nothing): leave it out, or choose another --statistic")
    assert cli.main(["compare", "--arm", "a", *good, "--arm", "b", str(gap), "--statistic", "final"]) == 0
    assert (f"- {gap} (b) has no window value (fewer rounds than it needs, or an evaluation recorded nothing): it "
            "is left out of the window (secondary) comparison") in capsys.readouterr().out
    assert _refusal(capsys, ["--arm", "a", *good, "--arm", "b", good[1]]) == (
        f"fedagent compare: {good[1]} (a) and {good[1]} (b) are the same run (summary "
        f"{Path(good[1]).resolve() / 'federated_summary.json'}): give each run once")
    # a run directory and its summary file are one run, with no run id to tell (a summary by hand)
    summary = Path(good[1]) / "federated_summary.json"
    summary.write_text(json.dumps({k: v for k, v in json.loads(summary.read_text()).items() if k != "run_id"}))
    assert "are the same run (summary " in _refusal(capsys, ["--arm", "a", *good, "--arm", "b", str(summary)])
    # an unfinished run with fewer rounds than the window: said so, not an evaluation that recorded nothing
    early = _run(tmp_path / "early", [0.1, 0.2], total_rounds=10, status=None)
    assert _refusal(capsys, ["--arm", "a", *good, "--arm", "b", str(early), "--allow-unfinished"]) == (
        f"fedagent compare: {early} has 1 round(s), fewer than the --window of 3 its window statistic needs: leave "
        "it out, or choose a smaller --window or --statistic final")
    missing = tmp_path / "nowhere"
    assert _refusal(capsys, ["--arm", "a", *good, "--arm", "b", str(missing)]) == (
        f"fedagent compare: {missing} does not exist: check the path")
    missing.mkdir()  # a run directory without its record
    assert _refusal(capsys, ["--arm", "a", *good, "--arm", "b", str(missing)]) == (
        f"fedagent compare: {missing}/federated_summary.json does not exist: the run wrote no record; give a run "
        "directory holding federated_summary.json")
    (missing / "federated_summary.json").write_text("{}")  # found: it says what is wrong itself, once
    assert _refusal(capsys, ["--arm", "a", *good, "--arm", "b", str(missing)]).count("give") == 1
    assert "named twice" in _refusal(capsys, ["--arm", "a", *good, "--arm", "a", *good])
    assert _refusal(capsys, ["--arm", "a", *good]) == (
        "fedagent compare: 1 arm given: compare needs two or more --arm NAME DIR [DIR ...]")
    assert _refusal(capsys, ["--arm", "a", "--arm", "b", *good]) == (
        "fedagent compare: arm a has no run directories: --arm a DIR [DIR ...]")


def test_the_command_prints_the_tables_and_writes_the_same_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fed, loc = _arm(tmp_path, "federated", FEDERATED), _arm(tmp_path, "local", LOCAL)
    out = tmp_path / "cmp.json"
    assert cli.main(["compare", "--arm", f"federated={fed[0]}", *map(str, fed[1:]), "--arm", "local", *map(str, loc),
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert markdown(saved) == text
    assert saved["pairs"][0]["ci95"] == pytest.approx([0.0240, 0.2710], abs=1e-3)
    assert [r["seed"] for r in saved["runs"]] == [4, 5, 6, 7, 8, 9] * 2
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically: no temporary left beside it
    assert "| arm | run | seed | status | rounds 8–10 | round 10 | 95% Wilson (round 10) | n episodes |" in text
    assert "| local − " not in text and "| federated − local |" in text
    assert cli.main(["--help"]) == 0 and "  compare  " in capsys.readouterr().out


def test_a_json_file_that_cannot_be_written_is_refused_before_anything_is_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not the tables, then a traceback or an errno about a temporary name: one line naming the file and
    what to do, exit 2, nothing printed or left behind. A missing directory is made, as before."""
    a, b = _arm(tmp_path, "a", [0.3, 0.4]), _arm(tmp_path, "b", [0.1])
    argv = ["--arm", "a", *map(str, a), "--arm", "b", *map(str, b)]
    (tmp_path / "afile").write_text("not a directory")
    for where, why in ((tmp_path / "afile" / "cmp.json", f"{tmp_path / 'afile'} is not a directory"),
                       (tmp_path / "afile" / "sub" / "cmp.json", f"{tmp_path / 'afile'} is not a directory"),
                       (tmp_path, "it is a directory")):
        assert _refusal(capsys, [*argv, "--json", str(where)]) == (
            f"fedagent compare: cannot write --json {where}: {why}; name a file in a directory you can write "
            "(missing directories are made)")
    assert not list(tmp_path.glob(".*"))  # no temporary left beside the directory given as FILE
    made = tmp_path / "new" / "dir" / "cmp.json"
    assert cli.main(["compare", *argv, "--json", str(made)]) == 0
    assert markdown(json.loads(made.read_text())) == capsys.readouterr().out


def test_an_arm_that_mixes_configs_or_repeats_a_seed_is_named(tmp_path: Path) -> None:
    """Not refused (a repeated seed is another draw of GPU run-to-run spread), but said under the tables."""
    a = [_run(tmp_path / "a1", [0.0, 0.3, 0.3, 0.3], seed=1),
         _run(tmp_path / "a2", [0.0, 0.4, 0.4, 0.4], seed=1, mode="local")]
    b = _arm(tmp_path, "b", [0.1, 0.2], rounds=3)
    notes = compare({"a": a, "b": b})["notes"]
    assert notes == ["arm a has more than one run of seed(s) [1]: each counts as a run",
                     "arm a mixes runs of different configs (env mode strategy): tinyguess federated fedavg; "
                     "tinyguess local fedavg"]


def _paired_arms(root: Path, federated: list[float], local: list[float], seeds: list[int] | None = None,
                 local_seeds: list[int] | None = None) -> tuple[list[Path], list[Path]]:
    """Two arms of 10-round runs whose last 3 rounds score the seed's value (as :func:`_arm`), with their
    seeds given (default 4, 5, ...)."""
    seeds = seeds or list(range(4, 4 + len(federated)))
    local_seeds = local_seeds or seeds
    return ([_run(root / f"federated-s{s}", [0.0625] * 8 + [w] * 3, seed=s) for s, w in zip(seeds, federated)],
            [_run(root / f"local-s{s}", [0.0625] * 8 + [w] * 3, seed=s, mode="local")
             for s, w in zip(local_seeds, local)])


def test_paired_rows_give_the_within_seed_difference_with_its_t_interval(tmp_path: Path) -> None:
    """Local's seeds spread widely (a session's luck) and federated is each seed's local + 0.10, 0.12, 0.14:
    Welch over runs shows nothing (the luck is spread), the paired rows show federated ahead. By hand:
    differences 0.10, 0.12, 0.14, mean 0.12, sd 0.02, t_{0.975, 2} 4.303 × 0.02 / √3 = 0.0497:
    [+0.0703, +0.1697]. The Welch rows stay as they are."""
    fed, loc = _paired_arms(tmp_path, [0.30, 0.62, 0.44], [0.20, 0.50, 0.30])
    report = compare({"federated": fed, "local": loc}, paired_by_seed=True)
    assert compare({"federated": fed, "local": loc})["pairs"] == report["pairs"]
    assert report["pairs"][0]["reading"] == "no difference shown at 3 runs an arm"
    window, final = report["paired"]
    assert [window["statistic"], final["statistic"]] == ["window", "final"]
    assert window["arms"] == ["federated", "local"] and window["paired_by"] == "seed"
    assert window["seeds"] == [4, 5, 6] and window["n_pairs"] == 3
    assert window["per_seed"] == pytest.approx([0.10, 0.12, 0.14])
    assert (window["mean"], window["sd"]) == pytest.approx((0.12, 0.02))
    assert window["ci95"] == pytest.approx([0.0703, 0.1697], abs=1e-4)
    assert window["reading"] == "federated ahead within seeds"
    assert window["only_in"] == {"federated": [], "local": []} and window["without_value"] == []
    assert final["ci95"] == window["ci95"]  # these runs' last round is their window's value
    text = markdown(report)
    assert ("rounds 8–10 (primary), paired within seed: A − B of the two runs of each seed (matched by base_seed), "
            "mean over seeds with the 95% t-interval (n − 1 degrees of freedom):") in text
    assert ("| federated − local | 3 | 4: +0.100, 5: +0.120, 6: +0.140 | +0.120 | 0.020 | [+0.070, +0.170] | "
            "federated ahead within seeds |") in text
    assert "round 10 (secondary), paired within seed:" in text
    assert "paired within seed" not in markdown(compare({"federated": fed, "local": loc}))


def test_seeds_in_one_arm_only_are_named_and_left_out_of_the_pairing(tmp_path: Path) -> None:
    """Seeds 4 and 5 in both arms, 6 in federated only, 7 in local only: two pairs, t_{0.975, 1} = 12.706:
    differences 0.1 and 0.2, mean 0.15, sd 0.0707, half 12.706 × 0.0707 / √2 = 0.6353."""
    fed, loc = _paired_arms(tmp_path, [0.4, 0.5, 0.9], [0.3, 0.3, 0.1], seeds=[4, 5, 6], local_seeds=[4, 5, 7])
    report = compare({"federated": fed, "local": loc}, paired_by_seed=True)
    window = report["paired"][0]
    assert window["seeds"] == [4, 5] and window["per_seed"] == pytest.approx([0.1, 0.2])
    assert window["ci95"] == pytest.approx([0.15 - 0.6353, 0.15 + 0.6353], abs=1e-4)
    assert window["reading"] == "no difference shown at 2 paired seeds"
    assert window["only_in"] == {"federated": [6], "local": [7]}
    assert report["notes"].count("paired federated − local: seed(s) with a run in one arm only, left out of the "
                                 "pairing: [6] in federated only; [7] in local only") == 1
    # one seed paired: no interval, said so, as the Welch rows say it
    one = compare({"federated": fed[:1], "local": loc[:1]}, paired_by_seed=True)["paired"][0]
    assert (one["n_pairs"], one["mean"], one["sd"], one["ci95"]) == (1, pytest.approx(0.1), None, None)
    assert one["reading"] == "no interval over seeds: needs 2 or more paired seeds (here 1)"
    # a seed whose run lacks the secondary value is left out of that pairing only, and named
    gap = _run(tmp_path / "gap", [0.1] * 9 + [None, 0.5], seed=4, mode="local")  # round 9 recorded nothing
    found = compare({"federated": fed, "local": [gap, *loc[1:]]}, statistic="final", paired_by_seed=True)
    final, window = found["paired"]
    assert (final["seeds"], window["seeds"], window["without_value"]) == ([4, 5], [5], [4])
    assert ("paired federated − local: seed(s) [4] lack a window value in one arm: left out of the paired window "
            "comparison") in found["notes"]


def test_paired_refuses_a_seed_run_twice_in_an_arm_or_a_run_without_a_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fed, loc = _paired_arms(tmp_path, [0.4, 0.5], [0.3, 0.35])
    again = _run(tmp_path / "federated-s4-again", [0.0625] * 8 + [0.6] * 3, seed=4)
    argv = ["--arm", "federated", *map(str, fed), str(again), "--arm", "local", *map(str, loc)]
    assert _refusal(capsys, ["--paired", *argv]) == (
        f"fedagent compare: --paired: arm federated has 2 runs of seed 4 ({fed[0]}, {again}): a seed pairs one run "
        "an arm; give one of them, or compare without --paired")
    assert cli.main(["compare", *argv]) == 0  # without --paired a repeated seed is a note, as before
    capsys.readouterr()
    summary = Path(loc[1]) / "federated_summary.json"
    summary.write_text(json.dumps({k: v for k, v in json.loads(summary.read_text()).items() if k != "base_seed"}))
    assert _refusal(capsys, ["--paired", "--arm", "federated", *map(str, fed), "--arm", "local", *map(str, loc)]) == (
        f"fedagent compare: {loc[1]} (local) has no base_seed in its summary: --paired matches runs by seed; leave "
        "it out, or compare without --paired")


def test_the_command_prints_the_paired_rows_and_writes_them_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fed, loc = _paired_arms(tmp_path, [0.30, 0.62, 0.44], [0.20, 0.50, 0.30])
    out = tmp_path / "cmp.json"
    assert cli.main(["compare", "--paired", "--arm", "federated", *map(str, fed), "--arm", "local", *map(str, loc),
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert markdown(saved) == text
    assert [row["statistic"] for row in saved["paired"]] == ["window", "final"]
    assert saved["paired"][0]["ci95"] == pytest.approx([0.0703, 0.1697], abs=1e-4)
    assert ("| A − B (paired) | seeds paired | A − B per seed | mean | sd | 95% over seeds (paired t) | reading |"
            in text)
    assert text.index("with Welch's 95% interval over runs") < text.index("paired within seed")
    assert "--paired" in _help(capsys)


def _help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    return capsys.readouterr().out


def test_a_paired_seed_whose_run_is_unfinished_is_marked(tmp_path: Path) -> None:
    """With --allow-unfinished, a seed whose local run stopped at round 5 of 10 pairs its rounds 3-5 with
    federated's rounds 8-10: its per-seed difference is marked, as the Welch rows mark such an arm, and
    the mark is explained; the finished seeds are not marked."""
    fed, loc = _paired_arms(tmp_path, [0.30, 0.62], [0.20, 0.50])
    running = _run(tmp_path / "local-s6", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], seed=6, total_rounds=10, status=None,
                   mode="local")
    fed.append(_run(tmp_path / "federated-s6", [0.0625] * 8 + [0.7] * 3, seed=6))
    text = markdown(compare({"federated": fed, "local": [*loc, running]}, paired_by_seed=True, allow_unfinished=True))
    assert "| federated − local | 3 | 4: +0.100, 5: +0.120, 6†: +0.200 |" in text
    assert ("† a seed whose run in one of the arms is unfinished: its difference covers the rounds that run has "
            "(named in its row of the runs table), not the headings' rounds.") in text
    assert "†" not in markdown(compare({"federated": fed[:2], "local": loc}, paired_by_seed=True))


def test_a_paired_seed_whose_runs_started_from_different_models_is_named(tmp_path: Path) -> None:
    """--paired assumes both runs of a seed shared one start (one session's warm start): where their
    summaries record different starting models, a note names the seed; runs of one start, or without
    the hash, give none."""
    fed = [_run(tmp_path / f"federated-s{s}", [0.0625] * 8 + [w] * 3, seed=s, start=h)
           for s, w, h in ((4, 0.4, "aa" * 32), (5, 0.5, "bb" * 32), (6, 0.6, None))]
    loc = [_run(tmp_path / f"local-s{s}", [0.0625] * 8 + [w] * 3, seed=s, mode="local", start=h)
           for s, w, h in ((4, 0.3, "aa" * 32), (5, 0.4, "cc" * 32), (6, 0.5, "dd" * 32))]
    notes = compare({"federated": fed, "local": loc}, paired_by_seed=True)["notes"]
    assert [note for note in notes if "started from different models" in note] == [
        "paired federated − local: the runs of seed(s) [5] started from different models (their summaries' "
        "base_model_sha256 differ): the pairing assumes one shared start, which they do not have, so their "
        "differences keep that start's luck"]
    unpaired = compare({"federated": fed, "local": loc})["notes"]
    assert not any("started from different models" in note for note in unpaired)
