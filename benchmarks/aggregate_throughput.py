"""Throughput and memory of the streamed checkpoint aggregation (a script, not a test).

Builds one ~500 MB fp32 checkpoint per client with Llama-like tensor shapes, in verl's
``fsdp-shards`` layout: even clients are world size 1 with plain tensors, odd clients world size
2 with DTensor ``Shard(0)`` blocks written by two gloo processes. For 2 and 4 clients it then
measures, twice each, with a cold page cache (the files' pages evicted with
``posix_fadvise(DONTNEED)`` before each measurement, so both read from disk) and a warm one:

* the raw read speed of the same shard files (``cat files > /dev/null``), and, warm, a Python
  ``readinto`` loop over them (GNU cat may hand the copy to the kernel with
  ``copy_file_range``/``splice`` and touch no data when the target is /dev/null);
* the aggregation (``open_checkpoint`` + ``weighted_mean``) in a child process: wall time,
  MB/s of input, ratio to the cat, and the child's peak RSS (``VmHWM``) next to its peak
  right before aggregating (interpreter + torch);
* the content-hash check of the inputs, which the server pays once per client reference.

Usage: ``python benchmarks/aggregate_throughput.py [--workdir DIR] [--clients 2 4]``.
Needs about 2.5 GB of temporary disk (4 x 0.5 GB inputs + one output); removes it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# Llama-like, ~125M parameters (498 MB in fp32): 32k vocab, 768 hidden, GQA with 4 KV heads.
VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 32000, 768, 2048, 12, 12, 4
HEAD_DIM = HIDDEN // HEADS


def model_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """State-dict keys and shapes of the synthetic model, in Llama order."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
            (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return shapes


def write_hf_config(directory: Path) -> None:
    """``huggingface/config.json`` so that the averaged directory is a loadable Llama."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        tie_word_embeddings=False,
    ).save_pretrained(str(directory / "huggingface"))


def write_plain_client(directory: Path, seed: int) -> None:
    """World size 1, plain tensors (an unsharded state dict)."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(s, generator=generator) * 0.02 for k, s in model_shapes()}
    torch.save(state, directory / "model_world_size_1_rank_0.pt")
    (directory / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    write_hf_config(directory)


def _dtensor_worker(rank: int, init_file: str, directory: str, seed: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        generator = torch.Generator().manual_seed(seed * 10 + rank)
        state = {}
        for key, shape in model_shapes():
            rows = shape[0] // 2 + (shape[0] % 2 if rank == 0 else 0)
            local = torch.randn((rows, *shape[1:]), generator=generator) * 0.02
            state[key] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride(),
            )
        torch.save(state, Path(directory) / f"model_world_size_2_rank_{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write_dtensor_client(directory: Path, seed: int) -> None:
    """World size 2, DTensor Shard(0) blocks written by two gloo ranks."""
    import torch.multiprocessing as mp

    directory.mkdir(parents=True)
    init_file = directory.parent / f".init_{directory.name}"
    mp.start_processes(
        _dtensor_worker, args=(str(init_file), str(directory), seed), nprocs=2, join=True,
        start_method="spawn",
    )
    init_file.unlink(missing_ok=True)
    (directory / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 2}))
    write_hf_config(directory)


_CHILD = r"""
import json, sys, time
def hwm_mb():
    # VmHWM: peak resident set of this process image. ru_maxrss would do, except that Linux
    # carries it across exec, so a child would report its (big) parent's peak.
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024
t0 = time.perf_counter()
from fedagent_flwr.checkpoint import CheckpointRef, open_checkpoint, weighted_mean, hash_checkpoint_dir
dirs, out = json.loads(sys.argv[1]), sys.argv[2]
import_s = time.perf_counter() - t0
base_mb = hwm_mb()
t1 = time.perf_counter()
def world_size(d):
    with open(d + "/fsdp_config.json") as f:
        return int(json.load(f)["world_size"])
# No hash here (timed separately below): for_directory would hash every file first.
readers = [open_checkpoint(CheckpointRef(d, format="fsdp-shards", world_size=world_size(d)),
                           check_hash=False) for d in dirs]
open_s = time.perf_counter() - t1
report = weighted_mean([(r, float(i + 1)) for i, r in enumerate(readers)], out)
agg_s = time.perf_counter() - t1
peak_mb = hwm_mb()
t2 = time.perf_counter()
for d in dirs:
    hash_checkpoint_dir(d)
hash_s = time.perf_counter() - t2
print(json.dumps({"open_s": open_s, "agg_s": agg_s, "weighted_mean_s": report.seconds,
                  "bytes_read": report.bytes_read, "peak_rss_mb": peak_mb,
                  "base_rss_mb": base_mb, "hash_s": hash_s, "import_s": import_s,
                  "io": readers[0].io}))
"""


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (POSIX_FADV_DONTNEED needs no privileges for
    clean pages), so the next read comes from disk: the cold-cache rows compare disk reads."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_cat(files: list[Path]) -> float:
    started = time.perf_counter()
    with open(os.devnull, "wb") as sink:
        subprocess.run(["cat", *map(str, files)], stdout=sink, check=True)
    return time.perf_counter() - started


def time_python_read(files: list[Path], block: int = 8 << 20) -> float:
    """Sequential read into one reused 8 MiB buffer: a user-space copy per byte, like the reader."""
    buffer = bytearray(block)
    view = memoryview(buffer)
    started = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(view):
                pass
    return time.perf_counter() - started


def run_aggregation(dirs: list[Path], out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([str(d) for d in dirs]), str(out)],
        check=True, capture_output=True, text=True, env=env,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="aggbench_", dir=args.workdir))
    try:
        started = time.perf_counter()
        clients = []
        for i in range(max(args.clients)):
            directory = work / f"client_{i}"
            (write_plain_client if i % 2 == 0 else write_dtensor_client)(directory, seed=i + 1)
            clients.append(directory)
        build_s = time.perf_counter() - started
        mb_per_client = sum(p.stat().st_size for p in clients[0].glob("*.pt")) / 1e6
        print(f"built {len(clients)} clients of {mb_per_client:.0f} MB in {build_s:.1f}s "
              f"(world sizes {[1 if i % 2 == 0 else 2 for i in range(len(clients))]}), "
              f"torch {torch.__version__}, {os.cpu_count()} CPUs")

        rows = []
        for n in args.clients:
            dirs = clients[:n]
            files = sorted(f for d in dirs for f in d.glob("model_world_size_*.pt"))
            input_mb = sum(f.stat().st_size for f in files) / 1e6
            for cache in ("cold", "warm"):
                for rep in range(1, args.repeats + 1):
                    if cache == "cold":
                        evict(files)
                    cat_s = time_cat(files)
                    if cache == "cold":
                        evict(files)
                        read_s = float("nan")
                    else:
                        read_s = time_python_read(files)
                    out = work / f"global_{n}_{cache}_{rep}"
                    if cache == "cold":
                        evict(files)
                    child = run_aggregation(dirs, out)
                    shutil.rmtree(out)
                    rows.append({
                        "clients": n, "cache": cache, "rep": rep, "input_mb": round(input_mb, 1),
                        "cat_s": round(cat_s, 3), "cat_mb_s": round(input_mb / cat_s, 1),
                        "pyread_s": round(read_s, 3), "pyread_mb_s": round(input_mb / read_s, 1),
                        "agg_s": round(child["agg_s"], 3), "agg_mb_s": round(input_mb / child["agg_s"], 1),
                        "ratio_agg_over_cat": round(child["agg_s"] / cat_s, 2),
                        "open_s": round(child["open_s"], 3),
                        "peak_rss_mb": round(child["peak_rss_mb"], 1),
                        "base_rss_mb": round(child["base_rss_mb"], 1),
                        "hash_s": round(child["hash_s"], 3),
                        "bytes_read_mb": round(child["bytes_read"] / 1e6, 1), "io": child["io"],
                    })
        header = ("clients", "cache", "rep", "input_mb", "cat_s", "cat_mb_s", "pyread_mb_s", "agg_s",
                  "agg_mb_s", "ratio_agg_over_cat", "peak_rss_mb", "base_rss_mb", "hash_s")
        widths = [max(8, len(h)) for h in header]
        print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
        for row in rows:
            print(" ".join(f"{row[h]:>{w}}" for h, w in zip(header, widths)))
        print(json.dumps({"benchmark": "aggregate_throughput", "mb_per_client": round(mb_per_client, 1),
                          "build_s": round(build_s, 1), "rows": rows}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
