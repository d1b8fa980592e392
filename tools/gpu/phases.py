"""Phase tables of persistent verl sessions, from the ``phases.jsonl`` files their trainers wrote.

    python3 tools/gpu/phases.py /tmp/out                      # every phases.jsonl under /tmp/out
    python3 tools/gpu/phases.py /tmp/before /tmp/after --from-round 2 [--out phases.md]
    python3 tools/gpu/arms.py phases --out /tmp/out           # the same for an arms.py matrix

Each persistent verl session records its start-up and its rounds phase by phase
(``fedagent_flwr/trainers/verl/phases.py``; ``<run>/trainers/client_<c>/phases.jsonl``). This
prints two markdown tables with one column per session (``run/client``) and their mean:

* **start-up**: each phase's seconds, indented under the phase it runs inside; the session is
  ready at the ``session_start`` row's end (``ready at``, seconds since the trainer process
  started), and its first weight sync and generation come in round 1;
* **rounds** (from ``--from-round`` on, default 2: the first round carries the start-up): the
  mean per round of each phase, and the share of a round spent in reload + the round's first
  weight sync + dataloader (issue 16's per-round overhead, target <= 10%).

A phase recorded by several processes at once (one per rank) counts its slowest; one called
several times by one process in a round (a sync per step) counts their sum.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _load_phases_module() -> Any:
    """``fedagent_flwr/trainers/verl/phases.py`` loaded by its path: it needs only the standard
    library, whereas importing it through its package pulls in the config schema (omegaconf),
    which a GPU node's plain ``python3`` lacks (the staged site directory is only on the runs' path)."""
    path = REPO / "fedagent_flwr" / "trainers" / "verl" / "phases.py"
    spec = importlib.util.spec_from_file_location("fedagent_flwr_phases_file", path)
    assert spec is not None and spec.loader is not None  # the file is part of this checkout
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


_PHASES = _load_phases_module()
FILE_NAME: str = _PHASES.FILE_NAME
PhasesFileError: type[Exception] = _PHASES.PhasesFileError
read_phases = _PHASES.read_phases

#: Start-up phases in the order they happen, with their depth (a phase runs inside the last
#: shallower one above it). The ``*_ready`` phases overlap what follows ``init_workers``.
STARTUP: list[tuple[str, int]] = [
    ("server_start", 0), ("session_start", 0), ("compose_config", 1), ("ray_start", 1), ("driver_imports", 1),
    ("task_runner", 1), ("task_runner_spawn", 2), ("trainer_setup", 2), ("init_workers", 2),
    ("ray_resource_pool", 3), ("worker_group_create", 3), ("worker_spawn_actor_rollout", 4),
    ("worker_spawn_critic", 4), ("critic_init", 3), ("init_model", 3), ("ref_init", 4), ("actor_init", 4),
    ("reward_loop_create", 3), ("rollout_engine_init", 3), ("agent_loop_workers_create", 3), ("sleep_replicas", 3),
    ("agent_loop_workers_ready", 2), ("reward_loop_workers_ready", 2),
    ("first_weight_sync", 0), ("first_generation", 0),
]
#: A round's phases, in order, with their depth.
ROUND: list[tuple[str, int]] = [
    ("round_total", 0), ("prepare", 1), ("train_round", 1), ("reload", 2), ("reload_actor", 3), ("reload_ref", 3),
    ("reload_critic", 3), ("dataloader", 2), ("fit", 2), ("weight_sync", 3), ("generation", 3),
    ("update_critic", 3), ("update_actor", 3), ("checkpoint_save", 3), ("sleep_replicas", 2),
    ("collect_result", 1),
]
OVERHEAD = ("reload", "dataloader")  # plus the round's first weight sync


class Session:
    """The records of one session (one trainer process's life) under a column label."""

    def __init__(self, label: str, records: list[dict[str, Any]]) -> None:
        self.label = label
        self.records = records

    def startup(self) -> dict[str, float]:
        """Seconds per start-up phase (records without a round, and the session's ``first_*``)."""
        return _combine(r for r in self.records if "round" not in r or r["phase"].startswith("first_"))

    def ready_at(self) -> float | None:
        """Seconds since the trainer process started when the session was ready (None: never)."""
        ends = [float(r["t"]) for r in self.records if r["phase"] == "session_start" and not r.get("failed")]
        return min(ends) if ends else None

    def rounds(self, from_round: int) -> dict[int, dict[str, float]]:
        """Seconds per phase of each round >= ``from_round`` (the ``first_*`` phases left out),
        with ``overhead`` (reload + the round's first sync + dataloader) added."""
        by_round: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for record in self.records:
            if "round" in record and not record["phase"].startswith("first_") and int(record["round"]) >= from_round:
                by_round[int(record["round"])].append(record)
        table = {}
        for number, records in sorted(by_round.items()):
            values = _combine(records)
            first_sync = [r for r in records if r["phase"] == "weight_sync" and r.get("call") == 1]
            if first_sync or any(name in values for name in OVERHEAD):
                values["overhead"] = (sum(values.get(name, 0.0) for name in OVERHEAD)
                                      + sum(float(r["dt"]) for r in first_sync))
            table[number] = values
        return table


def _combine(records: Any) -> dict[str, float]:
    """Per phase: the sum over one process's records, then the slowest process."""
    per_pid: dict[str, dict[Any, float]] = defaultdict(lambda: defaultdict(float))
    for record in records:
        per_pid[record["phase"]][record.get("pid")] += float(record["dt"])
    return {name: max(pids.values()) for name, pids in per_pid.items()}


def find_sessions(roots: list[Path]) -> list[Session]:
    """Every session in the phases.jsonl files under ``roots`` (a file, or a directory searched
    recursively); labelled by the path below the root without ``runs``/``trainers`` (prefixed
    by the root's name when there are several roots), ``#n`` for a file's later sessions."""
    sessions = []
    for root in roots:
        if not root.exists():
            raise SystemExit(f"phases: {root} does not exist; pass a run directory, an arms.py --out "
                             f"directory or a {FILE_NAME}")
        files = [root] if root.is_file() else sorted(root.rglob(FILE_NAME))
        for path in files:
            parts = [] if path == root else [p for p in path.parent.relative_to(root).parts
                                             if p not in ("runs", "trainers")]
            label = "/".join(([root.name] if len(roots) > 1 or not parts else []) + parts) or path.parent.name
            groups: dict[str, list[dict[str, Any]]] = {}
            for record in read_phases(path):
                groups.setdefault(str(record.get("session", "")), []).append(record)
            for index, records in enumerate(groups.values(), start=1):
                sessions.append(Session(label if index == 1 else f"{label} #{index}", records))
    return sessions


def _row(name: str, depth: int, values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    mean = sum(present) / len(present) if present else None
    cells = ["–" if v is None else f"{v:.1f}" for v in [*values, mean]]
    return f"| {'&nbsp;' * 2 * depth}{name} | " + " | ".join(cells) + " |"


def _ordered(canonical: list[tuple[str, int]], seen: set[str]) -> list[tuple[str, int]]:
    """The canonical rows present in ``seen``, each indented by its ancestors that are present,
    then any other phase (sorted), not indented."""
    rows, open_depths = [], []  # depths of the present rows a later row may run inside
    for name, depth in canonical:
        if name not in seen:
            continue
        while open_depths and open_depths[-1] >= depth:
            open_depths.pop()
        rows.append((name, len(open_depths)))
        open_depths.append(depth)
    known = {name for name, _ in canonical}
    return rows + [(n, 0) for n in sorted(seen - known)]


def tables(sessions: list[Session], from_round: int = 2) -> str:
    """The start-up and the rounds table (markdown) of ``sessions``."""
    if not sessions:
        return f"no {FILE_NAME} found\n"
    header = "| phase | " + " | ".join(s.label for s in sessions) + " | mean |"
    rule = "|---" * (len(sessions) + 2) + "|"
    startups = [s.startup() for s in sessions]
    lines = ["Start-up of the persistent verl session (seconds per phase; an indented phase runs inside the one "
             "above it; `*_ready` overlap what follows; `first_*` happen in round 1)", "", header, rule]
    for name, depth in _ordered(STARTUP, set().union(*startups)):
        lines.append(_row(name, depth, [s.get(name) for s in startups]))
    lines.append(_row("**ready at** (s since the trainer process started)", 0, [s.ready_at() for s in sessions]))
    rounds = [s.rounds(from_round) for s in sessions]
    means: list[dict[str, float]] = []
    for per_round in rounds:
        names = set().union(*per_round.values()) if per_round else set()
        # a phase's mean over the rounds that have it (a round without a sync has no first sync)
        means.append({n: sum(r[n] for r in per_round.values() if n in r) / sum(n in r for r in per_round.values())
                      for n in names})
    lines += ["", f"Rounds >= {from_round} (seconds per round, mean over the rounds; overhead = reload + the "
              "round's first weight sync + dataloader)", "", header, rule]
    lines.append(_row("rounds averaged", 0, [float(len(r)) if r else None for r in rounds]))
    for name, depth in _ordered(ROUND, set().union(*means) - {"overhead"}):
        lines.append(_row(name, depth, [m.get(name) for m in means]))
    lines.append(_row("overhead", 0, [m.get("overhead") for m in means]))
    shares = [100.0 * m["overhead"] / m["round_total"] if m.get("round_total") and "overhead" in m else None
              for m in means]
    lines.append(_row("overhead share of the round (%)", 0, shares))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", type=Path, nargs="+", help=f"directories searched for {FILE_NAME}, or such files")
    parser.add_argument("--from-round", type=int, default=2, help="first round of the rounds table (default 2)")
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    args = parser.parse_args(argv)
    try:
        text = tables(find_sessions(args.roots), args.from_round)
    except PhasesFileError as exc:
        raise SystemExit(f"phases: {exc}") from exc
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
