"""Print a partition: ``python -m fedagent_flwr.hetero.inspect --env alfworld --strategy coverage ...``.

Prints ``{"clients": {"<c>": [indices in order]}}`` (one JSON line), each client's goals in the
order its environment gets them (FedAgent's; sorted for WebShop, as FedAgent's WebShop wrappers
return them). Indices are the ones FedAgent prints:

* ``alfworld``: positions in the train game list (sorted by path, then shuffled with seed 42);
* ``webshop``: absolute goal indices (validation size + pool position; FedAgent: 500..6909);
  an environment-level variant arm (``bm25_reweight``, ``bm25_field_subset``, ``lookalike``,
  ``rank_wrapper``) prints ``[j]``, the client's index into the variant pool, and ``catalog_split``
  its goal slice;
* ``tinyguess``: pool positions (secret ``lo + i``).

The pool comes from ``--data-dir DIR`` (the environment's data: an ``ALFWORLD_DATA`` root with
``json_2.1.1``, or a WebShop data directory), ``--paths FILE`` (ALFWorld: a JSON list of
split-relative game paths ``<task_dir>/<trial_dir>/game.tw-pddl``, already in FedAgent's order) or
``--num-goals N`` (strategies that depend on indices only: the pool size; for WebShop the whole
goal list, 6910, of which the first 500 are validation). ``hardness`` needs ``--labels FILE`` (a
FedAgent trajectories file). ``--summary`` prints sizes, overlaps and the category mix per client
instead. The run's ``seed`` is ``--seed`` (42 reproduces FedAgent).

Errors are one line on stderr naming the option to fix, with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedagent_flwr.cli import one_line_parser, print_output, program
from fedagent_flwr.hetero import (
    STRATEGIES,
    GoalInfo,
    PartitionError,
    needs_goal_info,
    partition_goals,
)
from fedagent_flwr.hetero.common import knob, unknown_knob
from fedagent_flwr.hetero.env_level import CATALOG_SPLIT, ENV_LEVEL_STRATEGIES, POOL_STRATEGIES, pool_variant
from fedagent_flwr.hetero.task import all_clients, load_hardness_labels
from fedagent_flwr.hetero.uniform import DEFAULT_MIN_GOALS
from fedagent_flwr.plugins import is_dotted_path
from fedagent_flwr.schema.run import Partition

ENVS = ("alfworld", "webshop", "tinyguess")
#: FedAgent's WebShop validation split: goals[0:500].
WEBSHOP_VAL_SIZE = 500
#: The default run's TinyGuess pool (secrets 1..10).
TINYGUESS_GOALS = 10


class UsageError(Exception):
    """A bad option: ``option`` names it, the message says what to do."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option


def _parser() -> argparse.ArgumentParser:
    parser = one_line_parser(
        "inspect",
        prog=program("python -m fedagent_flwr.hetero.inspect"),
        description="Print each client's goals under a partition strategy, as FedAgent computes them.",
    )
    parser.add_argument("--env", required=True, choices=ENVS, help="environment whose pool is partitioned")
    parser.add_argument("--strategy", default="uniform", help="partition strategy (default: uniform)")
    parser.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                        help="a strategy knob, e.g. omega=0.5 or size_std=16 (repeatable; values are JSON or text)")
    parser.add_argument("--clients", type=int, default=2, metavar="N", help="number of clients (default: 2)")
    parser.add_argument("--min-goals", type=int, metavar="L",
                        help=f"min_goals_per_client (default: FedAgent's {DEFAULT_MIN_GOALS})")
    parser.add_argument("--seed", type=int, metavar="S", help="the run's base seed (default: FedAgent's 42)")
    data = parser.add_argument_group("data (one of)")
    data.add_argument("--data-dir", metavar="DIR", help="the environment's data directory")
    data.add_argument("--paths", metavar="FILE", help="ALFWorld: JSON list of split-relative game paths, in order")
    data.add_argument("--num-goals", type=int, metavar="N",
                      help="pool size for index-only strategies (WebShop: the whole goal list, e.g. 6910)")
    parser.add_argument("--labels", metavar="FILE", help="hardness: success labels (a FedAgent trajectories file)")
    parser.add_argument("--summary", action="store_true", help="print sizes, overlaps and category mix instead")
    return parser


# --- the pool -------------------------------------------------------------------------------------


@dataclass
class Pool:
    """What a partition is computed on: size, metadata (or None) and the printed index offset."""

    size: int
    info: list[GoalInfo] | None
    offset: int = 0


def alfworld_goal_info(paths: Sequence[str]) -> list[GoalInfo]:
    """GoalInfo of ALFWorld game paths ``.../<task_dir>/<trial_dir>/game.tw-pddl`` (specs/partitions.md §5.2, §9).

    Category: the task type (the task directory's text before its first ``-``); task id (hardness
    labels): ``alfworld_<task_dir>_<trial_dir>_game``; scene and spec: the task directory split at
    its last ``-``. A path with fewer than three components gets no metadata (FedAgent drops it).
    """
    out = []
    for path in paths:
        parts = str(path).rstrip("/").split("/")
        if len(parts) < 3 or "-" not in parts[-3]:
            out.append(GoalInfo())
            continue
        task_dir, trial = parts[-3], parts[-2]
        spec, scene = task_dir.rsplit("-", 1)
        task_id = f"alfworld_{task_dir}_{trial}_game" if parts[-1] == "game.tw-pddl" else None
        out.append(GoalInfo(category=task_dir.split("-", 1)[0], task_id=task_id, scene=scene, group=spec, trial=trial))
    return out


def _read_paths(path: str) -> list[str]:
    try:
        paths = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError("--paths", f"cannot read {path}: {exc}") from None
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
        raise UsageError("--paths", f"{path} must hold a non-empty JSON list of game paths")
    return paths


def _pool(args: argparse.Namespace, labels: dict[str, bool] | None) -> Pool:
    given = [name for name, value in (("--data-dir", args.data_dir), ("--paths", args.paths),
                                      ("--num-goals", args.num_goals)) if value is not None]
    if len(given) > 1:
        raise UsageError(given[1], f"give one of --data-dir, --paths, --num-goals, not {' and '.join(given)}")
    if args.paths is not None and args.env != "alfworld":
        raise UsageError("--paths", "is for --env alfworld; use --data-dir or --num-goals")
    if args.num_goals is not None:
        minimum = WEBSHOP_VAL_SIZE + 1 if args.env == "webshop" else 1
        if args.num_goals < minimum:
            raise UsageError("--num-goals", f"must be at least {minimum}, got {args.num_goals}"
                             + (" (WebShop's first 500 goals are validation)" if args.env == "webshop" else ""))
        if args.env == "webshop":
            return Pool(args.num_goals - WEBSHOP_VAL_SIZE, None, WEBSHOP_VAL_SIZE)
        return Pool(args.num_goals, None)
    if args.paths is not None:
        paths = _read_paths(args.paths)
        return Pool(len(paths), alfworld_goal_info(paths))
    if args.data_dir is not None:
        if args.env == "alfworld":
            from fedagent_flwr.envs.alfworld.env import AlfWorldEnv
            from fedagent_flwr.envs.base import EnvConfigError

            try:
                info = AlfWorldEnv.goal_info({"data_dir": args.data_dir, "split": "train"})
            except EnvConfigError as exc:
                raise UsageError("--data-dir",
                                 f"{exc}; give an ALFWORLD_DATA root (json_2.1.1) or use --paths") from None
            return Pool(len(info), info)
        if args.env == "webshop":
            from fedagent_flwr.envs.webshop.data import WebShopDataError, load_world
            from fedagent_flwr.envs.webshop.goal_info import goal_info_for_world

            try:
                world = load_world(args.data_dir)
            except (WebShopDataError, OSError, ValueError) as exc:
                raise UsageError("--data-dir", f"{exc}; give a WebShop data directory or use --num-goals") from None
            info = goal_info_for_world(world, labels=labels)
            return Pool(len(info), info, world.val_size)
        raise UsageError("--data-dir", "TinyGuess has no data; use --num-goals (default 10)")
    if args.env == "tinyguess":
        return Pool(TINYGUESS_GOALS, None)
    raise UsageError("--data-dir", f"--env {args.env} needs its pool: give --data-dir DIR"
                     + (", --paths FILE" if args.env == "alfworld" else "") + " or --num-goals N")


# --- options --------------------------------------------------------------------------------------


def parse_knobs(pairs: Sequence[str]) -> dict[str, Any]:
    """``["omega=0.5", "fallback=skip"]`` -> ``{"omega": 0.5, "fallback": "skip"}`` (values JSON, else text)."""
    knobs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError("--knob", f"expected KEY=VALUE, got {pair!r}")
        if key == "strategy":
            raise UsageError("--knob", "strategy has its own option: use --strategy")
        try:
            knobs[key] = json.loads(raw)
        except ValueError:
            knobs[key] = raw
    return knobs


def _strategy(args: argparse.Namespace) -> str:
    strategy = args.strategy.strip()
    key = strategy.lower()
    if is_dotted_path(strategy):
        return strategy
    if key in ENV_LEVEL_STRATEGIES:
        if args.env != "webshop":
            raise UsageError("--strategy", f"{key!r} is a WebShop environment-level arm; use --env webshop")
        return key
    if key in STRATEGIES or key in ("", "iid"):
        return key
    known = sorted({*STRATEGIES, *(ENV_LEVEL_STRATEGIES if args.env == "webshop" else ())})
    raise UsageError("--strategy", f"unknown strategy {strategy!r}; use one of {', '.join(known)} "
                     "or the dotted path of a partition function")


def _problem_option(message: str, knobs: dict[str, Any]) -> str:
    """The option a partition error is about, for the one-line message."""
    if "min_goals_per_client" in message:
        return "--min-goals"
    for key in knobs:
        if key not in ("min_goals_per_client", "trajectories_file") and key in message:
            return f"--knob {key}"
    if "client" in message and ("num_clients" in message or "client_id" in message):
        return "--clients"
    if "label" in message:
        return "--labels"
    return "--strategy"


# --- computing and printing -----------------------------------------------------------------------


def _option_or_knob(knobs: dict[str, Any], key: str, value: int | None, option: str, default: int) -> int:
    """``--min-goals`` / ``--seed``, which a knob of FedAgent's name may give instead (not both, differently)."""
    given = knobs.pop(key, None)
    if given is not None and (isinstance(given, bool) or not isinstance(given, int)):
        raise UsageError(f"--knob {key}", f"must be an integer, got {given!r}; use {option}")
    if given is not None and value is not None and given != value:
        raise UsageError(f"--knob {key}", f"{given} contradicts {option} {value}; give one of them")
    out = value if value is not None else given if given is not None else default
    if out < 0:
        raise UsageError(option, f"must be >= 0, got {out}")
    return out


def _check_knobs(strategy: str, knobs: dict[str, Any]) -> None:
    """Refuse what a run's config would refuse: for a built-in strategy a knob it does not know (a
    typo would print the default's partition), and for any strategy a known knob of the wrong type
    or out of its bound, even one this strategy does not read."""
    if not is_dotted_path(strategy) and (unknown := unknown_knob(knobs)):
        raise UsageError(f"--knob {unknown[0]}", unknown[1])
    for key in sorted(set(knobs) & set(Partition.__dataclass_fields__)):
        try:
            knob(knobs, key)
        except PartitionError as exc:
            raise UsageError(f"--knob {key}", str(exc)) from None


def compute(args: argparse.Namespace) -> tuple[dict[int, list[int]], Pool, str, dict[str, Any]]:
    """``({client: printed indices}, pool, strategy, knobs)`` for parsed options."""
    if args.clients < 1:
        raise UsageError("--clients", f"must be >= 1, got {args.clients}")
    strategy = _strategy(args)
    knobs = parse_knobs(args.knob)
    args.min_goals = _option_or_knob(knobs, "min_goals_per_client", args.min_goals, "--min-goals", DEFAULT_MIN_GOALS)
    args.seed = _option_or_knob(knobs, "base_seed", args.seed, "--seed", 42)
    knobs["min_goals_per_client"] = args.min_goals
    _check_knobs(strategy, knobs)
    if args.labels is not None:
        knobs["trajectories_file"] = args.labels
    labels = None
    if knobs.get("trajectories_file"):
        option = "--labels" if args.labels is not None else "--knob trajectories_file"
        try:
            labels = load_hardness_labels(knobs["trajectories_file"])
        except PartitionError as exc:
            raise UsageError(option, f"{exc}; give a FedAgent trajectories file") from None
    if strategy in POOL_STRATEGIES:
        try:
            variant_n = knobs.get("variant_n") or None
            return ({c: [int(pool_variant(strategy, c, args.clients, variant_n, args.seed).index or 0)]
                     for c in range(args.clients)}, Pool(0, None), strategy, knobs)
        except PartitionError as exc:
            raise UsageError(_problem_option(str(exc), knobs), str(exc)) from None
    pool = _pool(args, labels)
    task_strategy = "task_disjoint" if strategy == CATALOG_SPLIT else strategy
    try:
        if needs_goal_info(task_strategy) and pool.info is None:
            remedy = {"alfworld": "give --paths FILE or --data-dir DIR", "webshop": "give --data-dir DIR"}
            raise UsageError("--num-goals" if args.num_goals is not None else "--data-dir",
                             f"strategy {strategy!r} reads goal metadata; "
                             + remedy.get(args.env, "use another strategy (TinyGuess has none)"))
        unlabelled = pool.info is None or all(g.success is None for g in pool.info)
        if task_strategy == "hardness" and labels is None and unlabelled:
            raise UsageError("--labels", "hardness needs success labels: give --labels FILE "
                             f"(FedAgent's qwen2.5-1.5b_{args.env}_trajectories.json)")
        order = "sorted" if args.env == "webshop" else "fedagent"
        parts = all_clients(task_strategy, args.clients, pool.size, knobs, args.seed, pool.info)
        if parts is None:
            parts = [partition_goals(task_strategy, c, args.clients, pool.size, knobs, args.seed, pool.info, order)
                     for c in range(args.clients)]
        elif order == "sorted":
            parts = [sorted(p) for p in parts]
    except PartitionError as exc:
        raise UsageError(_problem_option(str(exc), knobs), str(exc)) from None
    return {c: [pool.offset + g for g in part] for c, part in enumerate(parts)}, pool, strategy, knobs


def render(clients: dict[int, list[int]]) -> str:
    return json.dumps({"clients": {str(c): goals for c, goals in clients.items()}}, separators=(",", ":"))


def summary(args: argparse.Namespace, clients: dict[int, list[int]], pool: Pool, strategy: str,
            knobs: dict[str, Any]) -> str:
    """Sizes, pairwise overlaps and the category mix (and easy count, with labels) per client."""
    shown = {k: v for k, v in knobs.items() if k != "min_goals_per_client"}
    lines = [f"{args.env} {strategy}: {len(clients)} clients, pool {pool.size}, min_goals {args.min_goals}, "
             f"seed {args.seed}, knobs {json.dumps(shown, sort_keys=True)}"]
    if strategy in POOL_STRATEGIES:
        lines += [f"client {c}: variant {v[0]}" for c, v in clients.items()]
        return "\n".join(lines)
    sets = {c: set(g) for c, g in clients.items()}
    labels = load_hardness_labels(knobs["trajectories_file"]) if knobs.get("trajectories_file") else None
    for c, goals in clients.items():
        line = f"client {c}: {len(goals)} goals"
        if len(sets[c]) != len(goals):
            line += f" ({len(sets[c])} distinct)"
        if pool.info is not None:
            infos = [pool.info[g - pool.offset] for g in goals]
            if labels is not None:
                easy = sum(bool(labels.get(str(i.task_id), False)) for i in infos if i.task_id is not None)
                line += f", easy {easy}"
            elif any(i.success is not None for i in infos):
                line += f", easy {sum(i.success is True for i in infos)}"
            mix = Counter("unknown" if i.category is None else str(i.category) for i in infos)
            line += "; " + ", ".join(f"{cat} {n}" for cat, n in mix.most_common())
        lines.append(line)
    ids = list(clients)
    if len(ids) > 1:
        width = max(len(str(len(g))) for g in clients.values()) + 1
        lines.append("overlaps (goals two clients share):")
        lines.append(" " * 6 + "".join(f"{c:>{width}}" for c in ids))
        for a in ids:
            lines.append(f"{a:>6}" + "".join(f"{len(sets[a] & sets[b]):>{width}}" for b in ids))
    union = set().union(*sets.values()) if sets else set()
    lines.append(f"union: {len(union)} of {pool.size} goals; {pool.size - len(union)} in no client")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        clients, pool, strategy, knobs = compute(args)
    except UsageError as exc:
        print(f"inspect: error: {exc}", file=sys.stderr)
        return 2
    print_output(summary(args, clients, pool, strategy, knobs) if args.summary else render(clients))
    return 0


if __name__ == "__main__":
    sys.exit(main())
