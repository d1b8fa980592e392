"""Wall time of the checkpoint audit (``python -m fedagent_flwr.checkpoint.verify``) with each file
hashed once per audit (:mod:`fedagent_flwr.checkpoint.audit_digests`) against every use hashing
its file again, on a small synthetic multi-round run.

    python benchmarks/verify_hash_once.py                        # 3 FedAdam rounds of 2 clients
    python benchmarks/verify_hash_once.py --strategy fedavg      # FedAvg's weighted means
    python benchmarks/verify_hash_once.py --checkout /tmp/base   # also the audit of another checkout

The audit checked some files' content hashes twice: a client checkpoint when its reference was
built and again when it was opened, and with a server optimiser a round's global model and state
in their round and again as the next round's previous model and state. Now the audit remembers
each digest with the file's stat and reuses it while the stat is unchanged.

The run (:func:`verify_memory.build_run`: one fp32 key of ``--rows`` x ``--cols``, the real
strategy, ``--rounds`` rounds of ``--clients`` clients) is written in a temp dir removed at the
end; the benchmark then waits until its files are older than :data:`.audit_digests.RACY_NS`
(younger ones are never reused). One child process then runs the audit (``verify.main``) once to
warm up and ``--repeats`` times per variant, alternating:

* ``rehash``: ``RACY_NS`` beyond any file's age, so no digest is remembered and every use hashes
  its file again, as the audit did before (the baseline);
* ``once``: the default, each file hashed once per audit.

``--checkout PATH`` adds ``checkout``: the audit of that checkout (``PYTHONPATH=PATH``, e.g. one
from before this change) in a child of its own, the same repeats. Per variant: the audit's exit
status, the median and fastest wall time, and (counted by wrapping
``content_hash.file_digest``, so every real hash is counted and still computed) the files hashed
per audit, their MB and the seconds spent hashing them (the median), and the audit's CPU seconds
(``process_time``, every thread: steadier than wall time on a shared machine). Every variant's
output must be identical. Ratios are against ``rehash`` measured in the same run, of the median and
the fastest wall time and of the CPU seconds. The seconds are wall time on a machine that may be
shared: compare them within one run, and rerun.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, time, io, contextlib
from pathlib import Path
from fedagent_flwr.checkpoint import content_hash
from fedagent_flwr.checkpoint.verify import main as verify
try:
    from fedagent_flwr.checkpoint import audit_digests
except ImportError:  # a checkout from before the digests were kept
    audit_digests = None

run_root, repeats, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
plain = content_hash.file_digest
spent = {"hash_calls": 0, "hash_bytes": 0, "hash_seconds": 0.0}

def counted(path):
    begin = time.perf_counter()
    digest = plain(path)
    spent["hash_seconds"] += time.perf_counter() - begin
    spent["hash_calls"] += 1
    spent["hash_bytes"] += Path(path).stat().st_size
    return digest

content_hash.file_digest = counted  # hash_checkpoint_dir and audit_digests look it up at each call
try:  # an older checkout's optimiser audit imported it by name
    from fedagent_flwr.checkpoint import verify_optimizer
    if hasattr(verify_optimizer, "file_digest"):
        verify_optimizer.file_digest = counted
except ImportError:
    pass
default = audit_digests.RACY_NS if audit_digests else None

def audit(variant):
    if audit_digests:
        audit_digests.RACY_NS = 1 << 62 if variant == "rehash" else default
    spent.update(hash_calls=0, hash_bytes=0, hash_seconds=0.0)
    out = io.StringIO()
    begin, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(out):
        code = verify([run_root])
    return {"variant": variant, "status": code, "seconds": time.perf_counter() - begin,
            "cpu_seconds": time.process_time() - cpu, **spent, "output": out.getvalue().splitlines()}

audit(variants[0])  # warm-up: first calls into torch and safetensors
print(json.dumps([audit(variant) for _ in range(repeats) for variant in variants]))
"""


def children(run_root: Path, repeats: int, variants: list[str], checkout: Path) -> list[dict[str, Any]]:
    """The audits of ``variants`` by ``checkout``, ``repeats`` times each, alternating, in one child."""
    env = {"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", _CHILD, str(run_root), str(repeats), ",".join(variants)],
                            capture_output=True, text=True, env=env, cwd=checkout, check=False)
    if result.returncode != 0 or not result.stdout.strip():
        raise SystemExit(f"the audit's child failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return list(json.loads(result.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", choices=("fedadam", "fedavg"), default="fedadam")
    parser.add_argument("--checkout", type=Path, help="one more variant: the audit of this checkout")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))
    from verify_memory import build_run, same_audit_output

    from fedagent_flwr.checkpoint.audit_digests import RACY_NS

    with tempfile.TemporaryDirectory(prefix="verify-hash-once-") as temp:
        begin = time.perf_counter()
        run_root = build_run(Path(temp), args.rows, args.cols, args.seed, args.strategy, args.rounds, args.clients)
        written = time.perf_counter() - begin
        time.sleep(RACY_NS / 1e9 + 0.1)  # younger files are never reused
        print(f"{args.strategy}: {args.rounds} rounds of {args.clients} clients, key {args.rows} x {args.cols} "
              f"({args.rows * args.cols * 4 / 2**20:.0f} MiB fp32 per file); run written in {written:.1f} s")
        runs = children(run_root, args.repeats, ["rehash", "once"], REPO)
        if args.checkout:
            runs += [{**found, "variant": "checkout"}
                     for found in children(run_root, args.repeats, ["once"], args.checkout.resolve())]
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for found in runs:
        by_variant.setdefault(found["variant"], []).append(found)
    stats = {name: {"median_s": statistics.median(f["seconds"] for f in found),
                    "min_s": min(f["seconds"] for f in found),
                    "cpu_s": statistics.median(f["cpu_seconds"] for f in found),
                    "hash_s": statistics.median(f["hash_seconds"] for f in found),
                    "hashed": found[0]["hash_calls"], "hashed_mb": found[0]["hash_bytes"] / 2**20}
             for name, found in by_variant.items()}
    base = stats["rehash"]
    print(f"{'variant':<9} {'status':>6} {'median_s':>8} {'min_s':>7} {'cpu_s':>7} {'hashed':>6} {'hashed_mb':>9} "
          f"{'hash_s':>7} {'median_ratio':>12} {'min_ratio':>9} {'cpu_ratio':>9}")
    for name, found in stats.items():
        print(f"{name:<9} {by_variant[name][0]['status']:>6} {found['median_s']:>8.3f} {found['min_s']:>7.3f} "
              f"{found['cpu_s']:>7.3f} {found['hashed']:>6} {found['hashed_mb']:>9.0f} {found['hash_s']:>7.3f} "
              f"{found['median_s'] / base['median_s']:>12.3f} {found['min_s'] / base['min_s']:>9.3f} "
              f"{found['cpu_s'] / base['cpu_s']:>9.3f}")
    same = same_audit_output(runs)
    once = stats["once"]
    print(f"ratio_once: median {once['median_s'] / base['median_s']:.3f}, min {once['min_s'] / base['min_s']:.3f}, "
          f"cpu {once['cpu_s'] / base['cpu_s']:.3f}; hashing was {base['hash_s'] / base['median_s']:.0%} of "
          f"rehash's median wall time and is {once['hash_s'] / once['median_s']:.0%} of once's")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
