"""Host and GPU memory of a GPU node while a matrix runs, sampled into ``OUT/hostmem.jsonl``.

Host memory, not the GPU's, caps how many verl sessions one node runs (docs/results.md, batch 11:
five sessions and three simulations held 84.1 of 125.8 GiB of host memory at round 2, the GPU
48.4 of 140.4 GiB). ``arms.py launch`` starts this detached beside each matrix, so every batch
records the figure that decides ``--max-sessions``. Standard library only: it runs on the node's
bare ``python3``.

    python3 tools/gpu/hostmem.py --out /tmp/out --pids 123:4567 456 [--every 30]

Samples until none of ``--pids`` (the matrix's launchers; ``pid:ticks`` names the process by its
start time as well, as ``gpu_share`` records it, else the start time is read now) runs: an ended
process that nobody reaped, or a pid taken by a later process, counts as ended. One JSON line a
sample: ``{"t": unix time, "host_used_mib", "host_total_mib", "gpu_used_mib", "top"}`` (``gpu_used_mib``
is the sum over the node's GPUs, None without ``nvidia-smi``; ``top`` the ``--top`` largest processes
by memory, ``[pid, command, mib]`` each, ``mib`` the proportional set size (shared pages divided among
their processes; the resident size where the kernel gives none, and in batches 12 and 13), so that a
batch whose host memory grows round by round says which processes grow: batch 12 did not). Lines
are appended and flushed one by one; a line cut short (a full disk) is skipped when read back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_share  # noqa: E402  (beside this file; standard library only)

SAMPLES_FILE = "hostmem.jsonl"
TOP = 12  # processes recorded per sample
COMMAND_CHARS = 80


def host_mib(meminfo: Path = Path("/proc/meminfo")) -> tuple[int, int]:
    """(used, total) host memory in MiB; used = MemTotal - MemAvailable, as ``free`` counts it."""
    fields = {}
    for line in meminfo.read_text().splitlines():
        name, _, rest = line.partition(":")
        fields[name] = int(rest.split()[0])  # kB
    total = fields["MemTotal"]
    return (total - fields["MemAvailable"]) // 1024, total // 1024


def gpu_used_mib() -> int | None:
    """GPU memory in use over all GPUs (MiB), or None when ``nvidia-smi`` is missing or fails."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    values = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not values or not all(v.isdigit() for v in values):
        return None
    return sum(int(v) for v in values)


def proportional_mib(entry: Path) -> int | None:
    """The process's proportional set size (``Pss`` of ``smaps_rollup``) in MiB: its resident pages,
    each shared page divided among the processes that map it. Resident size (``statm``) counts a
    page shared by N processes N times, so verl's workers and vLLM's, which share model weights and
    CUDA mappings, would add up to more than the node holds. None where the kernel offers no
    ``smaps_rollup`` (before Linux 4.14) or it cannot be read."""
    try:
        for line in (entry / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) // 1024
    except (OSError, IndexError, ValueError):
        return None
    return None


#: What ``top``'s sizes are (Pss; the resident size for a process whose ``smaps_rollup`` cannot be
#: read), recorded in every sample since 2026-12-04.
TOP_MEASURE = "pss"
#: When the sampler switched from resident sizes to Pss (commit 59033fd, 2026-12-03 21:11 UTC): a
#: sample without ``top_measure`` taken before it (batches 12 and 13) holds resident sizes, which count
#: a page shared by N processes N times; one taken after it (batch 14) holds Pss.
PSS_SINCE = 1796332270.0


def top_processes(count: int = TOP, proc: Path = Path("/proc")) -> list[list[Any]]:
    """The ``count`` processes with the most memory, largest first: ``[pid, command, mib]`` each,
    ``mib`` the proportional set size (:func:`proportional_mib`; the resident size where that cannot
    be read), the command being the first ``COMMAND_CHARS`` characters of the command line (Ray's
    workers rename theirs, e.g. ``ray::WorkerDict``). Processes that end while being read, and
    kernel threads (no command line), are left out."""
    page = os.sysconf("SC_PAGE_SIZE")
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            resident_pages = int((entry / "statm").read_text().split()[1])
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile, or not ours to read
        command = " ".join(w.decode("utf-8", "replace") for w in words if w).strip()
        if command:
            proportional = proportional_mib(entry)
            mib = proportional if proportional is not None else resident_pages * page // (1024 * 1024)
            found.append([int(entry.name), command[:COMMAND_CHARS], mib])
    found.sort(key=lambda row: (-row[2], row[0]))
    return found[:count]


def sample(top: int = TOP) -> dict[str, Any]:
    """One sample of the node's memory and its ``top`` largest processes, stamped with the time."""
    used, total = host_mib()
    return {"t": round(time.time(), 1), "host_used_mib": used, "host_total_mib": total, "gpu_used_mib": gpu_used_mib(),
            "top": top_processes(top), "top_measure": TOP_MEASURE}


def watched(specs: list[str]) -> list[tuple[int, str | None]]:
    """``pid`` or ``pid:ticks`` -> (pid, start ticks); a bare pid's ticks are read now (None: gone)."""
    found = []
    for spec in specs:
        pid, named, ticks = spec.partition(":")
        found.append((int(pid), (ticks or None) if named else gpu_share.start_ticks(int(pid))))
    return found


def watch(out: Path, pids: list[tuple[int, str | None]], every: float, top: int = TOP) -> int:
    """Append a sample to ``out/hostmem.jsonl`` every ``every`` seconds, and a last one once none of
    ``pids`` runs (checked each second, so the sampler does not outlive the matrix by long); return
    how many samples were written."""
    count = 0
    with open(out / SAMPLES_FILE, "a") as samples:
        while True:
            samples.write(json.dumps(sample(top)) + "\n")
            samples.flush()
            count += 1
            due = time.monotonic() + every
            while time.monotonic() < due:
                if not any(gpu_share.is_running(pid, ticks) for pid, ticks in pids):
                    samples.write(json.dumps(sample(top)) + "\n")
                    return count + 1
                time.sleep(min(1.0, max(due - time.monotonic(), 0.0)))


def _rows(out: Path) -> list[dict[str, Any]]:
    """``out``'s samples in order, lines cut short skipped."""
    try:
        lines = (out / SAMPLES_FILE).read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short
        if isinstance(row, dict) and isinstance(row.get("host_used_mib"), int):
            rows.append(row)
    return rows


def peak(out: Path) -> dict[str, Any] | None:
    """The largest host and GPU memory of ``out``'s samples, or None when there are none."""
    rows = _rows(out)
    if not rows:
        return None
    gpu = [r["gpu_used_mib"] for r in rows if r.get("gpu_used_mib") is not None]
    return {"samples": len(rows), "host_used_mib": max(r["host_used_mib"] for r in rows),
            "host_total_mib": rows[-1]["host_total_mib"], "gpu_used_mib": max(gpu) if gpu else None}


def kind(command: str) -> str:
    """The kind of process a command line names, so that like processes sum: a Ray worker's title up
    to its method (``ray::WorkerDict.update_actor`` -> ``ray::WorkerDict``), else the program's name
    and its words before the first ``--`` option (which tend to differ per process), four at most."""
    words = command.split()
    if not words:
        return ""
    if words[0].startswith("ray::"):
        return words[0].split(".", 1)[0]
    head = [words[0].rsplit("/", 1)[-1]]
    for word in words[1:4]:
        if word.startswith("--"):
            break
        head.append(word)
    return " ".join(head)


def top_measure(out: Path) -> str:
    """What the ``top`` sizes of ``out``'s samples are: ``"pss"`` when every sample says so, else
    ``"resident"`` (samples from before :data:`PSS_SINCE` held resident sizes)."""
    measures = {row.get("top_measure", "pss" if float(row.get("t", 0)) >= PSS_SINCE else "resident")
                for row in _rows(out) if row.get("top")}
    return "pss" if measures == {"pss"} else "resident"


def growth(out: Path) -> list[dict[str, Any]]:
    """How much each kind of process grew while sampled: per process (pid and kind: a Ray worker's
    title changes with the method it runs), its largest resident memory among the samples it was
    among the largest in, minus that at the first, summed per ``kind``; largest growth first. The
    peak, not the last sample: a process's last sample may catch it tearing down. ``first_mib``/
    ``peak_mib`` sum the same processes; processes seen in one sample only count with a growth of 0.
    Samples without ``top`` (before it was recorded) give none."""
    first: dict[tuple[int, str], int] = {}
    peak: dict[tuple[int, str], int] = {}
    for row in _rows(out):
        for pid, command, rss in row.get("top") or []:
            key = (pid, kind(command))
            first.setdefault(key, rss)
            peak[key] = max(peak.get(key, rss), rss)
    kinds: dict[str, dict[str, Any]] = {}
    for key, rss in first.items():
        total = kinds.setdefault(key[1], {"kind": key[1], "processes": 0, "first_mib": 0, "peak_mib": 0})
        total["processes"] += 1
        total["first_mib"] += rss
        total["peak_mib"] += peak[key]
    for total in kinds.values():
        total["grew_mib"] = total["peak_mib"] - total["first_mib"]
    return sorted(kinds.values(), key=lambda k: (-k["grew_mib"], k["kind"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pids", nargs="+", required=True, help="pid or pid:ticks of each process to outlive")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples (> 0)")
    parser.add_argument("--top", type=int, default=TOP, help="largest processes recorded per sample")
    args = parser.parse_args(argv)
    if not args.every > 0:
        parser.error(f"--every must be above 0, got {args.every}")
    args.out.mkdir(parents=True, exist_ok=True)
    watch(args.out, watched(args.pids), args.every, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
