"""How a memory shortage reads in the output of torch, vLLM and Ray: one declaration for the verl
trainer, which turns a log into its reason (:func:`fedagent_flwr.trainers.verl.runner.known_cause`),
and the server, which takes every wording as one failure reason (:mod:`fedagent_flwr.serverapp.failures`).
The GPU's memory and the machine's (host) memory are told apart: they have different fixes.
Stdlib only: both sides import it."""

from __future__ import annotations

import re

#: Ray's memory monitor killing workers because the machine's memory (RAM) passed its threshold. Its
#: error is also called ``OutOfMemoryError``, with or without the ``ray.exceptions.`` prefix, so
#: :data:`TORCH_OOM` alone would take it for the GPU's: check this first (:func:`is_host_memory_shortage`).
#: When a text holds both (a CUDA error in a log that also shows a kill), the host's memory is taken.
HOST_OOM = re.compile(r"killed due to the node running low on memory|Memory on the node \(|"
                      r"ray\.exceptions\.OutOfMemoryError|killed due to memory pressure \(OOM\)|"
                      r"NODE_OUT_OF_MEMORY")
#: torch's GPU out-of-memory (its ``torch.OutOfMemoryError``); a text that :data:`HOST_OOM` matches is not.
TORCH_OOM = re.compile(r"CUDA out of memory|(?<!exceptions\.)OutOfMemoryError")
#: vLLM could not size its KV cache: another process on the GPU changed its memory use meanwhile.
VLLM_KV_CACHE = re.compile(r"Error in memory profiling|No available memory for the cache blocks")
#: vLLM refusing to start: the GPU has less free memory than ``trainer.gpu_memory_utilization``
#: asks for. Its engine then fails with "Engine core initialization failed. See root cause above.",
#: and only the log above holds this line.
VLLM_STARTUP = re.compile(r"Free memory on device .{0,80}? is less than desired GPU memory utilization "
                          r"\([^)]*\)")
#: The verl trainer's own wording of all three (``known_cause``).
RAN_OUT = "ran out of GPU memory"
#: The verl trainer's wording of :data:`HOST_OOM`.
HOST_RAN_OUT = "the machine ran low on memory (RAM, not the GPU's)"


def is_host_memory_shortage(text: str) -> bool:
    """Whether ``text`` says Ray killed workers because the machine's memory ran low."""
    return HOST_OOM.search(text) is not None or HOST_RAN_OUT in text
