"""ALFWorld service throughput with 1, 2 and 4 engine workers (a script, not a test).

FedAgent's ALFWorld service serialised every TextWorld reset/step of every session behind one
process-wide lock; that made the env 73 % of a 4-GPU training step, and eight service replicas cut
the step by 57 % (reference/fedagent.md §6). Here one client service runs several engine worker
processes instead. For each worker count this script starts one real ALFWorld service (under the
ALFWorld service venv, on loopback), runs ``--sessions`` concurrent sessions that each play the
expert walkthroughs of the game set episode after episode, and reports episode steps per second
(resets and steps, counted over the whole run) and the ratio to one worker.

The games are the shared trial rebuilt in standard form plus goal variants of its scene (built and
cached on first use, about 30 s). Expect the ratio to be bounded by the machine's free cores. On a
shared machine, ``--repeat`` interleaves the worker counts and keeps each count's best run, the
one least disturbed by other load.

Usage: ``python benchmarks/alfworld_workers.py [--sessions 8] [--episodes 3] [--workers 1 2 4] [--repeat 1]
[--data ALFWORLD_DATA]`` (``--data``: a game set with ``walkthrough.json`` beside each game, e.g.
one built by :func:`~fedagent_flwr.envs.alfworld.gameset.ensure_variant_set` on another machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from fedagent_flwr.envs.alfworld.data import load_games
from fedagent_flwr.envs.alfworld.gameset import ensure_variant_set
from fedagent_flwr.envs.alfworld.service_venv import ensure_service_python
from fedagent_flwr.envs.service.manager import EnvServiceManager, ServiceLaunch

TRIAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "alfworld" / "debug" / "multi-agent"


async def play(client: httpx.AsyncClient, url: str, session: int, episodes: int,
               walkthroughs: dict[str, list[str]]) -> int:
    """Expert walkthroughs, episode after episode, for one session; the number of requests played."""
    sid = f"bench-{session}"
    await client.post(f"{url}/create", json={"session_id": sid})
    played = 0
    try:
        for episode in range(episodes):
            reply = await client.post(f"{url}/reset", json={"session_id": sid, "seed": session * 1000 + episode})
            reply.raise_for_status()
            played += 1
            game = reply.json()["info"]["game"]
            for step_id, command in enumerate(walkthroughs[game]):
                action = f"<think>plan</think><action>{command}</action>"
                step = await client.post(f"{url}/step", json={"session_id": sid, "step_id": step_id, "action": action})
                step.raise_for_status()
                played += 1
    finally:
        await client.post(f"{url}/close", json={"session_id": sid})
    return played


async def measure(url: str, sessions: int, episodes: int, walkthroughs: dict[str, list[str]]) -> tuple[int, float]:
    limits = httpx.Limits(max_connections=sessions + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        started = time.perf_counter()
        counts = await asyncio.gather(*(play(client, url, s, episodes, walkthroughs) for s in range(sessions)))
        return sum(counts), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8, help="concurrent sessions (and pool slots)")
    parser.add_argument("--episodes", type=int, default=3, help="episodes per session")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="engine worker counts")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over the worker counts; best run kept")
    parser.add_argument("--data", type=Path, default=None, help="an ALFWORLD_DATA root with walkthroughs")
    args = parser.parse_args()

    python = ensure_service_python()
    data = args.data.resolve() if args.data else ensure_variant_set(TRIAL)
    games = load_games(data, "train")
    walkthroughs = {g.game_file: json.loads((g.trial_dir / "walkthrough.json").read_text()) for g in games}
    results: dict[int, float] = {}
    for workers in [w for _ in range(args.repeat) for w in args.workers]:
        launch = ServiceLaunch(env="ALFWorld", pool_size=args.sessions, interpreter=str(python),
                               config={"data_dir": str(data), "split": "train", "engine_workers": workers})
        with tempfile.TemporaryDirectory() as tmp, EnvServiceManager(launch, Path(tmp) / "svc.json",
                                                                     startup_timeout_s=300) as manager:
            url = manager.ensure_running()
            requests, seconds = asyncio.run(measure(url, args.sessions, args.episodes, walkthroughs))
        rate = requests / seconds
        results[workers] = max(rate, results.get(workers, 0.0))
        print(f"engine_workers={workers}: {requests} resets+steps in {seconds:.1f} s = {rate:.1f} steps/s "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    base = results.get(1) or next(iter(results.values()))
    print(json.dumps({
        "cores": os.cpu_count(), "sessions": args.sessions, "episodes_per_session": args.episodes,
        "steps_per_s": {str(w): round(v, 2) for w, v in results.items()},
        "ratio_to_1_worker": {str(w): round(v / base, 2) for w, v in results.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
