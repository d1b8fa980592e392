"""tools/gpu/arms.py dynamics: each committed run's take-off round and training dynamics, one row a run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedagent_flwr.serverapp.recorder import RunRecorder
from testkit.gpu_tools import gpu_tool

REPO = Path(__file__).resolve().parents[3]


def _arms_module():  # noqa: ANN202 - tools/gpu/arms.py
    return gpu_tool("arms")


def test_dynamics_of_the_committed_declared_runs(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """The rows of the centralized spread analysis (docs/gpu-runs/2026-12-04/centralized-spread.md
    §3.2) by command: centralized s6 took off at round 5 by reply length and round 7 by entropy, with
    the rounds 8-10 window 0.661; s7 never did; federated s4's round 9 had client 0 alone, so its
    max grad norm (1.66) is that client's, and the run is named under the table."""
    arms = _arms_module()
    out = tmp_path / "dynamics"
    assert arms.main(["dynamics", "--from", str(REPO / "docs" / "gpu-runs"), "--out", str(out),
                      "--arms", "centralized", "federated", "--min-seed", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed == (out / "dynamics.md").read_text()
    assert ("| centralized s6 | 0.661 | 0.719 | 0.609 | 2.34 → 0.17 | 53 → 21 | 0.26 / 0.47 | 3.48 | 0.258 "
            "| 5 / 7 |") in printed
    assert ("| centralized s7 | 0.208 | 0.219 | 0.212 | 2.84 → 2.31 | 142 → 138 | 0.11 / 0.16 | 0.58 | 0.260 "
            "| – / – |") in printed
    assert ("| federated s4 | 0.531 | 0.578 | 0.538 | 2.14 → 0.34 | 75 → 36 | 0.10 / 0.27 | 1.66 | 0.204 "
            "| 7 / 7 |") in printed
    assert "| federated s9 | 0.401 | 0.484 | 0.330 | 2.41 → 1.24 | 111 → 33 |" in printed
    # centralized s4-s9 (s9 from batch 17 took off at 5 / 8): three of six, length median 5, entropy median 7
    assert "- centralized: by reply length 3 of 6 (median round 5); by entropy 3 of 6 (median round 7)" in printed
    assert "- federated: by reply length 5 of 6 (median round 9); by entropy 5 of 6 (median round 9)" in printed
    assert "Runs that did not run as planned (their rows include these rounds): federated-s4 (round 9" in printed
    assert "No metrics file" not in printed
    data = json.loads((out / "dynamics.json").read_text())
    names = [row["name"] for row in data["runs"]]
    assert names == [f"centralized-s{s}" for s in range(4, 10)] + [f"federated-s{s}" for s in range(4, 10)]
    s6 = data["runs"][names.index("centralized-s6")]
    assert s6["val_window"] == 0.6615  # compare.window_mean, as `pool` reports it
    assert (s6["takeoff_length"], s6["takeoff_entropy"]) == (5, 7)
    assert s6["per_round"]["length"]["5"] == pytest.approx(53.3, abs=0.1)
    assert data["runs"][names.index("centralized-s7")]["takeoff_length"] is None
    assert data["per_arm"]["centralized"] == {"runs": 6, "with_metrics": 6, "took_off_length": 3,
                                              "median_takeoff_length": 5, "took_off_entropy": 3,
                                              "median_takeoff_entropy": 7}
    # a used folder is refused, as pool's is
    assert arms.main(["dynamics", "--from", str(REPO / "docs" / "gpu-runs"), "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err


def _committed_run(source: Path, name: str, lengths: list[float], with_metrics: bool, *,
                   clients: int = 1, planned: bool = True, no_train_in: int | None = None,
                   lost_in: int | None = None) -> None:
    """A 5-round run recorded by the real RunRecorder and committed under ``source`` as the dated
    folders hold them (``recipe10r-<name>-summary.json``; ``metrics/recipe10r-<name>.jsonl`` only
    ``with_metrics``). Client 0's training reply length per round from ``lengths``, entropy 2.0
    falling by 0.3 a round; each further client ``c`` (``clients``) has 20 tokens and 0.4 entropy more
    per ``c``. ``planned=False``: the header has no ``total_rounds`` (a summary without a planned
    total). ``no_train_in``: that round aggregated but no client's train event was recorded (a round
    missing from the metrics file). ``lost_in``: in that round the last client failed (the round is
    recorded as having trained without it, as batch 12's federated seed 4 lost client 1 in round 9)."""
    header = {"base_model": "/m", "env_kind": "tinyguess", "mode": "local" if clients == 1 else "federated"}
    if planned:
        header["total_rounds"] = 5
    recorder = RunRecorder(source.parent / "records" / name, header)
    recorder.record_eval(server_round=0, model="/m", metrics={"num-examples": 64, "success-rate": 0.0625})
    for r, length in enumerate(lengths, start=1):
        present = list(range(clients - 1)) if r == lost_in else list(range(clients))
        client_metrics = {c: {"num-examples": 512, "success-rate": 0.1 * r, "zero-variance-group-share": 0.05 * r,
                              "verl.actor.entropy": 2.0 - 0.3 * r + 0.4 * c, "verl.actor.grad_norm": 0.5 + 0.1 * r,
                              "verl.response_length.mean": length + 20 * c}
                          for c in present}
        recorder.record_round(server_round=r, clients=list(range(clients)), started_from="/m",
                              client_actors={c: f"/c{c}r{r}" for c in present}, aggregated=f"/g{r}",
                              rejected={} if r != lost_in else {clients - 1: "failed: out of memory"},
                              client_metrics={} if r == no_train_in else client_metrics,
                              update_stats={"mean_update_norm": 0.25 + 0.01 * r, "client_update_norm": [0.25]})
        recorder.record_eval(server_round=r, model=f"/g{r}", metrics={"num-examples": 64, "success-rate": 0.125 * r})
    recorder.finish()
    day = source / "2026-12-09"
    (day / "metrics").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(recorder.summary_path, day / f"recipe10r-{name}-summary.json")
    if with_metrics:
        shutil.copyfile(recorder.run_dir / "metrics.jsonl", day / "metrics" / f"recipe10r-{name}.jsonl")


def test_a_run_without_a_metrics_file_keeps_its_summary_columns(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    arms = _arms_module()
    source = tmp_path / "gpu-runs"
    _committed_run(source, "local-s4", [120, 100, 58, 40, 30], with_metrics=True)
    _committed_run(source, "local-s5", [120, 100, 58, 40, 30], with_metrics=False)
    out = tmp_path / "dynamics"
    assert arms.main(["dynamics", "--from", str(source), "--out", str(out), "--arms", "local"]) == 0
    printed = capsys.readouterr().out
    # window: rounds 3-5, (0.375 + 0.5 + 0.625) / 3; update norm: mean of 0.26 .. 0.30
    # take-off: length 58 < 60 at round 3; entropy 2.0 - 0.6 = 1.4 < 1.5 at round 2 (1.7 at round 1)
    assert ("| local s4 | 0.500 | 0.625 | 0.400 | 0.50 → 0.50 | 30 → 30 | 0.20 / 0.25 | 1.00 | 0.280 "
            "| 3 / 2 |") in printed
    assert "| local s5 | 0.500 | 0.625 |  |  |  |  |  | 0.280 |  |" in printed
    assert "- local: by reply length 1 of 1 (median round 3); by entropy 1 of 1 (median round 2)" in printed
    assert "No metrics file committed beside these runs' summaries" in printed
    assert "local-s5 (" + str(source / "2026-12-09" / "recipe10r-local-s5-summary.json") + ")" in printed
    data = json.loads((out / "dynamics.json").read_text())
    assert data["without_metrics"] == ["local-s5"]
    s5 = data["runs"][1]
    assert s5["metrics"] is None and s5["takeoff_length"] is None and s5["mean_update_norm"] == pytest.approx(0.28)


def test_a_round_missing_from_the_metrics_file_empties_its_window_and_is_named(tmp_path: Path,
                                                                             capsys) -> None:  # noqa: ANN001
    """Round 4 of 5 aggregated but left no train event: the rounds 3-5 training window has two of its
    three rounds, so its train success, zero-variance mean and zero-variance maximum are all empty
    (the maximum used to be taken over the two present), and the note under the table names the
    round. The summary's columns (validation, update norm) still come from the summary."""
    arms = _arms_module()
    source = tmp_path / "gpu-runs"
    _committed_run(source, "local-s4", [120, 100, 58, 40, 30], with_metrics=True, no_train_in=4)
    out = tmp_path / "dynamics"
    assert arms.main(["dynamics", "--from", str(source), "--out", str(out), "--arms", "local"]) == 0
    printed = capsys.readouterr().out
    # entropy/length r5 are there (round 5 trained); take-offs from the rounds present: 58 at r3, 1.4 at r2
    assert "| local s4 | 0.500 | 0.625 |  | 0.50 → 0.50 | 30 → 30 |  | 1.00 | 0.280 | 3 / 2 |" in printed
    assert ("Rounds without a train event in the run's metrics file (a window that needs one is left empty; "
            "take-offs are read from the rounds present): local-s4 (round 4)") in printed
    row = json.loads((out / "dynamics.json").read_text())["runs"][0]
    assert row["train_window"] is None
    assert row["zero_variance_window_mean"] is None and row["zero_variance_window_max"] is None
    assert "4" not in row["per_round"]["length"] and row["per_round"]["length"]["5"] == 30


def test_a_round_that_lost_a_client_averages_the_clients_present(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Two clients, client 1 lost in round 4: that round's training means are client 0's alone (reply
    length 58, below the take-off threshold; with client 1's 78 it would have been 68, and the
    take-off round 5), the other rounds are both clients' means, and the run is named under the
    table with the round and the client."""
    arms = _arms_module()
    source = tmp_path / "gpu-runs"
    _committed_run(source, "federated-s4", [120, 100, 80, 58, 30], with_metrics=True, clients=2, lost_in=4)
    out = tmp_path / "dynamics"
    assert arms.main(["dynamics", "--from", str(source), "--out", str(out), "--arms", "federated"]) == 0
    printed = capsys.readouterr().out
    row = json.loads((out / "dynamics.json").read_text())["runs"][0]
    assert row["per_round"]["length"] == {"1": 130, "2": 110, "3": 90, "4": 58, "5": 40}
    # entropy: clients 2.0 - 0.3 r and 2.4 - 0.3 r, mean 2.2 - 0.3 r (1.3 at round 3, the first below
    # 1.5); round 4 is client 0's 0.8 alone (the mean of both would be 1.0)
    assert row["per_round"]["entropy"]["4"] == pytest.approx(0.8)
    assert row["per_round"]["entropy"]["3"] == pytest.approx(1.3)
    assert (row["takeoff_length"], row["takeoff_entropy"]) == (4, 3)
    assert ("| federated s4 | 0.500 | 0.625 | 0.400 | 0.70 → 0.70 | 40 → 40 | 0.20 / 0.25 | 1.00 | 0.280 "
            "| 4 / 3 |") in printed
    assert ("Runs that did not run as planned (their rows include these rounds): federated-s4 (round 4 trained "
            "without client(s) [1])") in printed
    assert "Rounds without a train event" not in printed  # client 0 trained in round 4


def test_a_summary_without_a_planned_total_has_no_last_round_values(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A summary with no ``total_rounds``: the last round and the window are unknown, so their
    columns are empty (the round-0 base value, 0.0625, used to show as the last round's validation)
    and no take-off is claimed; the header does not name rounds and the note says why."""
    arms = _arms_module()
    source = tmp_path / "gpu-runs"
    _committed_run(source, "local-s4", [120, 100, 58, 40, 30], with_metrics=True, planned=False)
    out = tmp_path / "dynamics"
    assert arms.main(["dynamics", "--from", str(source), "--out", str(out), "--arms", "local"]) == 0
    printed = capsys.readouterr().out
    assert ("| run | val last 3 rounds | val last round | train succ. last 3 rounds | entropy r5 → last round |"
            in printed)
    assert "| local s4 |  |  |  | 0.50 → ? | 30 → ? |  | 1.00 | 0.280 | – / – |" in printed
    assert ("No planned number of rounds (`total_rounds`) in these runs' summaries, so no last-round or window "
            "values and no take-off: local-s4") in printed
    row = json.loads((out / "dynamics.json").read_text())["runs"][0]
    assert row["total_rounds"] == 0
    assert row["val_last"] is None and row["val_window"] is None and row["length_last"] is None


def test_an_out_that_is_a_file_is_refused(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """``--out`` naming a file (or a path inside one) exits 2 with a message, not a traceback."""
    arms = _arms_module()
    source = tmp_path / "gpu-runs"
    _committed_run(source, "local-s4", [120, 100, 58, 40, 30], with_metrics=True)
    taken = tmp_path / "taken.md"
    taken.write_text("someone's notes\n")
    assert arms.main(["dynamics", "--from", str(source), "--out", str(taken), "--arms", "local"]) == 2
    assert f"arms.py dynamics: {taken} is a file, not a folder" in capsys.readouterr().err
    assert arms.main(["dynamics", "--from", str(source), "--out", str(taken / "dyn"), "--arms", "local"]) == 2
    assert f"{taken} is a file, not a folder: give --out a new or empty folder ({taken / 'dyn'}" in (
        capsys.readouterr().err)
    assert taken.read_text() == "someone's notes\n"


def test_a_summary_compare_refuses_or_that_cannot_be_read_is_refused_in_one_line(tmp_path: Path,
                                                                                 capsys) -> None:  # noqa: ANN001
    """A committed summary whose round-4 point lacks its success rate is refused as ``fedagent compare``
    refuses it (its file, round and advice named), and a torn one as unreadable: exit 2, one line each,
    nothing written. Both used to end in a traceback (CompareError, JSONDecodeError)."""
    arms = _arms_module()
    source = tmp_path / "gpu-runs"
    _committed_run(source, "local-s4", [120, 100, 58, 40, 30], with_metrics=True)
    _committed_run(source, "local-s5", [120, 100, 58, 40, 30], with_metrics=False)
    path = source / "2026-12-09" / "recipe10r-local-s5-summary.json"
    summary = json.loads(path.read_text())
    del summary["val_curve"][4]["success_rate"]
    path.write_text(json.dumps(summary))
    out = tmp_path / "dynamics"
    assert arms.main(["dynamics", "--from", str(source), "--out", str(out), "--arms", "local"]) == 2
    printed = capsys.readouterr()
    assert printed.err == (f"arms.py dynamics: {path}: val_curve round 4 has no success_rate (every point the "
                           "recorder writes has one; a round whose evaluation recorded nothing has no point): "
                           "restore the summary as its run wrote it, or leave the run out\n")
    assert printed.out == "" and not out.exists()

    path.write_text(json.dumps(summary)[:40])  # cut off mid-write
    assert arms.main(["dynamics", "--from", str(source), "--out", str(out), "--arms", "local"]) == 2
    printed = capsys.readouterr()
    assert printed.err.startswith(f"arms.py dynamics: {path} cannot be read: JSONDecodeError: ")
    assert printed.err.count("\n") == 1 and printed.out == "" and not out.exists()
