"""Stopping a Flower SuperLink together with everything it started, by PID.

A SuperLink starts ``flower-superexec`` in a session of its own, which runs ``flwr-simulation``
and Ray; Ray's agents outlive their parents when the SuperLink alone is stopped. ``flwr run .``
also leaves its managed local SuperLink running after the run (Flower's design). ``make run``
gives that SuperLink a project-local ``FLWR_HOME``; :func:`stop_local_superlink` finds it by the
log path only it uses and stops its process tree, so nothing else on the machine is touched.

    python -m fedagent_flwr.launch stop-local .flwr
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from fedagent_flwr.procs import pids_with_cmdline, stop_group


def stop_superlink_tree(pid: int, grace_s: float = 15.0) -> None:
    """Stop a SuperLink (its process group) and the superexec group(s) it launched."""
    groups = []
    for member in [pid, *pids_with_cmdline(f"--parent-pid {pid}")]:
        with contextlib.suppress(ProcessLookupError):
            groups.append(os.getpgid(member))
    for group in dict.fromkeys(groups):
        stop_group(group, grace_s)


def local_superlink_pids(flwr_home: str | os.PathLike[str]) -> list[int]:
    """PIDs of ``flower-superlink`` processes started by ``flwr run`` for this ``FLWR_HOME``."""
    return pids_with_cmdline(str(Path(flwr_home).resolve() / "local-superlink"), "flower-superlink")


def stop_local_superlink(flwr_home: str | os.PathLike[str]) -> list[int]:
    """Stop this home's managed local SuperLink(s) and their children; return the PIDs."""
    pids = local_superlink_pids(flwr_home)
    for pid in pids:
        stop_superlink_tree(pid)
    return pids


def main(argv: list[str] | None = None) -> int:
    """``stop-local FLWR_HOME``: used by ``make run`` after ``flwr run`` returns."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "stop-local":
        print("usage: python -m fedagent_flwr.launch stop-local FLWR_HOME", file=sys.stderr)
        return 2
    pids = stop_local_superlink(args[1])
    print(f"stopped the local SuperLink {pids}" if pids else "no local SuperLink runs for this FLWR_HOME")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
