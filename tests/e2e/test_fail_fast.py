"""Fail fast and honestly, in real Flower simulations run the way `make run` runs them
(``python -m fedagent_flwr.outcome run -- flwr run ... --stream``): a run that cannot work stops at
start with one line naming the config key and the fix; a round that every client fails the same way
stops the run, and so do ``max_empty_rounds`` rounds in a row that aggregated nothing; a run with a
round that aggregated nothing ends ``degraded``, one with no round that aggregated anything
``failed``, one in which no round had a learning signal ``degraded``; and the exit status says which."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.flower_harness import SuperLink
from testkit.run_end import NO_SIGNAL, expected_end, ran_every_round

pytestmark = pytest.mark.slow

COMMON = "eval.num_episodes=2 trainer.max_new_tokens=8 trainer.lr=1e-3"
# For the runs whose claims are about the training rounds' failures: no evaluation, neither the base
# model's at round 0 nor the global model's after each round (two trainer processes an evaluation,
# each ~4.5 s of CPU in subprocess mode, and episodes that none of those claims reads).
NO_EVAL = "eval.enabled=false"


# A hang guard, not a bound on speed: a run that never ends fails here instead of at the suite's timeout.
HANG_GUARD_S = 900
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _run(superlink: SuperLink, overrides: str, supernodes: int = 2) -> tuple[int, list[str]]:
    """Run a job as `make run` does; return its exit status and its output lines."""
    command = [sys.executable, "-m", "fedagent_flwr.outcome", "run", "--", *superlink.command(overrides, supernodes)]
    process = subprocess.Popen(command, env=superlink.env, cwd=superlink.env["FEDAGENT_TEST_CWD"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"the run did not end within {HANG_GUARD_S} s:\n{output[-3000:]}")
    return process.returncode, output.splitlines()


def _first(lines: list[str], text: str) -> tuple[int, str]:
    """The index and text of the first line of ``lines`` that holds ``text``."""
    found = [(index, line) for index, line in enumerate(lines) if text in line]
    assert found, f"no line with {text!r} in:\n" + "\n".join(lines[-60:])
    return found[0]


def _ours(lines: list[str]) -> list[str]:
    """What the ServerApp and the outcome wrapper said (``[fedagent] ...`` lines), in order."""
    return [_ANSI.sub("", line).split("[fedagent] ", 1)[1] for line in lines if "[fedagent] " in line]


def _summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "job" / "federated_summary.json").read_text())


def test_missing_webshop_data_stops_the_run_at_start_naming_env_data_dir(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The done-when check of issue 13: env=webshop env.data_dir=/nonexistent stops before round 0,
    with one line naming env.data_dir and the download command, said right after the run directory
    (nothing was built, asked or waited for first); the summary says failed and the exit status is
    1 (before: every client's service failed, every round). That the command then returns without
    waiting for Flower to wind the simulation down is tests/test_outcome.py's."""
    returncode, lines = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} env=webshop "
                   f"env.data_dir=/nonexistent {COMMON}")
    output = "\n".join(lines)
    expected = ("config key 'env.data_dir' = '/nonexistent': WebShop data directory /nonexistent has no "
                "items_shuffle_1000.json; fetch the data with: "
                "python -m fedagent_flwr.envs.webshop.download /nonexistent")
    _, line = _first(lines, "[fedagent] cannot start the run:")
    assert line.endswith(f"[fedagent] cannot start the run: {expected}")
    assert lines.count(line) == 1  # one line, not one per client
    assert "[ROUND 0]" not in output and "configure_evaluate" not in output  # no client was asked anything
    summary = _summary(tmp_path)
    assert (summary["status"], summary["error"]) == ("failed", expected)
    assert returncode == 1, output[-3000:]
    final = f"run failed: {expected} (summary: {tmp_path / 'job' / 'federated_summary.json'})"
    assert lines[-1] == f"[fedagent] {final}"
    # The refusal is the ServerApp's next word after naming the run directory: no strategy was built
    # ("federated run: ..."), no node was looked for; then only the outcome (the wrapper may first
    # say that it stopped following the log of a simulation Flower is still winding down).
    ours = _ours(lines)
    assert ours[:2] == [f"run directory: {tmp_path / 'job'}", f"cannot start the run: {expected}"], ours
    assert [text.split(";")[0] for text in ours[2:-1]] in ([], ["the run has ended"]) and ours[-1] == final, ours
    assert "Starting FedAvgFSDP strategy" not in output


def test_a_checkpoint_store_that_cannot_start_is_named_alike_in_the_log_and_the_summary(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """storage.kind=http on a port another process listens on: the run fails before round 0, and
    the log's line says what the summary says (the log used to leave out "cannot start the
    checkpoint store", so it named a port clash without saying what wanted the port)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        returncode, lines = _run(
            superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} num_rounds=1 "
                       f"storage.kind=http storage.port={port} {COMMON}")
    summary = _summary(tmp_path)
    assert summary["status"] == "failed" and summary["error"].startswith("cannot start the checkpoint store: ")
    assert summary["error"] == (
        f"cannot start the checkpoint store: config keys 'storage.host' = '127.0.0.1' and 'storage.port' = {port}: "
        f"cannot listen on 127.0.0.1:{port} (Address already in use); choose a free port (0 picks one, when the "
        "clients run on this machine) or an address of this machine")
    _, line = _first(lines, "[fedagent] cannot start the run:")
    assert line.endswith(f"[fedagent] cannot start the run: {summary['error']}"), line
    assert "[ROUND 0]" not in "\n".join(lines)
    assert returncode == 1


def test_too_few_supernodes_are_named_without_waiting_for_them(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """clients.total=3 on a 2-SuperNode simulation: the hint comes as soon as the ServerApp has looked
    at the nodes, before round 0 (before: after discovery's 600 s timeout, which waits saying
    "Waiting for client partitions [2] to connect" every second)."""
    returncode, lines = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} clients.total=3 "
                   f"clients.per_round=3 num_rounds=1 {COMMON}")
    output = "\n".join(lines)
    at, line = _first(lines, "[fedagent] run failed:")
    expected = ("config key 'clients.total' = 3 needs client partition(s) [2], but this simulation has 2 "
                "SuperNode(s) (partitions 0-1): run with --federation-config 'num-supernodes=3' or set clients.total=2")
    assert line.endswith(expected)
    waited = [text for text in lines[:at] if "Waiting for client partitions" in text]
    assert not waited, f"discovery waited for the partition before naming it: {waited[:3]}"
    assert "[ROUND 0]" not in output and "configure_evaluate" not in output  # no client was asked anything
    assert (_summary(tmp_path)["status"], _summary(tmp_path)["error"]) == ("failed", expected)
    assert returncode == 1
    # The fix the line suggests, in the same run directory: a run that failed before any round is
    # no record to protect, so the corrected config is not refused as "another configuration".
    # (Persistent trainers, one start per node instead of one per job, and no evaluation: neither
    # is what this checks, and the runs here whose clients fail keep subprocess mode.)
    returncode, lines = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} clients.total=2 "
                   f"clients.per_round=2 num_rounds=1 {COMMON} trainer.mode=persistent {NO_EVAL}")
    assert ran_every_round(_summary(tmp_path)), "\n".join(lines[-60:])
    assert returncode == expected_end(_summary(tmp_path))[1]


def test_a_round_every_client_fails_alike_stops_the_run_with_the_clients_error(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Round 1 gives both clients an unknown environment: the run stops after round 1 (before: it
    went on, and ended 'completed'), with the client's own error line as the reason."""
    returncode, lines = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} num_rounds=3 "
                   f"strategy.class_path=testkit.strategies.BreaksEveryClientAlike {COMMON} {NO_EVAL}")
    output = "\n".join(lines)
    summary = _summary(tmp_path)
    assert summary["status"] == "failed", output[-3000:]
    assert summary["error"].startswith("round 1: every client (2) failed the same way, so the run stops: "
                                       "client 0 round 1: reference trainer exited with code")
    assert "NoSuchEnv" in summary["error"] and "ClientAppException" not in summary["error"]
    assert [entry["round"] for entry in summary["rounds"]] == [1] and summary["last_completed_round"] == 0
    assert "[ROUND 2]" not in output
    # One readable line per failed client from the strategy, not Flower's copy of each Ray traceback.
    assert "Received error in reply" not in output
    assert sum("round 1: client" in line and "failed: client" in line for line in lines) == 2
    assert len(lines) < 400, f"{len(lines)} lines of output"
    assert returncode == 1


def test_a_round_that_aggregated_nothing_makes_the_run_degraded(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Round 1's clients fail for two different reasons, round 2 trains: the run ends 'degraded'
    (before: 'completed') and the exit status is 3."""
    returncode, lines = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} num_rounds=2 "
                   f"strategy.class_path=testkit.strategies.BreaksEveryClientDifferently {COMMON} {NO_EVAL}")
    output = "\n".join(lines)
    summary = _summary(tmp_path)
    assert summary["status"] == "degraded", output[-3000:]
    first, second = summary["rounds"]
    assert first["aggregated_actor"] is None and second["aggregated_actor"] is not None
    assert "NoSuchEnv" in first["rejected"]["0"] and "NoSuchEnv" not in first["rejected"]["1"]
    assert summary["warning"].startswith(
        "round(s) [1] aggregated no client checkpoint and kept the previous global model")
    assert returncode == 3
    assert lines[-1].startswith("[fedagent] run degraded: round(s) [1]")


def test_rounds_that_aggregate_nothing_for_different_reasons_stop_the_run_after_max_empty_rounds(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Every round's clients fail, for two different reasons (so no round stops the run by itself):
    with the default max_empty_rounds=2 the run stops after round 2 of 3, failed (before: it ran every
    round, trained nothing and ended 'degraded')."""
    returncode, lines = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} num_rounds=3 "
                   f"strategy.class_path=testkit.strategies.BreaksEveryRoundDifferently {COMMON} {NO_EVAL}")
    output = "\n".join(lines)
    summary = _summary(tmp_path)
    assert summary["status"] == "failed", output[-3000:]
    assert summary["error"].startswith("round(s) [1, 2] aggregated no client update, 2 in a row (max_empty_rounds=2), "
                                       "so the run stops instead of training nothing; round 2: client 0: ")
    assert "NoSuchEnv" in summary["error"]
    assert [entry["round"] for entry in summary["rounds"]] == [1, 2] and "[ROUND 3]" not in output
    assert returncode == 1
    assert lines[-1].startswith("[fedagent] run failed: round(s) [1, 2] aggregated no client update")


def test_a_run_whose_every_round_aggregated_nothing_failed(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """One round, both clients failing for different reasons: the run ran its rounds but trained
    nothing, so it ends 'failed' (before: 'degraded'), naming the last round's client failures."""
    returncode, lines = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} num_rounds=1 "
                   f"strategy.class_path=testkit.strategies.BreaksEveryClientDifferently {COMMON} {NO_EVAL}")
    output = "\n".join(lines)
    summary = _summary(tmp_path)
    assert summary["status"] == "failed", output[-3000:]
    assert summary["error"].startswith("no round aggregated any client update (round(s) [1]): the run trained nothing "
                                       "and its final model is the one it started from (last round, 1: client 0: ")
    assert summary["last_completed_round"] == 1  # every round ran; a re-run has nothing left to redo
    assert returncode == 1
    assert lines[-1].startswith("[fedagent] run failed: no round aggregated any client update")


def _most_digits_in_one_token(model_dir: Path) -> int:
    """The most digits (``\\d``, as TinyGuess reads them) in any one token of ``model_dir``'s
    tokenizer, decoded alone the way a one-token reply is (``skip_special_tokens=True``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return max((len(run) for i in range(len(tokenizer))
                for run in re.findall(r"\d+", tokenizer.decode([i], skip_special_tokens=True))), default=0)


def test_a_run_in_which_no_round_had_a_learning_signal_is_degraded_and_says_why(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Every GRPO group of every round scores alike, by construction: the secrets are 10..19 (two
    digits), a reply is one token (trainer.max_new_tokens=1) and no token of the tokenizer holds
    two digits, so no guess can be right and every episode's reward is 0. The run trains every
    round yet ends 'degraded' with the no-signal reason (without serverapp.learning's rule it
    would end 'completed'), exit status 3, and the log says why: once per round and at the end."""
    assert _most_digits_in_one_token(tiny_model_dir) <= 1  # the premise: a one-token reply is one digit at most
    rounds = 2
    returncode, lines = _run(
        superlink, f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} num_rounds={rounds} "
                   "env.train.envs.0.config.lo=10 env.train.envs.0.config.hi=19 "  # two-digit secrets only
                   "trainer.max_new_tokens=1 trainer.lr=1e-3 eval.enabled=false trainer.mode=persistent")
    output = "\n".join(lines)
    summary = _summary(tmp_path)
    # Every round trained (aggregated both clients), and every client's groups were all flat.
    assert [entry["round"] for entry in summary["rounds"]] == list(range(1, rounds + 1)), output[-3000:]
    assert all(entry["aggregated_actor"] is not None and not entry["rejected"] for entry in summary["rounds"])
    assert [entry["zero_variance_group_share"] for entry in summary["rounds"]] == [{"0": 1.0, "1": 1.0}] * rounds
    events = [json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    trains = [event for event in events if event["event"] == "train"]
    assert len(trains) == 2 * rounds
    assert all(event["metrics"]["zero-variance-group-share"] == 1.0 for event in trains), trains
    assert all(event["metrics"]["success-rate"] == 0.0 == event["metrics"]["reward-mean"] for event in trains), trains
    # The record, the status and the exit status.
    assert summary["learning"]["no_signal_run"] is True
    assert summary["learning"]["rounds_without_signal"] == list(range(1, rounds + 1))
    assert summary["status"] == "degraded", output[-3000:]
    assert summary["warning"].startswith(f"{NO_SIGNAL} (rounds {list(range(1, rounds + 1))}): ")
    assert expected_end(summary) == ("degraded", 3)  # testkit's independent reading agrees
    assert returncode == 3
    # The log says why: a warning each round, and the outcome line last.
    ours = _ours(lines)
    for r in range(1, rounds + 1):
        assert any(text.startswith(f"round {r} had no learning signal") for text in ours), ours
    assert lines[-1].startswith(f"[fedagent] run degraded: {NO_SIGNAL} (rounds {list(range(1, rounds + 1))})")
