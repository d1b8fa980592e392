"""``fedagent compare``'s within-seed rows (``--paired``) and its report as markdown: the tables
:func:`fedagent_flwr.compare.compare`'s report is printed as (runs, arms, pairs of arms with Welch's
interval over runs, and with ``--paired`` the within-seed differences), apart from the reading of runs
and the Welch rows so that each module stays small. Also the check that the keys of a summary compare
reads have the shapes the recorder writes (:func:`summary_problem`), as a message that ``compare``
refuses the run with, and the check of where ``--json`` would write the report (:func:`json_refusal`):
not over an input, nor over a file that is not an earlier report.

Standard library only (with ``intervals`` and ``outcome``), as ``compare`` (``tools/gpu/arms_report.py`` runs
on a GPU node's bare ``python3``).
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedagent_flwr.intervals import paired_difference_interval
from fedagent_flwr.outcome import SUMMARY_FILE, summary_path

#: The statistics a run has, in the order the tables show them: ``window`` (the mean validation success
#: over the last rounds, :func:`fedagent_flwr.compare.window_mean`) and ``final`` (the last round's success).
STATISTICS = ("window", "final")
#: The top-level keys of the report ``fedagent compare --json`` writes (:func:`fedagent_flwr.compare.compare`),
#: the same in every version so far; ``paired`` is added with ``--paired``. How :func:`json_refusal` tells
#: an earlier report, which ``--json`` may replace, from any other file, which it must not.
REPORT_KEYS = frozenset({"statistic", "secondary", "window", "total_rounds", "window_rounds", "runs", "arms",
                         "pairs", "notes"})
#: Larger than any report (a run's row is about 1 kB): a bigger file is no earlier report, and is not read
#: to find out (a long run's metrics.jsonl may be far bigger).
REPORT_MAX_BYTES = 16 * 1024 * 1024


def _shown(value: object) -> str:
    """``value`` as the summary's JSON spells it (``null``, ``"high"``, ``NaN``), cut short so that a
    message stays one line."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _count(value: object) -> bool:
    """Whether ``value`` is a whole number of 0 or more, as the recorder writes rounds and episode
    counts: not a bool (an int to Python), a string or a fraction, which ``int()`` would turn into a
    traceback or another number."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _rate(value: object) -> bool:
    """Whether ``value`` is a success rate: a number from 0 to 1, not a bool, NaN or an infinity."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0 <= value <= 1)


def point_problem(point: object, index: int) -> str | None:
    """What makes ``val_curve[index]`` unreadable, naming its round where it has one; None if nothing.

    Every point the recorder writes (``RunRecorder.record_eval``) has a round and a ``success_rate``
    from 0 to 1, from its first version on; a round whose evaluation recorded nothing gets no point
    (``record_eval_failure`` records it in ``eval_failures``), which compare handles as a round without
    a value. So no legitimate point lacks a success rate: one without it was altered, and reading it as
    0.0 would move its run's means without a word."""
    if not isinstance(point, dict):
        return f"val_curve[{index}] is {_shown(point)}, not a validation point (an object)"
    if not _count(point.get("round")):
        return f"val_curve[{index}] has round {_shown(point.get('round'))}, not a round number (0 or more)"
    where = f"val_curve round {point['round']}"
    if "success_rate" not in point:
        return (f"{where} has no success_rate (every point the recorder writes has one; a round whose "
                "evaluation recorded nothing has no point)")
    if not _rate(point["success_rate"]):
        return f"{where} has success_rate {_shown(point['success_rate'])}, not a number from 0 to 1"
    if "n" in point and not _count(point["n"]):
        return f"{where} has n {_shown(point['n'])}, not an episode count (a whole number of 0 or more)"
    if point.get("failed") and not isinstance(point["failed"], dict):
        return f"{where} has failed {_shown(point['failed'])}, not an object (client -> why)"
    return None


def _round_problem(entry: object, index: int) -> str | None:
    """What makes ``rounds[index]`` unreadable for ``compare.deviations``, or None."""
    if not isinstance(entry, dict) or not _count(entry.get("round")):
        return f"rounds[{index}] is {_shown(entry)}, not a round entry (an object with a round number)"
    where = f"rounds round {entry['round']}"
    if entry.get("rejected") and not isinstance(entry["rejected"], dict):
        return f"{where} has rejected {_shown(entry['rejected'])}, not an object (client -> why)"
    for key in ("clients", "client_actor_ids"):
        value = entry.get(key)
        if value and not (isinstance(value, list) and all(_count(c) for c in value)):
            return f"{where} has {key} {_shown(value)}, not a list of client numbers"
    return None


def curve_problem(curve: Sequence[object]) -> str | None:
    """What makes the validation curve ``curve`` unreadable, or None: its first unreadable point
    (:func:`point_problem`), else a round with two points. The recorder writes one point a round (a
    resumed run keeps only its committed rounds' points and evaluates none of them again), so a second
    point of a round was added by hand or by a merge; reading the curve by round would keep the later
    one without a word, and which of the two is the run's value is not compare's to choose."""
    first: dict[int, int] = {}
    for index, point in enumerate(curve):
        problem = point_problem(point, index)
        if problem:
            return problem
        assert isinstance(point, dict)  # point_problem refuses anything else
        round_ = point["round"]
        if round_ in first:
            return (f"val_curve has round {round_} twice (val_curve[{first[round_]}] and val_curve[{index}]; "
                    "the recorder writes one point a round)")
        first[round_] = index
    return None


def summary_problem(summary: Mapping[str, Any]) -> str | None:
    """What in ``summary`` compare cannot read as the recorder writes it, naming the key (and the
    round), or None: ``val_curve`` (a list of points, one a round: :func:`curve_problem`),
    ``total_rounds`` and ``last_completed_round`` (whole numbers; absent or null as an older summary may
    have them), ``base_seed`` (a whole number, or absent or null) and ``rounds`` (:func:`_round_problem`).
    Checked before any of them is read, so that a summary edited by hand or torn is refused in one line
    rather than with a traceback or a guessed value."""
    curve = summary.get("val_curve")
    if curve is not None and not isinstance(curve, list):
        return f"val_curve is {_shown(curve)}, not a list of validation points (objects)"
    problem = curve_problem(curve or [])
    if problem:
        return problem
    for key in ("total_rounds", "last_completed_round"):
        if summary.get(key) is not None and not _count(summary[key]):
            return f"{key} is {_shown(summary[key])}, not a number of rounds (a whole number of 0 or more)"
    seed = summary.get("base_seed")
    # --paired matches runs by it: ``true`` is an int to Python and would pair as seed 1, "4" as no seed
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        return f"base_seed is {_shown(seed)}, not a seed (a whole number, as the run's seed setting)"
    entries = summary.get("rounds")
    if entries is not None and not isinstance(entries, list):
        return f"rounds is {_shown(entries)}, not a list of round entries (objects)"
    return next((p for p in (_round_problem(e, i) for i, e in enumerate(entries or [])) if p), None)


def _paired_reading(first: str, second: str, n: int, low: float | None, high: float | None) -> str:
    """In words, what the within-seed interval shows (as ``compare``'s reading of the Welch rows)."""
    if low is None or high is None:
        return f"no interval over seeds: needs 2 or more paired seeds (here {n})"
    if low == high:  # every seed's difference the same: no spread, no interval
        return "no spread between the seeds' differences: no interval, so no direction shown"
    if low > 0:
        return f"{first} ahead within seeds"
    if high < 0:
        return f"{second} ahead within seeds"
    return f"no difference shown at {n} paired seeds"


def paired(runs: Sequence[Mapping[str, Any]], names: Sequence[str], statistic: str) -> list[dict[str, Any]]:
    """Each pair of arms in the order given (earlier minus later) on ``statistic``, within seed: the
    runs of the two arms matched by seed, each seed's A − B, their mean, sd and 95% t-interval over
    seeds (n − 1 degrees of freedom, :func:`fedagent_flwr.intervals.paired_difference_interval`), with
    the seeds left out: ``only_in`` (a run in one arm only) and ``without_value`` (a run lacking
    ``statistic``). Where both arms of a seed ran in one session from one shared start, the session's
    luck cancels in its difference. ``runs`` are the report's rows (arm, seed and the statistics); every
    run must have a seed, one run a seed an arm (:func:`fedagent_flwr.compare.compare` checks)."""
    by_arm = {name: {run["seed"]: run for run in runs if run["arm"] == name} for name in names}
    found = []
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            a, b = by_arm[first], by_arm[second]
            both = sorted(seed for seed in a if seed in b and seed is not None)
            values = {seed: (a[seed][statistic], b[seed][statistic]) for seed in both}
            seeds = [seed for seed in both if None not in values[seed]]
            # of the runs' values as compare reads them; only the reported figures are rounded
            differences = [values[seed][0] - values[seed][1] for seed in seeds]
            mean = sd = low = high = None
            if len(differences) >= 2:
                mean, sd, low, high = paired_difference_interval(differences)
            elif differences:
                mean = differences[0]
            found.append({
                "arms": [first, second], "statistic": statistic, "paired_by": "seed",
                "seeds": seeds, "per_seed": [round(d, 4) for d in differences], "n_pairs": len(seeds),
                "mean": None if mean is None else round(mean, 4), "sd": None if sd is None else round(sd, 4),
                "ci95": None if low is None or high is None or low == high else [round(low, 4), round(high, 4)],
                "reading": _paired_reading(first, second, len(seeds), low, high),
                "only_in": {first: sorted(s for s in a if s not in b), second: sorted(s for s in b if s not in a)},
                "without_value": [seed for seed in both if seed not in seeds],
            })
    return found


def _rounds(first: int, last: int) -> str:
    return f"rounds {first}–{last}" if first != last else f"round {last}"


def _label(report: dict[str, Any], statistic: str) -> str:
    """The rounds ``statistic`` covers as planned: the tables' headings."""
    if statistic == "window":
        return _rounds(*report["window_rounds"])
    return _rounds(report["total_rounds"], report["total_rounds"])


def _value(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _cell(report: dict[str, Any], run: dict[str, Any], statistic: str) -> str:
    """A run's value under its heading; an unfinished run's value, which covers the rounds the run has
    rather than the heading's, names them (a heading must not claim rounds a value does not cover)."""
    if run[statistic] is None or run["final_round"] == report["total_rounds"]:
        return _value(run[statistic])
    own = run["window_rounds"] if statistic == "window" else [run["final_round"]] * 2
    return f"{_value(run[statistic])} ({_rounds(*own)})"


def markdown(report: dict[str, Any]) -> str:
    """The comparison as markdown tables: runs, arms, and pairs on the primary statistic, then on
    the secondary one. With ``--window 1`` the window is the final round: the two statistics are one,
    shown once, rather than twice under one heading. An arm whose means include an unfinished run's
    values from other rounds than the headings' is marked ``†`` in the arms and pairs tables (the
    runs table names that run's rounds in its cells). With ``--paired`` (the report has ``paired``) the
    within-seed tables follow the Welch ones, labelled as such."""
    primary, secondary, total = report["statistic"], report["secondary"], report["total_rounds"]
    single = report["window"] == 1
    shown = (primary,) if single else STATISTICS
    final = _label(report, "final")
    moved = {run["arm"] for run in report["runs"] if run["final_round"] != total}
    marked = {name: name + ("†" if name in moved else "") for name in report["arms"]}
    what = (f"mean validation success over the last {report['window']} of {total} rounds"
            if primary == "window" else f"validation success at the last of {total} rounds")
    lines = [f"Primary statistic ({primary}): {_label(report, primary)}, {what}; declare it before the runs. "
             + ("--window 1 makes the window the final round, so the two statistics are one: no secondary is shown."
                if single else f"Secondary: {_label(report, secondary)}."), ""]
    lines += [f"| arm | run | seed | status | {' | '.join(_label(report, s) for s in shown)} | 95% Wilson ({final}) | "
              "n episodes |", "|---" * (6 + len(shown)) + "|"]
    for run in report["runs"]:
        status = run["status"] + (f" (unfinished: {run['unfinished']})" if run["unfinished"] else "")
        low, high = run["final_ci95"]
        own = "" if run["final_round"] == total else f" ({_rounds(run['final_round'], run['final_round'])})"
        lines.append(f"| {run['arm']} | {run['run']} | {'–' if run['seed'] is None else run['seed']} | {status} | "
                     + "".join(f"{_cell(report, run, s)} | " for s in shown)
                     + f"[{low:.3f}, {high:.3f}]{own} | {run['final_n']} |")
    lines += ["", f"| arm | runs | {' | '.join(f'{_label(report, s)}: mean over runs | sd' for s in shown)} |",
              "|---" * (2 + 2 * len(shown)) + "|"]
    for name, row in report["arms"].items():
        lines.append(f"| {marked[name]} | {row['runs']} | "
                     + "".join(f"{_value(row[s]['mean'])} | {_value(row[s]['sd'])} | " for s in shown).rstrip())
    if moved:
        lines += ["", "† the arm's means include an unfinished run's values, which cover the rounds that run has "
                  "(named in its row of the runs table), not the headings' rounds."]
    for statistic, role in ((primary, "primary"), (secondary, "secondary"))[:len(shown)]:
        lines += ["", f"{_label(report, statistic)} ({role}), A − B with Welch's 95% interval over runs:", "",
                  "| A − B | A | B | A − B | 95% over runs | reading | runs an arm for this gap |",
                  "|---|---|---|---|---|---|---|"]
        for pair in (p for p in report["pairs"] if p["statistic"] == statistic):
            first, second = pair["arms"]
            ci = "–" if pair["ci95"] is None else f"[{pair['ci95'][0]:+.3f}, {pair['ci95'][1]:+.3f}]"
            needed = ("–" if pair["ci95"] is None else
                      "over 200" if pair["seeds_needed"] is None else str(pair["seeds_needed"]))
            difference = "–" if pair["difference"] is None else f"{pair['difference']:+.3f}"
            lines.append(f"| {marked[first]} − {marked[second]} | {_value(report['arms'][first][statistic]['mean'])} | "
                         f"{_value(report['arms'][second][statistic]['mean'])} | {difference} | {ci} | "
                         f"{pair['reading']} | {needed} |")
    lines += ["", "Runs an arm for this gap: for the interval over runs to exclude 0 with 80% power if the gap and "
              "the runs' spreads were the ones seen here (a plan, as uncertain as those spreads)."]
    if "paired" in report:
        lines += _paired_lines(report, ((primary, "primary"), (secondary, "secondary"))[:len(shown)])
    lines += [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def _paired_lines(report: dict[str, Any], roles: tuple[tuple[str, str], ...]) -> list[str]:
    """The ``--paired`` tables, one a statistic: per pair of arms the seeds paired, each seed's A − B,
    their mean and sd and the 95% t-interval over seeds. Labelled within-seed throughout, so that they
    are not read as the Welch rows above (the primary analysis, over runs)."""
    lines: list[str] = []
    # a seed whose run in either arm is unfinished: its value covers that run's rounds, not the heading's
    moved = {(run["arm"], run["seed"]) for run in report["runs"] if run["final_round"] != report["total_rounds"]}
    for statistic, role in roles:
        lines += ["", f"{_label(report, statistic)} ({role}), paired within seed: A − B of the two runs of each seed "
                  "(matched by base_seed), mean over seeds with the 95% t-interval (n − 1 degrees of freedom):", "",
                  "| A − B (paired) | seeds paired | A − B per seed | mean | sd | 95% over seeds (paired t) "
                  "| reading |",
                  "|---|---|---|---|---|---|---|"]
        for row in (r for r in report["paired"] if r["statistic"] == statistic):
            first, second = row["arms"]
            per_seed = ", ".join(f"{seed}{'†' if {(first, seed), (second, seed)} & moved else ''}: {d:+.3f}"
                                 for seed, d in zip(row["seeds"], row["per_seed"])) or "–"
            mean = "–" if row["mean"] is None else f"{row['mean']:+.3f}"
            ci = "–" if row["ci95"] is None else f"[{row['ci95'][0]:+.3f}, {row['ci95'][1]:+.3f}]"
            lines.append(f"| {first} − {second} | {row['n_pairs']} | {per_seed} | {mean} | {_value(row['sd'])} | "
                         f"{ci} | {row['reading']} |")
    if moved:
        lines += ["", "† a seed whose run in one of the arms is unfinished: its difference covers the rounds that run "
                  "has (named in its row of the runs table), not the headings' rounds."]
    return lines + ["", "Paired within seed: runs of two arms matched by seed, where both arms ran one session from "
                    "one shared start; seeds with a run in one arm only are left out, named below."]


def is_report(value: object) -> bool:
    """Whether ``value`` (a parsed JSON file) has the shape of a report ``fedagent compare --json`` wrote:
    an object with exactly :data:`REPORT_KEYS` (and ``paired``), both statistics named, runs, pairs and
    notes as lists, each run a row naming its arm and run, arms as an object. Conservative, as the
    report has no key of its own to tell it by: anything else is no report, and is not replaced."""
    if not isinstance(value, dict) or not REPORT_KEYS <= value.keys() <= REPORT_KEYS | {"paired"}:
        return False
    return (value["statistic"] in STATISTICS and value["secondary"] in STATISTICS
            and all(isinstance(value[key], list) for key in ("runs", "pairs", "notes"))
            and isinstance(value["arms"], dict)
            and all(isinstance(run, dict) and "arm" in run and "run" in run for run in value["runs"]))


def _not_a_report(path: Path) -> str | None:
    """What the file at ``path`` is, if it exists and is not an earlier report (:func:`is_report`),
    which writing the comparison there would replace; None where nothing is there, or an earlier
    report. Only a regular file of at most :data:`REPORT_MAX_BYTES` is read (a FIFO would block)."""
    if not os.path.lexists(path) or path.is_dir():  # nothing to lose; a directory is refused as unwritable
        return None
    if not path.exists():  # the write would replace the link, not make the file it names
        return "a broken symbolic link"
    what = "an existing file that is not an earlier comparison (the JSON report fedagent compare writes)"
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode) or info.st_size > REPORT_MAX_BYTES:
            return what
        found = json.loads(path.read_bytes())
    except OSError as exc:  # a file it may not read: whose it is cannot be told
        return f"an existing file that cannot be read to tell whether it is an earlier comparison ({exc.strerror})"
    except (ValueError, RecursionError):  # not JSON, or not UTF-8 (UnicodeDecodeError is a ValueError)
        return what
    return None if is_report(found) else what


def _overwritten_input(path: Path, arms: Mapping[str, Sequence[str | Path]]) -> str | None:
    """The input that writing the comparison to ``path`` would replace, or None: any run's record (a
    file named federated_summary.json, whether given or not, or a link to one) or one of the summaries
    given (the same file by another name, a link or a hard link included). Checked before anything is
    written, so that a slip of ``--json`` cannot destroy the record a comparison is made from."""
    target = path.resolve()
    for runs in arms.values():
        for run in runs:
            summary = summary_path(run)
            try:
                same = target == summary.resolve() or (target.exists() and summary.exists()
                                                       and os.path.samefile(target, summary))
            except OSError:  # a file that cannot be looked at cannot be compared either: compare says so
                same = False
            if same:
                return f"the summary of run {run}, an input of this comparison"
    if SUMMARY_FILE in (path.name, target.name):
        return f"a run's record (a file named {SUMMARY_FILE})"
    return None


def _unwritable(path: Path) -> str | None:
    """Why the comparison cannot be written to ``path``, or None; a missing directory is no problem
    (the atomic write makes it, as every run file's does)."""
    if path.is_dir():
        return "it is a directory"
    parent = path.parent
    while not parent.exists() and not parent.is_symlink():  # the nearest that exists decides
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None


def json_refusal(path: Path, arms: Mapping[str, Sequence[str | Path]]) -> str | None:
    """Why ``fedagent compare`` must not write its report to ``path`` (``--json``), as its one line
    saying what to do, or None: it would replace an input (:func:`_overwritten_input`), it cannot be
    written (:func:`_unwritable`), or it would replace a file that is not an earlier report
    (:func:`_not_a_report`: a run's metrics.jsonl, notes, anything; an earlier report is replaced, as
    rerunning a comparison to the same file does). Checked before the runs are read or anything is
    printed, so that a report is not printed and then lost to a bad ``--json``, and nothing is lost to it."""
    overwrites = _overwritten_input(path, arms)
    if overwrites:
        return f"--json {path} would overwrite {overwrites}: name another file for the comparison"
    problem = _unwritable(path)
    if problem:
        return (f"cannot write --json {path}: {problem}; name a file in a directory you can write (missing "
                "directories are made)")
    existing = _not_a_report(path)
    if existing:
        return (f"--json {path} would overwrite {existing}: name another file for the comparison, or delete "
                f"{path} first")
    return None
