"""A ServerApp killed while retention removes what a commit let go: the run record never says less
than was removed, and nothing is counted twice.

Real FedAdam rounds (real checkpoints, real strategy and recorder, real files), with the clients'
checkpoints where trainers write them (``round_<r>/client_<c>/checkpoints/``); ``storage.keep_last_k=1``.
The kill is simulated in the test process (SystemExit at a chosen removal; the in-memory record is
then dropped and only what is on disk is read again, as a re-run does). Retention used to note what
it removed only after removing it: killed in between, the record said nothing was removed while the
files were gone, the audit then failed the run ("round_1/global does not exist", "previous global
model ... is missing") and no later commit ever counted those bytes."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.resume import load_previous_run
from fedagent_flwr.serverapp.retention import Retention
from fedagent_flwr.serverapp.strategy import FedAdamFSDP
from testkit.audit import audit_run
from testkit.ckpt_factory import Suite
from testkit.client_replies import train_reply
from testkit.round_harness import connect, train_round
from testkit.strategy_setup import client_slot, initial_checkpoint

ADAM = {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99}
ROUNDS = [(("qwen_a", "qwen_b"), (4, 12)), (("qwen_b", "qwen_c"), (6, 6))]  # clients' models and episodes
STATE = Path("server_optimizer") / "global.safetensors"  # a round's optimiser state, beside its global model
REMOVED_LINES = ("round 1: global model removed by the run (storage.keep_last_k); not checked",
                 "round 2: content hash as committed; client checkpoints removed by the run after the round was "
                 "committed (storage.keep_client_checkpoints=false); recomputation not checked")


def _run(suite: Suite, tmp_path: Path, committed: int = 2,
         slots: tuple[str, str] = ("checkpoints", "checkpoints")) -> tuple[Path, RunRecorder, dict[str, Any]]:
    """Two FedAdam rounds, the first ``committed`` of them committed; the run directory, its
    recorder and its header. ``slots``: where in its client directory each round's trainers write
    (``checkpoints``, which retention removes, or another folder, which it does not list)."""
    initial = initial_checkpoint(tmp_path)
    run_root = tmp_path / "run"
    run_root.mkdir()
    header = {"base_model": initial.path, "base_model_sha256": initial.sha256, "env_kind": "test",
              "mode": "federated", "strategy": "fedadam", "config_sha256": "same", "total_rounds": 3, "run_id": 1}
    recorder = RunRecorder(run_root, header)
    strategy = FedAdamFSDP(run_root=str(run_root), initial_model=initial, num_clients=2, clients_per_round=2, **ADAM)
    connect(strategy, recorder, range(2))
    for r, (names, episodes) in enumerate(ROUNDS, 1):
        written = [client_slot(run_root, c, r) / slots[r - 1] for c in (0, 1)]  # where trainers write them
        replies = [train_reply(c, CheckpointRef.for_directory(suite.copy(name, written[c])), count)
                   for c, (name, count) in enumerate(zip(names, episodes))]
        train_round(strategy, r, replies)
        if r <= committed:
            recorder.complete_round(r)
    return run_root, recorder, header


def _bytes(path: Path) -> int:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.lstat().st_size for p in files)


def _expected(run_root: Path) -> dict[int, dict[str, int]]:
    """What the commit of round 2 lets go, by round and kind, in bytes (measured before it goes)."""
    checkpoints = {r: sum(_bytes(run_root / f"round_{r}" / f"client_{c}" / "checkpoints") for c in (0, 1))
                   for r in (1, 2)}
    return {1: {"client_checkpoints": checkpoints[1], "global_model": _bytes(run_root / "round_1" / "global"),
                "server_optimizer_state": _bytes(run_root / "round_1" / STATE)},
            2: {"client_checkpoints": checkpoints[2]}}


def _killed_at(monkeypatch: pytest.MonkeyPatch, target: Path, before: bool) -> None:
    """Kill the 'ServerApp' (SystemExit) at the removal of file ``target``: before or right after it."""
    unlink = Path.unlink

    def unlink_or_die(self: Path, missing_ok: bool = False) -> None:
        if self == target and before:
            raise SystemExit("killed")
        unlink(self, missing_ok=missing_ok)
        if self == target:
            raise SystemExit("killed")

    monkeypatch.setattr(Path, "unlink", unlink_or_die)


def _stored(run_root: Path) -> dict[str, Any]:
    return json.loads((run_root / "federated_summary.json").read_text())


def _removed(summary: dict[str, Any]) -> dict[int, dict[str, int]]:
    return {int(e["round"]): e["removed"] for e in summary["rounds"] if "removed" in e}


def _resumed(run_root: Path, header: dict[str, Any], committed: int = 2) -> RunRecorder:
    """The recorder of a re-run (the record as the killed attempt left it on disk); its start
    model is the last committed round's global model, hash-checked: retention never removes the newest."""
    previous = load_previous_run(run_root, {**header, "run_id": 2})
    assert previous is not None and previous.last_completed_round == committed
    assert previous.global_model(CheckpointRef.for_directory(header["base_model"])).path == str(
        run_root / f"round_{committed}" / "global")
    return RunRecorder(run_root, {**header, "run_id": 2}, previous)


def _audited(run_root: Path, *lines: str) -> str:
    audit = audit_run(run_root)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    for line in lines:
        assert any(printed.startswith(line) for printed in audit.stdout.splitlines()), (line, audit.stdout)
    return audit.stdout


def test_killed_after_the_removals_the_audit_passes_and_the_resume_counts_them_once(
    suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_root, recorder, header = _run(suite, tmp_path)
    expected = _expected(run_root)
    with monkeypatch.context() as patch:  # killed once every file is gone, before the record says so
        _killed_at(patch, run_root / "round_1" / STATE, before=False)
        with pytest.raises(SystemExit):
            Retention(run_root, keep_last_k=1).after_commit(recorder, 2)
    assert not (run_root / "round_1" / "global").exists() and not (run_root / "round_1" / STATE).exists()
    assert not list(run_root.glob("round_*/client_*/checkpoints"))
    # The audit reads the removals from the note written before them: "removed by the run", not a failure.
    _audited(run_root, *REMOVED_LINES)

    again = _resumed(run_root, header)
    Retention(run_root, keep_last_k=1).after_resume(again)  # the ServerApp's first step after a resume
    summary = _stored(run_root)
    assert _removed(summary) == expected and not any("removing" in e for e in summary["rounds"])
    assert summary["disk_freed_bytes"] == sum(sum(kinds.values()) for kinds in expected.values())
    # The next commit finds nothing more to remove and counts nothing twice.
    assert Retention(run_root, keep_last_k=1).after_commit(again, 2) == 0
    assert _removed(_stored(run_root)) == expected
    assert _stored(run_root)["disk_freed_bytes"] == summary["disk_freed_bytes"]
    _audited(run_root, *REMOVED_LINES)


def test_killed_half_way_the_next_commit_removes_the_rest_and_counts_each_file_once(
    suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_root, recorder, header = _run(suite, tmp_path)
    expected = _expected(run_root)
    with monkeypatch.context() as patch:  # killed before round 1's optimiser state, the last to go
        _killed_at(patch, run_root / "round_1" / STATE, before=True)
        with pytest.raises(SystemExit):
            Retention(run_root, keep_last_k=1).after_commit(recorder, 2)
    assert not (run_root / "round_1" / "global").exists() and (run_root / "round_1" / STATE).is_file()
    _audited(run_root, *REMOVED_LINES)

    again = _resumed(run_root, header)
    assert Retention(run_root, keep_last_k=1).after_commit(again, 2) == sum(sum(k.values()) for k in expected.values())
    summary = _stored(run_root)
    assert not (run_root / "round_1" / STATE).exists()
    assert _removed(summary) == expected and not any("removing" in e for e in summary["rounds"])
    assert summary["disk_freed_bytes"] == sum(sum(kinds.values()) for kinds in expected.values())


def test_a_directory_killed_half_way_through_its_removal_is_gone_whole(
    suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A global model is several files: killed between two of them, it used to stay half there,
    which the audit cannot tell from a damaged one. It is renamed out of its name first. The
    clients' checkpoints (and every state) kept: round 2's audit steps from the removed model."""
    run_root, recorder, header = _run(suite, tmp_path)
    expected = {1: {"global_model": _bytes(run_root / "round_1" / "global")}}
    retention = Retention(run_root, keep_client_checkpoints=True, keep_last_k=1)
    rmtree: Callable[..., Any] = shutil.rmtree

    def rmtree_killed_in_round_1_global(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).parent == run_root / "round_1" and "global" in Path(path).name:
            (Path(path) / "model.safetensors").unlink()  # the weights went, the config and tokenizer not yet
            raise SystemExit("killed")
        rmtree(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(shutil, "rmtree", rmtree_killed_in_round_1_global)
        with pytest.raises(SystemExit):
            retention.after_commit(recorder, 2)
    assert not (run_root / "round_1" / "global").exists()
    # through the optimiser's audit: the model round 2 stepped from is noted for removal and gone
    removed_lines = (REMOVED_LINES[0], f"round 2: previous global model {run_root / 'round_1' / 'global'} removed "
                     "by the run (storage.keep_last_k); not checked")
    _audited(run_root, *removed_lines)

    again = _resumed(run_root, header)
    retention.after_resume(again)
    assert [p.name for p in run_root.rglob("*") if p.name.startswith(".removing-")] == []  # the leftover went
    summary = _stored(run_root)
    assert _removed(summary) == expected and summary["disk_freed_bytes"] == expected[1]["global_model"]
    _audited(run_root, *removed_lines)


def test_noted_with_the_commit_retention_adds_no_write_of_its_own(
    suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ServerApp notes what a commit lets go just before the commit (RoundLoop's
    before_commit): the commit's write records the note, and after_commit writes once, as before,
    without listing the run's files again."""
    run_root, recorder, _ = _run(suite, tmp_path)
    expected = _expected(run_root)
    retention = Retention(run_root, keep_last_k=1)
    retention.before_commit(recorder, 2)
    recorder.complete_round(2)  # the commit (again, for the test): the note is in it
    first, second = _stored(run_root)["rounds"]
    assert "removing" not in first  # the note is the committing round's: no commit, no note
    noted: dict[int, dict[str, int]] = {}
    for item in second["removing"]:
        noted.setdefault(item["round"], {}).setdefault(item["kind"], 0)
        noted[item["round"]][item["kind"]] += item["bytes"]
    assert noted == expected
    assert {"round": 1, "kind": "global_model", "path": "round_1/global",  # relative to the run directory
            "bytes": expected[1]["global_model"]} in second["removing"]
    writes: list[int] = []
    write = recorder.write
    monkeypatch.setattr(recorder, "write", lambda *args, **kwargs: (writes.append(1), write(*args, **kwargs))[1])
    listed: list[int] = []  # the run's files are listed once a commit, by before_commit
    client_checkpoints = Retention._client_checkpoints
    monkeypatch.setattr(Retention, "_client_checkpoints",
                        lambda self, r: (listed.append(r), client_checkpoints(self, r))[1])
    assert retention.after_commit(recorder, 2) == sum(sum(kinds.values()) for kinds in expected.values())
    assert len(writes) == 1 and _removed(_stored(run_root)) == expected and listed == []
    # Called alone (no note yet), it writes the note first: one write more.
    writes.clear()
    (run_root / "round_2" / "client_9" / "checkpoints").mkdir(parents=True)  # a checkpoint to remove
    (run_root / "round_2" / "client_9" / "checkpoints" / "model.pt").write_bytes(b"w" * 99)
    assert retention.after_commit(recorder, 2) == 99 and len(writes) == 2


def test_a_note_made_for_a_commit_that_did_not_happen_removes_nothing(suite: Suite, tmp_path: Path) -> None:
    """Noted just before round 2's commit, which then does not happen (the ServerApp stops between
    the note and the commit: a failure of the round's own bookkeeping, or a stop), and the run's
    last write (``finish``) records the note, but in round 2's entry, which a re-run drops with the
    round. Round 1's global model, the re-run's start, stays (the note lists it: keep_last_k=1)."""
    run_root, recorder, header = _run(suite, tmp_path, committed=1)
    retention = Retention(run_root, keep_last_k=1)
    retention.before_commit(recorder, 2)
    recorder.finish("failed", "stopped before round 2's commit")
    assert any(item["path"] == "round_1/global" for item in _stored(run_root)["rounds"][1]["removing"])

    again = _resumed(run_root, header, committed=1)
    retention.after_resume(again)
    assert (run_root / "round_1" / "global").is_dir() and (run_root / "round_1" / STATE).is_file()
    assert all((run_root / "round_1" / f"client_{c}" / "checkpoints").is_dir() for c in (0, 1))
    assert "disk_freed_bytes" not in _stored(run_root)
    _resumed(run_root, header, committed=1)  # and round 1's global model is still as committed


def test_the_audit_trusts_no_note_of_a_round_that_did_not_commit(suite: Suite, tmp_path: Path) -> None:
    """Round 2's note (never committed) lists round 1's global model; that model deleted by hand
    is a missing input, not a removal by the run: the audit fails its round 1."""
    run_root, recorder, _ = _run(suite, tmp_path, committed=1)
    Retention(run_root, keep_last_k=1).before_commit(recorder, 2)
    recorder.finish("failed", "stopped before round 2's commit")
    shutil.rmtree(run_root / "round_1" / "global")
    audit = audit_run(run_root)
    assert audit.returncode == 1, audit.stdout
    assert "round 1: cannot verify" in audit.stdout and "removed by the run" not in audit.stdout, audit.stdout


def test_a_tree_renamed_but_not_deleted_is_counted_once_and_removed_at_the_next_commit(
    suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Round 1's global model renamed out of its path, then its tree cannot be deleted (a
    permission, an NFS busy file): the path is gone by the run and counted once; the leftover
    ``.removing-global`` used to stay for good (nothing noted it again); the next commit removes it."""
    run_root, recorder, _ = _run(suite, tmp_path)
    trash = run_root / "round_1" / ".removing-global"
    rmtree = shutil.rmtree

    def refuse_the_trash(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path) == trash:
            raise PermissionError(13, "Permission denied", str(path))
        rmtree(path, *args, **kwargs)

    retention = Retention(run_root, keep_last_k=1)
    expected = _expected(run_root)
    monkeypatch.setattr(shutil, "rmtree", refuse_the_trash)
    retention.after_commit(recorder, 2)
    assert trash.is_dir() and not (run_root / "round_1" / "global").exists()
    assert _removed(_stored(run_root)) == expected
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    retention.after_commit(recorder, 2)
    assert not trash.exists() and _removed(_stored(run_root)) == expected


def _receipts(run_root: Path) -> list[Path]:
    """A store's receipt beside each client's checkpoint (``.receipt-<name>.json``, as the http and
    s3 stores leave them), which retention removes with the client checkpoints; round 1's first."""
    receipts = []
    for r, (names, _) in enumerate(ROUNDS, 1):
        for c, name in enumerate(names):
            receipt = run_root / f"round_{r}" / f"client_{c}" / f".receipt-{name}.json"
            receipt.write_text("{}")
            receipts.append(receipt)
    return receipts


def test_a_noted_file_gone_does_not_make_a_missing_unnoted_input_of_its_round_removed_by_the_run(
    suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed right after retention removed round 1's first receipt: the note lists the receipts
    (and round 1's optimiser state), not the clients' checkpoints, which the trainers wrote where
    retention does not look (``output/``). A client checkpoint of round 1 then deleted by hand was
    taken as removed by the run (the audit read the note per round and kind: one client checkpoint
    of round 1 noted and gone made them all so) and round 1 was skipped; it is a missing input."""
    run_root, recorder, _ = _run(suite, tmp_path, slots=("output", "output"))
    receipts = _receipts(run_root)
    with monkeypatch.context() as patch:
        _killed_at(patch, receipts[0], before=False)
        with pytest.raises(SystemExit):
            Retention(run_root, keep_last_k=0).after_commit(recorder, 2)
    noted = [item["path"] for item in _stored(run_root)["rounds"][1]["removing"]]
    assert "round_1/client_0/.receipt-qwen_a.json" in noted and not receipts[0].exists()
    assert not any("output" in path for path in noted)
    lost = run_root / "round_1" / "client_1" / "output" / "qwen_b"
    shutil.rmtree(lost)  # by hand: no removal of the run
    audit = audit_run(run_root)
    assert audit.returncode == 1, audit.stdout
    first = audit.stdout.splitlines()[0]
    assert first.startswith(f"round 1: cannot verify: checkpoint directory {lost} does not exist"), audit.stdout
    assert "removed by the run" not in audit.stdout, audit.stdout


def test_an_input_noted_and_gone_is_removed_by_the_run_and_one_still_there_is_recomputed(
    suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed before round 1's optimiser state, the last removal: every receipt is gone, and so are
    round 2's client checkpoints (under ``checkpoints/``, which the note lists: removed by the run,
    the round not recomputed); round 1's, written where retention does not look, are all there and
    the round is recomputed, its receipts gone or not (it used to be skipped as removed)."""
    run_root, recorder, _ = _run(suite, tmp_path, slots=("output", "checkpoints"))
    receipts = _receipts(run_root)
    with monkeypatch.context() as patch:
        _killed_at(patch, run_root / "round_1" / STATE, before=True)
        with pytest.raises(SystemExit):
            Retention(run_root, keep_last_k=0).after_commit(recorder, 2)
    assert not any(receipt.exists() for receipt in receipts) and (run_root / "round_1" / STATE).is_file()
    assert not list(run_root.glob("round_2/client_*/checkpoints"))
    assert all((run_root / "round_1" / f"client_{c}" / "output").is_dir() for c in (0, 1))
    stdout = _audited(run_root, "round 1: clients [0, 1] fedadam step 1 max abs error ", REMOVED_LINES[1])
    assert stdout.splitlines()[0].endswith(" ok"), stdout


def test_a_damaged_note_never_removes_outside_the_run_directory(
    suite: Suite, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A summary whose note lists a path out of the run directory (``../outside/victim``, an absolute
    path: damaged, or edited by hand; retention writes neither) used to make the resume remove it
    (``run_dir / "/x"`` is ``/x``). It is left, with one warning line naming the summary and the
    path; the note's own paths are removed and counted as ever."""
    run_root, _, header = _run(suite, tmp_path)
    outside = tmp_path / "outside" / "victim"
    outside.parent.mkdir()
    outside.write_text("not the run's")
    absolute = tmp_path / "absolute-victim"
    absolute.mkdir()
    (absolute / "data").write_text("not the run's either")
    summary = _stored(run_root)
    summary["rounds"][1]["removing"] = [
        {"round": 1, "kind": "global_model", "path": "round_1/global", "bytes": 7},
        {"round": 1, "kind": "client_checkpoints", "path": "../outside/victim", "bytes": 13},
        {"round": 1, "kind": "client_checkpoints", "path": str(absolute), "bytes": 20},
        {"round": 2, "kind": "client_checkpoints", "path": "round_2/../../outside/victim", "bytes": 13},
    ]
    (run_root / "federated_summary.json").write_text(json.dumps(summary))

    again = _resumed(run_root, header)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        Retention(run_root, keep_last_k=1).after_resume(again)
    assert outside.read_text() == "not the run's" and (absolute / "data").is_file()
    assert not (run_root / "round_1" / "global").exists()
    stored = _stored(run_root)
    assert _removed(stored) == {1: {"global_model": 7}} and not any("removing" in e for e in stored["rounds"])
    warned = [r.getMessage() for r in caplog.records if "outside the run directory" in r.getMessage()]
    assert len(warned) == 3, warned
    for line, path in zip(warned, ("../outside/victim", str(absolute), "round_2/../../outside/victim")):
        assert str(run_root / "federated_summary.json") in line and repr(path) in line, line
