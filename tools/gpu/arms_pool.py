"""Gather committed GPU runs into one matrix folder, so that ``arms.py report`` compares them.

    python3 tools/gpu/arms.py pool --from docs/gpu-runs --out /tmp/declared --arms federated local --min-seed 4
    python3 tools/gpu/arms.py pool ... --leave-out federated-s4      # a sensitivity check

The runs of the declared comparison (docs/results.md §4) come from several GPU sessions, each
committed as ``docs/gpu-runs/<date>/<prefix>-<arm>-s<seed>-summary.json`` with its metrics in
``<date>/metrics/<prefix>-<arm>-s<seed>[.metrics].jsonl``. This lays the chosen ones out as a
launched matrix would be (``matrix.json``, ``runs/<arm>-s<seed>/``), from the named prefix only:
runs committed under another prefix (``lost-r9-...``, ``repro-A-...``) are not the recipe's runs
of record and stay out. Two committed runs of one arm and seed are refused, naming both files:
which one counts is the caller's decision, not this tool's.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # arms_report reads fedagent_flwr
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/gpu is not a package

from arms_report import MATRIX_FILE, check_summary  # noqa: E402

from fedagent_flwr.atomic import write_json_atomic  # noqa: E402
from fedagent_flwr.outcome import SummaryError, load_summary  # noqa: E402

#: The prefix of the 10-round recipe's committed runs (``recipe10r-federated-s4-summary.json``).
DEFAULT_PREFIX = "recipe10r"


class PoolError(ValueError):
    """The committed runs cannot be pooled as asked (none found, or one arm and seed twice)."""


def find_runs(source: Path, prefix: str, arms: list[str], min_seed: int) -> dict[tuple[str, int], Path]:
    """``(arm, seed) -> summary file`` of every committed run under ``source`` (its dated folders)
    named ``<prefix>-<arm>-s<seed>-summary.json`` with ``arm`` in ``arms`` and ``seed >= min_seed``."""
    pattern = re.compile(rf"^{re.escape(prefix)}-({'|'.join(map(re.escape, arms))})-s(\d+)-summary\.json$")
    found: dict[tuple[str, int], Path] = {}
    for path in sorted(source.glob("*/*-summary.json")):
        match = pattern.match(path.name)
        if match is None or int(match.group(2)) < min_seed:
            continue
        key = (match.group(1), int(match.group(2)))
        if key in found:
            raise PoolError(f"{key[0]} seed {key[1]} is committed twice: {found[key]} and {path}; "
                            "rename the one that does not count (e.g. lost-...) and pool again")
        found[key] = path
    if not found:
        raise PoolError(f"no {prefix}-<arm>-s<seed>-summary.json under {source}/*/ for arms {arms} "
                        f"and seeds from {min_seed}")
    return found


def require_empty_folder(out: Path, error: type[ValueError], advice: str) -> None:
    """Raise ``error`` unless ``out`` can be written into as a new or empty folder: when it is not
    empty (``advice`` says why that matters and what to do), or when it, or the nearest of its
    parents that exists, is no folder (a file given as ``--out``). Shared by ``pool`` and
    ``arms_dynamics.dynamics``, whose tables would read a used folder's files as their own."""
    existing = next((path for path in (out, *out.parents) if path.exists()), None)
    if existing is not None and not existing.is_dir():
        raise error(f"{existing} is a file, not a folder: give --out a new or empty folder"
                    + ("" if existing == out else f" ({out} would be inside it)"))
    if out.exists() and any(out.iterdir()):
        raise error(f"{out} is not empty: {advice}")


def ordered_runs(found: dict[tuple[str, int], Path], arms: list[str]) -> list[tuple[tuple[str, int], Path]]:
    """``found``'s runs (:func:`find_runs`) in the order of the tables: by arm as ``arms`` lists
    them, then by seed."""
    return sorted(found.items(), key=lambda item: (arms.index(item[0][0]), item[0][1]))


def _run_key(name: str) -> tuple[str, int] | None:
    """``("federated", 4)`` for ``federated-s4``; None for anything else."""
    match = re.fullmatch(r"([a-z]+)-s(\d+)", name)
    return (match.group(1), int(match.group(2))) if match else None


def metrics_file(summary: Path) -> Path | None:
    """The metrics committed beside ``summary`` (both spellings the dated folders use), or None."""
    stem = summary.name.removesuffix("-summary.json")
    for name in (f"{stem}.jsonl", f"{stem}.metrics.jsonl"):
        if (summary.parent / "metrics" / name).is_file():
            return summary.parent / "metrics" / name
    return None


def pool(source: Path, out: Path, arms: list[str], min_seed: int, recipe: str = "tinyguess_verl",
         prefix: str = DEFAULT_PREFIX, leave_out: list[str] | None = None) -> dict[str, Any]:
    """Write ``out/matrix.json`` and ``out/runs/<arm>-s<seed>/`` (summary, and metrics where
    committed) for the runs :func:`find_runs` picks, less those named in ``leave_out``
    (``<arm>-s<seed>``: a sensitivity check by command, not by hand; the matrix and the report name
    them); return the matrix. ``out`` must be new or empty: pooling into a used folder would mix
    what it holds with these runs. A committed summary that ``fedagent compare`` would refuse raises
    :class:`fedagent_flwr.compare.CompareError` naming it (``arms_report.check_summary``), before
    anything is written."""
    require_empty_folder(out, PoolError, "pool into a new or empty folder (a run's old metrics or a "
                         "hostmem.jsonl left there would enter the report)")
    found = find_runs(source, prefix, arms, min_seed)
    left_out = list(dict.fromkeys(leave_out or []))
    # A misspelt name would silently leave nothing out and the report would read as the check asked for.
    unknown = [name for name in left_out if _run_key(name) not in found]
    if unknown:
        raise PoolError(f"--leave-out {' '.join(unknown)}: no such run among those pooled "
                        f"({', '.join(f'{arm}-s{seed}' for arm, seed in sorted(found))}); name runs as <arm>-s<seed>")
    removed = {key for key in map(_run_key, left_out) if key is not None}
    for key in removed:
        del found[key]
    # An arm emptied by --leave-out would drop the comparison asked for without a word.
    emptied = sorted({arm for arm, _ in removed} - {arm for arm, _ in found})
    if emptied:
        raise PoolError(f"--leave-out leaves no run of {', '.join(emptied)}: leave fewer out, or drop the arm "
                        "from --arms")
    # A summary the report would refuse is refused here, naming the committed file, before anything is
    # written (the folder would be left in use, without a report); an unreadable one the report lists
    # as a run without a result.
    for summary in found.values():
        try:
            record = load_summary(summary)
        except SummaryError:
            continue
        check_summary(summary, record)
    runs = []
    for (arm, seed), summary in ordered_runs(found, arms):
        name = f"{arm}-s{seed}"
        folder = out / "runs" / name
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(summary, folder / "federated_summary.json")
        metrics = metrics_file(summary)
        if metrics is not None:
            shutil.copyfile(metrics, folder / "metrics.jsonl")
        runs.append({"name": name, "arm": arm, "seed": seed, "source": str(summary)})
    # no waves: nothing to schedule or wait for; the folder is for ``report`` (and ``phases``)
    matrix = {"recipe": recipe, "runs": runs, "waves": [], "pooled": True, "left_out": left_out}
    write_json_atomic(out / MATRIX_FILE, matrix)
    return matrix
