"""``fedagent compare``: does one arm beat another across your own runs?

Each run directory's ``federated_summary.json`` (its validation curve per round) gives the run one
value of each statistic: the mean validation success over the last ``window`` rounds it was planned
to run (default 3: rounds 8-10 of 10) and its success at the final round. Per arm, the mean over its
runs (one run a seed); per pair of arms, the difference with Welch's 95% interval over runs
(:func:`fedagent_flwr.intervals.seed_difference_interval`), which counts how differently runs of one
config end, GPU run-to-run variation included, and the runs an arm would need for the interval to
exclude 0 at this gap (:func:`fedagent_flwr.intervals.seeds_for_difference`). This is how
docs/results.md states its results; which statistic is primary should be chosen before the runs
(declared), the other then being secondary. ``--paired`` adds, beside those rows, the difference within
each seed where both arms ran one session a seed from one shared start (a session's luck common to both
arms): runs matched by their ``base_seed``, the mean of the seeds' differences with its 95% t-interval
over seeds (:func:`fedagent_flwr.compare_report.paired`); seeds with a run in one arm only are named
and left out of the pairing.

    fedagent compare --arm federated outputs/fed-s* --arm local outputs/local-s*
    fedagent compare --arm federated=outputs/run-1 outputs/run-2 --arm local=... --json cmp.json
    fedagent compare --paired --arm federated outputs/fed-s* --arm local outputs/local-s*

Runs that cannot be compared as they are are refused, one line naming the run and what to do: an
unreadable or unfinished run (status running or failed, or fewer rounds than planned:
``--allow-unfinished`` includes it, flagged, on the rounds it has, which its cells name), a run
without a validation curve or without the rounds its statistic needs, runs of different total
rounds, a run given twice; with ``--paired``, a run without a seed or two runs of one seed in an arm.
A summary whose keys are not as the recorder writes them (``val_curve`` not a list of points, a point
without a success rate from 0 to 1, a round with two points, ``total_rounds`` not a number, ``base_seed``
not a whole number) is refused naming the file and the key or round; so, before any write, is a
``--json`` file that is an input summary or any run's record, or an existing file that is not an
earlier comparison (:func:`fedagent_flwr.compare_report.json_refusal`).

Standard library only (with ``intervals``, ``losses``, ``outcome``, ``atomic``): ``tools/gpu/arms_report.py``
uses these functions on a GPU node's bare ``python3``. The within-seed rows, the markdown and the
``--json`` checks are in :mod:`fedagent_flwr.compare_report`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedagent_flwr.atomic import write_json_atomic
from fedagent_flwr.cli import program
from fedagent_flwr.compare_report import STATISTICS, curve_problem, json_refusal, markdown, paired, summary_problem
from fedagent_flwr.intervals import seed_difference_interval, seeds_for_difference, wilson_interval
from fedagent_flwr.losses import evaluation_losses, round_losses
from fedagent_flwr.outcome import SummaryError, load_summary, summary_path

#: The last-rounds window: each run's mean validation success over the last this-many rounds it was
#: planned to run (rounds 8-10 of a 10-round run), the statistic docs/results.md §4 declares for
#: comparing arms (one round's 64 episodes swing by about ±0.06 from one round to the next, so a mean
#: over 3 rounds is less noisy than the last round alone).
WINDOW = 3
#: Statuses of a run that has not ended as a run should (``outcome``): still running, or killed.
UNFINISHED_STATUSES = ("running", "failed")


class CompareError(ValueError):
    """The runs cannot be compared as given; the message says which run and what to do, in one line."""


def validation_by_round(curve: list[dict[str, Any]]) -> dict[int, float]:
    """``round -> validation success`` of a summary's ``val_curve``. One reading for :func:`window_mean`,
    the final round and the GPU tools' tables (``arms_dynamics``), so that they cannot disagree on a
    run's rounds.

    Raises :class:`CompareError` for a point without a round or a success rate from 0 to 1, and for a
    round with two points (:func:`fedagent_flwr.compare_report.curve_problem`): no curve the recorder
    writes has either, and counting the point 0.0, or the round's later point, moved its run's window
    mean without a word. :func:`run_statistic` checks the whole summary first, so that compare's
    refusal names the file as well."""
    problem = curve_problem(curve)
    if problem:
        raise CompareError(problem)
    return {int(p["round"]): float(p["success_rate"]) for p in curve}


def window_mean(curve: list[dict[str, Any]], total_rounds: int, window: int = WINDOW) -> float | None:
    """Mean validation success over rounds ``total_rounds - window + 1 .. total_rounds`` (the last
    ``window`` rounds the run was planned to run), to 4 places; None unless the curve has every one of
    them (a run lost before its end, or a round whose evaluation recorded nothing, has no window
    rather than another one)."""
    if total_rounds < window or window < 1:
        return None
    by_round = validation_by_round(curve)
    rounds = range(total_rounds - window + 1, total_rounds + 1)
    if any(r not in by_round for r in rounds):
        return None
    return round(sum(by_round[r] for r in rounds) / window, 4)


def mean_and_sd(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean of ``values`` (one a run) and their sample standard deviation (None for one value)."""
    if not values:
        raise ValueError("need at least one value")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


@dataclass(frozen=True)
class SeedDifference:
    """Mean of A's runs minus mean of B's, its Welch 95% interval over runs, and the runs an arm would
    need for that interval to exclude 0 with 80% power at this gap and these spreads (None: over 200)."""

    difference: float
    low: float
    high: float
    seeds_needed: int | None


def seed_difference(a: Sequence[float], b: Sequence[float]) -> SeedDifference | None:
    """:class:`SeedDifference` of ``a`` and ``b`` (one value a run); None with fewer than 2 runs on a
    side, where no interval over runs can be given."""
    if len(a) < 2 or len(b) < 2:
        return None
    difference, low, high = seed_difference_interval(list(a), list(b))
    sd_a, sd_b = mean_and_sd(a)[1], mean_and_sd(b)[1]
    assert sd_a is not None and sd_b is not None  # two or more values a side
    return SeedDifference(difference, low, high, seeds_for_difference(sd_a, sd_b, difference))


def deviations(summary: dict[str, Any]) -> list[str]:
    """Where a run did not run as planned though it may have ended: each round that aggregated
    nothing, or without a client it selected (``rounds[].rejected``), each validation point that lacks a
    client's episodes (``val_curve[].failed``; an unknown node's negative key is no client), and a
    status other than ``completed``. A run's window and final value then rest on a partial round or
    point, which a comparison should say (batch 12's federated seed 4 lost a client in round 9)."""
    found = []
    for entry in summary.get("rounds", []):
        if entry.get("aggregated_actor") is None:
            found.append(f"round {entry['round']} aggregated nothing")
            continue
        gone, critic_only = round_losses(entry)
        if gone:
            found.append(f"round {entry['round']} trained without client(s) {sorted(map(int, gone))}")
        if critic_only:  # PPO: the actor averaged, the critic refused
            found.append(f"round {entry['round']}'s critic lacks client(s) {sorted(map(int, critic_only))}")
    for point in summary.get("val_curve", []):
        lost = evaluation_losses(point)
        if lost:
            found.append(f"round {point['round']}'s evaluation lacks client(s) {sorted(map(int, lost))}")
    if summary.get("status") not in (None, "completed"):
        found.append(f"status {summary.get('status')}")
    return found


@dataclass(frozen=True)
class RunStatistic:
    """One run's values: its statistics, the rounds they cover (``window_rounds``, None without a
    window; ``final_round``: the rounds planned, or for an unfinished run the last ones it has), the
    final round's episodes and Wilson interval, and ``unfinished`` (why it did not end as planned;
    empty when it did)."""

    arm: str
    run: str
    run_id: Any
    seed: int | None
    status: str
    config: str
    total_rounds: int
    last_round: int
    window: float | None
    final: float | None
    window_rounds: tuple[int, int] | None
    final_round: int
    final_n: int
    final_ci95: tuple[float, float]
    unfinished: str
    deviations: tuple[str, ...]
    #: the content hash of the model the run started from (its summary's ``base_model_sha256``)
    start_sha256: str | None = None


def run_statistic(arm: str, run: str | Path, window: int = WINDOW, allow_unfinished: bool = False
                  ) -> RunStatistic:
    """Read ``run`` (a run directory, or a summary file) and compute its statistics.

    Raises :class:`CompareError` for a run without a readable summary or validation curve, and for an
    unfinished one unless ``allow_unfinished``: then its statistics are those of the rounds it has (its
    last ``window`` validated rounds, its last point) and ``unfinished`` says so."""
    if not os.path.exists(run):  # a typo, not a run that wrote no record
        raise CompareError(f"{run} does not exist: check the path")
    try:
        summary = load_summary(run)
    except SummaryError as exc:  # a summary found says itself what is wrong with it
        raise CompareError(str(exc) if summary_path(run).exists() else f"{exc}; give a run directory holding "
                           "federated_summary.json") from None
    problem = summary_problem(summary)
    if problem:  # before any key is read: a value compare would have to guess is refused, not guessed
        raise CompareError(f"{summary_path(run)}: {problem}: restore the summary as its run wrote it, or leave "
                           "the run out")
    curve = summary.get("val_curve") or []
    if not curve:
        raise CompareError(f"{run} has no validation curve (val_curve is empty: the run evaluated nothing); "
                           "leave it out")
    status = summary["status"]
    by_round = validation_by_round(curve)
    last = max(by_round)
    total = int(summary.get("total_rounds") or last)
    completed = summary.get("last_completed_round")
    reached = last if completed is None else int(completed)
    unfinished = ""
    if status in UNFINISHED_STATUSES or reached < total:
        unfinished = f"status {status}, round {reached} of {total}"
        if not allow_unfinished:
            raise CompareError(f"{run} is not finished ({unfinished}): wait for it to end, or pass "
                               "--allow-unfinished to include it, flagged, on the rounds it has")
    end = last if unfinished else total
    point = next(p for p in curve if int(p["round"]) == end) if end in by_round else None
    n = int(point.get("n", 0)) if point is not None else 0
    rate = by_round.get(end)
    low, high = wilson_interval((rate or 0.0) * n, n)
    seed = summary.get("base_seed")
    config = " ".join(str(summary.get(key, "?")) for key in ("env_kind", "mode", "strategy"))
    return RunStatistic(arm=arm, run=str(run), run_id=summary.get("run_id"),
                        seed=seed, status=status, config=config,  # an int or None: summary_problem refused the rest
                        total_rounds=total, last_round=last, window=window_mean(curve, end, window), final=rate,
                        window_rounds=(end - window + 1, end) if end >= window else None, final_round=end,
                        final_n=n, final_ci95=(round(low, 4), round(high, 4)), unfinished=unfinished,
                        deviations=tuple(deviations(summary)), start_sha256=summary.get("base_model_sha256") or None)


def _check_runs(runs: list[RunStatistic], statistic: str, window: int) -> None:
    """Refuse runs that cannot be compared with each other: one run given twice, runs planned for
    different numbers of rounds, a run without the rounds the primary statistic needs."""
    seen: dict[Any, RunStatistic] = {}
    for run in runs:
        # the same summary file (a run directory and its summary count alike) or the same run id
        keys = [("file", summary_path(run.run).resolve())] + ([("id", run.run_id)] if run.run_id is not None else [])
        for key in keys:
            if key in seen:
                same = f"run id {run.run_id}" if key[0] == "id" else f"summary {key[1]}"
                raise CompareError(f"{seen[key].run} ({seen[key].arm}) and {run.run} ({run.arm}) are the same run "
                                   f"({same}): give each run once")
        seen.update((key, run) for key in keys)
    totals = {run.total_rounds for run in runs}
    if len(totals) > 1:
        listed = "; ".join(f"{run.run} ({run.arm}): {run.total_rounds}" for run in runs)
        raise CompareError(f"the runs were planned for different numbers of rounds ({listed}): compare runs of "
                           "one plan (the same num_rounds)")
    if window < 1 or window > min(totals):
        raise CompareError(f"--window {window}: must be 1 to the runs' {min(totals)} rounds")
    for run in runs:
        if getattr(run, statistic) is None:
            end = run.last_round if run.unfinished else run.total_rounds
            if statistic == "window" and end < window:
                raise CompareError(f"{run.run} has {end} round(s), fewer than the --window of {window} its window "
                                   "statistic needs: leave it out, or choose a smaller --window or --statistic final")
            rounds = f"rounds {end - window + 1}-{end}" if statistic == "window" else f"round {end}"
            raise CompareError(f"{run.run} has no validation point for every one of {rounds}, which its {statistic} "
                               "statistic needs (an evaluation recorded nothing): leave it out, or choose "
                               "another --statistic")


def _arm_row(runs: list[RunStatistic]) -> dict[str, Any]:
    row: dict[str, Any] = {"runs": len(runs), "seeds": [run.seed for run in runs]}
    for statistic in STATISTICS:
        values = [v for v in (getattr(run, statistic) for run in runs) if v is not None]
        mean, sd = mean_and_sd(values) if values else (None, None)
        row[statistic] = {"per_run": values, "mean": None if mean is None else round(mean, 4),
                          "sd": None if sd is None else round(sd, 4)}
    return row


def _reading(first: str, second: str, found: SeedDifference | None, n_a: int, n_b: int) -> str:
    """In words, what the interval shows, as docs/results.md reads its comparisons."""
    if found is None:
        return f"no interval over runs: needs 2 or more runs an arm (here {n_a} and {n_b})"
    if found.low == found.high:  # no run differs from its arm's others: Welch has no interval to give
        return "no spread between runs: no interval, so no direction shown"
    if found.low > 0:
        return f"{first} ahead"
    if found.high < 0:
        return f"{second} ahead"
    runs = f"{n_a}" if n_a == n_b else f"{n_a} and {n_b}"
    return f"no difference shown at {runs} runs an arm"


def pairs(arms: dict[str, dict[str, Any]], statistic: str) -> list[dict[str, Any]]:
    """Each pair of arms in the order given (earlier minus later) on ``statistic``: the difference of
    the means over runs, its Welch 95% interval over runs, the reading and the runs an arm needs."""
    names, found = list(arms), []
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            a, b = arms[first][statistic], arms[second][statistic]
            diff = seed_difference(a["per_run"], b["per_run"])
            found.append({
                "arms": [first, second], "statistic": statistic,
                # of the unrounded means, as the interval's; None for a secondary statistic no run of an
                # arm has (its rounds' evaluations recorded nothing)
                "difference": (None if not a["per_run"] or not b["per_run"] else
                               round(mean_and_sd(a["per_run"])[0] - mean_and_sd(b["per_run"])[0], 4)),
                "ci95": None if diff is None or diff.low == diff.high else [round(diff.low, 4), round(diff.high, 4)],
                "seeds_needed": None if diff is None or diff.low == diff.high else diff.seeds_needed,
                "reading": _reading(first, second, diff, len(a["per_run"]), len(b["per_run"])),
            })
    return found


def _check_paired(runs: list[RunStatistic], names: Sequence[str]) -> None:
    """Refuse runs that cannot be matched by seed: a run without one, or two runs of one seed in an arm
    (which of them would pair is a choice the command must not make)."""
    for run in runs:
        if run.seed is None:
            raise CompareError(f"{run.run} ({run.arm}) has no base_seed in its summary: --paired matches runs by "
                               "seed; leave it out, or compare without --paired")
    for name in names:
        mine = [run for run in runs if run.arm == name]
        for seed in sorted({run.seed for run in mine if run.seed is not None}):
            same = [run.run for run in mine if run.seed == seed]
            if len(same) > 1:
                raise CompareError(f"--paired: arm {name} has {len(same)} runs of seed {seed} ({', '.join(same)}): "
                                   "a seed pairs one run an arm; give one of them, or compare without --paired")


def compare(arms: Mapping[str, Sequence[str | Path]], window: int = WINDOW, statistic: str = "window",
            allow_unfinished: bool = False, paired_by_seed: bool = False) -> dict[str, Any]:
    """The comparison of ``arms`` (name -> run directories): per run, per arm and per pair of arms,
    for the primary ``statistic`` and the other one; with ``paired_by_seed`` also the within-seed
    differences (the report's ``paired``: :func:`fedagent_flwr.compare_report.paired`); refuses what
    cannot be compared (CompareError)."""
    if statistic not in STATISTICS:
        raise CompareError(f"--statistic {statistic}: choose one of {', '.join(STATISTICS)}")
    empty = [name for name, dirs in arms.items() if not dirs]
    if empty:
        raise CompareError(f"arm {empty[0]} has no run directories: --arm {empty[0]} DIR [DIR ...]")
    if len(arms) < 2:
        raise CompareError(f"{len(arms)} arm given: compare needs two or more --arm NAME DIR [DIR ...]")
    if window < 1:
        raise CompareError(f"--window {window}: must be 1 or more rounds")
    runs = [run_statistic(name, run, window, allow_unfinished) for name, dirs in arms.items() for run in dirs]
    _check_runs(runs, statistic, window)
    if paired_by_seed:
        _check_paired(runs, list(arms))
    table = {name: _arm_row([run for run in runs if run.arm == name]) for name in arms}
    total = runs[0].total_rounds
    secondary = next(s for s in STATISTICS if s != statistic)
    notes = [f"arm {name} has 1 run: no interval over runs can be given; its run's 95% Wilson interval over "
             "its final round's episodes is in the runs table" for name, row in table.items() if row["runs"] < 2]
    notes += [f"{run.run} ({run.arm}) is unfinished ({run.unfinished}): included on request "
              "(--allow-unfinished), on the rounds it has" for run in runs if run.unfinished]
    notes += [f"{run.run} ({run.arm}) has no {secondary} value (fewer rounds than it needs, or an evaluation "
              f"recorded nothing): it is left out of the {secondary} (secondary) comparison"
              for run in runs if getattr(run, secondary) is None]
    for run in runs:
        # an unfinished run's status is in its note above; the rounds that lost clients are not
        found = [d for d in run.deviations if not (run.unfinished and d == f"status {run.status}")]
        if found:
            notes.append(f"{run.run} ({run.arm}) did not run as planned, and its values include these rounds: "
                         f"{'; '.join(found)}")
    for name in arms:
        seeds = [run.seed for run in runs if run.arm == name and run.seed is not None]
        twice = sorted({seed for seed in seeds if seeds.count(seed) > 1})
        if twice:  # two runs of one seed count as two seeds: fine for GPU run-to-run spread, worth saying
            notes.append(f"arm {name} has more than one run of seed(s) {twice}: each counts as a run")
        configs = sorted({run.config for run in runs if run.arm == name})
        if len(configs) > 1:
            notes.append(f"arm {name} mixes runs of different configs (env mode strategy): {'; '.join(configs)}")
    rows = [{**asdict(run), "final_ci95": list(run.final_ci95),
             "window_rounds": None if run.window_rounds is None else list(run.window_rounds)} for run in runs]
    within = paired(rows, list(arms), statistic) + paired(rows, list(arms), secondary) if paired_by_seed else []
    starts = {(run.arm, run.seed): run.start_sha256 for run in runs}
    for row in within:
        first, second = row["arms"]
        alone = "; ".join(f"{seeds} in {name} only" for name, seeds in row["only_in"].items() if seeds)
        if alone and row["statistic"] == statistic:  # once a pair of arms: the same seeds for both statistics
            notes.append(f"paired {first} − {second}: seed(s) with a run in one arm only, left out of the pairing: "
                         f"{alone}")
        if row["without_value"]:
            notes.append(f"paired {first} − {second}: seed(s) {row['without_value']} lack a {row['statistic']} value "
                         f"in one arm: left out of the paired {row['statistic']} comparison")
        # the pairing's premise: both runs of a seed started from one model (one session's shared start)
        apart = [seed for seed in row["seeds"] if starts[first, seed] and starts[second, seed]
                 and starts[first, seed] != starts[second, seed]]
        if apart and row["statistic"] == statistic:
            notes.append(f"paired {first} − {second}: the runs of seed(s) {apart} started from different models "
                         "(their summaries' base_model_sha256 differ): the pairing assumes one shared start, which "
                         "they do not have, so their differences keep that start's luck")
    report = {
        "statistic": statistic, "secondary": secondary, "window": window, "total_rounds": total,
        "window_rounds": [total - window + 1, total],
        "runs": rows,
        "arms": table,
        "pairs": pairs(table, statistic) + pairs(table, secondary),
        "notes": notes,
    }
    if paired_by_seed:  # only when asked: without --paired the report is as it was
        report["paired"] = within
    return report


def _arm_argument(values: list[str]) -> tuple[str, list[str]]:
    """``--arm NAME DIR [DIR ...]`` or ``--arm NAME=DIR [DIR ...]`` as ``(name, dirs)``."""
    first, rest = values[0], values[1:]
    if "=" in first:
        name, _, run = first.partition("=")
        return name, [run, *rest] if run else rest
    return first, rest


def main(argv: Sequence[str] | None = None) -> int:
    """Print the comparison; exit 0 on a report, 2 on input that cannot be compared (one line why)."""
    parser = argparse.ArgumentParser(
        prog=program("python -m fedagent_flwr.compare"),
        description="Does one arm beat another across your own runs? Per run its statistics, per arm the mean "
        "over its runs (one a seed), per pair of arms the difference with Welch's 95% interval over runs. "
        "Exit 0 with a report, 2 with one line saying which run cannot be compared and what to do.",
        epilog="Choose the primary statistic (and the window) before the runs and state it as declared, as "
        "docs/results.md does: picking whichever statistic reads better after seeing both is not a test.")
    parser.add_argument("--arm", nargs="+", action="append", required=True, metavar=("NAME", "DIR"),
                        help="an arm's name and its run directories (or summary files); NAME=DIR works too; "
                        "repeat for each arm, pairs are earlier minus later")
    parser.add_argument("--statistic", choices=STATISTICS, default="window",
                        help="the primary statistic: the mean over the last --window rounds (default) or the "
                        "final round's success; the other is reported as secondary")
    parser.add_argument("--window", type=int, default=WINDOW, help=f"rounds in the window (default {WINDOW})")
    parser.add_argument("--allow-unfinished", action="store_true",
                        help="include runs that are still running, failed or stopped early, flagged, on the "
                        "rounds they have")
    parser.add_argument("--paired", action="store_true",
                        help="also the difference within each seed (runs of two arms matched by base_seed, as when "
                        "both arms run in one session from one shared start): per seed A − B, their mean and the "
                        "95%% t-interval over seeds (n − 1 df); seeds in one arm only are named and left out")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the comparison as JSON to FILE")
    args = parser.parse_args(argv)
    arms: dict[str, list[str]] = {}
    try:
        for values in args.arm:
            name, runs = _arm_argument(values)
            if not name or name in arms:
                raise CompareError(f"--arm {name!r}: {'an empty name' if not name else 'named twice'}; give each "
                                   "arm once, as --arm NAME DIR [DIR ...]")
            arms[name] = runs
        refusal = None if args.json is None else json_refusal(args.json, arms)
        if refusal:
            raise CompareError(refusal)
        report = compare(arms, args.window, args.statistic, args.allow_unfinished, args.paired)
    except CompareError as exc:
        print(f"fedagent compare: {exc}", file=sys.stderr)
        return 2
    print(markdown(report), end="")
    if args.json is not None:
        try:
            write_json_atomic(args.json, report)
        except OSError as exc:
            print(f"fedagent compare: cannot write {args.json}: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
