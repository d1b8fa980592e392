"""Retention's removal note as the audit reads it (:mod:`fedagent_flwr.checkpoint.removal_note`):
path by path, not per round and kind. An input counts as removed by the run only when the note
lists it, or a directory holding it, and that listed path is gone; the run directory may be named
relatively or through a symlink, and the inputs by absolute paths of either form. The audit on real
runs killed mid-removal: tests/serverapp/test_retention_crash.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedagent_flwr.checkpoint.removal_note import gone_by_note, noted_as_gone


def _note(*paths: str) -> list[dict[str, object]]:
    return [{"round": 2, "removing": [{"round": 1, "kind": "client_checkpoints", "path": p, "bytes": 1}
                                      for p in paths]}]


def test_only_the_noted_paths_that_are_gone_and_what_they_held_are_removed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    kept = run / "round_1" / "client_1" / "checkpoints" / "global_step_4" / "actor"
    kept.mkdir(parents=True)
    (run / "round_1" / "client_0").mkdir(parents=True)
    gone = noted_as_gone(_note("round_1/client_0/.receipt-checkpoints.json", "round_1/client_0/checkpoints",
                               "round_1/client_1/checkpoints", "../elsewhere", "round_1/./client_2//x"), run)
    # the receipt and client 0's checkpoints are gone; client 1's are still there; a path out of
    # the run is ignored; a path is normalised as retention writes it
    assert gone == {"round_1/client_0/.receipt-checkpoints.json", "round_1/client_0/checkpoints",
                    "round_1/client_2/x"}
    assert gone_by_note(run / "round_1" / "client_0" / "checkpoints" / "global_step_4" / "actor", run, gone)
    assert gone_by_note(run / "round_1" / "client_0" / "checkpoints", run, gone)
    # the same round and kind, but not noted, or noted and still there: not removed by the run
    assert not gone_by_note(run / "round_1" / "client_0" / "output", run, gone)
    assert not gone_by_note(run / "round_1" / "client_3" / "checkpoints", run, gone)
    assert not gone_by_note(kept, run, gone)
    assert not gone_by_note(tmp_path / "elsewhere", run, gone)
    assert not gone_by_note(run / "round_1" / "client_0" / "checkpointsX", run, gone)  # a name, not a prefix


def test_the_run_directory_named_relatively_or_through_a_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "data" / "run"
    (real / "round_1").mkdir(parents=True)
    link = tmp_path / "outputs"
    link.symlink_to(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    relative = Path("outputs") / "run"
    gone = noted_as_gone(_note("round_1/global"), relative)
    assert gone == {"round_1/global"}
    for source in (real / "round_1" / "global", link / "run" / "round_1" / "global",
                   Path("outputs/run/round_1/../round_1/global"), Path(os.path.relpath(real / "round_1" / "global"))):
        assert gone_by_note(source, relative, gone), source
        assert gone_by_note(source, real, gone), source
    assert not gone_by_note(real / "round_2" / "global", relative, gone)
