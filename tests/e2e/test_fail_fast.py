"""Fail fast and honestly, in real Flower simulations run the way `make run` runs them
(``python -m fedagent_flwr.outcome run -- flwr run ... --stream``): a run that cannot work stops at
start with one line naming the config key and the fix; a round that every client fails the same way
stops the run, and so do ``max_empty_rounds`` rounds in a row that aggregated nothing; a run with a
round that aggregated nothing ends ``degraded``, one with no round that aggregated anything
``failed``; and the exit status says which."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit.flower_harness import SuperLink

pytestmark = pytest.mark.slow

COMMON = "eval.num_episodes=2 trainer.max_new_tokens=8 trainer.lr=1e-3"
# For the runs whose claims are about the training rounds' failures: no round-0 evaluation of the
# base model (two trainer processes and their episodes that none of those claims reads).
NO_BASE_EVAL = "eval.before_train=false"


def _run(superlink: SuperLink, overrides: str, supernodes: int = 2) -> tuple[int, list[tuple[float, str]], float]:
    """Run a job as `make run` does; return its exit status, its output lines (each with the seconds
    since the start at which it arrived) and the seconds until the command returned."""
    command = [sys.executable, "-m", "fedagent_flwr.outcome", "run", "--", *superlink.command(overrides, supernodes)]
    started = time.monotonic()
    process = subprocess.Popen(command, env=superlink.env, cwd=superlink.env["FEDAGENT_TEST_CWD"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    lines = [(time.monotonic() - started, line.rstrip("\n")) for line in process.stdout]
    returncode = process.wait(timeout=900)
    return returncode, lines, time.monotonic() - started


def _first(lines: list[tuple[float, str]], text: str) -> tuple[float, str]:
    found = [(at, line) for at, line in lines if text in line]
    assert found, f"no line with {text!r} in:\n" + "\n".join(line for _, line in lines[-60:])
    return found[0]


def _summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "job" / "federated_summary.json").read_text())


def test_missing_webshop_data_stops_the_run_at_start_naming_env_data_dir(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The done-when check of issue 13: env=webshop env.data_dir=/nonexistent stops before round 0,
    within a minute, with one line naming env.data_dir and the download command; the summary says
    failed and the exit status is 1 (before: every client's service failed, every round)."""
    returncode, lines, seconds = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} env=webshop "
                   f"env.data_dir=/nonexistent {COMMON}")
    output = "\n".join(line for _, line in lines)
    expected = ("config key 'env.data_dir' = '/nonexistent': WebShop data directory /nonexistent has no "
                "items_shuffle_1000.json; fetch the data with: python -m fedagent_flwr.envs.webshop.download /nonexistent")
    at, line = _first(lines, "[fedagent] cannot start the run:")
    assert line.endswith(f"[fedagent] cannot start the run: {expected}")
    assert [text for _, text in lines].count(line) == 1  # one line, not one per client
    assert "[ROUND 0]" not in output and "configure_evaluate" not in output  # no client was asked anything
    summary = _summary(tmp_path)
    assert (summary["status"], summary["error"]) == ("failed", expected)
    assert returncode == 1, output[-3000:]
    assert lines[-1][1] == f"[fedagent] run failed: {expected} (summary: {tmp_path / 'job' / 'federated_summary.json'})"
    assert at < 60 and seconds < 60, f"failure line after {at:.0f} s, command returned after {seconds:.0f} s"


def test_too_few_supernodes_are_named_within_seconds(superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path) -> None:
    """clients.total=3 on a 2-SuperNode simulation: the hint comes as soon as the ServerApp has looked
    at the nodes (before: after discovery's 600 s timeout)."""
    returncode, lines, _ = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} clients.total=3 "
                   f"clients.per_round=3 num_rounds=1 {COMMON}")
    started, _ = _first(lines, "[fedagent] run directory:")
    at, line = _first(lines, "[fedagent] run failed:")
    expected = ("config key 'clients.total' = 3 needs client partition(s) [2], but this simulation has 2 "
                "SuperNode(s) (partitions 0-1): run with --federation-config 'num-supernodes=3' or set clients.total=2")
    assert line.endswith(expected)
    assert at - started < 20, f"{at - started:.0f} s from the run directory line to the hint"
    assert (_summary(tmp_path)["status"], _summary(tmp_path)["error"]) == ("failed", expected)
    assert returncode == 1
    # The fix the line suggests, in the same run directory: a run that failed before any round is
    # no record to protect, so the corrected config is not refused as "another configuration".
    # (Persistent trainers: one start per node instead of one per job; the trainers are not what
    # this checks, and the other runs here keep subprocess mode.)
    returncode, lines, _ = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} clients.total=2 "
                   f"clients.per_round=2 num_rounds=1 {COMMON} trainer.mode=persistent")
    assert _summary(tmp_path)["status"] == "completed", "\n".join(line for _, line in lines[-60:])
    assert returncode == 0


def test_a_round_every_client_fails_alike_stops_the_run_with_the_clients_error(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Round 1 gives both clients an unknown environment: the run stops after round 1 (before: it
    went on, and ended 'completed'), with the client's own error line as the reason."""
    returncode, lines, _ = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} num_rounds=3 "
                   f"strategy.class_path=testkit.strategies.BreaksEveryClientAlike {COMMON} {NO_BASE_EVAL}")
    output = "\n".join(line for _, line in lines)
    summary = _summary(tmp_path)
    assert summary["status"] == "failed", output[-3000:]
    assert summary["error"].startswith("round 1: every client (2) failed the same way, so the run stops: "
                                       "client 0 round 1: reference trainer exited with code")
    assert "NoSuchEnv" in summary["error"] and "ClientAppException" not in summary["error"]
    assert [entry["round"] for entry in summary["rounds"]] == [1] and summary["last_completed_round"] == 0
    assert "[ROUND 2]" not in output
    # One readable line per failed client from the strategy, not Flower's copy of each Ray traceback.
    assert "Received error in reply" not in output
    assert sum("round 1: client" in line and "failed: client" in line for _, line in lines) == 2
    assert len(lines) < 400, f"{len(lines)} lines of output"
    assert returncode == 1


def test_a_round_that_aggregated_nothing_makes_the_run_degraded(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Round 1's clients fail for two different reasons, round 2 trains: the run ends 'degraded'
    (before: 'completed') and the exit status is 3."""
    returncode, lines, _ = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} num_rounds=2 "
                   f"strategy.class_path=testkit.strategies.BreaksEveryClientDifferently {COMMON} {NO_BASE_EVAL}")
    output = "\n".join(line for _, line in lines)
    summary = _summary(tmp_path)
    assert summary["status"] == "degraded", output[-3000:]
    first, second = summary["rounds"]
    assert first["aggregated_actor"] is None and second["aggregated_actor"] is not None
    assert "NoSuchEnv" in first["rejected"]["0"] and "NoSuchEnv" not in first["rejected"]["1"]
    assert summary["warning"].startswith("round(s) [1] aggregated no client checkpoint and kept the previous global model")
    assert returncode == 3
    assert lines[-1][1].startswith("[fedagent] run degraded: round(s) [1]")


def test_rounds_that_aggregate_nothing_for_different_reasons_stop_the_run_after_max_empty_rounds(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Every round's clients fail, for two different reasons (so no round stops the run by itself):
    with the default max_empty_rounds=2 the run stops after round 2 of 3, failed (before: it ran every
    round, trained nothing and ended 'degraded')."""
    returncode, lines, _ = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} num_rounds=3 "
                   f"strategy.class_path=testkit.strategies.BreaksEveryRoundDifferently {COMMON} {NO_BASE_EVAL}")
    output = "\n".join(line for _, line in lines)
    summary = _summary(tmp_path)
    assert summary["status"] == "failed", output[-3000:]
    assert summary["error"].startswith("round(s) [1, 2] aggregated no client update, 2 in a row (max_empty_rounds=2), "
                                       "so the run stops instead of training nothing; round 2: client 0: ")
    assert "NoSuchEnv" in summary["error"]
    assert [entry["round"] for entry in summary["rounds"]] == [1, 2] and "[ROUND 3]" not in output
    assert returncode == 1
    assert lines[-1][1].startswith("[fedagent] run failed: round(s) [1, 2] aggregated no client update")


def test_a_run_whose_every_round_aggregated_nothing_failed(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """One round, both clients failing for different reasons: the run ran its rounds but trained
    nothing, so it ends 'failed' (before: 'degraded'), naming the last round's client failures."""
    returncode, lines, _ = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} num_rounds=1 "
                   f"strategy.class_path=testkit.strategies.BreaksEveryClientDifferently {COMMON} {NO_BASE_EVAL}")
    output = "\n".join(line for _, line in lines)
    summary = _summary(tmp_path)
    assert summary["status"] == "failed", output[-3000:]
    assert summary["error"].startswith("no round aggregated any client update (round(s) [1]): the run trained nothing "
                                       "and its final model is the one it started from (last round, 1: client 0: ")
    assert summary["last_completed_round"] == 1  # every round ran; a re-run has nothing left to redo
    assert returncode == 1
    assert lines[-1][1].startswith("[fedagent] run failed: no round aggregated any client update")
