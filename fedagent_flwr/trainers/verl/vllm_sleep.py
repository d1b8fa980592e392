"""vLLM's "Memory usage increased after sleeping." check, tolerated on a GPU that other jobs share.

vLLM 0.24.0's ``Worker.sleep`` (``vllm/v1/worker/gpu_worker.py``) reads the device's free memory
(``torch.cuda.mem_get_info``), puts its allocator to sleep (``allocator.sleep(...)``: the weights
offloaded to the host or discarded, the KV cache freed), reads the free memory again and then
asserts ``freed_bytes >= 0, "Memory usage increased after sleeping."``; only a log line follows.
``mem_get_info`` is device-wide: when another process on the same GPU allocates between the two
reads (another persistent verl session waking its engine or training, as in every batch of several
sessions sharing the H200), the free memory can shrink although this engine's allocator did sleep,
and the assertion fails. The worker's RPC then fails, vLLM's executor does not record that it
sleeps (``Executor.sleep`` sets ``is_sleeping`` only after the RPC returns), and verl fails the
whole session for the round: GPU batch 20 (2026-12-05) lost client 1 of FedProx seed 8 in round 3
with ``Call to sleep method failed: Worker failed with error 'Memory usage increased after
sleeping.'``.

The job's ``sitecustomize`` (:mod:`.engine_hooks`' import hook) therefore wraps ``Worker.sleep`` in
every process that imports ``vllm.v1.worker.gpu_worker`` (vLLM's GPU worker processes) so that
exactly that AssertionError, raised by the assert statement of ``sleep`` itself (i.e. after
``allocator.sleep`` returned), prints one line and lets ``sleep`` return ``None``, as it does when
the check passes; the executor then records the sleep as usual. Any other exception, an
AssertionError with another message, or this one raised deeper (inside the allocator), propagates
unchanged. A module without ``Worker.sleep`` is left alone, with a note.

Always on; ``FEDAGENT_VLLM_SLEEP_CHECK=strict`` in the ClientApp's environment keeps vLLM's own
behaviour (the job's processes inherit it).
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

from fedagent_flwr.trainers.verl.engine_hooks import patch_when_imported

TARGET_MODULE = "vllm.v1.worker.gpu_worker"
#: The message of vLLM 0.24.0's assertion (the only AssertionError tolerated).
MESSAGE = "Memory usage increased after sleeping."
ENV_CHECK = "FEDAGENT_VLLM_SLEEP_CHECK"
STRICT = "strict"
TAG = "[vllm sleep]"
_MARK = "_fedagent_vllm_sleep"  # on the wrapper: the method it wraps


def _raised_by(exc: BaseException, code: Any) -> bool:
    """Whether ``exc`` was raised in a frame running ``code`` itself, not in a function it called."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code is code


def tolerate_shared_gpu_check(module: Any) -> bool:
    """Wrap ``module.Worker.sleep`` so vLLM's device-wide free-memory assertion does not fail it.

    Returns whether the method is (now) wrapped; applying it twice wraps once. A module without
    ``Worker.sleep`` (another vLLM version) is left alone, with a note.
    """
    worker = getattr(module, "Worker", None)
    original: Any = getattr(worker, "sleep", None)
    code = getattr(inspect.unwrap(original), "__code__", None) if callable(original) else None
    if worker is None or code is None:
        print(f"{TAG} note: {getattr(module, '__name__', TARGET_MODULE)} has no Worker.sleep shaped as in "
              "vLLM 0.24.0; its free-memory check after sleeping is left as it is", flush=True)
        return False
    if getattr(original, _MARK, None) is not None:
        return True

    @functools.wraps(original)
    def sleep(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except AssertionError as exc:
            if str(exc) != MESSAGE or not _raised_by(exc, code):
                raise
            print(f"{TAG} pid {os.getpid()}: vLLM's device-wide free-memory check saw GPU memory grow while "
                  f"this engine slept (most likely another process on the GPU allocated); the allocator did sleep; "
                  "continuing", flush=True)
            return None

    setattr(sleep, _MARK, original)
    worker.sleep = sleep
    return True


def install_from_environment() -> bool:
    """Arm the patch (the job's sitecustomize) unless ``FEDAGENT_VLLM_SLEEP_CHECK=strict``."""
    if os.environ.get(ENV_CHECK, "").strip().lower() == STRICT:
        return False
    patch_when_imported(TARGET_MODULE, tolerate_shared_gpu_check)
    return True
