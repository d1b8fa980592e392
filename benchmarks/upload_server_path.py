"""The server's side of one client upload, per store kind: what it costs from the first byte the
store receives to the end of the aggregation's read of that checkpoint.

    python benchmarks/upload_server_path.py --layers 6 --repeats 3

Writes one synthetic client checkpoint (world size 1, plain fp32 tensors, Llama-like shapes as in
``aggregate_throughput.py``; ~350 MB with the default 6 layers) into a temp dir that is removed at
the end, then, per repeat and per store kind, runs the real store code on real files:

* ``shared-fs``: the checkpoint is copied into the client's slot of the run root (not timed: the
  client writes it there), the store resolves it and the aggregation opens and reads it;
* ``http``: the store serves on loopback (uvicorn, as in the tests) and a child process uploads
  the checkpoint through the real client (its own hashing of the files is the client's cost, in
  another process); the server's CPU seconds during the upload are its receive-write-verify
  work (``upload_cpu_s``);
* ``s3``: moto's S3 server runs as a subprocess (``testkit/s3_harness.py``; a stand-in that speaks
  S3's HTTP API to the real s3fs/botocore client, not AWS's throughput), the client's upload is
  not timed, and the store's ``resolve`` (download, per-file check against the pinned manifest,
  content hash) is the upload phase (``upload_wall_s``, ``upload_cpu_s``; moto's own CPU is in
  its process and not counted).

The aggregation phase (``agg_wall_s``, ``agg_cpu_s``) is what the strategy does with the
reference: ``open_checkpoint(..., check_hash="while-reading", receipts=store.receipt_check())``,
every tensor read into a reused buffer, ``verify_content()``. The page cache is warm throughout
(the files were just written; ``aggregate_throughput.py`` measures cold reads), so the figures
are dominated by what this benchmark is about: how many times the server hashes (sha256) and
reads the checkpoint's bytes.

Yardsticks measured in the same run, on the same files: ``hash_s`` (one sha256 pass over the
files a store transfers, plain ``hashlib``) and ``read_s`` (one plain read of them). Each kind's
``server_cpu_s`` (upload + aggregation CPU of the server process) is reported as
``passes = server_cpu_s / hash_s``: roughly how many sha256 passes' worth of CPU the server
spends per upload (the reads, the transfer and the arithmetic add a fraction of one). The
figures are medians over the repeats. To compare code versions, run this file against each
checkout (``PYTHONPATH=<checkout>``): the yardsticks make the ratios comparable across runs.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aggregate_throughput import write_plain_client  # noqa: E402 -- the sibling benchmark's model

from fedagent_flwr.checkpoint import CheckpointRef, open_checkpoint  # noqa: E402
from fedagent_flwr.checkpoint.manifest import transfer_files  # noqa: E402
from fedagent_flwr.checkpoint.store import StorageSettings, open_client_store, open_server_store  # noqa: E402

RUN = "7"  # the run id the instructions name (the http client checks it)
KINDS = ("shared-fs", "http", "s3")
_BLOCK = 8 * 1024 * 1024

_HTTP_CLIENT = r"""
import json, sys
from pathlib import Path
from fedagent_flwr.checkpoint.store import open_client_store
fields, source, work = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
client = open_client_store(fields, int(fields["store-run"]), lambda: Path(work))
ref = client.put(source, "actor", 1, 0)
print("REF " + json.dumps(ref.__dict__), flush=True)
"""


def yardsticks(directory: Path) -> dict[str, float]:
    """One plain read and one sha256 pass over the files a store transfers (warm cache)."""
    files = [directory / name for name in transfer_files(directory)]
    for path in files:  # warm the cache first, so both passes see the same state
        path.read_bytes()
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb") as handle:
            while handle.read(_BLOCK):
                pass
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for path in files:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(_BLOCK):
                digest.update(block)
    hash_s = time.perf_counter() - t0
    return {"read_s": read_s, "hash_s": hash_s, "bytes": sum(p.stat().st_size for p in files)}


def aggregate_read(store: Any, ref: CheckpointRef, run_root: Path) -> tuple[float, float]:
    """What the strategy does with one client's reference: resolve, open (hash checked while
    reading, receipts trusted), read every tensor, verify. Returns (wall s, CPU s)."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    local = store.resolve(ref, 1, 0) if store.kind != "s3" else ref
    reader = open_checkpoint(local, root=run_root, check_hash="while-reading", receipts=store.receipt_check())
    try:
        buffer: torch.Tensor | None = None
        for key in reader.keys():
            shape = reader.shape(key)
            if buffer is None or buffer.numel() < max(1, torch.Size(shape).numel()):
                buffer = torch.empty(max(1, torch.Size(shape).numel()), dtype=torch.float32)
            reader.read_into(key, buffer[: torch.Size(shape).numel()].view(shape))
        reader.verify_content()
    finally:
        reader.close()
    return time.perf_counter() - t0, time.process_time() - cpu0


@contextmanager
def s3_endpoint(log_dir: Path) -> Iterator[str]:
    """moto's S3 server with its fake credentials in this process's environment."""
    from testkit.s3_harness import FAKE_CREDENTIALS, moto_s3

    saved = {name: os.environ.get(name) for name in FAKE_CREDENTIALS}
    os.environ.update(FAKE_CREDENTIALS)
    try:
        with moto_s3(log_dir) as url:
            yield url
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def one_kind(kind: str, source: Path, work: Path, endpoint: str, repeat: int) -> dict[str, float]:
    """Upload phase and aggregation phase of ``source`` through a fresh ``kind`` store."""
    run_root = work / f"{kind}-{repeat}" / "run"
    run_root.mkdir(parents=True)
    upload_wall = upload_cpu = 0.0
    if kind == "shared-fs":
        store = open_server_store(StorageSettings(kind="shared-fs"), run_root, RUN)
        target = run_root / "round_1" / "client_0" / "actor"
        shutil.copytree(source, target)
        ref = CheckpointRef.for_directory(target, "actor")
    elif kind == "http":
        store = open_server_store(StorageSettings(kind="http", host="127.0.0.1", port=0), run_root, RUN)
        fields = {**store.instruction_fields(), **store.upload_grant(1, 0)}
        t0, cpu0 = time.perf_counter(), time.process_time()
        # -P: the working directory must not come before PYTHONPATH's checkout on sys.path.
        done = subprocess.run([sys.executable, "-P", "-c", _HTTP_CLIENT, json.dumps(fields), str(source),
                               str(work / f"node-{repeat}")], capture_output=True, text=True, check=True)
        upload_wall, upload_cpu = time.perf_counter() - t0, time.process_time() - cpu0
        line = next(line for line in done.stdout.splitlines() if line.startswith("REF "))
        ref = CheckpointRef(**json.loads(line[4:]))
    else:
        bucket = f"bench-{os.getpid()}-{repeat}"
        settings = StorageSettings(kind="s3", url=f"s3://{bucket}/fed", endpoint_url=endpoint)
        from fedagent_flwr.checkpoint.s3_store import open_filesystem

        open_filesystem(endpoint).mkdir(bucket)
        store = open_server_store(settings, run_root, RUN)
        client = open_client_store(store.instruction_fields(), int(RUN), lambda: work / f"node-s3-{repeat}")
        uploaded = client.put(source, "actor", 1, 0)
        t0, cpu0 = time.perf_counter(), time.process_time()
        ref = store.resolve(uploaded, 1, 0)
        upload_wall, upload_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    try:
        agg_wall, agg_cpu = aggregate_read(store, ref, run_root)
    finally:
        store.close()
    shutil.rmtree(run_root.parent, ignore_errors=True)
    return {"upload_wall_s": upload_wall, "upload_cpu_s": upload_cpu, "agg_wall_s": agg_wall, "agg_cpu_s": agg_cpu,
            "server_cpu_s": upload_cpu + agg_cpu}


def main(argv: list[str] | None = None) -> int:
    args, kinds = parse_args(__doc__, argv)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="upload-bench-"))
    try:
        source = work / "client"
        write_plain_client(source, seed=1, layers=args.layers)
        med_rows, hash_s, read_s, _ = measure_kinds(kinds, source, work, args.repeats, one_kind)
        for kind in kinds:
            med = med_rows[kind]
            print(f"{kind}: upload_wall_s={med['upload_wall_s']:.3f} upload_cpu_s={med['upload_cpu_s']:.3f} "
                  f"agg_wall_s={med['agg_wall_s']:.3f} agg_cpu_s={med['agg_cpu_s']:.3f} "
                  f"passes={med['server_cpu_s'] / hash_s:.2f} agg_vs_read={med['agg_wall_s'] / read_s:.2f} "
                  f"agg_vs_hash={med['agg_wall_s'] / hash_s:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def parse_args(doc: str, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The options this benchmark and node_fetch_path.py share (``--layers``, ``--repeats``,
    ``--kinds``) and the kinds asked for; prints which checkout is measured."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6, help="model depth (6: ~350 MB fp32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {KINDS}")
    args = parser.parse_args(argv)
    print(f"code: {_measured_code()}", flush=True)
    return args, [k for k in args.kinds.split(",") if k]


def measure_kinds(kinds: list[str], source: Path, work: Path, repeats: int,
                  one_kind: Callable[[str, Path, Path, str, int], dict[str, float]],
                  ) -> tuple[dict[str, dict[str, float]], float, float, float]:
    """Run ``one_kind`` for every kind ``repeats`` times, each repeat after a fresh measure of the
    yardsticks (one read, one sha256 pass of ``source``), with moto's server up when s3 is among
    them; print every row, and return each kind's medians, the median hash and read seconds and
    the bytes measured (the same loop for this benchmark and node_fetch_path.py)."""
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    sticks: list[dict[str, float]] = []
    context = s3_endpoint(work) if "s3" in kinds else _no_endpoint()
    with context as endpoint:
        for repeat in range(repeats):
            sticks.append(yardsticks(source))
            print(f"repeat {repeat}: read_s={sticks[-1]['read_s']:.3f} hash_s={sticks[-1]['hash_s']:.3f} "
                  f"({sticks[-1]['bytes'] / 1e6:.0f} MB) load={os.getloadavg()[0]:.2f}", flush=True)
            for kind in kinds:
                row = one_kind(kind, source, work, endpoint, repeat)
                rows[kind].append(row)
                print(f"  {kind}: " + " ".join(f"{k}={v:.3f}" for k, v in row.items()), flush=True)
    hash_s = statistics.median(s["hash_s"] for s in sticks)
    read_s = statistics.median(s["read_s"] for s in sticks)
    print(f"median read_s={read_s:.3f} hash_s={hash_s:.3f} MB={sticks[0]['bytes'] / 1e6:.0f}")
    medians = {kind: {k: statistics.median(r[k] for r in rows[kind]) for k in rows[kind][0]} for kind in kinds}
    return medians, hash_s, read_s, sticks[0]["bytes"]


def _measured_code() -> str:
    """Which checkout's ``fedagent_flwr`` this run measures (its folder and git commit)."""
    import fedagent_flwr

    root = Path(fedagent_flwr.__file__).resolve().parent.parent
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return f"{root} at {done.stdout.strip() or 'unknown commit'}{' (modified)' if dirty else ''}"


@contextmanager
def _no_endpoint() -> Iterator[str]:
    yield ""


if __name__ == "__main__":
    raise SystemExit(main())
