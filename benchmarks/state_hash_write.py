"""What recording a server optimiser's state hash costs: hash the state file after writing it
(the earlier code) against hashing its bytes while they are written (``sha256=True``).

    python benchmarks/state_hash_write.py --mb 320 --repeats 3

Writes a synthetic optimiser state (``m/<key>`` and ``v/<key>`` fp32 buffers of Llama-like
shapes, ``--mb`` MB in all) with the real :class:`SafetensorsStreamWriter` into a temp dir (one
file at a time, removed after each pass, the dir removed at the end), per repeat in four ways:

* ``write``: the writer alone, no hash (the yardstick: what writing the file costs);
* ``old``: the writer, then ``file_digest`` of the file, as ``close_state`` did. The file was just
  written, so its pages are in the page cache: the best case for this way. ``old_cold`` evicts
  them first (``posix_fadvise(POSIX_FADV_DONTNEED)`` after the writer's fsync), as for a 7B
  model's ~56 GB Adam state, which does not stay in the page cache;
* ``new``: the writer with ``sha256=True``, then ``digest()`` (no read of the file).

Every pass ends with the file fsynced and renamed (the writer's ``close``), as a round's state;
the order of the ways rotates from one repeat to the next. Every way's digest is checked equal to
the others', and each pass reports how much of the file it read back (``rchar`` of
``/proc/self/io``, page-cache hits included: exact whatever the load, 1.00 for ``old``, 0.00 for
``new``). Wall times are medians over the repeats, and each way's fastest pass is given too (the
one least disturbed by other load on a shared machine). The last lines are the CPU-seconds ratio
``old / new`` (every thread of the process), then the wall-time ratios ``old / new`` and
``old_cold / new`` (how many times faster recording the hash is now) and ``new / write`` (what
hashing while writing adds to the write itself), of the medians and of the fastest passes, each
taken within the same run, so they compare across machines where the absolute times do not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fedagent_flwr.checkpoint.content_hash import file_digest
from fedagent_flwr.checkpoint.safetensors_writer import SafetensorsStreamWriter

HIDDEN, INTERMEDIATE = 2048, 5632  # Llama-like widths, as in aggregate_throughput.py
SEED = 7


def layer_shapes(hidden: int, intermediate: int) -> list[tuple[str, tuple[int, ...]]]:
    """One decoder layer's keys (attention, MLP, norms)."""
    return ([(f"attn.{n}.weight", (hidden, hidden)) for n in ("q", "k", "v", "o")]
            + [(f"mlp.{n}.weight", (intermediate, hidden)) for n in ("gate", "up")]
            + [("mlp.down.weight", (hidden, intermediate)), ("input_norm.weight", (hidden,)),
               ("post_norm.weight", (hidden,))])


def state_entries(megabytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """``m/`` and ``v/`` buffers of as many layers as fit ``megabytes`` (at least one), in the
    order the server optimiser writes them (per key: every buffer)."""
    layer = layer_shapes(HIDDEN, INTERMEDIATE)
    layer_bytes = 2 * 4 * sum(torch.Size(shape).numel() for _, shape in layer)
    layers = max(1, megabytes * 1024 * 1024 // layer_bytes)
    return [(f"{buffer}/layers.{i}.{key}", shape) for i in range(layers) for key, shape in layer
            for buffer in ("m", "v")]


def write_state(path: Path, entries: list[tuple[str, tuple[int, ...]]], values: dict[tuple[int, ...], torch.Tensor],
                sha256: bool) -> SafetensorsStreamWriter:
    """The state file through the real writer (one random tensor per shape, written for every key)."""
    with SafetensorsStreamWriter(path, entries, {"format": "pt"}, sha256=sha256) as writer:
        for key, shape in entries:
            writer.write(key, values[shape])
    return writer


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (it was fsynced: they are clean)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bytes_read() -> int:
    """Bytes this process has read through read() calls so far, page-cache hits included
    (``rchar`` of ``/proc/self/io``; -1 where there is none)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def timed(run: Callable[[], bytes | None]) -> tuple[float, float, int, bytes | None]:
    """Wall seconds, CPU seconds (every thread of this process), bytes read and the result of ``run``."""
    t0, cpu0, read0 = time.perf_counter(), time.process_time(), bytes_read()
    result = run()
    return time.perf_counter() - t0, time.process_time() - cpu0, bytes_read() - read0, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=320, help="size of the state file (MB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = parser.parse_args()
    entries = state_entries(args.mb)
    generator = torch.Generator().manual_seed(SEED)
    values = {shape: torch.randn(shape, generator=generator) for shape in {s for _, s in entries}}
    work = Path(tempfile.mkdtemp(prefix="state-hash-bench-", dir=args.dir))
    path = work / "global.safetensors"

    def write_only() -> None:
        write_state(path, entries, values, sha256=False)

    def old(cold: bool) -> bytes:
        write_state(path, entries, values, sha256=False)
        if cold:
            evict(path)
        return file_digest(path)

    def new() -> bytes:
        return write_state(path, entries, values, sha256=True).digest()

    ways: dict[str, Callable[[], bytes | None]] = {
        "write": write_only, "old": lambda: old(False), "old_cold": lambda: old(True), "new": new}
    times: dict[str, list[float]] = {name: [] for name in ways}
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for repeat in range(args.repeats):
            digests = set()
            order = list(ways)[repeat % len(ways):] + list(ways)[:repeat % len(ways)]  # no way always first
            for name in order:
                seconds, cpu_seconds, read, digest = timed(ways[name])
                size = path.stat().st_size
                path.unlink()
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
                if digest is not None:
                    digests.add(digest)
                print(f"repeat {repeat} {name:8s} {seconds:7.3f} s  {size / seconds / 1e6:7.0f} MB/s"
                      f"  cpu {cpu_seconds:6.3f} s  read back {read / size:4.2f} x the file")
            assert len(digests) == 1, "the ways disagree on the file's sha256"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {name: statistics.median(runs) for name, runs in times.items()}
    median_cpu = {name: statistics.median(runs) for name, runs in cpu.items()}
    print(f"state file: {len(entries)} tensors, {size / 1e6:.0f} MB; medians over {args.repeats} repeats: "
          + ", ".join(f"{name} {median[name]:.3f} s (cpu {median_cpu[name]:.3f} s)" for name in ways))
    best = {name: min(runs) for name, runs in times.items()}
    print("fastest: " + ", ".join(f"{name} {best[name]:.3f} s" for name in ways))
    print(f"cpu_ratio_old_vs_new={median_cpu['old'] / median_cpu['new']:.2f}")
    for label, pick in (("", median), ("fastest_", best)):
        print(f"{label}ratio_old_vs_new={pick['old'] / pick['new']:.2f} "
              f"{label}ratio_old_cold_vs_new={pick['old_cold'] / pick['new']:.2f} "
              f"{label}ratio_new_vs_write={pick['new'] / pick['write']:.2f}")


if __name__ == "__main__":
    main()
