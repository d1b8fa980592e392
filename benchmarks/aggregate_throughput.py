"""Cold-cache throughput of what the ServerApp does per round with the client checkpoints.

    python benchmarks/aggregate_throughput.py --clients 4 --repeats 1

Builds FSDP-style client checkpoints of mixed world sizes in verl's ``fsdp-shards`` layout
(world size 1 as plain tensors, 2 and 4 as DTensor ``Shard(0)`` blocks written by gloo
processes, as ``testkit/ckpt_factory.py`` does), Llama-like shapes, ~350 MB fp32 each with the
default 6 layers (>= 1 GB for 4 clients), in a temp dir that is removed at the end. Then, per
repeat, with the files' pages evicted from the page cache before every timed pass:

* ``cat`` of the rank files (the disk's sequential read speed, the yardstick);
* the server's work in a child process: open every client checkpoint with its content hash
  checked, average them (``weighted_mean``) and commit the output. ``store`` is what the
  strategy does with the http store (``storage.kind=http``, receipts trusted by default,
  ``storage.trust_store_receipts``): the checkpoints were uploaded through a real store on
  loopback before the timed passes (not timed: the clients' uploads), which verified every file's
  sha256 on receipt and wrote its receipt, so the aggregation takes those digests while the files'
  stat is unchanged, checks the content hash over them and hashes nothing again
  (``fedagent_flwr/checkpoint/receipts.py``). The store's own hashing at receipt is reported
  beside it (``receipt_hash_s``: the wall time of the store's hash of every received file, the
  upload's fsync included), so no cost is hidden: it is paid while the uploads arrive, before
  the round's aggregation. ``one-pass`` is what the strategy does with a shared filesystem (the
  default ``storage.kind``): the hash is checked from the bytes the aggregation reads;
  ``hash-first`` hashes every checkpoint before opening it (the earlier server: each file read
  twice). Run the benchmark with ``PYTHONPATH`` on an older checkout and ``--modes hash-first``
  for that code's numbers (``store`` needs this code).

Each child aggregates twice, evicting the files again in between: a ServerApp aggregates every
round in one long-lived process, and the first pass of a fresh process also pays one-time costs
(lazy imports inside torch and the readers, thread pools, first allocations). The first pass is
reported as ``first_pass_s`` (and ``first_pass_ratio``: what a run's first round sees); the second,
both with a cold page cache, is ``server_s``, the per-round figure the ratio is taken from.

The cache is made cold with ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file (no root
needed; ``/proc/sys/vm/drop_caches`` would evict every process's cache on a shared machine), and
``fincore`` (when installed) reports how much of the files stayed resident. The output lists,
per pass, wall times, MB/s, the server's CPU seconds (every thread; less sensitive to load than
wall time), the child's peak RSS over its import-time baseline, and the load averages (the ratio
is taken against ``cat`` in the same repeat, so both see the same load). The last line is
``ratio_vs_cat=<cat time / server time>`` of the first mode given (median over repeats); by
default that is ``store``, the mode of a deployment with the http store, whose ratio issue 16
tracks. ``--modes one-pass`` gives the shared-filesystem figure on the last line.

    python benchmarks/aggregate_throughput.py --layers 1 --clients 4 --repeats 1   # a quick check

``--layout safetensors`` writes each client as a Hugging Face model directory instead (one
``model.safetensors`` and its ``config.json``: what the default job's reference trainer uploads),
in fp32 or, with ``--dtype bfloat16``, bf16 (read into the mean's fp32 buffers: a conversion).
``--checkout PATH`` runs every mode also on the code of another checkout (the child with
``PYTHONPATH=PATH``, named ``<mode>@checkout``), right after the same mode on this code with the
files evicted again, and reports ``vs_checkout``: that checkout's server time over this code's
(above 1: this code is faster), with both outputs' sha256 compared (they must be equal).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]

# Llama-like, 32k vocab, 768 hidden, GQA with 4 KV heads; --layers sets the size (6: ~350 MB fp32).
VOCAB, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 32000, 768, 2048, 12, 4
HEAD_DIM = HIDDEN // HEADS
LAYERS = 6
WORLD_SIZES = (1, 2, 4, 2)  # client i has WORLD_SIZES[i % 4]: mixed, as in a real federation


def model_shapes(layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """State-dict keys and shapes of the synthetic model, in Llama order."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS if layers is None else layers):
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


def write_hf_config(directory: Path, layers: int) -> None:
    """``huggingface/config.json`` so that the averaged directory is a loadable Llama."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        tie_word_embeddings=False,
    ).save_pretrained(str(directory / "huggingface"))


def write_plain_client(directory: Path, seed: int, layers: int) -> None:
    """World size 1, plain tensors (an unsharded state dict)."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(s, generator=generator) * 0.02 for k, s in model_shapes(layers)}
    torch.save(state, directory / "model_world_size_1_rank_0.pt")
    (directory / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    write_hf_config(directory, layers)


def write_safetensors_client(directory: Path, seed: int, layers: int, dtype: torch.dtype = torch.float32) -> None:
    """A Hugging Face model directory: one ``model.safetensors`` (in ``dtype``) and its ``config.json``."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    save_file({k: (torch.randn(s, generator=generator) * 0.02).to(dtype) for k, s in model_shapes(layers)},
              str(directory / "model.safetensors"))
    LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                tie_word_embeddings=False).save_pretrained(str(directory))


def data_files(directory: Path) -> list[Path]:
    """The files the server reads tensors from (rank files or safetensors files)."""
    return sorted([*directory.glob("model_world_size_*.pt"), *directory.glob("*.safetensors")])


def _dtensor_worker(rank: int, init_file: str, directory: str, seed: int, world: int, layers: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        generator = torch.Generator().manual_seed(seed * 10 + rank)
        state = {}
        for key, shape in model_shapes(layers):
            # torch.chunk's split: blocks of ceil(n / world) rows, the last ones shorter.
            block = -(-shape[0] // world)
            rows = max(0, min(block, shape[0] - rank * block))
            local = torch.randn((rows, *shape[1:]), generator=generator) * 0.02
            state[key] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride(),
            )
        torch.save(state, Path(directory) / f"model_world_size_{world}_rank_{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write_dtensor_client(directory: Path, seed: int, world: int, layers: int) -> None:
    """World size ``world``, DTensor Shard(0) blocks written by ``world`` gloo ranks."""
    import torch.multiprocessing as mp

    directory.mkdir(parents=True)
    init_file = directory.parent / f".init_{directory.name}"
    mp.start_processes(
        _dtensor_worker, args=(str(init_file), str(directory), seed, world, layers), nprocs=world, join=True,
        start_method="spawn",
    )
    init_file.unlink(missing_ok=True)
    (directory / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    write_hf_config(directory, layers)


_CHILD = r"""
import json, shutil, sys, time
def hwm_mb():
    # VmHWM: peak resident set of this process image. ru_maxrss would do, except that Linux
    # carries it across exec, so a child would report its (big) parent's peak.
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024
import os
import fedagent_flwr
from fedagent_flwr.checkpoint import CheckpointRef, open_checkpoint, weighted_mean, hash_checkpoint_dir
from fedagent_flwr.checkpoint.receipts import ReceiptCheck
refs, out, mode = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
# store: the key of the store's receipts, which the ServerApp holds in memory (here: from the parent)
receipts = ReceiptCheck(bytes.fromhex(os.environ["AGG_BENCH_RECEIPT_KEY"])) if mode == "store" else None
base_mb = hwm_mb()


def evict(paths):  # as the parent's evict(): the next read comes from disk
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one_pass(out):
    t0, cpu0 = time.perf_counter(), time.process_time()
    readers = []
    for r in refs:
        ref = CheckpointRef(**r)
        if mode == "hash-first":  # the earlier server: hash every file, then open and read it again
            if hash_checkpoint_dir(ref.path) != ref.sha256:
                raise SystemExit(f"hash mismatch in {ref.path}")
            readers.append(open_checkpoint(ref, check_hash=False))
        else:  # what the strategy does: the hash is checked from the bytes the mean reads (or receipts)
            readers.append(open_checkpoint(ref, check_hash="while-reading", receipts=receipts))
    open_s = time.perf_counter() - t0
    report = weighted_mean([(r, float(i + 1)) for i, r in enumerate(readers)], out)
    server_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0  # cpu: every thread, user + sys
    for reader in readers:
        reader.close()
    return readers, report, open_s, server_s, cpu_s


# A ServerApp aggregates every round in one process: the first pass of a fresh process also pays
# one-time costs (lazy imports inside torch and the readers, thread pools, first allocations).
# Both passes read with a cold page cache; the second is the per-round figure.
_, _, _, first_s, first_cpu_s = one_pass(out + "_first")
shutil.rmtree(out + "_first")
evict(json.loads(sys.argv[4]))
readers, report, open_s, server_s, cpu_s = one_pass(out)
peak_mb = hwm_mb()
t1 = time.perf_counter()
hash_checkpoint_dir(out)  # the strategy describes the new global model (warm: just written)
out_hash_s = time.perf_counter() - t1
print(json.dumps({"open_s": open_s, "server_s": server_s, "cpu_s": cpu_s, "bytes_read": report.bytes_read,
                  "first_server_s": first_s, "first_cpu_s": first_cpu_s,
                  "gap_bytes": sum(getattr(r, "hash_gap_bytes", 0) for r in readers),
                  "peak_rss_mb": peak_mb, "base_rss_mb": base_mb, "out_hash_s": out_hash_s,
                  "io": getattr(readers[0], "io", "?"), "package": os.path.dirname(fedagent_flwr.__file__),
                  "receipt_files": sum(len(getattr(r, "receipt_files", [])) for r in readers)}))
"""


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (POSIX_FADV_DONTNEED needs no privileges for
    clean pages), so the next read comes from disk."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_mb(files: list[Path]) -> float | None:
    """MB of ``files`` in the page cache (``fincore``), None where fincore is missing."""
    if shutil.which("fincore") is None:
        return None
    result = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                            capture_output=True, text=True, check=False)
    try:
        return sum(int(line) for line in result.stdout.split()) / 1e6
    except ValueError:
        return None


def time_cat(files: list[Path]) -> float:
    started = time.perf_counter()
    with open(os.devnull, "wb") as sink:
        subprocess.run(["cat", *map(str, files)], stdout=sink, check=True)
    return time.perf_counter() - started


def run_server(refs: list[dict[str, Any]], out: Path, mode: str, files: list[Path],
               receipt_key: bytes = b"", checkout: Path | None = None) -> dict[str, Any]:
    """The server's per-round work in a fresh interpreter (imports not timed), twice: the first
    pass of the process, then, with ``files`` evicted again, the per-round pass; on the code of
    ``checkout`` when given (``PYTHONPATH``)."""
    env = {**os.environ, "AGG_BENCH_RECEIPT_KEY": receipt_key.hex()}
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(checkout), *filter(None, [env.get("PYTHONPATH")])])
    # -P: `python -c` would put the working directory first on sys.path, ahead of PYTHONPATH, and
    # run this checkout's code as the other's when started from the repository root.
    result = subprocess.run(
        [sys.executable, "-P", "-c", _CHILD, json.dumps(refs), str(out), mode, json.dumps([str(f) for f in files])],
        check=False, capture_output=True, text=True, env=env,
    )
    if result.returncode != 0:
        raise SystemExit(f"the server child ({mode}) failed:\n{result.stderr[-4000:]}")
    child = dict(json.loads(result.stdout.strip().splitlines()[-1]))
    wanted = (checkout or REPO).resolve()
    if Path(child["package"]).resolve() != wanted / "fedagent_flwr":
        raise SystemExit(f"the server child ({mode}) ran the code in {child['package']}, not {wanted}'s")
    return child


def upload_through_store(work: Path, sources: list[Path], store: Any) -> tuple[list[dict[str, Any]], float, float]:
    """Upload every client directory through ``store`` (a running HttpServerStore) as its client
    of round 1 would; return the server's local references, the uploads' wall time and the store's
    time hashing received files (``hash_and_sync``: fsync and sha256 of each file as it completes)."""
    from fedagent_flwr.checkpoint import http_server
    from fedagent_flwr.checkpoint.http_client import HttpClientStore

    spent = [0.0]
    original = http_server.hash_and_sync

    def timed(path: Path) -> Any:
        started = time.perf_counter()
        try:
            return original(path)
        finally:
            spent[0] += time.perf_counter() - started

    http_server.hash_and_sync = timed  # type: ignore[assignment]
    try:
        refs, started = [], time.perf_counter()
        for client, directory in enumerate(sources):
            node = HttpClientStore(store.url, store.run_key, store.read_token(), work / f"node_{client}",
                                   upload_token=store.upload_token(1, client))
            local = store.resolve(node.put(directory, "actor", 1, client), 1, client)
            refs.append({"path": local.path, "format": local.format, "world_size": local.world_size,
                         "sha256": local.sha256})
        return refs, time.perf_counter() - started, spent[0]
    finally:
        http_server.hash_and_sync = original  # type: ignore[assignment]


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (size of each client)")
    parser.add_argument("--modes", nargs="+", default=["store", "one-pass", "hash-first"],
                        choices=["store", "one-pass", "hash-first"],
                        help="the first one's ratio is the last line (default: store, the http store's)")
    parser.add_argument("--layout", choices=["fsdp-shards", "safetensors"], default="fsdp-shards",
                        help="how the clients are written (safetensors: Hugging Face model directories)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the safetensors clients' dtype (bfloat16: read into the mean's fp32 buffers)")
    parser.add_argument("--checkout", type=Path, default=None,
                        help="also run every mode on this checkout's code (e.g. a git worktree of an older commit)")
    args = parser.parse_args()
    if args.dtype != "float32" and args.layout != "safetensors":
        parser.error("--dtype applies to --layout safetensors only (fsdp-shards clients are written in fp32)")

    from fedagent_flwr.checkpoint import CheckpointRef
    from fedagent_flwr.checkpoint.hf_files import MODEL_FILE

    work = Path(tempfile.mkdtemp(prefix="aggbench_", dir=args.workdir))
    try:
        started = time.perf_counter()
        refs, files = [], []
        worlds = [1 if args.layout == "safetensors" else WORLD_SIZES[i % len(WORLD_SIZES)]
                  for i in range(args.clients)]
        for i, world in enumerate(worlds):
            directory = work / f"client_{i}"
            if args.layout == "safetensors":
                write_safetensors_client(directory, seed=i + 1, layers=args.layers, dtype=getattr(torch, args.dtype))
            elif world == 1:
                write_plain_client(directory, seed=i + 1, layers=args.layers)
            else:
                write_dtensor_client(directory, seed=i + 1, world=world, layers=args.layers)
            ref = CheckpointRef.for_directory(directory)  # the client's reference, hashed on its side
            refs.append({"path": ref.path, "format": ref.format, "world_size": ref.world_size, "sha256": ref.sha256})
            files += data_files(directory)
        input_mb = sum(f.stat().st_size for f in files) / 1e6
        print(f"built {args.clients} clients ({args.layout}), world sizes {worlds}, {input_mb:.0f} MB of files in "
              f"{time.perf_counter() - started:.1f}s; torch {torch.__version__}, {os.cpu_count()} CPUs")
        print("cold cache: posix_fadvise(POSIX_FADV_DONTNEED) on every data file before each timed pass "
              "(not /proc/sys/vm/drop_caches: it needs root and evicts every process's cache)")

        store_refs, store_files, receipt_key, upload_s, receipt_hash_s = [], [], b"", 0.0, 0.0
        if "store" in args.modes:
            from fedagent_flwr.checkpoint.http_server import HttpServerStore
            from fedagent_flwr.checkpoint.store import StorageSettings

            (work / "store_run").mkdir()
            store = HttpServerStore(StorageSettings(kind="http"), work / "store_run", "1")
            try:
                store_refs, upload_s, receipt_hash_s = upload_through_store(
                    work, [work / f"client_{i}" for i in range(args.clients)], store)
                receipt_key = store.receipt_key()
            finally:
                store.close()
            store_files = [f for r in store_refs for f in data_files(Path(r["path"]))]
            print(f"uploaded through a loopback http store in {upload_s:.2f}s; the store hashed the received "
                  f"files (fsync + sha256, receipt_hash_s) in {receipt_hash_s:.2f}s; receipts written")

        rows = []
        for rep in range(1, args.repeats + 1):
            evict(files)
            resident = resident_mb(files)
            load_before = load()
            cat_s = time_cat(files)
            codes = [None, args.checkout] if args.checkout else [None]  # None: this checkout's code
            for mode, checkout in [(mode, code) for mode in args.modes for code in codes]:
                mode_files = store_files if mode == "store" else files
                evict(mode_files)
                out = work / f"global_{mode}_{rep}{'_checkout' if checkout else ''}"
                child = run_server(store_refs if mode == "store" else refs, out, mode, mode_files, receipt_key,
                                   checkout)
                out_sha = hashlib.sha256((out / MODEL_FILE).read_bytes()).hexdigest()
                shutil.rmtree(out)
                mine = next((r for r in rows if r["rep"] == rep and r["mode"] == mode), None) if checkout else None
                if mine is not None and mine["out_sha"] != out_sha:
                    raise SystemExit(f"{mode}: the checkout's mean differs from this code's ({out_sha} vs "
                                     f"{mine['out_sha']})")
                rows.append({
                    "rep": rep, "mode": f"{mode}@checkout" if checkout else mode, "input_mb": round(input_mb, 1),
                    "out_sha": out_sha,
                    "vs_checkout": round(child["server_s"] / mine["server_s"], 3) if mine else "-",
                    "resident_mb_after_evict": None if resident is None else round(resident, 1),
                    "cat_s": round(cat_s, 3), "cat_mb_s": round(input_mb / cat_s, 1),
                    "server_s": round(child["server_s"], 3), "server_mb_s": round(input_mb / child["server_s"], 1),
                    "server_cpu_s": round(child["cpu_s"], 3),
                    "first_pass_s": round(child["first_server_s"], 3),
                    "first_pass_ratio": round(cat_s / child["first_server_s"], 3),
                    "ratio_vs_cat": round(cat_s / child["server_s"], 3),
                    "open_s": round(child["open_s"], 3), "out_hash_s": round(child["out_hash_s"], 3),
                    "read_mb": round((child["bytes_read"] + child["gap_bytes"]) / 1e6, 1),
                    "peak_rss_mb": round(child["peak_rss_mb"], 1),
                    "rss_over_base_mb": round(child["peak_rss_mb"] - child["base_rss_mb"], 1),
                    "io": child["io"], "load_before": load_before, "load_after": load(),
                    "receipt_files": child["receipt_files"],
                    # paid once per upload, before the round (not in server_s): shown so nothing is hidden
                    "receipt_hash_s": round(receipt_hash_s, 3) if mode == "store" else "-",
                })
        header = ("rep", "mode", "input_mb", "cat_s", "cat_mb_s", "first_pass_s", "first_pass_ratio", "server_s",
                  "server_cpu_s", "ratio_vs_cat", "vs_checkout",
                  "read_mb", "out_hash_s", "receipt_files", "receipt_hash_s", "rss_over_base_mb", "load_before",
                  "load_after")
        widths = [max(9, len(h)) for h in header]
        print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
        for row in rows:
            print(" ".join(f"{row[h]!s:>{w}}" for h, w in zip(header, widths)))
        print(json.dumps({"benchmark": "aggregate_throughput", "layout": args.layout, "dtype": args.dtype,
                          "world_sizes": worlds,
                          "layers": args.layers, "checkout": str(args.checkout) if args.checkout else None,
                          "upload_s": round(upload_s, 3), "receipt_hash_s": round(receipt_hash_s, 3),
                          "rows": rows}))
        ratios = [r["ratio_vs_cat"] for r in rows if r["mode"] == args.modes[0]]
        # Last line, for scripts: cat time / server time of the first mode (store by default: the
        # ServerApp's mode in a deployment with the http store).
        print(f"ratio_vs_cat={statistics.median(ratios):.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
