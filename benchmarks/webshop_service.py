"""WebShop env service under load (a script, not a test).

Starts one WebShop service (the real project service, a subprocess on loopback) with a 16-slot
pool, then runs 16 concurrent sessions that each play scripted episodes (search for the goal's
words, open a result, go back, search again). Reports time from launch to healthy, the
service's resident memory, and p50/p99 latency of search and click steps, next to FedAgent's
published figures for its Java/Lucene WebShop (reference/fedagent.md §6.1: ~26 s start-up and
~14 GB of RAM per env instance).

Usage: ``python benchmarks/webshop_service.py --data DIR [--sessions 16] [--episodes 4]``
(DIR holds items_shuffle_1000.json, items_ins_v2_1000.json; or set FEDAGENT_WEBSHOP_DATA).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from fedagent_flwr.envs.service.manager import EnvServiceManager, ServiceLaunch

FEDAGENT_STARTUP_S = 26.0  # per env instance, reference/fedagent.md §6.1
FEDAGENT_RSS_GB = 14.0


def rss_mb(pid: int) -> float:
    """Resident memory of one process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def play(client: httpx.AsyncClient, url: str, session: int, episodes: int,
               timings: dict[str, list[float]]) -> None:
    """Scripted episodes for one session: search, open a result, back, search again."""
    sid = f"bench-{session}"
    await client.post(f"{url}/create", json={"session_id": sid})
    try:
        for episode in range(episodes):
            reply = (await client.post(f"{url}/reset",
                                       json={"session_id": sid, "seed": 1000 * session + episode})).json()
            instruction = reply["obs"].split("Your task is to:", 1)[-1].split("\n", 1)[0]
            words = " ".join(w.strip(".,") for w in instruction.split()[2:8])
            step = 0

            async def act(kind: str, action: str) -> dict[str, Any]:
                nonlocal step
                started = time.perf_counter()
                # Replies in the format the agent is prompted for (FedAgent's projection).
                reply_text = f"<think>benchmark</think><action>{action}</action>"
                response = await client.post(f"{url}/step",
                                             json={"session_id": sid, "step_id": step, "action": reply_text})
                timings[kind].append(time.perf_counter() - started)
                response.raise_for_status()
                step += 1
                return response.json()

            result = await act("search", f"search[{words}]")
            clickables = result["info"]["available_actions"]["clickables"]
            products = [c for c in clickables if c not in ("back to search", "next >", "< prev", "search")]
            if products:
                await act("click", f"click[{products[0]}]")
                await act("click", "click[< prev]")
                await act("click", "click[back to search]")
                await act("search", f"search[{' '.join(words.split()[:3])}]")
    finally:
        await client.post(f"{url}/close", json={"session_id": sid})


async def load(url: str, sessions: int, episodes: int) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = {"search": [], "click": []}
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(play(client, url, s, episodes, timings) for s in range(sessions)))
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.environ.get("FEDAGENT_WEBSHOP_DATA", ""))
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--episodes", type=int, default=4)
    args = parser.parse_args()
    if not args.data:
        raise SystemExit("give --data DIR (the WebShop data directory) or set FEDAGENT_WEBSHOP_DATA")
    with tempfile.TemporaryDirectory(prefix="webshop_bench_") as work:
        launch = ServiceLaunch(env="WebShop", config={"data_dir": args.data, "split": "train"}, pool_size=args.sessions)
        manager = EnvServiceManager(launch, Path(work) / "service.json", startup_timeout_s=600)
        started = time.perf_counter()
        url = manager.ensure_running()
        startup_s = time.perf_counter() - started
        health = manager.health()
        try:
            idle_rss = rss_mb(manager.pid or 0)
            wall = time.perf_counter()
            timings = asyncio.run(load(url, args.sessions, args.episodes))
            wall = time.perf_counter() - wall
            loaded_rss = rss_mb(manager.pid or 0)
        finally:
            manager.stop()
    row: dict[str, Any] = {
        "benchmark": "webshop_service", "pool": args.sessions, "sessions": args.sessions,
        "goals": health.get("info", {}).get("num_goals"),
        "startup_s": round(startup_s, 2), "rss_idle_mb": round(idle_rss, 1), "rss_loaded_mb": round(loaded_rss, 1),
        "steps": sum(len(v) for v in timings.values()), "load_wall_s": round(wall, 2),
        "startup_ratio_vs_fedagent": round(startup_s / FEDAGENT_STARTUP_S, 4),
        "rss_ratio_vs_fedagent": round(loaded_rss / 1024 / FEDAGENT_RSS_GB, 4),
    }
    for kind, values in timings.items():
        if values:
            row[f"{kind}_p50_ms"] = round(1000 * statistics.median(values), 1)
            row[f"{kind}_p99_ms"] = round(1000 * percentile(values, 0.99), 1)
            row[f"{kind}_n"] = len(values)
    print(f"start-up to healthy {row['startup_s']} s (FedAgent ~{FEDAGENT_STARTUP_S:.0f} s per env instance: "
          f"ratio {row['startup_ratio_vs_fedagent']})")
    print(f"RSS idle {row['rss_idle_mb']} MB, after load {row['rss_loaded_mb']} MB for {args.sessions} slots "
          f"(FedAgent ~{FEDAGENT_RSS_GB:.0f} GB per env instance: ratio {row['rss_ratio_vs_fedagent']})")
    for kind in ("search", "click"):
        if f"{kind}_n" in row:
            print(f"{kind:6s} steps: n={row[f'{kind}_n']} p50 {row[f'{kind}_p50_ms']} ms, "
                  f"p99 {row[f'{kind}_p99_ms']} ms "
                  f"under {args.sessions} concurrent sessions")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
