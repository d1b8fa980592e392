"""The GPU's memory, shared by every matrix launched on the node: who is on it, and each vLLM's share.

Each verl session's vLLM asks for ``trainer.gpu_memory_utilization`` of the GPU when its engine
starts, and refuses to start when less than that is free ("Free memory on device cuda:0 (1.54/139.8
GiB) on startup is less than desired GPU memory utilization (0.3, 41.94 GiB)"). Two matrices
launched side by side, each within its own ``--max-sessions``, asked for 4 x 30 % of one H200 and
failed every round. So ``tools/gpu/arms.py launch``:

* keeps a registry of the live matrices, one JSON file per matrix under :data:`LIVE_DIR` named by a
  digest of its output folder, with the pids of its launchers (and scheduler), the verl sessions
  it runs at once and the share each asks for; an entry whose processes have all ended is removed
  when read (:func:`live_matrices`);
* gives every session of the new matrix the share :func:`share` of the GPU for all sessions on it,
  this matrix's and the live others' (never more than the others leave), and refuses a value set
  explicitly that over-commits it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

LIVE_DIR = Path("/tmp/fa-arms-live")
#: The share of the GPU all vLLM engines together are given; the rest is for the FSDP actors,
#: CUDA contexts and evaluation (Hugging Face generation).
TOTAL_SHARE = 0.85
#: An explicit value above this in total is refused: vLLM would not start beside the others.
OVERCOMMIT = 0.9
KEY = "trainer.gpu_memory_utilization"
_OVERRIDE = re.compile(r"(?:^|\s)\+{0,2}" + re.escape(KEY) + r"=(?P<value>\S*)")


class ShareError(ValueError):
    """The GPU cannot be shared as asked; the message names the setting and what to do."""


def start_ticks(pid: int) -> str | None:
    """When ``pid`` started (clock ticks after boot, /proc/<pid>/stat field 22), or None if gone.
    A pid with other start ticks is another process (pids are reused)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def entry_path(out: Path, live_dir: Path | None = None) -> Path:
    """The registry file of the matrix whose output folder is ``out`` (in ``live_dir``, default
    :data:`LIVE_DIR`)."""
    live_dir = LIVE_DIR if live_dir is None else live_dir
    digest = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]
    return live_dir / f"{digest}.json"


def register(out: Path, sessions: int, max_sessions: int, pids: list[int], utilization: float | None,
             live_dir: Path | None = None) -> Path:
    """Record the matrix in ``out`` as live: ``pids`` are its launchers (and scheduler), ``sessions``
    the verl sessions it runs at once (at most ``max_sessions``), each asking vLLM for
    ``utilization`` of the GPU (None: its runs start no vLLM)."""
    path = entry_path(out, live_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"out": str(out.resolve()), "sessions": sessions, "max_sessions": max_sessions,
             "gpu_memory_utilization": utilization, "pids": [[pid, start_ticks(pid)] for pid in pids]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entry, indent=2))
    tmp.replace(path)
    return path


def is_running(pid: int, ticks: str | None) -> bool:
    """Whether ``pid`` is still the process that started at ``ticks`` and has not ended. An ended
    process that nobody has reaped yet (a zombie, state Z, or dead, X) keeps its /proc entry and its
    start ticks, but holds nothing any more."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return ticks is not None and len(fields) > 19 and fields[19] == ticks and fields[0] not in ("Z", "X")


def _alive(entry: dict[str, Any]) -> bool:
    return any(is_running(int(pid), ticks) for pid, ticks in entry.get("pids", []))


def live_matrices(out: Path, live_dir: Path | None = None) -> list[dict[str, Any]]:
    """The registry entries of every other live matrix on this node (``out``'s own entry, from an
    earlier launch into the same folder, is not another matrix). Entries whose processes have all
    ended, and unreadable ones, are removed."""
    ours = entry_path(out, live_dir)
    found: list[dict[str, Any]] = []
    for path in sorted(ours.parent.glob("*.json")) if ours.parent.is_dir() else []:
        try:
            entry = json.loads(path.read_text())
            alive = _alive(entry)
        except (OSError, ValueError, TypeError, AttributeError):
            alive = False
        if not alive:
            path.unlink(missing_ok=True)
        elif path != ours:
            found.append(entry)
    return found


def explicit_value(extra: str) -> float | None:
    """The value ``extra`` (Hydra overrides) sets for :data:`KEY`, or None when it sets none."""
    matches = list(_OVERRIDE.finditer(extra))
    if not matches:
        return None
    text = matches[-1].group("value")
    try:
        value = float(text)
    except ValueError:
        raise ShareError(f"--extra sets {KEY}={text!r}: expected a number in (0, 1]") from None
    if not 0 < value <= 1:
        raise ShareError(f"--extra sets {KEY}={text}: expected a number in (0, 1]")
    return value


def without_setting(extra: str) -> str:
    """``extra`` without its :data:`KEY` overrides (the launch passes its own)."""
    return " ".join(_OVERRIDE.sub(" ", extra).split())


def share(sessions: int, default: float, explicit: float | None = None, other_sessions: int = 0,
          other_held: float = 0.0) -> float:
    """Each session's ``gpu_memory_utilization`` for ``sessions`` new verl sessions beside
    ``other_sessions`` live ones that asked for ``other_held`` of the GPU in all: the configured
    value (``explicit``, else ``default``), at most :data:`TOTAL_SHARE` split evenly over all
    sessions and at most an even split of what the others leave of it (rounded down to 2 decimals).

    Raises :class:`ShareError` when ``explicit`` over-commits the GPU (more than :data:`OVERCOMMIT`
    in all), or when the others leave nothing.
    """
    if sessions < 1:
        raise ValueError(f"sessions must be >= 1, got {sessions}")
    total = sessions + other_sessions
    if explicit is not None and max(total * explicit, other_held + sessions * explicit) > OVERCOMMIT + 1e-9:
        most = math.floor(min(OVERCOMMIT / total, (OVERCOMMIT - other_held) / sessions) * 100 + 1e-9) / 100
        raise ShareError(
            f"{KEY}={explicit:g} for {sessions} verl session(s) beside {other_sessions} live one(s) on this GPU "
            f"(holding {other_held:.0%} of it) over-commits it (more than {OVERCOMMIT:.0%} in all): vLLM would not "
            f"start; set at most {max(most, 0):g}, or leave it out to get an even share, or run fewer sessions "
            "(--max-sessions)")
    even = math.floor(min(TOTAL_SHARE / total, (TOTAL_SHARE - other_held) / sessions) * 100 + 1e-9) / 100
    if even <= 0:
        raise ShareError(f"the {other_sessions} live verl session(s) of other matrices hold {other_held:.0%} of "
                         f"this GPU already: no room for {sessions} more; wait for them, or stop them "
                         "(tools/gpu/arms.py stop --out ...)")
    return min(explicit if explicit is not None else default, even)
