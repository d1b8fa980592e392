"""The audit (``fedagent verify``) of a run record it cannot audit as given: the path given is a
run's summary file rather than its run directory, a path that does not exist, a record that is not
one as the ServerApp writes it (one line naming the file and the key, exit 2, no traceback), a
record that lacks rounds it says were completed, and an audit that checked nothing (exit 1, one
line saying why: never a silent pass). The runs are real: FedAvg rounds of two clients on real HF
checkpoints, recorded and committed by the real recorder, as ``tests/serverapp/strategy``'s audits
build them."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.checkpoint.verify import main as verify
from fedagent_flwr.cli import main as fedagent
from fedagent_flwr.serverapp.recorder import RunRecorder
from testkit.near_one import near_one, small_change_round
from testkit.round_harness import recorder_of
from testkit.strategy_setup import connected_strategy

SUMMARY = "federated_summary.json"


def _audit(*argv: str, command: Callable[[list[str]], int] = verify) -> tuple[int, str, str]:
    """The audit's exit status, stdout and stderr, run in this process as ``testkit.audit`` does
    (``command``: the module's ``main``, or ``fedagent`` given ``verify`` first)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = command(list(argv))
    return code, stdout.getvalue(), stderr.getvalue()


def _run(tmp_path: Path, rounds: int = 2) -> Path:
    """``rounds`` committed FedAvg rounds of two clients: the run directory."""
    strategy, run_root = connected_strategy(tmp_path, near_one(tmp_path, 5), clients=2)
    for server_round in range(1, rounds + 1):
        small_change_round(strategy, run_root, server_round, 30 + server_round)
        recorder_of(strategy).complete_round(server_round)
    return run_root


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real two-round run, shared by this module's tests (a run takes seconds to build)."""
    return _run(tmp_path_factory.mktemp("verify_record"))


@pytest.fixture
def real_run(shared_run: Path) -> Iterator[Path]:
    """The shared run, its record put back as the run wrote it after each test that edits it (the
    record names the run's checkpoints by absolute paths inside its run directory: an edited copy
    elsewhere would be refused as outside its run root)."""
    written = (shared_run / SUMMARY).read_text()
    yield shared_run
    (shared_run / SUMMARY).write_text(written)


def test_the_runs_summary_file_is_audited_as_its_run_directory(real_run: Path, tmp_path: Path) -> None:
    by_directory = _audit(str(real_run))
    assert by_directory[0] == 0 and by_directory[1].count(" ok") == 2, by_directory
    assert _audit(str(real_run / SUMMARY)) == by_directory  # before: "[Errno 20] Not a directory"
    copied = tmp_path / "run-123.json"  # a summary kept elsewhere: its folder is not its run directory
    copied.write_text((real_run / SUMMARY).read_text())
    code, stdout, stderr = _audit(str(copied))
    assert (code, stdout) == (2, "") and stderr == (
        f"verify: {copied} is a file, not a run directory: the audit reads a run's {SUMMARY} beside the "
        "checkpoints its rounds wrote; give the run directory that holds them\n")
    code, _, stderr = _audit(str(tmp_path / "nowhere"))
    assert code == 2 and stderr == (
        f"verify: {tmp_path / 'nowhere'} does not exist; give a run directory holding {SUMMARY}\n")


@pytest.mark.parametrize(("record", "named"), [
    ([], " holds a JSON array, not an object"),
    ({"rounds": "x"}, ": key 'rounds' is a JSON string, not an array"),
    ({"rounds": [{}]}, ": rounds[0] lacks key 'round' (the round's number)"),
    ({"rounds": [7]}, ": rounds[0] is a JSON number, not an object"),
    ({"rounds": [{"round": "1"}]}, ": rounds[0] key 'round' is a JSON string, not an integer"),
    ({"rounds": [{"round": True}]}, ": rounds[0] key 'round' is a JSON boolean, not an integer"),
    ({"rounds": [{"round": 1, "aggregated_actor": 3}]},
     ": rounds[0] key 'aggregated_actor' is a JSON number, not a string or null"),
    ({"rounds": [{"round": 1, "removed": ["global_model"]}]},
     ": rounds[0] key 'removed' is a JSON array, not an object"),
    ({"rounds": [{"round": 1, "removing": [{"kind": "global_model"}]}], "last_completed_round": 1},
     ": rounds[0] key 'removing' lists {\"kind\": \"global_model\"}, not an object with a string 'path'"),
    ({"rounds": [], "last_completed_round": "5"},
     ": key 'last_completed_round' is a JSON string, not an integer or null"),
    ({}, " lacks key 'rounds', so no round can be audited"),
    ({"rounds": [{"round": 0}]}, ": rounds[0] key 'round' is 0, not a positive integer (the ServerApp numbers rounds "
     "from 1)"),
    ({"rounds": [{"round": 1}, {"round": 1}]}, ": rounds[1] key 'round' repeats round 1 of rounds[0] (the ServerApp "
     "records a round once: which entry its commit wrote cannot be told)"),
])
def test_a_record_not_as_the_server_writes_it_is_refused_in_one_line_naming_the_key(
    tmp_path: Path, record: Any, named: str
) -> None:
    """Before: AttributeError ('list' object has no attribute 'get'), TypeError, KeyError 'round',
    out of the audit; or (no 'rounds' key) a silent pass."""
    path = tmp_path / SUMMARY
    if isinstance(record, dict):
        record = {"content_hash": "v2", **record}
    path.write_text(json.dumps(record))
    for flags in ((), ("--allow-unhashed",)):
        code, stdout, stderr = _audit(str(tmp_path), *flags)
        assert (code, stdout) == (2, ""), (code, stdout, stderr)
        assert stderr == (f"verify: {path}{named}: not a run record as the ServerApp writes it; give the run "
                          f"directory holding the run's own {SUMMARY}\n"), stderr


def test_rounds_the_record_says_were_completed_but_lacks_fail_the_audit(real_run: Path) -> None:
    """A real run's record cut short: round 1's entry gone, then every entry (before: exit 0, round
    2 audited or nothing printed at all)."""
    run_root = real_run
    record = json.loads((real_run / SUMMARY).read_text())
    assert record["last_completed_round"] == 2 and [e["round"] for e in record["rounds"]] == [1, 2]
    path = run_root / SUMMARY
    path.write_text(json.dumps({**record, "rounds": record["rounds"][1:]}))
    code, stdout, stderr = _audit(str(run_root))
    assert code == 1 and stdout.startswith("round 2: clients [0, 1] max abs error ") and " ok" in stdout, stdout
    assert stderr == (f"verify: {path} says 2 round(s) were completed (last_completed_round) but 'rounds' has no "
                      "entry for round(s) 1, so they cannot be audited: the record was truncated or edited; audit "
                      f"the run's own {SUMMARY}\n")
    path.write_text(json.dumps({**record, "rounds": [], "last_completed_round": 5}))
    code, stdout, stderr = _audit(str(run_root), "--allow-unhashed")
    assert (code, stdout) == (1, "") and "has no entry for round(s) 1-5, so they cannot be audited" in stderr, stderr


def test_a_run_that_stopped_before_its_first_round_has_nothing_to_audit_and_does_not_pass(tmp_path: Path) -> None:
    """The record of a real run refused before round 1, as the recorder writes it ("rounds": [],
    last_completed_round null, or 0 once the base model's evaluation committed): exit 1, one line
    (before: exit 0, nothing printed)."""
    recorder = RunRecorder(tmp_path, {"run_id": 1, "base_model": "/m"})
    recorder.finish("failed", "config key 'env.data_dir' = '/x': no data")
    code, stdout, stderr = _audit(str(tmp_path))
    assert (code, stdout) == (1, "") and stderr == (
        f"verify: nothing to audit: {tmp_path / SUMMARY} records no round (last_completed_round null, status "
        "\"failed\"): the run aggregated nothing, so nothing was checked; `fedagent outcome status` says why the "
        "run ended\n")
    recorder.complete_round(0)
    assert "records no round (last_completed_round 0, status \"failed\")" in _audit(str(tmp_path))[2]


def test_an_audit_that_checked_no_aggregate_fails(real_run: Path) -> None:
    """Every round kept the previous global model, or the record says the run removed every global
    model: nothing was recomputed nor hash-checked, so the audit must not pass (before: exit 0)."""
    record = json.loads((real_run / SUMMARY).read_text())
    run_root = real_run
    path = run_root / SUMMARY
    empty = [{**entry, "aggregated_actor": None, "aggregated_hf": None} for entry in record["rounds"]]
    path.write_text(json.dumps({**record, "rounds": empty}))
    code, stdout, stderr = _audit(str(run_root))
    assert code == 1 and stdout.count("no aggregate (previous global model kept)") == 2, stdout
    assert stderr == (f"verify: nothing was checked: no round {path} records has an aggregate (each kept the "
                      "previous global model), so there is nothing to recompute\n")
    removed = [{**entry, "removed": {"global_model": 1}} for entry in record["rounds"]]
    path.write_text(json.dumps({**record, "rounds": removed}))
    code, stdout, stderr = _audit(str(run_root))
    assert code == 1 and stdout.count("global model removed by the run (storage.keep_last_k); not checked") == 2
    assert stderr.startswith(f"verify: nothing was checked: every aggregate {path} records was removed by the run")
    # the default retention (client checkpoints removed after each commit): the committed hashes of the
    # global models are still checked, which is a check: the audit passes as it did
    kept = [{**entry, "removed": {"client_checkpoints": 1}} for entry in record["rounds"]]
    path.write_text(json.dumps({**record, "rounds": kept}))
    code, stdout, stderr = _audit(str(run_root))
    assert (code, stderr) == (0, "") and stdout.count("content hash as committed; client checkpoints removed") == 2



#: A real run's round entries (rounds 1 and 2) edited into a record that lists a round twice, the
#: index of the repeat and of the entry it repeats; each passed the audit before (exit 0).
_TWICE: dict[str, tuple[Callable[[dict[str, Any], dict[str, Any]], list[dict[str, Any]]], int, int, int]] = {
    "round 2's entry twice": (lambda r1, r2: [r1, r2, r2], 2, 2, 1),
    "round 1 again, naming round 2's aggregate": (lambda r1, r2: [r1, {**r2, "round": 1}, r2], 1, 1, 0),
    "round 2 again, naming round 1's aggregate": (lambda r1, r2: [r1, r2, {**r1, "round": 2}], 2, 2, 1),
    "round 2 again, out of order": (lambda r1, r2: [r2, r1, r2], 2, 2, 0),
}


@pytest.mark.parametrize("case", list(_TWICE))
def test_a_round_listed_twice_is_refused_in_one_line_naming_the_round(real_run: Path, case: str) -> None:
    """A real run's record with a round listed twice: which entry the round committed cannot be
    told, so the audit refuses it as a record the ServerApp does not write (before: exit 0, the
    round audited twice, each entry passing, the repeat of round 1 with round 2's aggregate too)."""
    edit, index, number, first = _TWICE[case]
    path = real_run / SUMMARY
    record = json.loads(path.read_text())
    assert [e["round"] for e in record["rounds"]] == [1, 2] and _audit(str(real_run))[0] == 0
    path.write_text(json.dumps({**record, "rounds": edit(*record["rounds"])}))
    refusal = (f"verify: {path}: rounds[{index}] key 'round' repeats round {number} of rounds[{first}] (the ServerApp "
               f"records a round once: which entry its commit wrote cannot be told): not a run record as the ServerApp "
               f"writes it; give the run directory holding the run's own {SUMMARY}\n")
    for flags in ((), ("--allow-unhashed",)):
        assert _audit(str(real_run), *flags) == (2, "", refusal)
    # as users run it: the fedagent console script's command, given the run or its record
    assert _audit("verify", str(real_run), command=fedagent) == (2, "", refusal)
    assert _audit("verify", str(path), command=fedagent) == (2, "", refusal)


@pytest.mark.parametrize("number", [0, -1, -2])
def test_a_round_numbered_below_one_is_refused_in_one_line(real_run: Path, number: int) -> None:
    """A real run's record with an entry for round 0 or a negative round (round 1's, renumbered):
    the ServerApp numbers rounds from 1 (before: exit 0, ``round 0: clients [0, 1] ... ok``). A
    string or a boolean is refused as a JSON type (the parametrized test above)."""
    path = real_run / SUMMARY
    record = json.loads(path.read_text())
    first, second = record["rounds"]
    path.write_text(json.dumps({**record, "rounds": [first, {**first, "round": number}, second]}))
    assert _audit("verify", str(real_run), command=fedagent) == (2, "", (
        f"verify: {path}: rounds[1] key 'round' is {number}, not a positive integer (the ServerApp numbers rounds "
        f"from 1): not a run record as the ServerApp writes it; give the run directory holding the run's own "
        f"{SUMMARY}\n"))
