"""Persistent vs subprocess trainer: wall clock per round, cold-start share, equality of results.

Compares two finished runs of the same job (same seeds), one with ``trainer.mode=subprocess`` and
one with ``trainer.mode=persistent``, from their ``federated_summary.json`` and ``metrics.jsonl``:

* wall clock of every round (training, aggregation, evaluation) and of the whole run, and the
  persistent/subprocess ratio, both measured in the compared runs themselves;
* the cold-start share of the client rounds: the verl backend reports ``verl.cold_start_s`` (time
  before step 1: Ray, FSDP, vLLM start in subprocess mode; the weight reload in a live session)
  next to ``train-seconds`` (the client's whole train call);
* the max abs difference between the two runs' aggregates, per round and final.

``--run`` first runs both jobs itself, one after the other, with ``flwr run`` on a local
simulation SuperLink (``FLWR_HOME`` in a temporary directory, stopped afterwards), e.g. on a CPU::

    python benchmarks/persistent_trainer.py --run --out /tmp/bench-persist \\
        --overrides "num_rounds=3 clients.total=2 clients.per_round=2"

On a GPU node run the two jobs with ``tools/gpu/run_federated.sh`` (one per GPU, side by side)
and compare them afterwards::

    python benchmarks/persistent_trainer.py RUN_DIR_SUBPROCESS RUN_DIR_PERSISTENT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]


def _summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "federated_summary.json").read_text())


def _train_events(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == "train"]


def _max_abs(a: str | None, b: str | None) -> float | None:
    if not a or not b:
        return None
    x, y = load_file(str(Path(a) / "model.safetensors")), load_file(str(Path(b) / "model.safetensors"))
    return max((x[k].double() - y[k].double()).abs().max().item() for k in x)


def _cold_start(run_dir: Path) -> dict[int, tuple[float, float]]:
    """Per round: (sum of clients' cold start seconds, sum of their train seconds)."""
    per_round: dict[int, tuple[float, float]] = {}
    for event in _train_events(run_dir):
        metrics = event.get("metrics", {})
        cold = float(metrics.get("verl.cold_start_s", 0.0))
        total = float(metrics.get("train-seconds", 0.0))
        old = per_round.get(int(event["round"]), (0.0, 0.0))
        per_round[int(event["round"])] = (old[0] + cold, old[1] + total)
    return per_round


def compare(subprocess_dir: Path, persistent_dir: Path) -> dict[str, Any]:
    """The comparison as a dict (also printed as a table by :func:`main`)."""
    runs = {"subprocess": subprocess_dir, "persistent": persistent_dir}
    summaries = {mode: _summary(path) for mode, path in runs.items()}
    colds = {mode: _cold_start(path) for mode, path in runs.items()}
    rounds = []
    for a, b in zip(summaries["subprocess"]["rounds"], summaries["persistent"]["rounds"]):
        r = a["round"]
        row = {"round": r, "max_abs_diff": _max_abs(a["aggregated_actor"], b["aggregated_actor"])}
        for mode, entry in (("subprocess", a), ("persistent", b)):
            cold, train = colds[mode].get(r, (0.0, 0.0))
            row[f"{mode}_s"] = entry.get("wall_seconds")
            row[f"{mode}_cold_share"] = round(cold / train, 3) if train else None
        if row["subprocess_s"] and row["persistent_s"]:
            row["ratio"] = round(row["persistent_s"] / row["subprocess_s"], 3)
        rounds.append(row)
    total = {mode: s.get("wall_seconds") for mode, s in summaries.items()}
    return {
        "rounds": rounds,
        "initial_eval_s": {mode: s.get("initial_eval_seconds") for mode, s in summaries.items()},
        "wall_s": total,
        "ratio": round(total["persistent"] / total["subprocess"], 3) if all(total.values()) else None,
        "final_max_abs_diff": _max_abs(summaries["subprocess"].get("final_model"),
                                       summaries["persistent"].get("final_model")),
        "status": {mode: s.get("status") for mode, s in summaries.items()},
    }


def _run_both(out: Path, overrides: str, federation: str) -> tuple[Path, Path]:
    """Run the job in both modes with ``flwr run`` on a local SuperLink; return the run dirs."""
    dirs = []
    for mode in ("subprocess", "persistent"):
        home = Path(tempfile.mkdtemp(prefix=f"flwr-bench-{mode}-"))
        env = {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
        run_config = f'overrides="output_dir={out} run_name={mode} trainer.mode={mode} {overrides}"'
        started = time.monotonic()
        print(f"[bench] {mode}: flwr run ({overrides})", flush=True)
        proc = subprocess.run(["flwr", "run", str(REPO), "--stream", "--run-config", run_config,
                               "--federation-config", federation], env=env, cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        (out / f"{mode}.log").write_text(proc.stdout)
        subprocess.run([sys.executable, "-m", "fedagent_flwr.launch", "stop-local", str(home)], env=env,
                       capture_output=True)
        print(f"[bench] {mode}: exit {proc.returncode} after {time.monotonic() - started:.1f} s", flush=True)
        if proc.returncode != 0:
            raise SystemExit(f"the {mode} run failed; see {out / f'{mode}.log'}")
        dirs.append(out / mode)
    return dirs[0], dirs[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="SUBPROCESS_RUN_DIR PERSISTENT_RUN_DIR")
    parser.add_argument("--run", action="store_true", help="run both jobs first (flwr run, local SuperLink)")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-persistent"))
    parser.add_argument("--overrides", default="num_rounds=3 clients.total=2 clients.per_round=2")
    parser.add_argument("--federation", default="num-supernodes=2 client-resources-num-cpus=1")
    parser.add_argument("--json", type=Path, help="also write the comparison here")
    args = parser.parse_args(argv)
    if args.run:
        args.out.mkdir(parents=True, exist_ok=True)
        runs = _run_both(args.out.resolve(), args.overrides, args.federation)
    elif len(args.runs) == 2:
        runs = (args.runs[0], args.runs[1])
    else:
        parser.error("give SUBPROCESS_RUN_DIR PERSISTENT_RUN_DIR, or --run")
    result = compare(*runs)
    print(f"{'round':>5} {'subprocess s':>13} {'persistent s':>13} {'ratio':>6} "
          f"{'cold share sub':>15} {'cold share pers':>16} {'max|diff|':>10}")
    for row in result["rounds"]:
        print(f"{row['round']:>5} {row['subprocess_s'] or float('nan'):>13.1f} "
              f"{row['persistent_s'] or float('nan'):>13.1f} "
              f"{row.get('ratio') or float('nan'):>6.3f} {_fmt(row['subprocess_cold_share']):>15} "
              f"{_fmt(row['persistent_cold_share']):>16} {_fmt(row['max_abs_diff'], '.2e'):>10}")
    print(f"initial eval s: {result['initial_eval_s']}")
    print(f"whole run s: {result['wall_s']}  persistent/subprocess = {result['ratio']}")
    print(f"final aggregate max|diff| = {result['final_max_abs_diff']}  status: {result['status']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
