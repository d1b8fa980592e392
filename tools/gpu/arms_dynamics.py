"""How each committed GPU run trained, one row a run: when it "took off", and what went with it.

    python3 tools/gpu/arms.py dynamics --from docs/gpu-runs --out /tmp/dynamics --arms centralized federated local \\
        --min-seed 4

The centralized spread analysis (docs/gpu-runs/2026-12-04/centralized-spread.md, §2 and §3.2) found
that every recipe run follows one path: long, high-entropy replies and slow gains, then a take-off in
which replies shrink and entropy falls while validation climbs; the runs differ mostly in when that
comes. Its table came from throwaway scripts; this makes it one command. The runs are the ones
``arms.py pool`` picks (:func:`arms_pool.find_runs`, same ``--from``, ``--arms``, ``--min-seed``),
read in place: validation from each run's summary (the rounds 8-10 window by
:func:`fedagent_flwr.compare.window_mean`, the statistic the comparisons use), the applied update's norm from
its ``rounds[].update_stats`` (``mean_update_norm``: the aggregate's move, its clients weighed by
their aggregation weights, unlike the training columns below, which weigh them equally; the two
agree only when the clients' weights do), and the training dynamics from the ``train`` events of
the metrics file committed beside it. Per round, client values are averaged with equal weight (a federated
round's two clients; a round in which a client was lost has the others' values only, and
``fedagent_flwr.compare.deviations`` names it under the table). verl's metrics in a ``train`` event are those
of the round's last step. A run committed without a metrics file gets the summary's columns only,
and the output says so.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # arms_report reads fedagent_flwr
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/gpu is not a package

from arms_pool import DEFAULT_PREFIX, find_runs, metrics_file, ordered_runs, require_empty_folder  # noqa: E402
from arms_report import read_checked_summary, train_client_means  # noqa: E402

from fedagent_flwr.atomic import write_json_atomic, write_text_atomic  # noqa: E402
from fedagent_flwr.compare import WINDOW, deviations, validation_by_round, window_mean  # noqa: E402

#: Take-off thresholds: a run has taken off in the first round whose mean training reply length
#: (``verl.response_length.mean``) is below TAKEOFF_LENGTH tokens, or, by the second criterion, whose
#: mean actor entropy (``verl.actor.entropy``) is below TAKEOFF_ENTROPY. Descriptive choices from the
#: centralized spread analysis (2026-12-04), read off its curves (runs that climbed went from 100-140
#: tokens and entropy ~2.5 to 20-40 tokens and entropy below 1), not tuned: nothing was fitted to them.
#: In the 26 committed recipe10r runs of arms centralized, federated and local, 55 or 65 tokens (1.4 or
#: 1.6) move no take-off by more than one round, though one at the edge can come or go (centralized
#: seed 1's round-10 length take-off is none at 55 tokens).
TAKEOFF_LENGTH = 60.0
TAKEOFF_ENTROPY = 1.5
#: The early round whose entropy and reply length are shown beside the last round's: round 5's reply
#: length ordered the centralized and federated windows in that analysis (Spearman -0.97), before
#: the window it predicts.
EARLY_ROUND = 5
#: The ``train`` event metrics read, by the name this module gives them.
TRAIN_METRICS = {
    "train_success": "success-rate",
    "zero_variance": "zero-variance-group-share",
    "entropy": "verl.actor.entropy",
    "grad_norm": "verl.actor.grad_norm",
    "length": "verl.response_length.mean",
}
JSON_FILE = "dynamics.json"
MARKDOWN_FILE = "dynamics.md"
DASH = "–"


class DynamicsError(ValueError):
    """The table cannot be written as asked (its folder is in use, or is a file)."""


def takeoff(series: dict[int, float], threshold: float, last_round: int) -> int | None:
    """The first round up to ``last_round`` whose value is below ``threshold``; None if none is."""
    return next((r for r in sorted(series) if r <= last_round and series[r] < threshold), None)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _whole_window(values: list[float], statistic: Any) -> float | None:
    """``statistic(values)`` when all :data:`fedagent_flwr.compare.WINDOW` rounds of a window are there, else
    None: over fewer rounds it would be another statistic (as :func:`fedagent_flwr.compare.window_mean`)."""
    return statistic(values) if len(values) == WINDOW else None


def run_row(arm: str, seed: int, summary_path: Path, metrics_path: Path | None) -> dict[str, Any]:
    """One run's row: the summary's columns always, the metrics file's when there is one (else None).

    The last-round and window columns are the planned last rounds' (``total_rounds``): a summary
    without a planned total (or 0) has none, rather than its round-0 base value as the last round.
    A window column has a value only when all :data:`fedagent_flwr.compare.WINDOW` of its rounds do (a mean or
    a maximum over fewer rounds would be another statistic), as :func:`fedagent_flwr.compare.window_mean`.
    ``mean_update_norm`` is the mean over rounds of ``update_stats.mean_update_norm``, the norm of
    the aggregate's move from the round's start (``checkpoint.update_stats``): the applied update,
    which weighs clients by their aggregation weights (``num-examples`` by default), whereas the
    training columns weigh each client equally; the two weightings agree only when the clients'
    weights are equal (one client, or equal shares). Raises :class:`fedagent_flwr.compare.CompareError`,
    naming the file, for a summary that cannot be read or that ``fedagent compare`` would refuse
    (:func:`arms_report.read_checked_summary`)."""
    summary = read_checked_summary(summary_path)
    total = int(summary.get("total_rounds") or 0)
    curve = summary.get("val_curve", [])
    val_by_round = validation_by_round(curve)
    norms = {int(r["round"]): float(r["update_stats"]["mean_update_norm"]) for r in summary.get("rounds", [])
             if (r.get("update_stats") or {}).get("mean_update_norm") is not None}
    window_rounds = list(range(total - WINDOW + 1, total + 1))
    row: dict[str, Any] = {
        "name": f"{arm}-s{seed}", "arm": arm, "seed": seed, "total_rounds": total,
        "summary": str(summary_path), "metrics": None if metrics_path is None else str(metrics_path),
        "val_window": window_mean(curve, total),
        "val_last": val_by_round.get(total) if total >= 1 else None,
        "mean_update_norm": _mean(list(norms.values())),
        "deviations": deviations(summary),
        "per_round": {"val_success": val_by_round, "update_norm": norms},
    }
    for column in ("train_window", "entropy_early", "entropy_last", "length_early", "length_last", "max_grad_norm",
                   "zero_variance_window_mean", "zero_variance_window_max", "takeoff_length", "takeoff_entropy"):
        row[column] = None
    if metrics_path is None:
        return row
    series = train_client_means(metrics_path, TRAIN_METRICS)  # keys matched exactly, means not rounded
    row["per_round"].update(series)
    in_window = {name: [by_round[r] for r in window_rounds if r in by_round] for name, by_round in series.items()}
    row.update({
        "train_window": _whole_window(in_window["train_success"], _mean),
        "entropy_early": series["entropy"].get(EARLY_ROUND),
        "entropy_last": series["entropy"].get(total) if total >= 1 else None,
        "length_early": series["length"].get(EARLY_ROUND),
        "length_last": series["length"].get(total) if total >= 1 else None,
        "max_grad_norm": max(series["grad_norm"].values(), default=None),
        "zero_variance_window_mean": _whole_window(in_window["zero_variance"], _mean),
        "zero_variance_window_max": _whole_window(in_window["zero_variance"], max),
        "takeoff_length": takeoff(series["length"], TAKEOFF_LENGTH, total),
        "takeoff_entropy": takeoff(series["entropy"], TAKEOFF_ENTROPY, total),
    })
    return row


def arm_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's take-offs, per criterion (reply length, entropy) apart: of its runs with metrics,
    how many took off by that criterion by their last planned round, and the median round among
    those that did (None if none did). A run counts under each criterion it met."""
    measured = [row for row in rows if row["metrics"] is not None]
    result: dict[str, Any] = {"runs": len(rows), "with_metrics": len(measured)}
    for criterion in ("length", "entropy"):
        rounds = [row[f"takeoff_{criterion}"] for row in measured if row[f"takeoff_{criterion}"] is not None]
        result[f"took_off_{criterion}"] = len(rounds)
        result[f"median_takeoff_{criterion}"] = statistics.median(rounds) if rounds else None
    return result


def missing_rounds(row: dict[str, Any]) -> list[int]:
    """The planned rounds (1 .. ``total_rounds``) that no :data:`TRAIN_METRICS` value of ``row``'s
    metrics file covers: no client's ``train`` event, or none carrying these metrics. Empty for a run
    without a metrics file (the table says that apart)."""
    if row["metrics"] is None:
        return []
    covered = {r for name in TRAIN_METRICS for r in row["per_round"][name]}
    return [r for r in range(1, row["total_rounds"] + 1) if r not in covered]


def _num(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _pair(first: float | None, second: float | None, digits: int, sep: str) -> str:
    if first is None and second is None:
        return ""
    return f"{_num(first, digits) or '?'}{sep}{_num(second, digits) or '?'}"


def _round(value: int | None) -> str:
    return DASH if value is None else str(value)


def _median(value: float | None) -> str:
    return DASH if value is None else f"{value:g}"


def render(rows: list[dict[str, Any]], arms: dict[str, dict[str, Any]]) -> str:
    """The markdown: the per-run table, the per-arm take-off summary and the notes."""
    totals = sorted({row["total_rounds"] for row in rows})
    # one planned total names its rounds; several, or one too short for them, get the general words
    last = f"r{totals[0]}" if len(totals) == 1 and totals[0] >= 1 else "last round"
    window = (f"r{totals[0] - WINDOW + 1}–{totals[0]}" if len(totals) == 1 and totals[0] >= WINDOW
              else f"last {WINDOW} rounds")
    lines = [
        f"Training dynamics per run: take-off round = first round whose mean training reply length is "
        f"< {TAKEOFF_LENGTH:g} tokens / whose mean actor entropy is < {TAKEOFF_ENTROPY:g} ({DASH}: none by the "
        "run's last planned round); training values are the clients' mean per round (verl's from the round's "
        "last step); ‖update‖ is the applied (aggregated) update's norm, mean over rounds.",
        "",
        f"| run | val {window} | val {last} | train succ. {window} | entropy r{EARLY_ROUND} → {last} | "
        f"resp. length r{EARLY_ROUND} → {last} | zero-var. share {window} mean / max | max grad norm | "
        "mean ‖applied update‖ a round | take-off round (length / entropy) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        takeoffs = ("" if row["metrics"] is None else
                    f"{_round(row['takeoff_length'])} / {_round(row['takeoff_entropy'])}")
        lines.append(
            f"| {row['arm']} s{row['seed']} | {_num(row['val_window'], 3)} | {_num(row['val_last'], 3)} | "
            f"{_num(row['train_window'], 3)} | {_pair(row['entropy_early'], row['entropy_last'], 2, ' → ')} | "
            f"{_pair(row['length_early'], row['length_last'], 0, ' → ')} | "
            f"{_pair(row['zero_variance_window_mean'], row['zero_variance_window_max'], 2, ' / ')} | "
            f"{_num(row['max_grad_norm'], 2)} | {_num(row['mean_update_norm'], 3)} | {takeoffs} |")
    lines += ["", "Take-offs per arm (runs with a metrics file; median round among the runs that took off):", ""]
    for arm, entry in arms.items():
        lines.append(
            f"- {arm}: by reply length {entry['took_off_length']} of {entry['with_metrics']} "
            f"(median round {_median(entry['median_takeoff_length'])}); by entropy {entry['took_off_entropy']} of "
            f"{entry['with_metrics']} (median round {_median(entry['median_takeoff_entropy'])})")
    missing = [row for row in rows if row["metrics"] is None]
    if missing:
        lines += ["", "No metrics file committed beside these runs' summaries (only the validation and update "
                  "columns, which come from the summary, are filled): "
                  + ", ".join(f"{row['name']} ({row['summary']})" for row in missing)]
    unplanned = [row["name"] for row in rows if row["total_rounds"] < 1]
    if unplanned:
        lines += ["", "No planned number of rounds (`total_rounds`) in these runs' summaries, so no last-round "
                  "or window values and no take-off: " + ", ".join(unplanned)]
    gaps = []
    for row in rows:
        absent = missing_rounds(row)
        if absent:
            gaps.append(f"{row['name']} (round{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))})")
    if gaps:
        lines += ["", "Rounds without a train event in the run's metrics file (a window that needs one is left "
                  "empty; take-offs are read from the rounds present): " + ", ".join(gaps)]
    deviating = [f"{row['name']} ({'; '.join(row['deviations'])})" for row in rows if row["deviations"]]
    if deviating:
        lines += ["", "Runs that did not run as planned (their rows include these rounds): " + ", ".join(deviating)]
    return "\n".join(lines) + "\n"


def dynamics(source: Path, out: Path, arms: list[str], min_seed: int,
             prefix: str = DEFAULT_PREFIX) -> dict[str, Any]:
    """Write ``out/dynamics.json`` and ``out/dynamics.md`` for the committed runs ``arms.py pool``
    would pick (``find_runs``; raises its PoolError when there are none, or a run is committed
    twice); return the JSON's content, with the markdown under ``"markdown"``. ``out`` must be new
    or empty, as ``pool``'s: a table left there from other runs would read as this one's. A summary
    that cannot be read or that compare would refuse raises CompareError (:func:`run_row`), before
    anything is written."""
    require_empty_folder(out, DynamicsError, "write the dynamics into a new or empty folder")
    found = find_runs(source, prefix, arms, min_seed)
    rows = [run_row(arm, seed, summary, metrics_file(summary)) for (arm, seed), summary in ordered_runs(found, arms)]
    per_arm = {arm: arm_summary([row for row in rows if row["arm"] == arm])
               for arm in arms if any(row["arm"] == arm for row in rows)}
    text = render(rows, per_arm)
    data = {"source": str(source), "prefix": prefix, "arms": arms, "min_seed": min_seed,
            "thresholds": {"takeoff_length": TAKEOFF_LENGTH, "takeoff_entropy": TAKEOFF_ENTROPY,
                           "early_round": EARLY_ROUND, "window": WINDOW},
            "runs": rows, "per_arm": per_arm,
            "without_metrics": [row["name"] for row in rows if row["metrics"] is None]}
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / JSON_FILE, data)
    write_text_atomic(out / MARKDOWN_FILE, text)
    return {**data, "markdown": text}
