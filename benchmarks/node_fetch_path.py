"""The node's side of one global model, per store kind: what a ClientApp spends from its
``store.fetch(instruction.global_model)`` to the directory it hands the trainer.

    python benchmarks/node_fetch_path.py --layers 6 --repeats 3

Writes one synthetic global model (world size 1, plain fp32 tensors, Llama-like shapes as in
``aggregate_throughput.py``; ~350 MB with the default 6 layers) into a server store's run root in
a temp dir that is removed at the end, shares it through the real server store, and lets a child
process (the node: its CPU is not mixed with the server's) fetch it through the real client store
into an empty node cache, then once more (a later round's cache hit):

* ``shared-fs``: the client store checks the path (no byte is read: the trainer reads the files
  where they are);
* ``http``: the server store serves on loopback (uvicorn, as in the tests); the node downloads
  every file, checks each against the manifest and the folder against the reference's content
  hash, and renames it into ``<work>/cache/<sha256>/``;
* ``s3``: moto's S3 server runs as a subprocess (``testkit/s3_harness.py``; it speaks S3's HTTP
  API to the real s3fs/botocore client, not at AWS's throughput, and its own CPU is in its
  process), and the node reads the model as above, against the manifest the reference pins.

The child reports the fetch's wall time and its own CPU seconds (``fetch_wall_s``,
``fetch_cpu_s``), the cache hit's wall time (``hit_wall_s``), and the bytes of files it hashed
during the fetch and the cache hit (``hashed_mb``, ``hit_hashed_mb``: every file hash of a fetch
goes through ``update_from_file``, which the child counts; ``hashed_passes`` is ``hashed_mb`` over
the model's transferred bytes, exact where the CPU figures are noisy). The page cache is warm (the files
were just written), so the figures show what this benchmark is about: how many times the node
hashes (sha256) the model's bytes before its trainer can start.

Yardsticks measured in the same run, on the same files: ``hash_s`` (one sha256 pass over the
files a store transfers, plain ``hashlib``) and ``read_s`` (one plain read of them), as in
``upload_server_path.py``. ``passes = fetch_cpu_s / hash_s`` is roughly how many sha256 passes'
worth of CPU the node spends per fetch (the transfer and the writes add a fraction of one). The
figures are medians over the repeats. To compare code versions, run this file against each
checkout (``PYTHONPATH=<checkout>``): the yardsticks make the ratios comparable across runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aggregate_throughput import write_plain_client  # noqa: E402 -- the sibling benchmark's model
from upload_server_path import measure_kinds, parse_args  # noqa: E402 -- same yardsticks and loop

from fedagent_flwr.checkpoint import CheckpointRef  # noqa: E402
from fedagent_flwr.checkpoint.store import StorageSettings, open_server_store  # noqa: E402

RUN = "7"  # the run id the instructions name (the clients check it)

# The node: one fetch into an empty cache, then the same reference again (a later round).
_NODE = r"""
import json, os, sys, time
from pathlib import Path
from fedagent_flwr.checkpoint import CheckpointRef, content_hash, manifest
from fedagent_flwr.checkpoint.store import open_client_store
fields, ref = json.loads(sys.argv[1]), CheckpointRef(**json.loads(sys.argv[2]))
work, run = Path(sys.argv[3]), int(sys.argv[4])
hashed = [0]
def counted(real):
    def update_from_file(digest, path):
        hashed[0] += os.path.getsize(path)
        return real(digest, path)
    return update_from_file
# Every file hash of a fetch goes through one of these two (the per-file check, the content hash).
manifest.update_from_file = counted(manifest.update_from_file)
content_hash.update_from_file = counted(content_hash.update_from_file)
client = open_client_store(fields, run, lambda: work)
t0, cpu0 = time.perf_counter(), time.process_time()
model = client.fetch(ref)
wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
fetch_hashed = hashed[0]
t0 = time.perf_counter()
again = open_client_store(fields, run, lambda: work).fetch(ref)
hit = time.perf_counter() - t0
assert again == model and any(model.iterdir())
print("FETCH " + json.dumps({"fetch_wall_s": wall, "fetch_cpu_s": cpu, "hit_wall_s": hit,
                             "hashed_mb": fetch_hashed / 1e6, "hit_hashed_mb": (hashed[0] - fetch_hashed) / 1e6}),
      flush=True)
"""


def one_kind(kind: str, source: Path, work: Path, endpoint: str, repeat: int) -> dict[str, float]:
    """One node's fetch of ``source`` shared through a fresh ``kind`` store, and its cache hit."""
    run_root = work / f"{kind}-{repeat}" / "run"
    global_dir = run_root / "global" / "actor"
    shutil.copytree(source, global_dir)
    if kind == "s3":
        bucket = f"bench-{os.getpid()}-{repeat}"
        from fedagent_flwr.checkpoint.s3_store import open_filesystem

        open_filesystem(endpoint).mkdir(bucket)
        settings = StorageSettings(kind="s3", url=f"s3://{bucket}/fed", endpoint_url=endpoint)
    elif kind == "http":
        settings = StorageSettings(kind="http", host="127.0.0.1", port=0)
    else:
        settings = StorageSettings(kind="shared-fs")
    store = open_server_store(settings, run_root, RUN)
    try:
        ref = store.share(CheckpointRef.for_directory(global_dir, "actor"))
        fields = store.instruction_fields()
        # -P: the working directory must not come before PYTHONPATH's checkout on sys.path.
        done = subprocess.run([sys.executable, "-P", "-c", _NODE, json.dumps(fields), json.dumps(ref.__dict__),
                               str(work / f"node-{kind}-{repeat}"), RUN], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{kind} node fetch failed:\n{done.stdout}\n{done.stderr}")
    finally:
        store.close()
    line = next(line for line in done.stdout.splitlines() if line.startswith("FETCH "))
    shutil.rmtree(run_root.parent, ignore_errors=True)
    shutil.rmtree(work / f"node-{kind}-{repeat}", ignore_errors=True)
    return {k: float(v) for k, v in json.loads(line[6:]).items()}


def main(argv: list[str] | None = None) -> int:
    args, kinds = parse_args(__doc__, argv)
    work = Path(tempfile.mkdtemp(prefix="node-fetch-bench-"))
    try:
        source = work / "model"
        write_plain_client(source, seed=1, layers=args.layers)
        med_rows, hash_s, _, measured_bytes = measure_kinds(kinds, source, work, args.repeats, one_kind)
        for kind in kinds:
            med = med_rows[kind]
            print(f"{kind}: fetch_wall_s={med['fetch_wall_s']:.3f} fetch_cpu_s={med['fetch_cpu_s']:.3f} "
                  f"hit_wall_s={med['hit_wall_s']:.3f} passes={med['fetch_cpu_s'] / hash_s:.2f} "
                  f"wall_vs_hash={med['fetch_wall_s'] / hash_s:.2f} "
                  f"hashed_passes={med['hashed_mb'] * 1e6 / measured_bytes:.2f} "
                  f"hit_hashed_mb={med['hit_hashed_mb']:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
