"""The persistent reference trainer's weight reload: the previous way against the current one.

    python benchmarks/reference_reload.py --layers 96 --width 2048 --repeats 5

A persistent reference trainer loads each round's global model into the model it already holds
(:meth:`fedagent_flwr.trainers.reference.session.ModelCache._load_weights`). Until stop 58 it read
every file whole with ``safetensors.torch.load_file`` (memory-mapped) and copied the result in with
``load_state_dict``; it now reads each tensor with :class:`.SafetensorsFile` straight into the
model's parameter (``read_into``), so no second copy of the model is held. This times both on one
model: ``--layers`` linear layers of ``width x width`` in fp32 (96 x 2048: 1.6 GB, ~ a 400M
model), saved in fp32 and in bf16 (a cast on the way), the files' pages warm (a node has just
fetched them). The peak RSS growth is measured in the child: its peak
resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` once the model is built) less its
resident set then. (``ru_maxrss`` would not do: a child started by exec keeps its parent's peak,
here the parent's copies of both files.) It counts the memory-mapped file's pages the previous way
touched (file-backed: the kernel can reclaim them, but they are resident while it copies). Each
repeat runs ``previous`` then ``current`` in fresh child processes. The output: per repeat and
way, seconds and peak RSS growth; then per dtype the median seconds and the ratio ``previous /
current`` (above 1: the current way is faster) over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
from safetensors.torch import load_file
from fedagent_flwr.checkpoint.safetensors_file import SafetensorsFile

def status(field):
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) for line in lines if line.startswith(field + ":")) / 1024

way, path, layers, width = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
own = model.state_dict()
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # the peak (VmHWM) starts again from the resident set now
base = status("VmRSS")
began = time.perf_counter()
if way == "previous":
    model.load_state_dict(load_file(path), strict=False)
else:
    with SafetensorsFile(path) as handle, torch.no_grad():
        for key in handle.keys():
            handle.read_into(key, own[key])
seconds = time.perf_counter() - began
print(json.dumps({"seconds": seconds, "rss_growth_mb": status("VmHWM") - base}))
"""

def _write(directory: Path, layers: int, width: int) -> dict[str, Path]:
    """The model's weights in fp32 and in bf16 (seeded: the same bytes every run)."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    weights = {f"{i}.weight": torch.randn(width, width, generator=generator) for i in range(layers)}
    files = {"fp32": directory / "fp32.safetensors", "bf16": directory / "bf16.safetensors"}
    save_file(weights, str(files["fp32"]))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(files["bf16"]))
    return files


def _child(way: str, path: Path, layers: int, width: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, way, str(path), str(layers), str(width)],
                          capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    """Time both ways (module docstring); prints one line per measurement, then the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="reload-bench-") as tmp:
        files = _write(Path(tmp), args.layers, args.width)
        for path in files.values():
            path.read_bytes()  # warm: a node reads the files it has just fetched
        seconds: dict[tuple[str, str], list[float]] = {}
        for repeat in range(args.repeats):
            for dtype, path in files.items():
                for way in ("previous", "current"):
                    got = _child(way, path, args.layers, args.width)
                    seconds.setdefault((dtype, way), []).append(got["seconds"])
                    print(f"repeat {repeat} {dtype} {way}: {got['seconds']:.3f} s, peak RSS "
                          f"+{got['rss_growth_mb']:.0f} MB", flush=True)
    for dtype in files:
        previous, current = (statistics.median(seconds[dtype, way]) for way in ("previous", "current"))
        print(f"{dtype}: previous {previous:.3f} s, current {current:.3f} s (medians of {args.repeats}); "
              f"ratio previous/current {previous / current:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
