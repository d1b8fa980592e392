"""tools/gpu/hostmem.py: the node's memory sampled while a matrix runs, and its peak in the arms report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from testkit.gpu_tools import gpu_tool

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "gpu" / "hostmem.py"


def _tool() -> Any:
    return gpu_tool("hostmem")


def test_host_memory_is_read_as_free_counts_it(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131960832 kB\nMemFree:         1000000 kB\nMemAvailable:   43181000 kB\n")
    # used = MemTotal - MemAvailable (not - MemFree: page cache can be given back)
    assert _tool().host_mib(meminfo) == ((131960832 - 43181000) // 1024, 131960832 // 1024)
    used, total = _tool().host_mib()  # this machine's own
    assert 0 < used < total


def test_the_sampler_runs_while_its_pids_run_and_then_stops(tmp_path: Path) -> None:
    """The real script under the bare interpreter (``-S``, as on a GPU node), watching a real process."""
    watched = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    sampler = subprocess.Popen([sys.executable, "-S", str(TOOL), "--out", str(tmp_path), "--pids", str(watched.pid),
                                "--every", "0.2"])
    samples = tmp_path / "hostmem.jsonl"
    deadline = time.monotonic() + 120  # a hang guard, not a timing check
    try:
        # it samples while the process runs ...
        while not samples.exists() or len(samples.read_text().splitlines()) < 3:
            assert sampler.poll() is None, "the sampler stopped while its process ran"
            assert time.monotonic() < deadline, "no samples"
            time.sleep(0.2)
        # ... and stops once it has ended (a hang guard, not a timing check)
        assert watched.stdin is not None
        watched.stdin.close()
        watched.wait(timeout=60)
        assert sampler.wait(timeout=60) == 0
    finally:
        for process in (watched, sampler):
            process.kill()
            process.wait()
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) >= 4  # three or more while it ran, one after
    assert all(0 < r["host_used_mib"] < r["host_total_mib"] for r in rows)
    peak = _tool().peak(tmp_path)
    assert peak["samples"] == len(rows) and peak["host_used_mib"] == max(r["host_used_mib"] for r in rows)


def test_an_ended_process_nobody_reaped_or_a_reused_pid_counts_as_ended(tmp_path: Path) -> None:
    """A zombie keeps its pid and /proc entry, and a reused pid is another process: neither may keep
    the sampler going after the matrix has ended."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # ends at once; not reaped until below
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        while _state(zombie.pid) != "Z":  # a hang guard below: the sampler's own wait
            time.sleep(0.05)
        # ``other`` runs, but under start ticks it did not start at: a pid that has been reused
        sampler = subprocess.run([sys.executable, "-S", str(TOOL), "--out", str(tmp_path), "--pids", str(zombie.pid),
                                  f"{other.pid}:1", "--every", "30"], timeout=120, check=False)
        assert sampler.returncode == 0
        assert len((tmp_path / "hostmem.jsonl").read_text().splitlines()) == 2  # the first and the last
    finally:
        assert other.stdin is not None
        other.stdin.close()
        for process in (zombie, other):
            process.kill()
            process.wait()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_line_cut_short_is_skipped_and_every_must_be_positive(tmp_path: Path) -> None:
    (tmp_path / "hostmem.jsonl").write_text(
        json.dumps({"t": 1.0, "host_used_mib": 100, "host_total_mib": 1000, "gpu_used_mib": None}) + "\n"
        + '{"t": 31.0, "host_used_mi')
    assert _tool().peak(tmp_path) == {"samples": 1, "host_used_mib": 100, "host_total_mib": 1000, "gpu_used_mib": None}
    refused = subprocess.run([sys.executable, "-S", str(TOOL), "--out", str(tmp_path), "--pids", "1", "--every", "0"],
                             capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode == 2 and "--every must be above 0, got 0.0" in refused.stderr


def test_the_arms_report_gives_the_peak(tmp_path: Path) -> None:
    arms = gpu_tool("arms")
    (tmp_path / arms.MATRIX_FILE).write_text(json.dumps({"recipe": "tinyguess_verl", "runs": []}))
    (tmp_path / "hostmem.jsonl").write_text(
        json.dumps({"t": 1.0, "host_used_mib": 20713, "host_total_mib": 128869, "gpu_used_mib": 4411}) + "\n"
        + json.dumps({"t": 31.0, "host_used_mib": 86126, "host_total_mib": 128869, "gpu_used_mib": 49530}) + "\n"
        + json.dumps({"t": 61.0, "host_used_mib": 85687, "host_total_mib": 128869, "gpu_used_mib": None}) + "\n")
    text = arms.report(tmp_path)
    assert ("Node memory at its peak over 3 samples (hostmem.jsonl): host 84.1 of 125.8 GiB, "
            "GPUs 48.4 GiB (summed).") in text
    data = json.loads((tmp_path / "arms.json").read_text())
    assert data["memory_peak"] == {"samples": 3, "host_used_mib": 86126, "host_total_mib": 128869,
                                   "gpu_used_mib": 49530}


_GROWER = """# grower-{marker}
import sys
held = [b"\\x01" * (64 << 20)]  # touched, so resident
print("ready", flush=True)
sys.stdin.readline()
held.append(b"\\x01" * (256 << 20))
print("grown", flush=True)
sys.stdin.read()
"""


def test_each_sample_names_the_largest_processes_and_the_report_says_which_kind_grew(tmp_path: Path) -> None:
    """Two real processes of one kind that each grow by 256 MiB while the real sampler (bare
    interpreter) reads /proc: the report sums them under their kind."""
    grower_code = _GROWER.replace("{marker}", str(os.getpid()))  # its own kind: not other processes like it
    # a short argv[0], so the marker is inside the 80 characters kept however long the venv's path is
    name = f"grower{os.getpid()}"
    growers = [subprocess.Popen([name, "-c", grower_code], executable=sys.executable, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    hang_guard = time.monotonic() + 300  # a stuck sampler fails the test, not the suite's timeout
    sampler = None
    samples = tmp_path / "hostmem.jsonl"
    try:
        for grower in growers:
            assert grower.stdout is not None and grower.stdout.readline() == "ready\n"
        sampler = subprocess.Popen([sys.executable, "-S", str(TOOL), "--out", str(tmp_path), "--pids",
                                    *(str(g.pid) for g in growers), "--every", "0.2", "--top", "100000"])
        while not samples.exists() or not samples.read_text().endswith("\n"):
            assert sampler.poll() is None, "the sampler stopped while its processes ran"
            assert time.monotonic() < hang_guard, "no sample written"
            time.sleep(0.1)
        for grower in growers:
            assert grower.stdin is not None and grower.stdout is not None
            grower.stdin.write("\n")
            grower.stdin.flush()
            assert grower.stdout.readline() == "grown\n"
        count = len(samples.read_text().splitlines())
        while len(samples.read_text().splitlines()) < count + 2:  # a full sample after both grew
            assert sampler.poll() is None, "the sampler stopped while its processes ran"
            assert time.monotonic() < hang_guard, "no sample after the growers grew"
            time.sleep(0.1)
        for grower in growers:
            assert grower.stdin is not None
            grower.stdin.close()
            grower.wait(timeout=60)
        assert sampler.wait(timeout=60) == 0
    finally:
        for process in [*growers, *([sampler] if sampler else [])]:
            process.kill()
            process.wait()
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    first = {pid: (command, rss) for pid, command, rss in rows[0]["top"]}
    assert all(first[g.pid][0].startswith(f"{name} -c ") for g in growers)
    assert all(first[g.pid][1] >= 64 for g in growers)
    assert all(len(command) <= 80 for row in rows for _, command, _ in row["top"])
    tool = _tool()
    assert {row["top_measure"] for row in rows} == {"pss"} and tool.top_measure(tmp_path) == "pss"
    assert rows[0]["top"] == sorted(rows[0]["top"], key=lambda r: (-r[2], r[0]))  # largest first
    kinds = {k["kind"]: k for k in tool.growth(tmp_path)}
    mine = kinds[tool.kind(first[growers[0].pid][0])]
    assert mine["kind"] == f"{name} -c # grower-{os.getpid()}"
    assert mine["processes"] == 2  # both growers, under one kind
    assert mine["grew_mib"] > 300  # more than one grower could (256 MiB each)
    # only the largest are kept
    assert len(_tool().top_processes(3)) == 3


def test_kinds_sum_ray_workers_and_drop_per_process_options() -> None:
    kind = _tool().kind
    assert kind("ray::WorkerDict.actor_rollout_update_actor") == kind("ray::WorkerDict") == "ray::WorkerDict"
    assert (kind("/usr/bin/python -m fedagent_flwr.trainers.verl.entry serve --session /tmp/a")
            == kind("python -m fedagent_flwr.trainers.verl.entry serve --session /tmp/b")
            == "python -m fedagent_flwr.trainers.verl.entry serve")


def test_the_arms_report_says_which_kind_of_process_grew(tmp_path: Path) -> None:
    arms = gpu_tool("arms")
    (tmp_path / arms.MATRIX_FILE).write_text(json.dumps({"recipe": "tinyguess_verl", "runs": []}))
    base = {"host_total_mib": 128869, "gpu_used_mib": None}
    (tmp_path / "hostmem.jsonl").write_text(
        json.dumps({**base, "t": 1.0, "host_used_mib": 50000,
                    "top": [[11, "ray::WorkerDict", 9000], [12, "ray::WorkerDict.update_actor", 8000],
                            [20, "python -m fedagent_flwr.trainers.verl.entry serve --s a", 1600]]}) + "\n"
        + json.dumps({**base, "t": 31.0, "host_used_mib": 60000,
                      "top": [[11, "ray::WorkerDict.generate", 13000], [12, "ray::WorkerDict", 12096],
                              [20, "python -m fedagent_flwr.trainers.verl.entry serve --s a", 1900]]}) + "\n"
        # a worker tearing down at the end: its peak, not this last sample, is what it grew to
        + json.dumps({**base, "t": 61.0, "host_used_mib": 45000, "top": [[11, "ray::WorkerDict", 3000]]}) + "\n")
    text = arms.report(tmp_path)
    assert "- `ray::WorkerDict` (2 processes): 16.6 -> 24.5 GiB (+7.9)" in text
    assert "- `python -m fedagent_flwr.trainers.verl.entry serve` (1 process): 1.6 -> 1.9 GiB (+0.3)" in text
    assert json.loads((tmp_path / "arms.json").read_text())["process_growth"][0]["grew_mib"] == 8096
    # these samples say nothing of their measure, as batches 12 and 13 wrote them: resident sizes
    assert "Resident size (a page shared by N processes counts N times" in text and "Proportional" not in text
    samples = (tmp_path / "hostmem.jsonl").read_text().splitlines()
    rows = [{**json.loads(line), "top_measure": "pss"} for line in samples]
    (tmp_path / "hostmem.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert "Proportional set size (Pss" in arms.report(tmp_path)
    # batch 14 recorded Pss before samples named their measure: told apart by when they were taken
    tool = _tool()
    rows = [{k: v for k, v in row.items() if k != "top_measure"} for row in rows]
    (tmp_path / "hostmem.jsonl").write_text("".join(json.dumps({**row, "t": tool.PSS_SINCE + row["t"]}) + "\n"
                                                    for row in rows))
    assert tool.top_measure(tmp_path) == "pss"


_SHARER = """
import mmap, os, sys
shared = mmap.mmap(-1, 256 << 20)  # anonymous and shared: a fork maps the same pages
shared.write(b"\\x01" * (256 << 20))
child = os.fork()
sum(shared[i] for i in range(0, 256 << 20, 4096))  # map every page into this process too
print("ready", os.getpid(), flush=True)
sys.stdin.read() if child else os.read(0, 1)
"""


def test_pages_two_processes_share_count_half_to_each() -> None:
    """A parent and its fork share 256 MiB: each one's resident size counts all of it (512 MiB
    for the two, more than they hold), their proportional sizes about half each."""
    tool = _tool()
    sharer = subprocess.Popen([sys.executable, "-c", _SHARER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert sharer.stdout is not None
        pids = sorted(int(sharer.stdout.readline().split()[1]) for _ in range(2))
        assert sharer.pid in pids
        rows = {pid: mib for pid, _, mib in tool.top_processes(100000) if pid in pids}
        resident = {pid: int((Path("/proc") / str(pid) / "statm").read_text().split()[1]) * os.sysconf(
            "SC_PAGE_SIZE") >> 20 for pid in pids}
    finally:
        sharer.kill()
        sharer.wait()
        assert sharer.stdin is not None
        sharer.stdin.close()  # the fork's read of stdin ends, and so does the fork
    assert all(resident[pid] >= 256 for pid in pids), resident
    assert sorted(rows) == pids and all(120 <= rows[pid] <= 200 for pid in pids), rows
