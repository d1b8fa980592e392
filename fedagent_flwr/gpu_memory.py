"""How a GPU-memory shortage reads in the output of torch and vLLM: one declaration for the verl
trainer, which turns a log into its reason (:func:`fedagent_flwr.trainers.verl.runner.known_cause`),
and the server, which takes every wording as one failure reason (:mod:`fedagent_flwr.serverapp.failures`).
Stdlib only: both sides import it."""

from __future__ import annotations

import re

#: torch's GPU out-of-memory; not Ray's ``ray.exceptions.OutOfMemoryError`` (the host's memory).
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
