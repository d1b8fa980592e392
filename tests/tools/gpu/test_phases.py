"""tools/gpu/phases.py (and ``arms.py phases``, ``collect.sh``) on phases.jsonl files written by the
session's own recorder (``trainers/verl/phases.py``), several processes and a restarted session
included, laid out as ``arms.py --out`` leaves them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from fedagent_flwr.trainers.verl.job import STEPS_FILE  # where every client-round keeps its steps
from fedagent_flwr.trainers.verl.phases import PhaseRecorder
from testkit.gpu_tools import collected, gpu_tool

REPO = Path(__file__).resolve().parents[3]
T0 = 1_700_000_000.0
_RANK = """
import sys
from fedagent_flwr.trainers.verl import phases
recorder = phases.from_environment()
recorder.record(sys.argv[1], recorder.t0 + float(sys.argv[2]), recorder.t0 + float(sys.argv[3]))
"""


def _tool(name: str) -> ModuleType:
    return gpu_tool(name)


def _phase(recorder: PhaseRecorder, name: str, start: float, end: float, **fields: object) -> None:
    recorder.record(name, T0 + start, T0 + end, **fields)


def _in_another_process(recorder: PhaseRecorder, name: str, start: float, end: float) -> None:
    """One rank's record, written by a process of its own through the session's environment."""
    subprocess.run([sys.executable, "-c", _RANK, name, str(start), str(end)], cwd=REPO, check=True, timeout=120,
                   env={**os.environ, **recorder.environment()}, capture_output=True)


def _write_runs(out: Path) -> None:
    """client 0: a session (start-up, rounds 1-3) and, after a restart, a second one; client 1: one."""
    path = out / "runs" / "federated-s1" / "trainers" / "client_0" / "phases.jsonl"
    first = PhaseRecorder(path, T0, session="a", log=lambda _: None)
    for name, start, end in (("server_start", 0, 2), ("session_start", 2, 40), ("compose_config", 2, 3),
                             ("ray_start", 3, 6), ("task_runner", 7, 40), ("init_workers", 10, 38),
                             ("rollout_engine_init", 20, 35)):
        _phase(first, name, start, end)
    _in_another_process(first, "worker_spawn_actor_rollout", 11, 15)  # rank 0
    _in_another_process(first, "worker_spawn_actor_rollout", 11, 17)  # rank 1: the slowest counts
    r1 = first.bound(round=1, client=0)
    _phase(r1, "first_weight_sync", 45, 47, call=1)
    _phase(r1, "first_generation", 47, 60, call=1)
    _phase(r1, "round_total", 2, 70)
    r2 = first.bound(round=2, client=0)
    for name, start, end, call in (("round_total", 100, 120, 0), ("reload", 101, 103, 0), ("dataloader", 103, 103.5, 0),
                                   ("weight_sync", 104, 105, 1), ("generation", 105, 109, 1),
                                   ("weight_sync", 110, 111, 2)):  # two syncs of one process: their sum
        _phase(r2, name, start, end, **({"call": call} if call else {}))
    r3 = first.bound(round=3, client=0)
    for name, start, end, call in (("round_total", 200, 230, 0), ("reload", 201, 204, 0), ("dataloader", 204, 204.5, 0),
                                   ("weight_sync", 205, 206.5, 1), ("generation", 206.5, 212.5, 1)):
        _phase(r3, name, start, end, **({"call": call} if call else {}))
    restarted = PhaseRecorder(path, T0, session="b", log=lambda _: None)
    _phase(restarted, "session_start", 300, 330)
    other = PhaseRecorder(out / "runs" / "federated-s1" / "trainers" / "client_1" / "phases.jsonl", T0,
                          session="c", log=lambda _: None)
    _phase(other, "session_start", 2, 50)
    _phase(other, "ray_start", 3, 5)
    _phase(other.bound(round=2, client=1), "round_total", 100, 110)


def _rows(text: str, table: int) -> dict[str, list[str]]:
    """The rows of the ``table``-th markdown table: phase name -> cells (the header under ``phase``)."""
    blocks = [b for b in text.split("\n\n") if b.startswith("| phase")]
    rows = {}
    for line in blocks[table].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] != "---":
            rows[cells[0].replace("&nbsp;", "")] = cells[1:]
    return rows


def test_tables_per_session_with_the_slowest_rank_and_summed_calls(tmp_path: Path) -> None:
    tool = _tool("phases")
    _write_runs(tmp_path)
    text = tool.tables(tool.find_sessions([tmp_path]))
    start, rounds = _rows(text, 0), _rows(text, 1)
    assert start["phase"] == ["federated-s1/client_0", "federated-s1/client_0 #2", "federated-s1/client_1", "mean"]
    assert start["session_start"] == ["38.0", "30.0", "48.0", "38.7"]
    assert start["ray_start"] == ["3.0", "–", "2.0", "2.5"]
    assert start["worker_spawn_actor_rollout"] == ["6.0", "–", "–", "6.0"]  # max over the two rank processes
    assert start["first_generation"] == ["13.0", "–", "–", "13.0"]
    assert start["**ready at** (s since the trainer process started)"] == ["40.0", "330.0", "50.0", "140.0"]
    names = list(start)
    assert names.index("compose_config") < names.index("init_workers") < names.index("rollout_engine_init") \
        < names.index("first_weight_sync")
    # depth 3: inside init_workers inside task_runner inside session_start
    assert "| " + "&nbsp;" * 6 + "rollout_engine_init |" in text
    assert "round_total" not in start  # a round's phases are in the rounds table
    # rounds 2 and 3 of client 0: (20 + 30) / 2 per round; syncs 2 (1 + 1) and 1.5
    assert rounds["rounds averaged"] == ["2.0", "–", "1.0", "1.5"]
    assert rounds["round_total"] == ["25.0", "–", "10.0", "17.5"]
    assert rounds["weight_sync"][0] == "1.8" and rounds["generation"][0] == "5.0"
    # overhead: reload + dataloader + the round's first sync = (2 + 0.5 + 1 + 3 + 0.5 + 1.5) / 2
    assert rounds["overhead"][0] == "4.2" and rounds["overhead share of the round (%)"][0] == "17.0"
    assert rounds["overhead"][2] == "–"  # client 1's round recorded none of its parts
    assert _rows(tool.tables(tool.find_sessions([tmp_path]), from_round=1), 1)["rounds averaged"][0] == "3.0"


def test_several_roots_are_named_and_arms_py_writes_phases_md(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    tool, arms = _tool("phases"), _tool("arms")
    _write_runs(tmp_path / "before")
    _write_runs(tmp_path / "after")
    assert tool.main([str(tmp_path / "before"), str(tmp_path / "after"), "--out", str(tmp_path / "t.md")]) == 0
    header = _rows((tmp_path / "t.md").read_text(), 0)["phase"]
    assert header[0] == "before/federated-s1/client_0" and header[3] == "after/federated-s1/client_0"
    capsys.readouterr()
    assert arms.main(["phases", "--out", str(tmp_path / "before")]) == 0
    written = (tmp_path / "before" / "phases.md").read_text()
    assert capsys.readouterr().out == written == tool.tables(tool.find_sessions([tmp_path / "before" / "runs"]))
    bad = tmp_path / "bad" / "phases.jsonl"
    bad.parent.mkdir()
    bad.write_text('{"phase": "ray_start"}\n')
    with pytest.raises(SystemExit, match=r"phases: .*bad/phases.jsonl:1: not a phase record"):
        tool.main([str(bad.parent)])
    with pytest.raises(SystemExit, match="does not exist"):
        tool.main([str(tmp_path / "nowhere")])


def test_collect_keeps_the_phase_tables_and_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _write_runs(out)
    steps = out / "runs" / "federated-s1" / "round_2" / "client_1" / "verl" / STEPS_FILE
    steps.parent.mkdir(parents=True)
    steps.write_text('{"data": {"critic/score/mean": 0.140625}, "step": 1}\n')
    results = collected(out, tmp_path)
    assert (results / "phases.md").is_file()
    assert (results / "federated-s1" / "trainers" / "client_0" / "phases.jsonl").is_file()
    assert (results / "federated-s1" / "trainers" / "client_1" / "phases.jsonl").is_file()
    # verl's per-step metrics, under the run and round
    assert (results / "federated-s1" / "steps" / "round_2-client_1.jsonl").read_bytes() == steps.read_bytes()


def test_collect_packs_a_tail_only_for_each_log_there_is(tmp_path: Path) -> None:
    """A shell glob that matches nothing stays the pattern itself: a session that wrote no top-level
    log must not come back with an empty ``results/*.log.tail``, one without runs with a ``results/*/``
    folder, nor a trainer without a server log with a tail of it; each log that is there comes as a tail."""
    def packed(out: Path, work: Path) -> set[str]:
        work.mkdir()
        results = collected(out, work)
        return {path.relative_to(results).as_posix() for path in results.rglob("*")}

    bare = tmp_path / "bare"
    bare.mkdir()
    assert packed(bare, tmp_path / "w1") == set()
    out = tmp_path / "out"
    trainer = out / "runs" / "local-s1" / "trainers" / "client_0"
    _phase(PhaseRecorder(trainer / "phases.jsonl", T0, session="a", log=lambda _: None), "server_start", 0, 2)
    run = {"phases.md", "local-s1", "local-s1/trainers", "local-s1/trainers/client_0",
           "local-s1/trainers/client_0/phases.jsonl"}
    assert packed(out, tmp_path / "w2") == run
    (out / "local-s1.log").write_text("round 1 of 1\n")
    (trainer / "server.log").write_text("session started\n")
    assert packed(out, tmp_path / "w3") == {*run, "local-s1.log.tail", "local-s1/client_0-server.log.tail"}
    tails = tmp_path / "w3" / "unpacked" / "results"
    assert (tails / "local-s1" / "client_0-server.log.tail").read_text() == "session started\n"
    assert (tails / "local-s1.log.tail").read_text() == "round 1 of 1\n"


def test_collect_keeps_every_hook_line_of_a_server_log_that_has_any(tmp_path: Path) -> None:
    """The lines the job's hooks print when they act, from the whole log (the tail alone lost this
    one), and no hooks file for a log without any."""
    out = tmp_path / "out"
    lines = ["[weight-sync lock] waiting 30 s for another verl job's weight sync on this host (/tmp/x.lock)",
             "(Worker pid=9) [vllm sleep] pid 9: vLLM's device-wide free-memory check saw GPU memory grow"]
    logs = {"client_0": lines[0] + "\n" + "x" * 250_000 + "\n" + lines[1] + "\nround 2 done\n",
            "client_1": "session started\nno hook acted\n"}
    for client, text in logs.items():
        trainer = out / "runs" / "federated-s1" / "trainers" / client
        trainer.mkdir(parents=True)
        (trainer / "server.log").write_text(text)
    results = collected(out, tmp_path)
    assert (results / "federated-s1" / "client_0-hooks.log").read_text().splitlines() == lines
    assert lines[0] not in (results / "federated-s1" / "client_0-server.log.tail").read_text()
    assert not (results / "federated-s1" / "client_1-hooks.log").exists()
    assert (results / "federated-s1" / "client_1-server.log.tail").is_file()


def test_phase_tables_need_only_the_standard_library(tmp_path: Path) -> None:
    """A GPU node runs ``arms.py phases`` with its plain ``python3``, whose path lacks the staged
    packages (omegaconf, torch): ``-S`` (no site-packages) reproduces that; the tables still come."""
    _write_runs(tmp_path)
    run = subprocess.run([sys.executable, "-S", str(REPO / "tools" / "gpu" / "arms.py"), "phases", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "session_start" in run.stdout and (tmp_path / "phases.md").read_text() == run.stdout
