"""The records side of ``tools/gpu/arms.py``: what its runs wrote, read back into the arms table
(``arms.py report``: arms.md, arms.json, arms.png) and the verl sessions' phase tables
(``arms.py phases``: phases.md).

arms.py imports this module from its own folder, as it imports ``gpu_share``, after putting the
repository on ``sys.path``. Like ``status`` and ``phases``, everything here but the plot (matplotlib)
runs on a GPU node's bare ``python3``: the standard library and ``fedagent_flwr``'s ``intervals``,
``losses``, ``compare`` (with ``outcome``, ``atomic`` and ``compare_report``) only. A run's statistics (the last-rounds
window) and deviations, the mean and spread over seeds and the differences over seeds are ``fedagent compare``'s
(:mod:`fedagent_flwr.compare`), so that the command and this table cannot disagree; so is the check of each
summary (:func:`fedagent_flwr.compare_report.summary_problem`): a summary compare refuses, this refuses too
(:class:`fedagent_flwr.compare.CompareError`, one line naming the file and the key or round).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from fedagent_flwr.compare import WINDOW, CompareError, deviations, mean_and_sd, seed_difference, window_mean
from fedagent_flwr.compare_report import summary_problem
from fedagent_flwr.intervals import pooled_difference_interval, wilson_interval
from fedagent_flwr.outcome import SummaryError, load_summary, summary_path

#: The matrix a launch wrote: its recipe, runs and waves (``arms.py launch``).
MATRIX_FILE = "matrix.json"


def run_summary(out: Path, name: str) -> dict[str, Any] | None:
    """``name``'s federated_summary.json under ``out``; None while there is none (or it is unreadable)."""
    try:
        return load_summary(out / "runs" / name)
    except SummaryError:
        return None


def check_summary(path: Path, summary: dict[str, Any]) -> None:
    """Raise :class:`CompareError` where ``fedagent compare`` would refuse the summary ``summary`` read
    from ``path`` (:func:`fedagent_flwr.compare_report.summary_problem`: a validation point without a
    success rate from 0 to 1, a round with two points, ``total_rounds`` not a number, ...), in its words,
    naming the file and the key or round. Before any key is read: such a point used to count as 0.0 in
    the arm's means, without a word, or to end the report in a traceback."""
    problem = summary_problem(summary)
    if problem:
        raise CompareError(f"{path}: {problem}: restore the summary as its run wrote it, or leave the run out")


def read_checked_summary(path: Path) -> dict[str, Any]:
    """The summary file ``path`` as :func:`check_summary` lets it be read; :class:`CompareError` (one
    line naming the file) where it cannot be read or compare would refuse it."""
    try:
        summary = load_summary(path)
    except SummaryError as exc:
        raise CompareError(str(exc)) from None
    check_summary(path, summary)
    return summary


def collect(out: Path) -> dict[str, Any]:
    """Every run's curve and final point, grouped by arm, with intervals. A run without a readable
    summary is listed as without a result; a summary that ``fedagent compare`` would refuse
    (:func:`check_summary`) raises :class:`CompareError`, before anything is written."""
    matrix = json.loads((out / MATRIX_FILE).read_text())
    runs: list[dict[str, Any]] = []
    arms: dict[str, list[dict[str, Any]]] = {}
    for run in matrix["runs"]:
        summary = run_summary(out, run["name"])
        if summary is not None:
            check_summary(summary_path(out / "runs" / run["name"]), summary)
        curve = (summary or {}).get("val_curve", [])
        if summary is None or not curve:
            runs.append({**run, "status": "no result"})
            continue
        base, final = curve[0], curve[-1]
        entry = {
            **run,
            "status": summary.get("status"),
            "rounds": final["round"],
            "base": _point(base),
            "final": _point(final),
            "curve": [_point(p) for p in curve],
            "window_mean": window_mean(curve, int(summary.get("total_rounds") or 0)),
            **_train_curves(out / "runs" / run["name"] / "metrics.jsonl"),
            "update_norm_ratio": [r.get("update_stats", {}).get("norm_ratio") for r in summary.get("rounds", [])
                                  if r.get("update_stats")],
            "mean_pairwise_cosine": [r.get("update_stats", {}).get("mean_pairwise_cosine")
                                     for r in summary.get("rounds", []) if r.get("update_stats")],
            "wall_seconds": summary.get("wall_seconds"),
            "deviations": deviations(summary),
        }
        runs.append(entry)
        arms.setdefault(run["arm"], []).append(entry)
    table = {arm: _pool(entries) for arm, entries in arms.items()}
    return {"recipe": matrix["recipe"], "runs": runs, "arms": table, "left_out": matrix.get("left_out", [])}


def _point(point: dict[str, Any]) -> dict[str, Any]:
    """A validation point with its Wilson interval; its summary passed :func:`check_summary`, so it has a
    success rate (no default: a point without one is refused, not read as 0.0)."""
    n = int(point.get("n", 0))
    rate = float(point["success_rate"])
    low, high = wilson_interval(rate * n, n)
    return {"round": point["round"], "n": n, "success_rate": rate, "ci95": [round(low, 4), round(high, 4)]}


def train_client_means(path: Path, keys: dict[str, str], by_suffix: bool = False,
                       digits: int | None = None) -> dict[str, dict[int, float]]:
    """Per name in ``keys`` (``name -> metric key``), ``round -> mean over the clients`` of that
    metric in the ``train`` events of the metrics file ``path``, rounds in order.

    Each client counts once (equal weight): a round that lost a client has the others' values only
    (:func:`deviations` names it). A round no event of which carries the metric is absent. The key
    must match exactly, or with ``by_suffix`` be the end of the event's key (``actor.entropy`` for
    ``verl.actor.entropy``: the first such key in the event counts). A null value is no value.
    ``digits``: round each mean to that many places (None: as computed). Raises OSError or
    ValueError when the file cannot be read or parsed; the callers decide what that means.
    Shared by ``arms.py report`` (:func:`collect`) and ``arms.py dynamics``."""
    values: dict[str, dict[int, list[float]]] = {name: {} for name in keys}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        event = json.loads(line)
        if event.get("event") != "train":
            continue
        metrics = event.get("metrics") or {}
        for name, key in keys.items():
            found = ([v for k, v in metrics.items() if k.endswith(key)] if by_suffix
                     else [metrics[key]] if key in metrics else [])
            if found and found[0] is not None:
                values[name].setdefault(int(event["round"]), []).append(float(found[0]))
    return {name: {r: (sum(v) / len(v) if digits is None else round(sum(v) / len(v), digits))
                   for r, v in sorted(by_round.items())}
            for name, by_round in values.items()}


#: The train metrics ``arms.py report`` keeps per run (name -> key suffix), for its JSON.
REPORT_TRAIN_METRICS = {"zero_variance_group_share": "zero-variance-group-share", "entropy": "actor.entropy",
                        "grad_norm": "actor.grad_norm"}


def _train_curves(path: Path) -> dict[str, list[float]]:
    """Per :data:`REPORT_TRAIN_METRICS` name, the clients' mean per round (4 places), in round
    order; empty lists when the run has no readable metrics file."""
    try:
        series = train_client_means(path, REPORT_TRAIN_METRICS, by_suffix=True, digits=4)
    except (OSError, ValueError):
        return {name: [] for name in REPORT_TRAIN_METRICS}
    return {name: list(by_round.values()) for name, by_round in series.items()}


def _pool(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds of the final success, and the Wilson interval of the pooled episodes."""
    finals = [e["final"] for e in entries]
    successes = sum(f["success_rate"] * f["n"] for f in finals)
    n = sum(f["n"] for f in finals)
    low, high = wilson_interval(successes, n)
    rates = [f["success_rate"] for f in finals]
    mean, spread = mean_and_sd(rates)
    windows = [e["window_mean"] for e in entries if e.get("window_mean") is not None]
    w_mean, window_std = mean_and_sd(windows) if windows else (None, None)
    base = [e["base"] for e in entries]
    base_low, base_high = wilson_interval(sum(b["success_rate"] * b["n"] for b in base), sum(b["n"] for b in base))
    return {
        "seeds": [e["seed"] for e in entries],
        "rounds": [e["rounds"] for e in entries],
        "final_mean": round(mean, 4),
        "final_per_seed": rates,
        "seed_std": None if spread is None else round(spread, 4),
        "pooled_n": n,
        "pooled_successes": round(successes, 4),
        "pooled_ci95": [round(low, 4), round(high, 4)],
        "window_per_seed": windows,
        "window_mean": None if w_mean is None else round(w_mean, 4),
        "window_std": None if window_std is None else round(window_std, 4),
        "base_mean": round(sum(b["success_rate"] for b in base) / len(base), 4),
        "base_pooled_ci95": [round(base_low, 4), round(base_high, 4)],
    }


def differences(arms: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pair of arms (in the order given, earlier minus later): the difference of their final
    means with its 95% interval over seeds (Welch; None with fewer than 2 seeds on a side) and over
    the pooled episodes (normal approximation), and the seeds per arm that would show a difference of
    that size at 80% power if the arms' spreads between seeds were the ones seen (``seeds_needed``;
    None with fewer than 2 seeds on a side, or beyond 200 seeds)."""
    names, pairs = list(arms), []
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            a, b = arms[first], arms[second]
            final = seed_difference(a["final_per_seed"], b["final_per_seed"])
            seeds = None if final is None else [round(final.low, 4), round(final.high, 4)]
            needed = None if final is None else final.seeds_needed
            _, low, high = pooled_difference_interval(a["pooled_successes"], a["pooled_n"], b["pooled_successes"],
                                                      b["pooled_n"])
            window = _window_difference(a, b)
            pairs.append({"arms": [first, second], "difference": round(a["final_mean"] - b["final_mean"], 4),
                          "seeds_ci95": seeds, "pooled_ci95": [round(low, 4), round(high, 4)],
                          "seeds_needed": needed, "window": window})
    return pairs


def _window_difference(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """The difference of two arms' window means (each run's mean over its last planned rounds), with
    its Welch interval over seeds where both arms have 2 or more windows (``seeds_ci95`` None with
    one: a session's single seed still shows the declared statistic, not only the final round's);
    None where an arm has no run with a whole window."""
    if not a["window_per_seed"] or not b["window_per_seed"]:
        return None
    windowed = seed_difference(a["window_per_seed"], b["window_per_seed"])
    if windowed is None:
        return {"difference": round(a["window_mean"] - b["window_mean"], 4), "seeds_ci95": None,
                "seeds_needed": None}
    return {"difference": round(windowed.difference, 4),
            "seeds_ci95": [round(windowed.low, 4), round(windowed.high, 4)],
            "seeds_needed": windowed.seeds_needed}


def _seeds_interval(difference: dict[str, Any]) -> str:
    low_high = difference["seeds_ci95"]
    return f"[{low_high[0]:+.3f}, {low_high[1]:+.3f}]" if low_high else "(needs 2 or more seeds per arm)"


def _seeds_needed(difference: dict[str, Any]) -> str:
    if difference["seeds_ci95"] is None:
        return ""
    needed = difference["seeds_needed"]
    return f"; seeds needed: {needed if needed is not None else 'over 200'}"


def report(out: Path) -> str:
    """Write arms.json, arms.md and arms.png under ``out``; return the markdown table. Raises
    :class:`CompareError`, writing nothing, where a run's summary is one compare refuses (:func:`collect`)."""
    data = collect(out)
    data["differences"] = differences(data["arms"])
    data["memory_peak"] = _memory_peak(out)
    hostmem = _sibling("hostmem.py")
    data["process_growth"] = hostmem.growth(out)
    data["process_growth_measure"] = hostmem.top_measure(out)
    (out / "arms.json").write_text(json.dumps(data, indent=2))
    lines = [
        f"recipe `{data['recipe']}`: final validation success per arm (mean over seeds; 95% Wilson interval of the "
        "pooled episodes; per-seed values)",
        "",
        "| arm | seeds | rounds | base (round 0) | final mean | 95% CI (pooled) | per seed | seed std |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, row in data["arms"].items():
        lines.append(
            f"| {arm} | {len(row['seeds'])} | {','.join(map(str, row['rounds']))} | {row['base_mean']:.3f} | "
            f"{row['final_mean']:.3f} | [{row['pooled_ci95'][0]:.3f}, {row['pooled_ci95'][1]:.3f}] "
            f"(n={row['pooled_n']}) | "
            f"{', '.join(f'{r:.3f}' for r in row['final_per_seed'])} | "
            f"{row['seed_std'] if row['seed_std'] is not None else '-'} |"
        )
    if data["differences"]:
        lines += ["", "Differences of the final means (95% intervals: over seeds, Welch's t, which counts how "
                  "differently runs end, GPU run-to-run variation included; over the pooled episodes, the "
                  "episodes' binomial noise only):", ""]
        lines += [f"- {d['arms'][0]} − {d['arms'][1]}: {d['difference']:+.3f}; over seeds " + _seeds_interval(d)
                  + f"; over pooled episodes [{d['pooled_ci95'][0]:+.3f}, {d['pooled_ci95'][1]:+.3f}]"
                  + _seeds_needed(d) for d in data["differences"]]
        windowed = [d for d in data["differences"] if d["window"] is not None]
        if windowed:
            lines += ["", f"Differences of the mean over each run's last {WINDOW} planned rounds (runs without all "
                      "of them have none; per seed: "
                      + "; ".join(f"{arm} " + ", ".join(f"{w:.3f}" for w in row["window_per_seed"])
                                  for arm, row in data["arms"].items())
                      + "), 95% intervals over seeds (Welch's t):", ""]
            lines += [f"- {d['arms'][0]} − {d['arms'][1]}: {d['window']['difference']:+.3f}; over seeds "
                      + _seeds_interval(d["window"]) + _seeds_needed(d["window"]) for d in windowed]
        lines += ["", "Seeds needed: per arm, for the interval over seeds to exclude 0 with 80% power if the "
                  "difference and the seeds' spreads were the ones seen here (a plan, as uncertain as those "
                  "spreads; `intervals.seeds_for_difference`)."]
    memory = data["memory_peak"]
    if memory is not None:
        gpu = f", GPUs {memory['gpu_used_mib'] / 1024:.1f} GiB (summed)" if memory["gpu_used_mib"] is not None else ""
        lines += ["", f"Node memory at its peak over {memory['samples']} samples (hostmem.jsonl): host "
                  f"{memory['host_used_mib'] / 1024:.1f} of {memory['host_total_mib'] / 1024:.1f} GiB{gpu}."]
    if data["process_growth"]:
        measure = ("Proportional set size (Pss: a page shared by N processes counts 1/N to each)"
                   if data["process_growth_measure"] == "pss" else
                   "Resident size (a page shared by N processes counts N times: these samples predate Pss)")
        lines += ["", f"{measure} per kind of process, from each process's first sample to its peak among the "
                  "largest (hostmem.jsonl `top`):", ""]
        lines += [f"- `{k['kind']}` ({k['processes']} process{'es' if k['processes'] != 1 else ''}): "
                  f"{k['first_mib'] / 1024:.1f} -> {k['peak_mib'] / 1024:.1f} GiB ({k['grew_mib'] / 1024:+.1f})"
                  for k in data["process_growth"][:10]]
    if data["left_out"]:
        lines += ["", f"Left out on request (`--leave-out`; a sensitivity check, not the full set): "
                  f"{', '.join(data['left_out'])}"]
    deviating = [f"{r['name']} ({'; '.join(r['deviations'])})" for r in data["runs"] if r.get("deviations")]
    if deviating:
        lines += ["", "Runs that did not run as planned (their values above include these rounds): "
                  + ", ".join(deviating)]
    missing = [r["name"] for r in data["runs"] if r.get("status") == "no result"]
    if missing:
        lines += ["", f"runs without a result: {', '.join(missing)}"]
    text = "\n".join(lines) + "\n"
    (out / "arms.md").write_text(text)
    _plot(data, out / "arms.png")
    return text


def _sibling(file: str) -> Any:
    """The tool ``file`` beside this one, loaded by path (tools/gpu is not a package)."""
    path = Path(__file__).resolve().parent / file
    spec = importlib.util.spec_from_file_location(f"fedagent_gpu_{path.stem}", path)
    assert spec is not None and spec.loader is not None  # the file beside this one
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _memory_peak(out: Path) -> dict[str, Any] | None:
    """The peak of ``out``'s node memory samples (``hostmem.py``), or None when there are none."""
    peak: dict[str, Any] | None = _sibling("hostmem.py").peak(out)
    return peak


def phases_report(out: Path, from_round: int = 2) -> str:
    """Write phases.md under ``out``: the start-up and round phase tables of every run's persistent
    verl sessions (``tools/gpu/phases.py`` on ``out/runs``); return the markdown."""
    tool = _sibling("phases.py")
    text = str(tool.tables(tool.find_sessions([out / "runs"]), from_round))
    (out / "phases.md").write_text(text)
    return text


def _plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.2))
    for arm in data["arms"]:
        entries = [r for r in data["runs"] if r["arm"] == arm and r.get("curve")]
        rounds = sorted({p["round"] for e in entries for p in e["curve"]})
        means, lows, highs = [], [], []
        for r in rounds:
            points = [p for e in entries for p in e["curve"] if p["round"] == r]
            successes = sum(p["success_rate"] * p["n"] for p in points)
            n = sum(p["n"] for p in points)
            low, high = wilson_interval(successes, n)
            mean = sum(p["success_rate"] for p in points) / len(points)
            means.append(mean)
            lows.append(max(mean - low, 0.0))
            highs.append(max(high - mean, 0.0))
        seeds = f"{len(entries)} seed{'s' if len(entries) != 1 else ''}"
        axis.errorbar(rounds, means, yerr=[lows, highs], fmt="o-", capsize=3, label=f"{arm} ({seeds})")
    axis.set_xlabel("round")
    axis.set_ylabel("validation success (95% CI)")
    axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title(f"FedAgent's arms, recipe {data['recipe']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
