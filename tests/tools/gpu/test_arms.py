"""tools/gpu/arms.py's report: the arms table from real run records (RunRecorder summaries)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fedagent_flwr.serverapp.recorder import RunRecorder
from testkit.gpu_tools import gpu_tool

REPO = Path(__file__).resolve().parents[3]


def _arms_module():  # noqa: ANN202 - the tools/gpu/arms.py module
    return gpu_tool("arms")


def _run(out: Path, name: str, rates: list[float | None], n: int = 64, total_rounds: int | None = None) -> None:
    """A run record with these validation rates from round 0 on (None: that round's evaluation recorded
    nothing), planned for ``total_rounds`` (default: the rounds given)."""
    total = len(rates) - 1 if total_rounds is None else total_rounds
    recorder = RunRecorder(out / "runs" / name, {"base_model": "/m", "env_kind": "tinyguess", "mode": "federated",
                                                 "total_rounds": total})
    for r, rate in enumerate(rates):
        if rate is not None:
            recorder.record_eval(server_round=r, model=f"/m{r}", metrics={"num-examples": n, "success-rate": rate})
    recorder.finish()


def test_report_pools_seeds_with_wilson_intervals(tmp_path: Path) -> None:
    arms = _arms_module()
    runs = [{"name": arms.run_name(arm, seed), "arm": arm, "seed": seed}
            for arm in ("federated", "local") for seed in (1, 2)]
    runs.append({"name": "centralized-s1", "arm": "centralized", "seed": 1})  # never started
    (tmp_path / arms.MATRIX_FILE).write_text(json.dumps({"recipe": "tinyguess_verl", "runs": runs}))
    _run(tmp_path, "federated-s1", [0.125, 0.25, 0.5])
    _run(tmp_path, "federated-s2", [0.125, 0.375, 0.40625])
    _run(tmp_path, "local-s1", [0.125, 0.25])
    _run(tmp_path, "local-s2", [0.125, 0.1875])
    text = arms.report(tmp_path)
    data = json.loads((tmp_path / "arms.json").read_text())
    fed = data["arms"]["federated"]
    assert fed["final_per_seed"] == [0.5, 0.40625] and fed["final_mean"] == pytest.approx(0.4531, abs=1e-4)
    # 32 + 26 successes of 128 pooled episodes: Wilson 95% [0.3700, 0.5389].
    assert fed["pooled_n"] == 128 and fed["pooled_ci95"] == pytest.approx([0.3700, 0.5389], abs=1e-3)
    assert data["arms"]["local"]["rounds"] == [1, 1]
    assert "| federated | 2 | 2,2 |" in text and "runs without a result: centralized-s1" in text
    assert (tmp_path / "arms.png").stat().st_size > 1000
    # federated - local: 0.453125 - 0.21875; pooled 58/128 - 28/128 by the normal approximation
    # (+/- 1.96 * 0.0572);
    # over seeds by Welch with sds 0.0663 and 0.0442 (df 1.75 -> 1, t 12.706): +/- 12.706 * 0.0563
    (diff,) = [d for d in data["differences"] if d["arms"] == ["federated", "local"]]
    assert diff["difference"] == pytest.approx(0.2344, abs=1e-4)
    assert diff["pooled_ci95"] == pytest.approx([0.1223, 0.3465], abs=1e-4)
    assert diff["seeds_ci95"] == pytest.approx([-0.4814, 0.9502], abs=1e-4)
    # Seeds needed (80% power at these spreads): 2 a side give (12.706 + 1.376) * 0.0563 = 0.79 > 0.234;
    # 3 a side (df 3.5 -> 3) give (3.182 + 0.978) * 0.0460 = 0.19 <= 0.234.
    assert diff["seeds_needed"] == 3
    assert ("- federated − local: +0.234; over seeds [-0.481, +0.950]; over pooled episodes [+0.122, +0.346]; "
            "seeds needed: 3") in text
    # metrics.jsonl carries verl's name for the validation rate as well.
    events = [json.loads(line) for line in (tmp_path / "runs" / "local-s2" / "metrics.jsonl").read_text().splitlines()]
    assert [e["val/success_rate"] for e in events if e["event"] == "evaluate"] == [0.125, 0.1875]


def test_report_compares_the_mean_of_the_last_rounds_over_seeds(tmp_path: Path) -> None:
    arms = _arms_module()
    runs = [{"name": arms.run_name(arm, seed), "arm": arm, "seed": seed}
            for arm in ("federated", "local") for seed in (1, 2, 3)]
    (tmp_path / arms.MATRIX_FILE).write_text(json.dumps({"recipe": "tinyguess_verl", "runs": runs}))
    # Each run's last 3 planned rounds count, and only when it has all of them.
    _run(tmp_path, "federated-s1", [0.9, 0.1, 0.2, 0.4, 0.3, 0.5])  # 0.4
    _run(tmp_path, "federated-s2", [0.1, 0.1, 0.3, 0.35, 0.4])  # 0.35
    _run(tmp_path, "federated-s3", [0.1, 0.6, 0.6, 0.6], total_rounds=5)  # lost at round 3 of 5: no window
    _run(tmp_path, "local-s1", [0.1, 0.2, 0.2, 0.25, 0.15])  # 0.2
    _run(tmp_path, "local-s2", [0.1, 0.1, 0.3, 0.2, 0.25])  # 0.25
    _run(tmp_path, "local-s3", [0.1, 0.2, 0.25, 0.2])  # 0.2167: rounds 1-3, round 0 (the base) never counts
    _run(tmp_path, "local-s4", [0.1, 0.2, 0.9, None, 0.9, 0.9])  # round 3's evaluation recorded nothing: no window
    runs.append({"name": "local-s4", "arm": "local", "seed": 4})
    (tmp_path / arms.MATRIX_FILE).write_text(json.dumps({"recipe": "tinyguess_verl", "runs": runs}))
    text = arms.report(tmp_path)
    data = json.loads((tmp_path / "arms.json").read_text())
    assert data["arms"]["federated"]["window_per_seed"] == pytest.approx([0.4, 0.35])
    assert data["arms"]["local"]["window_per_seed"] == pytest.approx([0.2, 0.25, 0.2167], abs=1e-4)
    (diff,) = [d["window"] for d in data["differences"] if d["arms"] == ["federated", "local"]]
    # 0.375 - 0.2222; Welch: se^2 = 0.00125/2 + 0.000648/3 = 0.000841, df = 1.7 -> 1 (t 12.706): +/- 0.3685
    assert diff["difference"] == pytest.approx(0.1528, abs=1e-4)
    assert diff["seeds_ci95"] == pytest.approx([-0.2157, 0.5212], abs=1e-3)
    assert diff["seeds_needed"] == 3
    assert "Differences of the mean over each run's last 3 planned rounds" in text
    assert "- federated − local: +0.153; over seeds [-0.216, +0.521]; seeds needed: 3" in text


def test_report_gives_the_window_difference_of_one_seed(tmp_path: Path) -> None:
    """One seed an arm (a batch-24 session) still shows the declared statistic, the difference of
    the last-rounds means, with its interval over seeds marked as needing two: before, only the
    final round's difference was printed, and the GPU notes had to say it was not the statistic."""
    arms = _arms_module()
    runs = [{"name": arms.run_name(arm, 5), "arm": arm, "seed": 5} for arm in ("federated", "local")]
    (tmp_path / arms.MATRIX_FILE).write_text(json.dumps({"recipe": "webshop_windowed_verl", "runs": runs}))
    # batch 24 seed 5's validation counts (docs/results.md §3): rounds 3-5 134/192 and 136/192
    _run(tmp_path, "federated-s5", [c / 64 for c in (42, 45, 44, 44, 46, 44)])
    _run(tmp_path, "local-s5", [c / 64 for c in (42, 38, 45, 45, 47, 44)])
    text = arms.report(tmp_path)
    (diff,) = json.loads((tmp_path / "arms.json").read_text())["differences"]
    assert diff["window"] == {"difference": pytest.approx(-0.0104, abs=1e-4), "seeds_ci95": None,
                              "seeds_needed": None}
    assert "- federated − local: +0.000; over seeds (needs 2 or more seeds per arm)" in text  # round 5: 44 and 44
    assert "- federated − local: -0.010; over seeds (needs 2 or more seeds per arm)" in text
    assert "per seed: federated 0.698; local 0.708" in text


def test_report_names_the_runs_that_lost_a_client(tmp_path: Path) -> None:
    """A run can end with every round aggregated and still have trained one round without a client,
    or have evaluated without one (batch 12's federated seed 4): the report says which runs, rounds
    and clients, since their windows rest on partial rounds."""
    arms = _arms_module()
    runs = [{"name": arms.run_name("federated", seed), "arm": "federated", "seed": seed} for seed in (1, 2)]
    (tmp_path / arms.MATRIX_FILE).write_text(json.dumps({"recipe": "tinyguess_verl", "runs": runs}))
    _run(tmp_path, "federated-s1", [0.1, 0.2, 0.3])
    recorder = RunRecorder(tmp_path / "runs" / "federated-s2", {"base_model": "/m", "total_rounds": 2})
    recorder.record_eval(server_round=0, model="/m", metrics={"num-examples": 64, "success-rate": 0.1})
    for r, actors, rejected in ((1, {0: "/c0", 1: "/c1"}, {}), (2, {0: "/c0"}, {1: "killed", -200: "stranger"})):
        recorder.record_round(server_round=r, clients=[0, 1], started_from="/m", client_actors=actors,
                              aggregated=f"/g{r}", rejected=rejected, client_metrics={})
        recorder.record_eval(server_round=r, model=f"/g{r}", metrics={"num-examples": 32, "success-rate": 0.25},
                             failed={1: "killed"} if r == 2 else {-201: "stranger"})
    recorder.finish(*recorder.outcome())
    text = arms.report(tmp_path)
    data = json.loads((tmp_path / "arms.json").read_text())
    assert [r["deviations"] for r in data["runs"]] == [[], [
        "round 2 trained without client(s) [1]", "round 2's evaluation lacks client(s) [1]", "status degraded"]]
    assert ("Runs that did not run as planned (their values above include these rounds): federated-s2 (round 2 "
            "trained without client(s) [1]; round 2's evaluation lacks client(s) [1]; status degraded)") in text
    # An empty round, and a PPO round whose actor averaged both clients but whose critic lacks one.
    report_tool = gpu_tool("arms_report")
    assert report_tool.deviations({"status": "degraded", "rounds": [
        {"round": 1, "clients": [0, 1], "aggregated_actor": None, "client_actor_ids": [], "rejected": {"0": "x"}},
        {"round": 2, "clients": [0, 1], "aggregated_actor": "/g2", "client_actor_ids": [0, 1], "rejected": {"1": "y"}},
    ], "val_curve": [{"round": 2, "failed": {"user-key": "z"}}]}) == [
        "round 1 aggregated nothing", "round 2's critic lacks client(s) [1]", "status degraded"]


def test_waves_keep_the_sessions_within_the_budget() -> None:
    arms = _arms_module()
    runs = arms.plan("tinyguess_verl", [1, 2], ["federated", "local", "centralized", "fedprox"], "num_rounds=3", 39400)
    assert [r["sessions"] for r in runs] == [2, 1, 1, 2] * 2
    assert len({r["port"] for r in runs}) == len(runs)
    assert runs[0]["overrides"] == "recipe=tinyguess_verl seed=1 num_rounds=3"
    groups = arms.waves(runs, 5)
    assert all(sum(r["sessions"] for r in g) <= 5 for g in groups)
    assert [r["name"] for g in groups for r in g] == [r["name"] for r in runs]  # order kept, nothing lost
    assert [[r["name"] for r in g] for g in groups][0] == ["federated-s1", "local-s1", "centralized-s1"]


def test_stop_ends_every_running_launcher_group_and_forgets_ended_ones(tmp_path: Path) -> None:
    """``arms.py stop`` signals each run's whole process group (a launcher and what it started in
    its group), the scheduler first, and drops the pid files of runs that had already ended."""
    import os
    import subprocess
    import time

    import psutil

    arms = _arms_module()
    # a "run": a launcher shell whose child sleeps, both in the launcher's own session/group
    running = subprocess.Popen(["bash", "-c", "sleep 300 & wait"], start_new_session=True)
    ended = subprocess.Popen(["true"], start_new_session=True)
    ended.wait()
    (tmp_path / "federated-s1.pid").write_text(arms._pid_line(running.pid))
    (tmp_path / "local-s1.pid").write_text(f"{ended.pid} 12345\n")
    # a pid file whose process is gone and whose pid now belongs to another process (this one)
    (tmp_path / "centralized-s1.pid").write_text(f"{os.getpid()} 1\n")
    time.sleep(0.2)  # let the launcher start its child
    child = subprocess.run(["pgrep", "-g", str(running.pid), "sleep"], capture_output=True, text=True).stdout.split()
    assert child, "the launcher's child did not start"

    assert arms.stop(tmp_path) == ["federated-s1"]
    assert running.wait(timeout=10) != 0
    def alive(pid: str) -> bool:  # a zombie (killed, not yet reaped by init) counts as gone
        try:
            return psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in child):
        time.sleep(0.1)
    assert not any(alive(pid) for pid in child), "the group's child survived"
    assert not list(tmp_path.glob("*.pid"))
    assert arms.stop(tmp_path) == []


def test_stop_leaves_pid_files_that_are_not_its_own_alone(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """``--out`` defaults to ``$OUT``, a folder others may use too: ``arms.py stop`` used to read every
    ``*.pid`` there, delete each one not holding "pid start-ticks" (a database's) and signal the
    group of any that did. It reads only its own (``schedule.pid``, ``<run>.pid``); one of those that
    it cannot parse is left and named on stderr; its runs' pid files are handled as before."""
    import subprocess

    arms = _arms_module()
    (tmp_path / arms.MATRIX_FILE).write_text(json.dumps({"runs": [{"name": "federated-s1"}, {"name": "local-s2"}]}))
    ours = subprocess.Popen(["sleep", "300"], start_new_session=True)
    theirs = subprocess.Popen(["sleep", "300"], start_new_session=True)  # another tool's daemon, own group
    try:
        (tmp_path / "federated-s1.pid").write_text(arms._pid_line(ours.pid))
        (tmp_path / "local-s2.pid").write_text("12")  # ours by name, but cut short: not a pid line of ours
        foreign = {"postgres.pid": "4242\n/var/lib/postgresql/data\n1700000000\n5432\n",
                   "daemon.pid": arms._pid_line(theirs.pid)}  # even one in arms.py's own format
        for name, text in foreign.items():
            (tmp_path / name).write_text(text)

        assert arms.main(["stop", "--out", str(tmp_path)]) == 0
        assert ours.wait(timeout=10) != 0 and not (tmp_path / "federated-s1.pid").exists()
        assert theirs.poll() is None, "a foreign pid file's process was signalled"
        for name, text in foreign.items():
            assert (tmp_path / name).read_text() == text, name
        assert (tmp_path / "local-s2.pid").read_text() == "12"
        printed = capsys.readouterr()
        assert printed.out == "stopped: federated-s1\n"
        assert printed.err.splitlines() == [f"arms.py stop: left {tmp_path / 'local-s2.pid'} alone: it holds '12', "
                                            "not '<pid> <start ticks>' as arms.py writes"]
    finally:
        for process in (ours, theirs):
            process.kill()
            process.wait()


def _gpu_share_module():  # noqa: ANN202 - tools/gpu/gpu_share.py, as arms.py imports it
    _arms_module()  # puts tools/gpu on sys.path
    import gpu_share

    return gpu_share


def test_each_session_gets_an_even_share_of_the_gpu_and_an_over_commit_is_refused() -> None:
    share = _gpu_share_module()
    assert share.share(2, 0.3) == 0.3  # two sessions: the default fits (0.85 / 2 = 0.42)
    assert share.share(4, 0.3) == 0.21  # the two side-by-side matrices of 2026-12-02: 4 x 0.3 did not fit
    assert share.share(3, 0.3) == 0.28 and share.share(4, 0.3, explicit=0.2) == 0.2
    assert share.share(2, 0.3, explicit=0.44) == 0.42
    # beside 2 live sessions at 0.3 each: an even split of the 0.25 they leave
    assert share.share(2, 0.3, other_sessions=2, other_held=0.6) == 0.12
    assert share.share(2, 0.3, other_sessions=2, other_held=0.42) == 0.21
    with pytest.raises(share.ShareError, match=r"trainer.gpu_memory_utilization=0.3 for 4 verl session\(s\) beside 0 "
                                               r"live one\(s\) on this GPU .*set at most 0.22"):
        share.share(4, 0.3, explicit=0.3)
    with pytest.raises(share.ShareError, match=r"hold 85% of this GPU already: no room for 1 more"):
        share.share(1, 0.3, other_sessions=2, other_held=0.85)
    assert share.explicit_value("num_rounds=3 trainer.gpu_memory_utilization=0.2") == 0.2
    assert share.explicit_value("num_rounds=3") is None
    with pytest.raises(share.ShareError, match="expected a number in"):
        share.explicit_value("+trainer.gpu_memory_utilization=lots")
    assert share.without_setting("a=1 trainer.gpu_memory_utilization=0.2 b=2") == "a=1 b=2"


def test_launch_counts_the_sessions_of_other_live_matrices_and_passes_each_run_its_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two matrices launched side by side (WebShop and TinyGuess, 2 sessions each) share the GPU:
    the second finds the first in the registry, and its runs get what the first leaves (before:
    0.3 each, 4 x 0.3 of the GPU, and vLLM did not start)."""
    import subprocess

    arms = _arms_module()
    share = _gpu_share_module()
    live = tmp_path / "live"
    started: list[subprocess.Popen[bytes]] = []

    def start(out: Path, run: dict) -> subprocess.Popen[bytes]:  # a live process in place of a GPU run
        process = subprocess.Popen(["sleep", "60"], start_new_session=True)
        started.append(process)
        return process

    monkeypatch.setattr(arms, "_start", start)
    try:
        # an entry whose processes have all ended is no matrix
        ended = subprocess.Popen(["true"])
        ended.wait()
        share.register(tmp_path / "old", 5, 5, [ended.pid], 0.3, live)
        first = arms.launch(tmp_path / "ws", "webshop_verl", [1], ["federated"], "env.data_dir=/d", 39400,
                            max_sessions=2, live_dir=live)
        assert first[0]["overrides"].endswith("env.data_dir=/d trainer.gpu_memory_utilization=0.3")
        # and a detached sampler records the node's memory while the matrix runs (tools/gpu/hostmem.py)
        deadline = time.monotonic() + 60  # a hang guard, not a timing check
        while not (tmp_path / "ws" / "hostmem.jsonl").exists():
            assert time.monotonic() < deadline, (tmp_path / "ws" / "hostmem.log").read_text()
            time.sleep(0.1)
        assert not share.entry_path(tmp_path / "old", live).exists()
        second = arms.launch(tmp_path / "w", "tinyguess_verl", [1], ["federated"], "num_rounds=3", 39500,
                             max_sessions=2, live_dir=live)
        assert second[0]["overrides"] == "recipe=tinyguess_verl seed=1 num_rounds=3 trainer.gpu_memory_utilization=0.12"
        printed = capsys.readouterr().out
        assert (f"GPU: 4 verl session(s) at once (2 of this matrix; other live matrices: 2 in {tmp_path / 'ws'}, "
                "holding 60% of the GPU): each run gets trainer.gpu_memory_utilization=0.12") in printed
        matrix = json.loads((tmp_path / "w" / arms.MATRIX_FILE).read_text())
        assert matrix["gpu"]["gpu_memory_utilization"] == 0.12 and matrix["gpu"]["total_sessions"] == 4
        # a third asking explicitly for more than is left is refused, and starts nothing
        monkeypatch.setattr(share, "LIVE_DIR", live)
        count = len(started)
        code = arms.main(["launch", "--out", str(tmp_path / "x"), "--recipe", "tinyguess_verl", "--seeds", "1",
                          "--arms", "local", "--extra", "trainer.gpu_memory_utilization=0.2"])
        assert code == 2 and len(started) == count and not (tmp_path / "x" / arms.MATRIX_FILE).exists()
        assert capsys.readouterr().err == (
            "arms.py launch: trainer.gpu_memory_utilization=0.2 for 1 verl session(s) beside 4 live one(s) on this GPU "
            "(holding 84% of it) over-commits it (more than 90% in all): vLLM would not start; set at most 0.06, or "
            "leave it out to get an even share, or run fewer sessions (--max-sessions)\n")
        # once the first matrix's runs have ended, it no longer counts
        started[0].kill()
        started[0].wait()
        assert [m["out"] for m in share.live_matrices(tmp_path / "x", live)] == [str((tmp_path / "w").resolve())]
        # relaunching into the same folder resumes its named runs: the share the first launch
        # recorded is kept (0.12), not the 0.3 an empty GPU would give, or the server would refuse
        # every run as another configuration
        for process in started[1:]:
            process.kill()
            process.wait()
        again = arms.launch(tmp_path / "w", "tinyguess_verl", [1], ["federated"], "num_rounds=3", 39500,
                            max_sessions=2, live_dir=live)
        assert again[0]["overrides"].endswith("trainer.gpu_memory_utilization=0.12")
    finally:
        for process in started:
            process.kill()
            process.wait()


def test_wait_returns_when_every_launcher_ended_and_false_at_the_timeout(tmp_path: Path) -> None:
    """``arms.py wait`` follows the launchers' pid files: it returns True once every one of them has
    ended (an ended launcher nobody reaped yet, a zombie, counts as ended; so does a pid file whose pid
    now belongs to another process), and False at its timeout while one is still running."""
    import os
    import subprocess

    arms = _arms_module()
    (tmp_path / arms.MATRIX_FILE).write_text(json.dumps({"runs": [{"name": "federated-s1"}]}))
    short = subprocess.Popen(["sleep", "1"], start_new_session=True)  # not reaped until the end: a zombie
    (tmp_path / "federated-s1.pid").write_text(arms._pid_line(short.pid))
    (tmp_path / "local-s1.pid").write_text(f"{os.getpid()} 1\n")  # a recycled pid: another process now
    assert arms.running(tmp_path) == ["federated-s1"]
    assert arms.wait([tmp_path], timeout=120, every=60, poll=0.1) is True
    assert Path(f"/proc/{short.pid}").exists(), "the launcher was reaped: the zombie case was not tested"
    assert arms.running(tmp_path) == []
    short.wait()

    long = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        (tmp_path / "schedule.pid").write_text(arms._pid_line(long.pid))
        assert arms.wait([tmp_path], timeout=0.5, every=60, poll=0.1) is False
        assert arms.running(tmp_path) == ["schedule"]
        assert arms.main(["wait", "--out", str(tmp_path), "--timeout", "0.2"]) == arms.STILL_RUNNING
    finally:
        long.kill()
        long.wait()
    assert arms.main(["wait", "--out", str(tmp_path), "--timeout", "5"]) == 0
    assert arms.main(["wait", "--out", str(tmp_path / "nowhere"), "--timeout", "5"]) == 2


def test_wait_collect_brings_back_what_a_still_running_matrix_wrote(tmp_path: Path) -> None:
    """``arms.py wait --collect DIR`` packs each matrix's results so far into ``DIR/<folder>.tgz``
    through the real ``collect.sh``, also when the wait timed out with a run still going: a device
    machine lost between two calls then loses nothing that an earlier call had already brought back."""
    import subprocess
    import tarfile

    arms = _arms_module()
    out, into = tmp_path / "outF", tmp_path / "returned"
    out.mkdir()
    (out / arms.MATRIX_FILE).write_text(json.dumps({"recipe": "tinyguess_verl", "runs": [
        {"name": "federated-s3", "arm": "federated", "seed": 3}]}))
    _run(out, "federated-s3", [0.0625, 0.09375, 0.40625])  # three validated rounds so far
    (out / "federated-s3.log").write_text("round 2 of 10\n")
    still = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        (out / "federated-s3.pid").write_text(arms._pid_line(still.pid))
        code = arms.main(["wait", "--out", str(out), "--timeout", "0.2", "--collect", str(into)])
    finally:
        still.kill()
        still.wait()
    assert code == arms.STILL_RUNNING
    with tarfile.open(into / "outF.tgz") as archive:
        names = set(archive.getnames())
        metrics = archive.extractfile("results/federated-s3/metrics.jsonl")
        assert metrics is not None
        rows = [json.loads(line) for line in metrics.read().decode().splitlines() if line.strip()]
    assert "results/federated-s3/federated_summary.json" in names
    assert "results/federated-s3.log.tail" in names
    assert [r["success_rate"] for r in rows if r.get("event") == "evaluate"] == [0.0625, 0.09375, 0.40625]


def test_pool_lays_out_the_committed_declared_runs_and_reports_them(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """The declared comparison from the committed summaries, as results.md §4 reads it: seeds from 4,
    the recipe's runs only (a lost run's snapshot, ``lost-r9-federated-s7``, stays out)."""
    arms = _arms_module()
    out = tmp_path / "declared"
    assert arms.main(["pool", "--from", str(REPO / "docs" / "gpu-runs"), "--out", str(out),
                      "--arms", "federated", "local", "--min-seed", "4"]) == 0
    matrix = json.loads((out / "matrix.json").read_text())
    names = {run["name"] for run in matrix["runs"]}
    assert {"federated-s4", "federated-s5", "federated-s6", "local-s4", "local-s5"} <= names
    assert not {"federated-s1", "federated-s3", "local-s3", "centralized-s1", "fedprox-s1"} & names
    assert all(Path(run["source"]).name.startswith("recipe10r-") for run in matrix["runs"])
    assert (out / "runs" / "federated-s4" / "metrics.jsonl").is_file()
    report = json.loads((out / "arms.json").read_text())
    s4 = next(run for run in report["runs"] if run["name"] == "federated-s4")
    assert s4["window_mean"] == 0.5312  # rounds 8-10 of the committed run: 0.531 in results.md
    assert s4["deviations"] == ["round 9 trained without client(s) [1]"]
    assert "federated − local" in capsys.readouterr().out


def test_pool_refuses_one_arm_and_seed_committed_twice_and_an_occupied_folder(tmp_path: Path) -> None:
    pooling = gpu_tool("arms_pool")
    source = tmp_path / "gpu-runs"
    committed = REPO / "docs" / "gpu-runs" / "2026-12-03" / "recipe10r-local-s5-summary.json"
    for day in ("2026-12-03", "2026-12-05"):
        (source / day).mkdir(parents=True)
        (source / day / committed.name).write_bytes(committed.read_bytes())
    with pytest.raises(pooling.PoolError, match="local seed 5 is committed twice: .*2026-12-03.*2026-12-05"):
        pooling.pool(source, tmp_path / "a", ["local"], 4)
    with pytest.raises(pooling.PoolError, match="no recipe10r-<arm>-s<seed>-summary.json"):
        pooling.pool(source, tmp_path / "b", ["federated"], 4)
    (source / "2026-12-05" / committed.name).unlink()
    pooling.pool(source, tmp_path / "c", ["local"], 4)
    assert json.loads((tmp_path / "c" / "matrix.json").read_text())["runs"][0]["name"] == "local-s5"
    assert not (tmp_path / "c" / "runs" / "local-s5" / "metrics.jsonl").exists()  # none committed beside it
    with pytest.raises(pooling.PoolError, match="is not empty: pool into a new or empty folder"):
        pooling.pool(source, tmp_path / "c", ["local"], 4)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "hostmem.jsonl").write_text("")  # an earlier matrix's samples: not this pool's
    with pytest.raises(pooling.PoolError, match="is not empty"):
        pooling.pool(source, tmp_path / "d", ["local"], 4)


def test_pool_refuses_an_out_that_is_a_file(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """``--out`` naming a file exits 2 with a message (it used to be a NotADirectoryError traceback),
    and the file is left as it was."""
    arms = _arms_module()
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    assert arms.main(["pool", "--from", str(REPO / "docs" / "gpu-runs"), "--out", str(taken),
                      "--arms", "federated", "local", "--min-seed", "4"]) == 2
    assert f"arms.py pool: {taken} is a file, not a folder: give --out a new or empty folder" in (
        capsys.readouterr().err)
    assert taken.read_text() == "{}"


def test_pool_leaves_out_named_runs_and_says_so(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """The sensitivity check of results.md §3 (batch 15) by command: without federated seed 4 (a
    client lost in round 9) the rounds 8-10 difference is +0.130 [+0.000, +0.259]; a misspelt
    name is refused, naming the runs there are, rather than leaving nothing out."""
    arms = _arms_module()
    out = tmp_path / "without-s4"
    assert arms.main(["pool", "--from", str(REPO / "docs" / "gpu-runs"), "--out", str(out), "--arms", "federated",
                      "local", "--min-seed", "4", "--leave-out", "federated-s4"]) == 0
    printed = capsys.readouterr().out
    matrix = json.loads((out / "matrix.json").read_text())
    names = {run["name"] for run in matrix["runs"]}
    assert "federated-s4" not in names and {"federated-s5", "local-s4"} <= names
    assert matrix["left_out"] == ["federated-s4"]
    assert not (out / "runs" / "federated-s4").exists()
    window = next(d["window"] for d in json.loads((out / "arms.json").read_text())["differences"])
    assert window["difference"] == pytest.approx(0.1295, abs=1e-4)
    assert window["seeds_ci95"] == pytest.approx([0.0003, 0.2587], abs=1e-4)
    assert "- federated − local: +0.130; over seeds [+0.000, +0.259]" in printed
    assert "Left out on request (`--leave-out`; a sensitivity check, not the full set): federated-s4" in printed
    assert "round 9 trained without" not in printed  # the deviating run is the one left out

    assert arms.main(["pool", "--from", str(REPO / "docs" / "gpu-runs"), "--out", str(tmp_path / "typo"),
                      "--arms", "federated", "local", "--min-seed", "4", "--leave-out", "fedrated-s4"]) == 2
    error = capsys.readouterr().err
    assert "--leave-out fedrated-s4: no such run among those pooled (federated-s4, federated-s5" in error
    every_local = [f"local-s{seed}" for seed in range(4, 10)]
    assert arms.main(["pool", "--from", str(REPO / "docs" / "gpu-runs"), "--out", str(tmp_path / "no-local"),
                      "--arms", "federated", "local", "--min-seed", "4", "--leave-out", *every_local]) == 2
    assert "--leave-out leaves no run of local: leave fewer out" in capsys.readouterr().err
    assert not (tmp_path / "typo" / "matrix.json").exists()


#: compare's advice after its refusal of a summary (``fedagent_flwr.compare.run_statistic``), which the
#: arms tools repeat word for word
RESTORE = "restore the summary as its run wrote it, or leave the run out"
NO_RATE = ("has no success_rate (every point the recorder writes has one; a round whose evaluation recorded "
           "nothing has no point)")


def _alter(path: Path, change) -> Path:  # noqa: ANN001 - change: a function editing the parsed summary
    """``path``'s summary edited by ``change`` by hand, as someone (or a merge) might."""
    summary = json.loads(path.read_text())
    change(summary)
    path.write_text(json.dumps(summary))
    return path


def _twice(summary: dict) -> None:
    summary["val_curve"].append({**summary["val_curve"][-1], "success_rate": 0.0})


@pytest.mark.parametrize(("rates", "change", "problem"), [
    # 2 rounds (fewer than the window): the old report counted the point as 0.0, exit 0, federated's final
    # mean 0.25 instead of 0.5, without a word
    ([0.1, 0.5, 0.5], lambda s: s["val_curve"][-1].pop("success_rate"), f"val_curve round 2 {NO_RATE}"),
    # 4 rounds (a whole window): the old report ended in compare's CompareError traceback
    ([0.1, 0.5, 0.5, 0.5, 0.5], lambda s: s["val_curve"][-1].pop("success_rate"), f"val_curve round 4 {NO_RATE}"),
    # a null rate: a TypeError traceback from float(None)
    ([0.1, 0.5, 0.5], lambda s: s["val_curve"][-1].update(success_rate=None),
     "val_curve round 2 has success_rate null, not a number from 0 to 1"),
    # round 2 twice, the later point 0.0: the old report took that one as the final round's, without a word
    ([0.1, 0.5, 0.5], _twice,
     "val_curve has round 2 twice (val_curve[2] and val_curve[3]; the recorder writes one point a round)"),
], ids=["no-rate-short-run", "no-rate-whole-window", "null-rate", "round-twice"])
def test_report_refuses_a_summary_compare_refuses_in_one_line(tmp_path: Path, capsys, rates: list[float],  # noqa: ANN001
                                                              change, problem: str) -> None:  # noqa: ANN001
    """A run's summary that ``fedagent compare`` refuses (``compare_report.summary_problem``) is refused
    by ``arms.py report`` too, in compare's words with the file named, exit 2 and nothing written: its
    point is not read as 0.0 (nor the round's later point kept), and no traceback."""
    arms = _arms_module()
    runs = [{"name": arms.run_name(arm, seed), "arm": arm, "seed": seed} for arm in ("federated", "local")
            for seed in (1, 2)]
    (tmp_path / arms.MATRIX_FILE).write_text(json.dumps({"recipe": "tinyguess_verl", "runs": runs}))
    for run in runs:
        _run(tmp_path, run["name"], rates)
    path = _alter(tmp_path / "runs" / "federated-s1" / "federated_summary.json", change)
    assert arms.main(["report", "--out", str(tmp_path)]) == 2
    printed = capsys.readouterr()
    assert printed.err == f"arms.py report: {path}: {problem}: {RESTORE}\n"
    assert printed.out == ""
    assert not list(tmp_path.glob("arms.*"))


def test_report_refusal_is_one_line_from_the_command(tmp_path: Path) -> None:
    """The command as a GPU node runs it (``python3 tools/gpu/arms.py report``): exit 2, one line on
    stderr naming the tool, the file and the round, no traceback."""
    import subprocess
    import sys

    runs = [{"name": f"{arm}-s1", "arm": arm, "seed": 1} for arm in ("federated", "local")]
    (tmp_path / "matrix.json").write_text(json.dumps({"recipe": "tinyguess_verl", "runs": runs}))
    for run in runs:
        _run(tmp_path, run["name"], [0.1, 0.2, 0.3, 0.4, 0.5])
    path = _alter(tmp_path / "runs" / "local-s1" / "federated_summary.json",
                  lambda s: s["val_curve"][3].pop("success_rate"))
    done = subprocess.run([sys.executable, str(REPO / "tools" / "gpu" / "arms.py"), "report", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"arms.py report: {path}: val_curve round 3 {NO_RATE}: {RESTORE}\n"


def test_pool_refuses_a_committed_summary_compare_refuses_before_writing(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """``arms.py pool`` checks the committed summaries before it lays anything out: one that compare
    refuses is named (the committed file, not the pooled copy), exit 2, and ``--out`` is not made (it
    used to be a CompareError traceback from the report, the folder left half made and in use)."""
    arms = _arms_module()
    source = tmp_path / "gpu-runs"
    (source / "2026-12-03").mkdir(parents=True)
    for arm in ("federated", "local"):
        name = f"recipe10r-{arm}-s5-summary.json"
        (source / "2026-12-03" / name).write_bytes((REPO / "docs" / "gpu-runs" / "2026-12-03" / name).read_bytes())
    path = _alter(source / "2026-12-03" / "recipe10r-federated-s5-summary.json",
                  lambda s: s["val_curve"][9].pop("success_rate"))
    out = tmp_path / "pooled"
    assert arms.main(["pool", "--from", str(source), "--out", str(out), "--arms", "federated", "local",
                      "--min-seed", "4"]) == 2
    printed = capsys.readouterr()
    assert printed.err == f"arms.py pool: {path}: val_curve round 9 {NO_RATE}: {RESTORE}\n"
    assert printed.out == "" and not out.exists()
