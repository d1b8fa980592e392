"""Peak memory of the checkpoint audit (``python -m fedagent_flwr.checkpoint.verify``) on a round
whose model is one large key: each key recomputed whole vs in chunks, for a server optimiser's
rounds (FedAdam) or FedAvg's weighted means.

    python benchmarks/verify_memory.py                      # one 2048 x 4096 key (8.4M elements)
    python benchmarks/verify_memory.py --rows 4096 --also 4194304 1048576   # 16.8M; 4M and 1M chunks
    python benchmarks/verify_memory.py --strategy fedavg    # FedAvg's audit (mean_audit.verify_mean)

The audit (:mod:`fedagent_flwr.checkpoint.verify_optimizer`) recomputes a round in float64: the
clients' weighted mean and its magnitude, ``x``, the buffers, their bounds, the step's temporaries
and the errors, about twenty float64 copies of what it holds at once. Held for a whole key, that is
tens of GB for a 7B model's embedding (152k x 3584 = 545M elements); in chunks of
``CHUNK_ELEMENTS`` elements it is about 100 MB whatever the key's size.

The benchmark writes, in a temp dir removed at the end, a base model holding one fp32 key of
``--rows`` x ``--cols`` (weights 1 + 0.1 N(0, 1)) and two FedAdam rounds of two clients (the base
model plus 1e-5 N(0, 1)) aggregated by the real strategy (``FedAdamFSDP``, driven as the tests
drive it: ``testkit.round_harness``), so that round 2 reads every input: the sources, ``x``, the
previous state (``m``, ``v``) and the new one. ``--strategy fedavg``: the same rounds by
``FedAvgFSDP``, whose audit (:mod:`fedagent_flwr.checkpoint.mean_audit`) reads the sources and the
written mean, with the same ``CHUNK_ELEMENTS``. Then, each in a child process of its own so that
each peak is its own, the audit of the run (``verify.main``) with:

* ``whole``: ``CHUNK_ELEMENTS`` larger than the key, so each key is one chunk (what the audit held
  before it was chunked: the baseline);
* ``chunked``: the module's default ``CHUNK_ELEMENTS``;
* ``chunk=N`` (``--also N``, default 4M): ``CHUNK_ELEMENTS`` = N (how the peak follows the chunk);
* ``checkout`` (``--checkout PATH``): the audit of another checkout (``PYTHONPATH=PATH``), e.g. one
  from before the chunks, to check that ``whole`` is what it held.

The defaults keep it under a minute and 2 GB on a 2-core machine (``whole`` holds ~1.5 GB, and
grows with the key: tens of GB for a 7B model's embedding; the chunked variants do not). The
seconds are wall time on a machine that may be shared: compare them within one run, and rerun.

Per variant: the audit's exit status and output (the same for all: the results do not depend on the
chunks), its wall time, and two peaks over the child's resident set just before the audit:
``hwm_mb`` (``VmHWM``, the kernel's peak resident set, which also counts the pages of the
memory-mapped safetensors files the audit reads: ~8 x the key's fp32 size in round 2, file-backed
and reclaimable, the same in every variant) and ``anon_mb`` (the peak of ``RssAnon``, the process's
own allocations, sampled every millisecond by a thread: the float64 working set). Ratios are
against ``whole`` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
KEY = "model.embed_tokens.weight"

_CHILD = r"""
import json, sys, threading, time
from fedagent_flwr.checkpoint import verify_optimizer
from fedagent_flwr.checkpoint.verify import main as verify
try:  # where the chunk size lies: audit_rows, verify_optimizer in an older checkout
    from fedagent_flwr.checkpoint import audit_rows as rows_module
except ImportError:
    rows_module = verify_optimizer

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":")) / 1024

run_root, chunk = sys.argv[1], sys.argv[2]
if chunk != "default":
    rows_module.CHUNK_ELEMENTS = int(chunk)
chunk = getattr(rows_module, "CHUNK_ELEMENTS", "none")  # an older checkout has none
base_rss, base_anon = status("VmRSS"), status("RssAnon")
peak_anon, done = [base_anon], threading.Event()

def sample():
    while not done.is_set():
        peak_anon[0] = max(peak_anon[0], status("RssAnon"))
        time.sleep(0.001)

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
begin = time.perf_counter()
code = verify([run_root])
seconds = time.perf_counter() - begin
done.set()
sampler.join()
peak_anon[0] = max(peak_anon[0], status("RssAnon"))
print(json.dumps({"status": code, "seconds": seconds, "hwm_mb": status("VmHWM") - base_rss,
                  "anon_mb": peak_anon[0] - base_anon, "chunk": chunk}))
"""


def build_run(root: Path, rows: int, cols: int, seed: int, strategy_name: str = "fedadam", rounds: int = 2,
              clients: int = 2) -> Path:
    """The base model and ``rounds`` rounds of ``clients`` clients (two of two here: module
    docstring) by FedAdam or FedAvg; the run root."""
    import torch
    from safetensors.torch import load_file, save_file

    from fedagent_flwr.checkpoint import CheckpointRef
    from fedagent_flwr.serverapp.strategy import FedAdamFSDP, FedAvgFSDP
    from testkit.client_replies import train_reply
    from testkit.round_harness import train_round
    from testkit.strategy_setup import client_slot, connected_strategy

    generator = torch.Generator().manual_seed(seed)
    base = root / "base"
    base.mkdir()
    save_file({KEY: 1.0 + 0.1 * torch.randn(rows, cols, generator=generator)}, str(base / "model.safetensors"))
    # no tie: the audit reads the one key, and transformers is not imported
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": False}))
    settings: dict[str, Any] = {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99} if strategy_name == "fedadam" else {}
    strategy, run_root = connected_strategy(root, CheckpointRef.for_directory(base),
                                            FedAdamFSDP if strategy_name == "fedadam" else FedAvgFSDP,
                                            clients=clients, **settings)
    for server_round in range(1, rounds + 1):
        replies = []
        for client in range(clients):
            copy = Path(shutil.copytree(strategy.global_model.path,
                                        client_slot(run_root, client, server_round) / "model"))
            tensor = load_file(str(copy / "model.safetensors"))[KEY]
            tensor += 1e-5 * torch.randn(tensor.shape, generator=generator)
            save_file({KEY: tensor}, str(copy / "model.safetensors"))
            del tensor
            replies.append(train_reply(client, CheckpointRef.for_directory(copy), 4 + 8 * client))
        train_round(strategy, server_round, replies)
    return run_root


def audit(run_root: Path, chunk: str, checkout: Path = REPO) -> dict[str, Any]:
    """``verify.main`` of ``checkout`` on the run in a child process with ``CHUNK_ELEMENTS`` = ``chunk``."""
    env = {"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin"}
    # cwd too: ``python -c`` puts it first on sys.path
    result = subprocess.run([sys.executable, "-c", _CHILD, str(run_root), chunk], capture_output=True, text=True,
                            env=env, cwd=checkout, check=False)
    if result.returncode not in (0, 1) or not result.stdout.strip():
        raise SystemExit(f"the audit's child failed ({result.returncode}):\n{result.stderr[-3000:]}")
    lines = result.stdout.strip().splitlines()
    return {**json.loads(lines[-1]), "output": lines[:-1]}


def same_audit_output(results: list[dict[str, Any]]) -> bool:
    """Whether every variant's audit printed the same lines with the same exit status as the first
    (a faster audit that says something else measures nothing); prints the verdict and the first's
    lines."""
    reference = results[0]
    same = all(found["output"] == reference["output"] and found["status"] == reference["status"]
               for found in results)
    print("audit output of every variant:", "identical" if same else "DIFFERENT")
    for line in reference["output"]:
        print("  " + line)
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--also", type=int, nargs="*", default=[1 << 22], metavar="N",
                        help="more variants: CHUNK_ELEMENTS = N")
    parser.add_argument("--checkout", type=Path, help="one more variant: the audit of this checkout")
    parser.add_argument("--strategy", choices=("fedadam", "fedavg"), default="fedadam",
                        help="whose rounds are audited: a server optimiser's (FedAdam) or FedAvg's weighted means")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))

    elements = args.rows * args.cols
    with tempfile.TemporaryDirectory(prefix="verify-memory-") as temp:
        begin = time.perf_counter()
        run_root = build_run(Path(temp), args.rows, args.cols, args.seed, args.strategy)
        print(f"{args.strategy}: key {args.rows} x {args.cols} = {elements / 1e6:.1f}M elements "
              f"({elements * 8 / 2**20:.0f} MiB as float64); run written in {time.perf_counter() - begin:.1f} s")
        variants = {"whole": str(2 * elements), "chunked": "default", **{f"chunk={n}": str(n) for n in args.also}}
        results = {name: audit(run_root, chunk) for name, chunk in variants.items()}
        if args.checkout:
            results["checkout"] = audit(run_root, "default", args.checkout.resolve())
    whole = results["whole"]
    print(f"{'variant':<13} {'chunk':>10} {'status':>6} {'seconds':>8} {'hwm_mb':>8} {'anon_mb':>8} "
          f"{'anon_ratio':>10} {'hwm_ratio':>9}")
    for name, found in results.items():
        print(f"{name:<13} {found['chunk']:>10} {found['status']:>6} {found['seconds']:>8.2f} {found['hwm_mb']:>8.0f} "
              f"{found['anon_mb']:>8.0f} {found['anon_mb'] / whole['anon_mb']:>10.3f} "
              f"{found['hwm_mb'] / whole['hwm_mb']:>9.3f}")
    same = same_audit_output(list(results.values()))
    print(f"anon_ratio_chunked={results['chunked']['anon_mb'] / whole['anon_mb']:.3f}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
