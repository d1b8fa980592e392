"""The warm start's GPU memory cap and its out-of-memory line.

Why a cap: a warm start sharing a GPU with verl sessions grew torch's caching allocator over the whole
card (docs/gpu.md §7) and starved its neighbours; under ``--max-gpu-memory-fraction`` it stops with its
own one-line error instead.
"""

from __future__ import annotations

from typing import Any


def apply_memory_cap(fraction: float | None, device: Any) -> int | None:
    """Cap the caching allocator at ``fraction`` of ``device``'s memory and return the cap in bytes
    (None without a fraction). ValueError when a fraction is given for a device that is not CUDA."""
    import torch

    if fraction is None:
        return None
    if device.type != "cuda":
        raise ValueError(f"--max-gpu-memory-fraction {fraction} needs a CUDA device, not {device}")
    # torch wants the device's index ("cuda", what --device auto/cuda gives, has none: the current one)
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return int(fraction * torch.cuda.get_device_properties(index).total_memory)


def out_of_memory_message(device: Any, cap: int | None, gradient_checkpointing: bool) -> str:
    """The one line for a CUDA out-of-memory error: under which limit, and what to lower."""
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    limit = (f"the cap --max-gpu-memory-fraction ({cap / 2**30:.1f} GiB of the card's {total / 2**30:.1f} GiB)"
             if cap is not None else f"the card's {total / 2**30:.1f} GiB (no cap; other processes' memory counts too)")
    hint = "" if gradient_checkpointing else ", or pass --gradient-checkpointing"
    return (f"out of GPU memory under {limit}; peak allocated by the warm start "
            f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB: lower --batch-size or --max-len{hint}")
