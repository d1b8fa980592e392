"""Helpers around Flower's managed local SuperLink for ``make run``.

``flwr run .`` starts a detached local SuperLink that keeps running after the run (Flower's
design). ``make run`` gives it a project-local ``FLWR_HOME``; this module finds that SuperLink by
the log file path only it uses and stops it by PID, so nothing else on the machine is touched.

    python -m fedagent_flwr.launch stop-local .flwr
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def local_superlink_pids(flwr_home: str | os.PathLike[str]) -> list[int]:
    """PIDs of ``flower-superlink`` processes started for this ``FLWR_HOME``."""
    marker = str(Path(flwr_home).resolve() / "local-superlink")
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        if any(w.endswith("flower-superlink") for w in words[:2]) and any(marker in w for w in words):
            pids.append(int(entry.name))
    return pids


def stop_local_superlink(flwr_home: str | os.PathLike[str], grace_s: float = 15.0) -> list[int]:
    """SIGTERM this home's local SuperLink(s), SIGKILL after ``grace_s``; return the PIDs."""
    pids = local_superlink_pids(flwr_home)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.2)
    for pid in pids:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    return pids


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "stop-local":
        print("usage: python -m fedagent_flwr.launch stop-local FLWR_HOME", file=sys.stderr)
        return 2
    pids = stop_local_superlink(args[1])
    print(f"stopped local SuperLink {pids}" if pids else "no local SuperLink running for this FLWR_HOME")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
