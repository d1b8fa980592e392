"""Device and compute-dtype choices shared by the reference trainer and the evaluator.

"auto" device: the first CUDA GPU when there is one (the verl backend evaluates this way on GPU
nodes), else the CPU. "auto" compute dtype: bf16 on a GPU and on CPUs that compute bf16 natively
(there it is about 2x faster than fp32; emulated bf16 is slower), else fp32.
"""

from __future__ import annotations

from typing import Any


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 / AMX); emulated bf16 is slower than fp32."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # private probe; absent means "do not assume"
        return False


def torch_device(name: str) -> Any:
    """The ``torch.device`` for a device choice (one of :data:`~fedagent_flwr.schema.trainer.DEVICES`)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def torch_compute_dtype(name: str, device: Any = None) -> Any:
    """``torch.float32`` or ``torch.bfloat16`` for a dtype choice (one of
    :data:`~fedagent_flwr.schema.trainer.COMPUTE_DTYPES`) on ``device`` (None: the CPU)."""
    import torch

    if name == "auto":
        on_gpu = device is not None and torch.device(device).type == "cuda"
        return torch.bfloat16 if on_gpu or native_bf16() else torch.float32
    return torch.bfloat16 if name == "bfloat16" else torch.float32
