"""tools/gpu/hostmem.py: the node's memory sampled while a matrix runs, and its peak in the arms report."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "gpu" / "hostmem.py"


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("hostmem", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    spec = importlib.util.spec_from_file_location("arms", REPO / "tools" / "gpu" / "arms.py")
    assert spec is not None and spec.loader is not None
    arms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arms)
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
