"""Check an environment against the text-environment contract before training on it::

    python -m fedagent_flwr.envs.check mypkg.envs.Countdown [--config '{"lo": 1}'] [--seeds 0 1 2] [--service]

For every seed one scripted episode is played twice, each time in a fresh instance (with
``--service``: through a real env service on loopback, started and stopped here), and checked:

* ``reset(seed)`` returns ``(str, dict)``, and the same observation both times (deterministic);
* every ``step`` returns ``(str, float, bool, dict)`` with a bool ``info["success"]``, and the same
  transition both times;
* the episode ends by itself within ``max_turns`` steps (from the config, else 6), since the
  episode runner cuts it there anyway;
* an environment with a goal pool (``num_goals``) can be restricted to one goal
  (``restrict_goals(config, [0])``) and then counts one goal.

One line per check; exit status 1 if any check fails, 2 if the environment cannot be built.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedagent_flwr.cli import program
from fedagent_flwr.envs.base import BaseTextEnv
from fedagent_flwr.envs.registry import get_env_class, make_env
from fedagent_flwr.envs.spec import DEFAULT_MAX_TURNS

DEFAULT_ACTIONS = ("<answer>1</answer>", "I am not sure.")


async def _play(env: BaseTextEnv, seed: int, actions: Sequence[str], max_steps: int) -> list[Any]:
    """The episode as a list: the reset result, then each step's result."""
    try:
        record: list[Any] = [await env.reset(seed)]
        for turn in range(max_steps):
            result = await env.step(actions[turn % len(actions)])
            record.append(result)
            if isinstance(result, tuple) and len(result) == 4 and result[2] is True:
                break
        return record
    finally:
        await env.close()


def _shape_problems(record: list[Any]) -> list[str]:
    problems = []
    reset = record[0]
    if not (isinstance(reset, tuple) and len(reset) == 2 and isinstance(reset[0], str) and isinstance(reset[1], dict)):
        problems.append(f"reset returned {reset!r:.120}, expected (observation: str, info: dict)")
    for turn, step in enumerate(record[1:], start=1):
        ok = (isinstance(step, tuple) and len(step) == 4 and isinstance(step[0], str)
              and isinstance(step[1], (int, float)) and not isinstance(step[1], bool) and isinstance(step[2], bool)
              and isinstance(step[3], dict))
        if not ok:
            problems.append(f"step {turn} returned {step!r:.120}, expected (str, float, bool, dict)")
        elif not isinstance(step[3].get("success"), bool):
            problems.append(f"step {turn}: info['success'] is {step[3].get('success')!r}, expected a bool")
    return problems


def check_env(name: str, config: dict[str, Any], seeds: Sequence[int], actions: Sequence[str] = DEFAULT_ACTIONS,
              make: Any = None) -> list[tuple[str, str]]:
    """Run the checks; returns ``(check, problem)`` pairs, problem "" when the check passed.

    ``make`` builds a fresh environment (default ``make_env(name, config)``).
    """
    build = make or (lambda: make_env(name, config))
    max_turns = int(config.get("max_turns", DEFAULT_MAX_TURNS))
    results: list[tuple[str, str]] = []
    for seed in seeds:
        first = asyncio.run(_play(build(), seed, actions, max_turns))
        second = asyncio.run(_play(build(), seed, actions, max_turns))
        shape = _shape_problems(first)
        results.append((f"seed {seed}: return types", "; ".join(shape)))
        if shape:
            continue
        same = first == second
        results.append((f"seed {seed}: deterministic", "" if same else
                        f"two episodes with seed {seed} and the same replies differ: "
                        f"{first!r:.200} vs {second!r:.200}"))
        ended = first[-1][2] if len(first) > 1 else False
        results.append((f"seed {seed}: ends within {max_turns} steps",
                        "" if ended else f"still running after {max_turns} steps (set max_turns in the config)"))
    cls = get_env_class(name)
    pool = cls.num_goals(config)
    if pool is not None:
        try:
            one = cls.num_goals(cls.restrict_goals(config, [0]))
            problem = "" if one == 1 else f"restrict_goals(config, [0]) leaves {one} goals, expected 1"
        except Exception as exc:  # reported as a failed check, not a crash
            problem = f"restrict_goals(config, [0]) raised {type(exc).__name__}: {exc}"
        results.append((f"goal pool of {pool}: restrict_goals", problem))
    return results


def _served(name: str, config: dict[str, Any], state_dir: Path) -> tuple[Any, dict[str, Any]]:
    """Start a one-slot service for ``name``; return its manager and /health reply."""
    from fedagent_flwr.envs.service.manager import EnvServiceManager, ServiceLaunch

    manager = EnvServiceManager(ServiceLaunch(env=name, config=config, pool_size=1), state_dir / "check.json")
    manager.ensure_running()
    return manager, manager.health()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog=program("python -m fedagent_flwr.envs.check"),
                                     description=__doc__.splitlines()[0])
    parser.add_argument("env", help="registered name or dotted path of the environment class")
    parser.add_argument("--config", default="{}", help="environment config as a JSON object")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--action", action="append", help="a scripted reply (repeatable; cycled)")
    parser.add_argument("--service", action="store_true", help="play through a real env service on loopback")
    args = parser.parse_args(argv)
    try:
        config = json.loads(args.config)
        if not isinstance(config, dict):
            raise ValueError("--config must be a JSON object")
        make_env(args.env, config)
    except Exception as exc:  # any failure to build is the answer
        print(f"env check: cannot build {args.env}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    actions = args.action or list(DEFAULT_ACTIONS)
    with tempfile.TemporaryDirectory(prefix="env-check-") as tmp:
        manager = None
        make = None
        if args.service:
            try:
                manager, health = _served(args.env, config, Path(tmp))
            except Exception as exc:
                print(f"env check: the service for {args.env} did not start: {exc}", file=sys.stderr)
                return 2
            print(f"service {manager.url} /health: {json.dumps(health, sort_keys=True)}")
            remote = {"url": manager.url, "env": get_env_class(args.env).env_name}
            make = lambda: make_env("Service", remote)  # noqa: E731
        try:
            results = check_env(args.env, config, args.seeds, actions, make)
        finally:
            if manager is not None:
                manager.stop()
    for check, problem in results:
        print(f"{'ok  ' if not problem else 'FAIL'} {check}{': ' + problem if problem else ''}")
    failed = sum(1 for _, problem in results if problem)
    print(f"{args.env}: {len(results) - failed} checks passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
