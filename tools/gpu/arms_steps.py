"""verl's per-step metrics of collected GPU runs, side by side: where two runs first differ, and
what their steps took.

    python3 tools/gpu/arms.py steps --run A=/tmp/r/results/local-s5 --run B=/tmp/r2/results/local-s5 \\
        [--keys critic/score/mean timing_s/step] [--client 1] [--write pair-steps.jsonl]

A run's results folder (``<archive>/results/<run>/``, packed by ``tools/gpu/collect.sh``) holds
``steps/round_<r>-client_<c>.jsonl``: each line one verl step of that client-round,
``{"step": n, "data": {"<verl metric>": value, ...}}`` (``keep_steps`` in
``fedagent_flwr/trainers/verl/job.py``). A round's first step is where two runs of one config can
first differ (docs/results.md, the reproducibility pairs), and ``metrics.jsonl`` keeps a round's
last step only. This reads one client's steps of each run (client 0 by default: the one client of
a local or centralized run) in round, then step order, and prints

* one row per (round, step) with the chosen keys of every run, key by key;
* for two runs, the first (round, step) at which a chosen key other than a timing key
  (``timing_s/...``, ``timing_per_token_ms/...``: they differ from run to run anyway) differs,
  with both values exact, or that none does;
* per run, the median and range of ``timing_s/step`` and ``timing_s/gen`` over the steps after
  the run's first (whose time includes the session's start-up), and how many steps that is.

A file is usually ``keep_steps``'s (finite numbers only), but a subprocess-mode job killed by
SIGTERM (the ClientApp's timeout) leaves verl's own file-logger lines instead (docs/gpu.md, verl's
loggers): the same ``{"step", "data"}`` form with every value verl logged, NaN and infinity as
``null``, strings and lists too, and possibly a last line cut off mid-write. Such a file reads as
``keep_steps`` would have kept it: of each step's values only the finite numbers, as floats
(:func:`numeric_values`); the rest counts as missing, shown as ``–`` in the table and as ``absent``
by the first difference, like a key a step does not have (a NaN kept would differ from itself). A
last line without its newline that is not JSON is the killed write: skipped, with a note on stderr
naming the file and line. Any other line that is no step is an error naming the file and line.

``--write`` keeps the same steps as one flat JSON line per (run, round, step), keys sorted: ``run``,
``round``, ``step`` and the chosen keys a step has, as ``docs/gpu-runs/2026-12-04/metrics/
repro-rs-steps.jsonl`` holds batch 17's pair. Values are written as read (that file's have six
decimals at most because they were copied from verl's console lines; a number verl wrote as an
integer is written as a float, as ``keep_steps`` keeps it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # fedagent_flwr.atomic

from fedagent_flwr.atomic import write_text_atomic  # noqa: E402

#: The folder of a run's results that collect.sh fills, and its files' names.
STEPS_FOLDER = "steps"
STEP_FILE = re.compile(r"round_(\d+)-client_(\d+)\.jsonl")
#: The metrics of docs/gpu-runs/2026-12-04/metrics/repro-rs-steps.jsonl (batch 17's pair), the
#: default ``--keys``: a new pair's file then compares line for line with that one.
DEFAULT_KEYS = ("actor/entropy", "actor/grad_norm", "actor/pg_loss", "critic/score/mean", "num_turns/mean",
                "response_length/mean", "timing_s/gen", "timing_s/step")
#: Keys that measure time: they differ between any two runs, so the first difference ignores them.
TIMING_PREFIXES = ("timing_s/", "timing_per_token_ms/")
#: The step times summarised per run, whatever ``--keys`` says.
TIMING_KEYS = ("timing_s/step", "timing_s/gen")
DASH = "–"

#: One run's steps of one client: ``(round, step) -> verl's metrics``, in round then step order.
Steps = dict[tuple[int, int], dict[str, float]]


class StepsError(ValueError):
    """The steps cannot be read or shown as asked (no steps folder, no such client or key)."""


def parse_run(text: str) -> tuple[str, Path]:
    """``LABEL=DIR`` of ``--run`` as ``(label, folder)``; argparse reports the error otherwise."""
    label, sep, folder = text.partition("=")
    if not sep or not label or not folder:
        raise argparse.ArgumentTypeError(f"{text!r}: give LABEL=RESULTS_RUN_DIR, e.g. A=/tmp/r/results/local-s5")
    return label, Path(folder)


def step_files(run_dir: Path) -> dict[tuple[int, int], Path]:
    """``(round, client) -> file`` of the run's ``steps/round_<r>-client_<c>.jsonl``. Raises
    StepsError when there are none, naming the folder and what writes it."""
    folder = run_dir / STEPS_FOLDER
    found = {}
    for path in folder.glob("round_*-client_*.jsonl") if folder.is_dir() else []:
        match = STEP_FILE.fullmatch(path.name)
        if match is not None:
            found[(int(match.group(1)), int(match.group(2)))] = path
    if not found:
        raise StepsError(
            f"{folder} {'holds no round_<r>-client_<c>.jsonl' if folder.is_dir() else 'does not exist'}: "
            "tools/gpu/collect.sh writes it into a run's results folder (<archive>/results/<run>/) from each "
            "client-round's verl/steps.jsonl; give --run that results folder (runs collected before collect.sh "
            "kept steps have none)")
    return found


def numeric_values(data: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of one step's ``data`` as floats, the rest (``null`` for NaN, strings,
    lists) left out: what the trainer's ``keep_steps`` keeps of a step (``numeric_metrics`` in
    ``fedagent_flwr/trainers/verl/verl_log.py``, applied here to the values as JSON holds them; not
    imported, because that package needs omegaconf and ``arms.py steps`` runs on a bare python3)."""
    values: dict[str, float] = {}
    for key, value in data.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            values[str(key)] = number
    return values


def read_step_file(path: Path) -> dict[int, dict[str, float]]:
    """``step -> numeric values`` of one ``round_<r>-client_<c>.jsonl``, whether ``keep_steps`` wrote
    it or a killed job left verl's raw lines (the module docstring); a step logged twice keeps its
    later line, as the trainer's reader does. A last line without its newline that is not JSON (cut
    off mid-write) is skipped with a note on stderr. Raises StepsError naming the file and line for
    any other line that is not ``{"step": n, "data": {...}}``."""
    # Bytes, split at newlines only: a write cut off inside a multi-byte character would not decode
    # as text, and a string value may hold a character that str.splitlines splits at (U+2028, which
    # orjson writes unescaped). A file ending in its newline ends in an empty item, so a last item
    # with text is a line never finished; json.loads decodes each line (a bad byte: ValueError).
    lines = path.read_bytes().split(b"\n")
    steps: dict[int, dict[str, float]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError as exc:
            if number == len(lines):
                print(f"arms.py steps: note: {path}:{number}: last line cut off (a killed job's half-written step), "
                      "skipped", file=sys.stderr)
                continue
            raise StepsError(f'{path}:{number}: not a step line ({{"step": n, "data": {{...}}}}): {exc}') from exc
        try:
            if not isinstance(entry["data"], dict):
                raise TypeError(f"data is {type(entry['data']).__name__}, not an object")
            step = entry["step"]
            # an integer, as the trainer's reader (verl_log.parse_record) requires: not "3", 1.5 or true
            if isinstance(step, bool) or not isinstance(step, int):
                raise TypeError(f"step is {step!r}, not an integer")
            steps[step] = numeric_values(entry["data"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StepsError(f'{path}:{number}: not a step line ({{"step": n, "data": {{...}}}}): '
                             f"{type(exc).__name__}: {exc}") from exc
    return steps


def read_steps(run_dir: Path, client: int) -> tuple[Steps, list[int]]:
    """``client``'s steps of the run (round, then step, numerically: round 10 after round 2) and the
    clients that have step files. Raises StepsError when ``client`` has none, or a line is no step
    (:func:`read_step_file`)."""
    files = step_files(run_dir)
    clients = sorted({c for _, c in files})
    if client not in clients:
        raise StepsError(f"{run_dir / STEPS_FOLDER} has no steps of client {client} (clients: "
                         f"{', '.join(map(str, clients))}); choose one with --client")
    steps: Steps = {}
    for (round_, _), path in sorted((key, path) for key, path in files.items() if key[1] == client):
        for step, data in read_step_file(path).items():
            steps[(round_, step)] = data
    if not steps:
        raise StepsError(f"{run_dir / STEPS_FOLDER}: client {client}'s files hold no step")
    return dict(sorted(steps.items())), clients


def is_timing(key: str) -> bool:
    """Whether ``key`` measures time (:data:`TIMING_PREFIXES`)."""
    return key.startswith(TIMING_PREFIXES)


def flat_lines(runs: dict[str, Steps], keys: list[str]) -> str:
    """The runs' steps as ``repro-rs-steps.jsonl`` holds them: one key-sorted JSON line per (run,
    round, step), runs in the order given, with the ``keys`` each step has."""
    return "".join(
        json.dumps({"run": label, "round": round_, "step": step, **{k: data[k] for k in keys if k in data}},
                   sort_keys=True) + "\n"
        for label, steps in runs.items() for (round_, step), data in steps.items())


def first_difference(runs: dict[str, Steps], keys: list[str]) -> str:
    """For two runs, the first (round, step) of either at which a chosen non-timing key differs (a
    step or a value that only one run has differs too), with every such key's exact values."""
    (a, first), (b, second) = runs.items()
    compared = [k for k in keys if not is_timing(k)]
    if not compared:
        return f"{a} and {b}: no key other than timing keys chosen, nothing compared"
    for place in sorted(set(first) | set(second)):
        where = f"round {place[0]} step {place[1]}"
        if place not in first or place not in second:
            return f"{a} and {b} first differ at {where}: only {a if place in first else b} has it"
        x, y = first[place], second[place]
        differing = [f"{k} {_exact(x.get(k))} ({a}) vs {_exact(y.get(k))} ({b})"
                     for k in compared if x.get(k) != y.get(k)]
        if differing:
            return f"{a} and {b} first differ at {where}: " + "; ".join(differing)
    return f"{a} and {b}: identical in every step shown ({', '.join(compared)})"


def _exact(value: float | None) -> str:
    return "absent" if value is None else repr(value)


def step_times(steps: Steps) -> dict[str, Any]:
    """Median, smallest and largest of each :data:`TIMING_KEYS` value over the steps after the
    run's first (round, step), which includes the session's start-up, and how many steps had it."""
    later = list(steps.values())[1:]
    result: dict[str, Any] = {"steps_after_first": len(later)}
    for key in TIMING_KEYS:
        values = [float(data[key]) for data in later if key in data]
        result[key] = ({"n": len(values), "median": statistics.median(values), "min": min(values),
                        "max": max(values)} if values else None)
    return result


def _cell(data: dict[str, float] | None, key: str) -> str:
    value = None if data is None else data.get(key)
    return DASH if value is None else f"{value:.6g}"


def render(runs: dict[str, Steps], keys: list[str], client: int, clients: dict[str, list[int]]) -> str:
    """The markdown: the side-by-side table, the first difference (two runs) and the step times."""
    labels = list(runs)
    lines = [f"verl's per-step metrics of client {client}, by round and step ("
             + "; ".join(f"{label}: {len(runs[label])} steps, clients with steps {', '.join(map(str, clients[label]))}"
                         for label in labels) + "):", "",
             "| round | step | " + " | ".join(f"{key} {label}" for key in keys for label in labels) + " |",
             "|---|---|" + "---|" * (len(keys) * len(labels))]
    for place in sorted({place for steps in runs.values() for place in steps}):
        lines.append(f"| {place[0]} | {place[1]} | "
                     + " | ".join(_cell(runs[label].get(place), key) for key in keys for label in labels) + " |")
    if len(runs) == 2:
        lines += ["", first_difference(runs, keys)]
    lines += ["", "Step times after each run's first step (which includes the start-up):", ""]
    for label, steps in runs.items():
        times = step_times(steps)
        count = times["steps_after_first"]
        parts = [f"{key} " + ("none" if t is None else f"median {t['median']:.2f} s, range {t['min']:.2f}–"
                              f"{t['max']:.2f} s" + ("" if t["n"] == count else f" (in {t['n']} of them)"))
                 for key, t in ((k, times[k]) for k in TIMING_KEYS)]
        lines.append(f"- {label}: {count} steps after the first; " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def steps_report(runs: list[tuple[str, Path]], keys: list[str] | None = None, client: int = 0,
                 write: Path | None = None) -> str:
    """Read each ``(label, results folder)``'s steps of ``client``, write them flat to ``write``
    (temporary name, then renamed) when given, and return the markdown (:func:`render`). ``keys``
    None: :data:`DEFAULT_KEYS`, less those no step has (named under the table). Raises StepsError
    for a label given twice, a run without steps, or a key asked for that no step of any run has (a
    misspelt key would otherwise show as an empty column)."""
    labels = [label for label, _ in runs]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise StepsError(f"--run label(s) {', '.join(twice)} given twice: give each run its own label")
    read = {label: read_steps(folder, client) for label, folder in runs}
    steps = {label: found for label, (found, _) in read.items()}
    present = {key for found in steps.values() for data in found.values() for key in data}
    chosen = list(DEFAULT_KEYS) if keys is None else keys
    unknown = [key for key in chosen if key not in present]
    if unknown and keys is not None:
        raise StepsError(f"no step of {', '.join(labels)} has {', '.join(unknown)} (keys present: "
                         f"{', '.join(sorted(present))})")
    chosen = [key for key in chosen if key in present]
    if write is not None:
        write_text_atomic(write, flat_lines(steps, chosen))
    text = render(steps, chosen, client, {label: clients for label, (_, clients) in read.items()})
    return text + (f"\nDefault keys no step has, left out: {', '.join(unknown)}\n" if unknown else "")
