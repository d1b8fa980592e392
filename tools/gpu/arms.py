"""FedAgent's arms side by side on one GPU node: launch them, watch them, and report the table.

    PYTHONPATH=/tmp/site python3 tools/gpu/arms.py launch --out /tmp/out --recipe tinyguess_verl --seeds 1 2 \\
        --arms federated local centralized fedprox [--extra "num_rounds=10"] [--max-sessions 4]
    python3 tools/gpu/arms.py status --out /tmp/out
    python3 tools/gpu/arms.py wait --out /tmp/out /tmp/out2 --timeout 540   # until every run ended (exit 0; 3: timeout)
    python3 tools/gpu/arms.py report --out /tmp/out      # arms.md, arms.json, arms.png
    python3 tools/gpu/arms.py phases --out /tmp/out      # phases.md: the verl sessions' phase tables
    python3 tools/gpu/arms.py pool --from docs/gpu-runs --out /tmp/declared --arms federated local --min-seed 4
                                                         # committed runs as one matrix, then its report
    python3 tools/gpu/arms.py dynamics --from docs/gpu-runs --out /tmp/dynamics --arms centralized federated \\
        --min-seed 4                                     # the same runs' take-off rounds and training dynamics
    python3 tools/gpu/arms.py steps --run A=/tmp/r/results/local-s5 --run B=/tmp/r2/results/local-s5 \\
        [--write FILE.jsonl]                             # collected runs' verl steps side by side, step times

Every arm runs the same recipe with the same per-client step budget (``train.local_steps`` per
round, ``num_rounds`` rounds) and is validated on the same fixed episodes (``eval.seed``):

* ``federated``: N = 2 clients on the recipe's heterogeneous partition, FedAvg every round;
* ``fedprox``: the same with FedProx (``strategy.proximal_mu``);
* ``local``: client 0 alone on its own partition (FedAgent's "local agent training");
* ``centralized``: one client holding the whole pool (FedAgent's upper baseline).

``launch`` starts one ``tools/gpu/run_federated.sh`` per (arm, seed), detached and side by side,
each with its own Flower home and ports, and returns at once; runs beyond ``--max-sessions``
verl sessions wait in later waves, started by a detached scheduler as earlier ones end. The GPU's
memory is shared with every other matrix live on the node: each run gets
``trainer.gpu_memory_utilization`` = its share for all their sessions together (``gpu_share.py``).
``report`` reads every run's ``federated_summary.json`` (finished or not: the summary is
rewritten after every round) and writes the table: the final validation success of each run with
its 95% Wilson interval, and per arm the mean over seeds with the Wilson interval of the pooled
episodes. Pooling counts the evaluation noise only; the spread between seeds is shown beside it,
so neither is hidden. ``report`` and ``phases`` (reading the runs' records back) live in
``arms_report.py`` beside this file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_share  # noqa: E402
from arms_dynamics import DynamicsError, dynamics  # noqa: E402
from arms_pool import DEFAULT_PREFIX, PoolError, pool  # noqa: E402
from arms_report import MATRIX_FILE, phases_report, report, run_summary  # noqa: E402
from arms_steps import DEFAULT_KEYS, StepsError, parse_run, steps_report  # noqa: E402

from fedagent_flwr.compare import CompareError  # noqa: E402

#: Overrides, Flower federation and verl sessions of each arm (the recipe and seed are added in
#: front). A session is one persistent trainer that trains; "local" has a second node that only
#: evaluates (Hugging Face generation, a few GB).
ARMS: dict[str, tuple[str, str, int]] = {
    "federated": ("", "num-supernodes=2 client-resources-num-gpus=0.5 client-resources-num-cpus=4", 2),
    "fedprox": ("strategy=fedprox strategy.proximal_mu=0.01",
                "num-supernodes=2 client-resources-num-gpus=0.5 client-resources-num-cpus=4", 2),
    "local": ("experiment=local", "num-supernodes=2 client-resources-num-gpus=0.5 client-resources-num-cpus=4", 1),
    "centralized": ("experiment=centralized",
                    "num-supernodes=1 client-resources-num-gpus=1 client-resources-num-cpus=4", 1),
}
COLLECT_SCRIPT = Path(__file__).resolve().parent / "collect.sh"
HOSTMEM_SCRIPT = Path(__file__).resolve().parent / "hostmem.py"
#: ``arms.py wait``'s exit status when its timeout passed with runs still going (not 124, which the
#: device tool reads as its own time limit).
STILL_RUNNING = 3
#: verl sessions one node runs at once by default: before the per-reload leak fix a persistent
#: session's host memory grew about 1.3 GiB a round, and five of them reached Ray's kill line on a
#: 126 GB H200 node at round 8 of 10 (docs/results.md, batch 12); since, four peak at ~61 GiB over 10
#: rounds (batch 13; batch 14 61.4 GiB to round 9). Other matrices on the node count too.
DEFAULT_MAX_SESSIONS = 4


def run_name(arm: str, seed: int) -> str:
    """The run's name (and log file stem) for ``arm`` with ``seed``."""
    return f"{arm}-s{seed}"


def plan(recipe: str, seeds: list[int], arms: list[str], extra: str, base_port: int) -> list[dict[str, Any]]:
    """Every (arm, seed) run with its overrides, federation, sessions and ports, seed-major order."""
    runs = []
    for index, (arm, seed) in enumerate((a, s) for s in seeds for a in arms):
        overrides, federation, sessions = ARMS[arm]
        runs.append({
            "name": run_name(arm, seed), "arm": arm, "seed": seed, "sessions": sessions, "federation": federation,
            "overrides": " ".join(x for x in (f"recipe={recipe}", f"seed={seed}", overrides, extra) if x),
            "port": base_port + 10 * index,
        })
    return runs


def waves(runs: list[dict[str, Any]], max_sessions: int) -> list[list[dict[str, Any]]]:
    """Runs grouped in the order given so that no group needs more than ``max_sessions`` sessions."""
    groups: list[list[dict[str, Any]]] = [[]]
    for run in runs:
        if groups[-1] and sum(r["sessions"] for r in groups[-1]) + run["sessions"] > max_sessions:
            groups.append([])
        groups[-1].append(run)
    return groups


def _start(out: Path, run: dict[str, Any]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OUT": str(out), "PORT": str(run["port"])}
    with open(out / f"{run['name']}.launch.log", "ab") as log:
        process = subprocess.Popen(
            ["bash", str(REPO / "tools/gpu/run_federated.sh"), run["name"], run["overrides"], run["federation"]],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives the command that launched it
        )
    (out / f"{run['name']}.pid").write_text(_pid_line(process.pid))  # its process group, for `stop`
    print(f"started {run['name']} (pid {process.pid}, port {run['port']}): {run['overrides']}", flush=True)
    return process


_start_ticks = gpu_share.start_ticks


def _pid_line(pid: int) -> str:
    return f"{pid} {_start_ticks(pid)}\n"


def _pid_record(pid_file: Path) -> tuple[int, str]:
    """A pid file's pid and start ticks, as :func:`_pid_line` writes them; OSError if it cannot be
    read, ValueError (saying what it holds) if it holds anything else."""
    text = pid_file.read_text(errors="replace")
    try:
        pid, started = text.split()
        return int(pid), started
    except ValueError:
        raise ValueError(f"it holds {text[:60]!r}, not '<pid> <start ticks>' as arms.py writes") from None


def _own_pid_files(out: Path) -> list[Path]:
    """The pid files in ``out`` that this script writes: ``schedule.pid`` and ``<run name>.pid``, a
    run being one of ``out``'s matrix (``matrix.json``) or named as :func:`run_name` names them (an
    earlier launch into the same folder may have had other runs). Others' (a database's, say, where
    ``OUT`` points at a shared folder) are not ours to read, signal or delete."""
    names = {"schedule"}
    try:
        names |= {str(r["name"]) for r in json.loads((out / MATRIX_FILE).read_text())["runs"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    pattern = re.compile(rf"(?:{'|'.join(map(re.escape, ARMS))})-s-?\d+")
    return [path for path in out.glob("*.pid") if path.stem in names or pattern.fullmatch(path.stem)]


def stop(out: Path) -> list[str]:
    """Stop ``out``'s scheduler (no further waves) and every run still going; return their names.

    Each run's launcher leads its own process group, and its TERM trap stops the run's SuperLink and
    simulation, which Flower starts outside that group. Only this script's pid files
    (:func:`_own_pid_files`) are read; one that does not hold "pid start-ticks" is left as it is
    (one line on stderr), never taken for an ended run and deleted.
    """
    stopped = []
    # the scheduler first, so that it cannot start another wave while the runs are stopped
    for pid_file in sorted(_own_pid_files(out), key=lambda path: (path.name != "schedule.pid", path.name)):
        try:
            pid, started = _pid_record(pid_file)
        except OSError as exc:
            print(f"arms.py stop: left {pid_file} alone: cannot read it ({exc})", file=sys.stderr)
            continue
        except ValueError as exc:
            print(f"arms.py stop: left {pid_file} alone: {exc}", file=sys.stderr)
            continue
        try:
            # the same process (pids wrap: a recycled one is a stranger), still leading its group
            if _start_ticks(pid) != started or os.getpgid(pid) != pid:
                raise ProcessLookupError
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pid_file.unlink(missing_ok=True)  # already ended
            continue
        stopped.append(pid_file.stem)
        pid_file.unlink()
    return stopped


def _recipe(recipe: str) -> dict[str, Any]:
    """The recipe's YAML (``conf/recipe/<recipe>.yaml``); empty when there is no such file."""
    import yaml  # here, not at the top: `status` and `phases` run on the node's bare python3 (stdlib only)

    path = REPO / "conf" / "recipe" / f"{recipe}.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def _uses_vllm(recipe: dict[str, Any], extra: str) -> bool:
    """Whether the runs train with verl (whose sessions start vLLM): ``trainer=`` in ``extra``,
    else the recipe's trainer group."""
    chosen = [x.split("=", 1)[1] for x in extra.split() if x.lstrip("+").startswith("trainer=")]
    if not chosen:
        chosen = [str(d.get("override /trainer")) for d in recipe.get("defaults") or []
                  if isinstance(d, dict) and "override /trainer" in d]
    return bool(chosen) and chosen[-1].startswith("verl")


def gpu_plan(out: Path, recipe: str, runs: list[dict[str, Any]], groups: list[list[dict[str, Any]]],
             extra: str, live_dir: Path | None = None) -> dict[str, Any]:
    """How this matrix shares the GPU: its sessions at once, the other live matrices' sessions, and
    each vLLM's ``trainer.gpu_memory_utilization`` (None: the runs start no vLLM). Raises
    gpu_share.ShareError when ``extra`` sets a value that over-commits the GPU."""
    from fedagent_flwr.schema.trainer import VerlKnobs  # needs omegaconf: PYTHONPATH=/tmp/site on the node

    config = _recipe(recipe)
    default = float((config.get("trainer") or {}).get("gpu_memory_utilization", VerlKnobs.gpu_memory_utilization))
    ours = max(sum(r["sessions"] for r in group) for group in groups)
    others = gpu_share.live_matrices(out, live_dir)
    other_sessions = sum(int(m.get("sessions", 0)) for m in others)
    # what the others' vLLMs asked for (a matrix whose runs start no vLLM: nothing)
    held = sum(int(m.get("sessions", 0)) * float(m.get("gpu_memory_utilization") or 0) for m in others)
    explicit = gpu_share.explicit_value(extra)
    # Relaunching into the same --out resumes its named runs, which the server accepts only with the
    # same config: keep the share the first launch recorded, whatever else is live now.
    earlier = _earlier_share(out) if explicit is None else None
    if earlier is not None:
        explicit = earlier
    value = gpu_share.share(ours, default, explicit, other_sessions, held) if _uses_vllm(config, extra) else None
    if earlier is not None and value is not None and value < earlier:
        raise gpu_share.ShareError(
            f"{out} was launched with {gpu_share.KEY}={earlier}, and its runs resume only with that value, but the "
            f"matrices live on the GPU now leave {value}: wait for them to end, or launch into another --out")
    if explicit is not None and value is not None and value < explicit:
        print(f"GPU: {gpu_share.KEY}={explicit} lowered to {value}, an even share of the GPU", flush=True)
    return {"sessions": ours, "other_matrices": {m["out"]: m.get("sessions") for m in others},
            "other_sessions": other_sessions, "other_held": round(held, 4), "total_sessions": ours + other_sessions,
            "explicit": explicit, "gpu_memory_utilization": value}


def _earlier_share(out: Path) -> float | None:
    """The vLLM share an earlier launch into ``out`` gave its runs (matrix.json), if any."""
    try:
        value = json.loads((out / MATRIX_FILE).read_text()).get("gpu", {}).get("gpu_memory_utilization")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def launch(out: Path, recipe: str, seeds: list[int], arms: list[str], extra: str, base_port: int,
           max_sessions: int = DEFAULT_MAX_SESSIONS, live_dir: Path | None = None) -> list[dict[str, Any]]:
    """Start the runs detached, wave after wave of at most ``max_sessions`` verl sessions.

    The first wave starts now; when there are more, a detached scheduler (this script's
    ``schedule`` command) starts each next wave once the previous one has ended, so the call
    returns at once either way. Every run gets its share of the GPU's memory
    (:func:`gpu_plan`), and the matrix is registered as live under ``live_dir`` (default
    ``gpu_share.LIVE_DIR``) for later launches.
    """
    out.mkdir(parents=True, exist_ok=True)
    runs = plan(recipe, seeds, arms, gpu_share.without_setting(extra), base_port)
    groups = waves(runs, max_sessions)
    gpu = gpu_plan(out, recipe, runs, groups, extra, live_dir)
    if gpu["gpu_memory_utilization"] is not None:
        for run in runs:
            run["overrides"] += f" {gpu_share.KEY}={gpu['gpu_memory_utilization']}"
        others = ", ".join(f"{n} in {o}" for o, n in gpu["other_matrices"].items())
        print(f"GPU: {gpu['total_sessions']} verl session(s) at once ({gpu['sessions']} of this matrix"
              + (f"; other live matrices: {others}, holding {gpu['other_held']:.0%} of the GPU" if others else "")
              + f"): each run gets {gpu_share.KEY}={gpu['gpu_memory_utilization']}", flush=True)
    (out / MATRIX_FILE).write_text(json.dumps({"recipe": recipe, "max_sessions": max_sessions, "gpu": gpu,
                                               "runs": runs, "waves": [[r["name"] for r in g] for g in groups]},
                                              indent=2))
    if len(groups) == 1:
        pids = [_start(out, run).pid for run in groups[0]]
    else:
        with open(out / "schedule.log", "ab") as log:
            scheduler = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "schedule", "--out", str(out)],
                                         cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        (out / "schedule.pid").write_text(_pid_line(scheduler.pid))
        pids = [scheduler.pid]
        print(f"{len(runs)} runs in {len(groups)} waves of at most {max_sessions} sessions: "
              + " | ".join(", ".join(r["name"] for r in g) for g in groups) + f" (progress in {out / 'schedule.log'})")
    gpu_share.register(out, gpu["sessions"], max_sessions, pids, gpu["gpu_memory_utilization"], live_dir)
    _sample_memory(out, pids)
    return runs


def _sample_memory(out: Path, pids: list[int]) -> None:
    """Sample the node's host and GPU memory into ``out/hostmem.jsonl`` while ``pids`` run (detached)."""
    with open(out / "hostmem.log", "ab") as log:
        named = [f"{pid}:{gpu_share.start_ticks(pid) or ''}" for pid in pids]  # by start time too: pids get reused
        subprocess.Popen([sys.executable, str(HOSTMEM_SCRIPT), "--out", str(out), "--pids", *named],
                         cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)


def schedule(out: Path) -> None:
    """Run the waves of ``out``'s matrix one after the other (started by :func:`launch`)."""
    matrix = json.loads((out / MATRIX_FILE).read_text())
    by_name = {r["name"]: r for r in matrix["runs"]}
    for number, names in enumerate(matrix["waves"], start=1):
        print(f"wave {number}/{len(matrix['waves'])}: {', '.join(names)}", flush=True)
        processes = [_start(out, by_name[name]) for name in names]
        for process in processes:
            process.wait()
    print("all waves done", flush=True)


def status(out: Path) -> None:
    """One line per run: status, last validated round and its success rate."""
    matrix = json.loads((out / MATRIX_FILE).read_text())
    for run in matrix["runs"]:
        summary = run_summary(out, run["name"])
        if summary is None:
            log = out / f"{run['name']}.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else ["(no log yet)"]
            print(f"{run['name']:>16}: starting | {tail[0][:150] if tail else ''}")
            continue
        curve = summary.get("val_curve", [])
        last = curve[-1] if curve else {}
        print(f"{run['name']:>16}: {summary.get('status')} round {last.get('round')} "
              f"success {last.get('success_rate')} (n={last.get('n')}) wall {summary.get('wall_seconds')} s")


def running(out: Path) -> list[str]:
    """The names of ``out``'s launchers (runs, and the scheduler of later waves) still alive."""
    alive = []
    for pid_file in sorted(_own_pid_files(out)):  # another program's pid file is not a launcher of ours
        try:
            pid, started = _pid_record(pid_file)
        except (OSError, ValueError):
            continue
        if gpu_share.is_running(pid, started):  # not a recycled pid, not an unreaped zombie
            alive.append(pid_file.stem)
    return alive


def wait(outs: list[Path], timeout: float, every: float = 60.0, poll: float = 5.0) -> bool:
    """Block until every run of every matrix in ``outs`` has ended (True) or ``timeout`` seconds
    have passed (False), printing their status lines every ``every`` seconds and whenever a run ends.

    One command that waits on the node, instead of a status call after each pause: a device machine
    that sits idle between two calls is given back, and the runs on it with it (docs/gpu.md §7).
    """
    missing = [str(out) for out in outs if not (out / MATRIX_FILE).is_file()]
    if missing:
        raise FileNotFoundError(f"no {MATRIX_FILE} in {', '.join(missing)}: --out takes the folders given to "
                                "`arms.py launch --out`")
    deadline = time.monotonic() + timeout
    last_print = -math.inf
    before: dict[Path, list[str]] = {}
    while True:
        now = {out: running(out) for out in outs}
        done = not any(now.values())
        if done or now != before or time.monotonic() - last_print >= every:
            print(time.strftime("%H:%M:%S"), "running:", {str(out): names for out, names in now.items()})
            for out in outs:
                status(out)
            sys.stdout.flush()  # a command killed at the device's time limit still shows its last lines
            last_print, before = time.monotonic(), now
        if done:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(poll, max(deadline - time.monotonic(), 0.0)))


def collect_archives(outs: list[Path], into: Path) -> list[Path]:
    """Pack each matrix's results so far into ``into/<folder name>.tgz`` with ``collect.sh``.

    Called at the end of every ``wait`` when asked: a device machine lost between two calls takes
    its runs with it (2026-12-03: ten rounds lost at round 8), so each call brings back a snapshot.
    Two folders of the same name would share one archive: give matrices distinct folder names.
    """
    into.mkdir(parents=True, exist_ok=True)
    archives = []
    for out in outs:
        archive = into.resolve() / f"{out.resolve().name}.tgz"
        sys.stdout.flush()  # the status lines first, then collect.sh's own
        # collect.sh changes into the checkout, so both paths go absolute
        done = subprocess.run(["bash", str(COLLECT_SCRIPT), str(archive)],
                              env={**os.environ, "OUT": str(out.resolve())}, check=False)
        if done.returncode != 0 or not archive.is_file():
            print(f"arms.py wait --collect: packing {out} into {archive} failed (exit {done.returncode})",
                  file=sys.stderr)
        archives.append(archive)
    return archives



def _committed_runs_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that pick committed runs and where their tables go, the same for ``pool`` and
    ``dynamics`` (both read them through ``arms_pool.find_runs``)."""
    parser.add_argument("--from", dest="source", type=Path, required=True, help="e.g. docs/gpu-runs")
    parser.add_argument("--out", type=Path, required=True, help="a new or empty folder")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--min-seed", type=int, default=1, help="leave out seeds below (the declared plan: 4)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="the committed runs' file prefix")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("launch", help="start every arm x seed detached")
    start.add_argument("--recipe", default="tinyguess_verl")
    start.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    start.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    start.add_argument("--extra", default="", help="more Hydra overrides for every run")
    start.add_argument("--port", type=int, default=39400, help="first local SuperLink port (each run takes 10)")
    start.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS,
                       help="verl sessions at once; more runs go in later waves (about 15 GB of host memory each)")
    phases = sub.add_parser("phases", help="phase tables of the runs' persistent verl sessions (phases.md)")
    phases.add_argument("--from-round", type=int, default=2, help="first round of the rounds table")
    for command in (start, sub.add_parser("status"), sub.add_parser("report"), phases,
                    sub.add_parser("stop", help="stop the scheduler and every run still going (SuperLinks included)"),
                    sub.add_parser("schedule", help="(internal) run the waves of a launched matrix")):
        command.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    waiting = sub.add_parser("wait", help="wait until every run of the matrices ended (exit 0) or --timeout "
                             f"(exit {STILL_RUNNING})")
    waiting.add_argument("--out", type=Path, nargs="+", required=True)
    waiting.add_argument("--timeout", type=float, required=True, help="seconds")
    waiting.add_argument("--every", type=float, default=60.0, help="seconds between status prints")
    waiting.add_argument("--collect", type=Path, default=None, metavar="DIR",
                         help="then pack each matrix's results so far into DIR/<folder>.tgz (tools/gpu/collect.sh), "
                         "ended or not: give $OUT, so that every wait call brings back what the runs wrote")
    pooling = sub.add_parser("pool", help="committed runs (docs/gpu-runs) as one matrix folder, then its report")
    _committed_runs_arguments(pooling)
    pooling.add_argument("--recipe", default="tinyguess_verl")
    pooling.add_argument("--leave-out", nargs="+", default=[], metavar="ARM-sSEED",
                         help="runs to leave out, e.g. federated-s4 (a sensitivity check; the report names them)")
    dyn = sub.add_parser("dynamics", help="per committed run: take-off round, entropy, reply length, update norms "
                         "(dynamics.md, dynamics.json); the applied update weighs clients by their aggregation "
                         "weights, the training columns equally: they agree only with equal client weights")
    _committed_runs_arguments(dyn)
    stepping = sub.add_parser("steps", help="collected runs' verl metrics step by step, side by side: where two "
                              "runs first differ, and each run's step and generation times after its first step")
    stepping.add_argument("--run", dest="runs", action="append", required=True, type=parse_run,
                          metavar="LABEL=DIR", help="a run's results folder (<archive>/results/<run>), repeated")
    stepping.add_argument("--keys", nargs="+", default=None, help="verl metrics to show (default: those of the "
                          f"committed repro-rs-steps.jsonl that the steps have: {' '.join(DEFAULT_KEYS)})")
    stepping.add_argument("--client", type=int, default=0, help="whose steps (a federated run has several)")
    stepping.add_argument("--write", type=Path, default=None, metavar="FILE.jsonl",
                          help="also write one flat JSON line per (run, round, step), as repro-rs-steps.jsonl")
    args = parser.parse_args(argv)
    if args.command == "steps":
        try:
            print(steps_report(args.runs, args.keys, args.client, args.write), end="")
        except (StepsError, OSError) as exc:  # OSError: a step file unreadable, or --write not writable
            print(f"arms.py steps: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "dynamics":
        try:
            table = dynamics(args.source, args.out, args.arms, args.min_seed, args.prefix)
        except (PoolError, DynamicsError, CompareError) as exc:  # CompareError: a summary compare refuses
            print(f"arms.py dynamics: {exc}", file=sys.stderr)
            return 2
        print(table["markdown"], end="")
        return 0
    if args.command == "pool":
        try:
            pool(args.source, args.out, args.arms, args.min_seed, args.recipe, args.prefix, args.leave_out)
            text = report(args.out)
        except (PoolError, CompareError) as exc:  # CompareError: a summary compare refuses
            print(f"arms.py pool: {exc}", file=sys.stderr)
            return 2
        print(text, end="")
        return 0
    if args.command == "wait":
        try:
            ended = wait(args.out, args.timeout, args.every)
        except FileNotFoundError as exc:
            print(f"arms.py wait: {exc}", file=sys.stderr)
            return 2
        if args.collect is not None:
            collect_archives(args.out, args.collect)
        return 0 if ended else STILL_RUNNING
    if args.command == "launch":
        try:
            launch(args.out, args.recipe, args.seeds, args.arms, args.extra, args.port, args.max_sessions)
        except ModuleNotFoundError as exc:  # the node's bare python3: the staged tree has yaml and omegaconf
            print(f"arms.py launch: {exc}; run it with PYTHONPATH=/tmp/site (the staged wheels, docs/gpu.md §1)",
                  file=sys.stderr)
            return 2
        except gpu_share.ShareError as exc:
            print(f"arms.py launch: {exc}", file=sys.stderr)
            return 2
    elif args.command == "schedule":
        schedule(args.out)
    elif args.command == "stop":
        print("stopped: " + (", ".join(stop(args.out)) or "nothing was running"))
    elif args.command == "status":
        status(args.out)
    elif args.command == "phases":
        print(phases_report(args.out, args.from_round), end="")
    else:
        try:
            text = report(args.out)
        except CompareError as exc:  # a run's summary compare refuses (arms_report.check_summary): nothing written
            print(f"arms.py report: {exc}", file=sys.stderr)
            return 2
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
