"""Peak memory and step time of one warm-start training step: full logits vs reply-only logits vs
reply-only logits with gradient checkpointing.

``fedagent warm-start`` on an H100 (2026-12-05) took the whole 80 GB card at batch 8 x 4,608 tokens:
the output head at every position (``[8, 4608, 49152]`` logits, upcast to fp32, log-softmax and their
gradients) and the 30 layers' activations. This benchmark runs the training step the command runs
(:func:`fedagent_flwr.trainers.common.warm_start.train`'s body: the loss of
:mod:`fedagent_flwr.trainers.common.reply_loss`, backward, gradient clipping, AdamW) in three
variants, each in a child process of its own so that each peak is its own:

* ``full``: the logits of every position (:func:`~fedagent_flwr.trainers.common.reply_loss.full_logits_reply_loss`,
  the command's loss before reply-only logits);
* ``reply``: the output head at the reply positions only (the command's default now);
* ``reply+ckpt``: the same with ``--gradient-checkpointing`` (transformers' non-reentrant checkpointing).

The model has SmolLM2-135M-Instruct's architecture (the warm start's base model: Llama, vocab 49,152,
30 layers, hidden 576, tied embeddings) with random weights from ``--seed``: memory and time do not
depend on the weights' values, and building it needs no download. The batch is ``--batch`` rows of
``--width`` tokens, each with ``--reply-tokens`` labelled positions at its end (the WebShop warm start
of 2026-12-05: 212,526 reply tokens in 4,811 windows, ~44 a window).

Peak memory: on the CPU the child's ``ru_maxrss`` (the whole process: Python, torch, model,
AdamW's state, the step), and the step's own share, ``ru_maxrss`` minus the resident size just before
the first step; on CUDA ``torch.cuda.max_memory_allocated`` (the caching allocator's live tensors,
which is what ``--max-gpu-memory-fraction`` caps, not nvidia-smi's reserved memory). Step time: the
median of the steps after the first (which also allocates AdamW's state). Ratios are against
``full`` measured in the same run. Usage::

    python benchmarks/warm_start_memory.py                      # CPU: batch 2 x 2048 tokens, 3 steps
    python benchmarks/warm_start_memory.py --width 4608 --steps 2
    python benchmarks/warm_start_memory.py --device cuda --batch 8 --width 4608   # the GPU run's shape
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("full", "reply", "reply+ckpt")

#: SmolLM2-135M-Instruct's architecture (its config.json), the warm start's base model.
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _rss_bytes() -> int:
    """The process's resident set size now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(variant: str, device_name: str, batch: int, width: int, reply_tokens: int, steps: int,
          seed: int) -> dict[str, Any]:
    """Build the model, run ``steps`` training steps of ``variant``, return its measurements."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from fedagent_flwr.trainers.common.reply_loss import IGNORE, full_logits_reply_loss, reply_loss

    torch.manual_seed(seed)
    device = torch.device(device_name)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device=device, dtype=torch.float32)
    if variant == "reply+ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SMOLLM2_135M["vocab_size"], (batch, width), generator=generator).to(device)
    attention = torch.ones_like(ids)
    labels = torch.full_like(ids, IGNORE)
    labels[:, width - reply_tokens:] = ids[:, width - reply_tokens:]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = _rss_bytes()
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        if variant == "full":
            loss_sum, n = full_logits_reply_loss(model, ids, attention, labels)
        else:
            loss_sum, n = reply_loss(model, ids, attention, labels)
        loss = loss_sum / n
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"variant": variant, "peak_bytes": peak, "before_bytes": before, "step_peak_bytes": peak - before,
            "step_s": statistics.median(times[1:] or times), "first_step_s": times[0], "losses": losses,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048, help="tokens a row")
    parser.add_argument("--reply-tokens", type=int, default=44, help="labelled positions a row")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = (args.device, args.batch, args.width, args.reply_tokens, args.steps, args.seed)
    if args.child:
        print(json.dumps(child(args.child, *shape)))
        return 0
    results = []
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--child", variant, "--device", args.device, "--batch", str(args.batch),
               "--width", str(args.width), "--reply-tokens", str(args.reply_tokens), "--steps", str(args.steps),
               "--seed", str(args.seed)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{variant}: failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")
            results.append({"variant": variant, "failed": done.stderr.strip()[-600:]})
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = next((r for r in results if r["variant"] == "full" and "failed" not in r), None)
    ok = [r for r in results if "failed" not in r]
    if ok:
        print(f"warm-start step, SmolLM2-135M architecture, batch {args.batch} x {args.width} tokens, "
              f"{args.reply_tokens} reply tokens a row, {args.steps} steps, {ok[0]['device']}, "
              f"torch {ok[0]['torch']} ({ok[0]['threads']} threads)")
    what = "max_memory_allocated" if args.device == "cuda" else "ru_maxrss"
    print(f"{'variant':<11} {what + ' GiB':>22} {'step share GiB':>15} {'step s':>8}   ratios vs full "
          "(peak, step share, time)   losses")
    for r in ok:
        ratio = (f"{r['peak_bytes'] / base['peak_bytes']:.2f}  {r['step_peak_bytes'] / base['step_peak_bytes']:.2f}  "
                 f"{r['step_s'] / base['step_s']:.2f}") if base else "-"
        print(f"{r['variant']:<11} {r['peak_bytes'] / 2**30:>22.2f} {r['step_peak_bytes'] / 2**30:>15.2f} "
              f"{r['step_s']:>8.2f}   {ratio:<36} {' '.join(f'{x:.4f}' for x in r['losses'])}")
    if args.json:
        args.json.write_text(json.dumps({"shape": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
