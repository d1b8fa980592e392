"""Run verl 0.9.1's own FSDP engine on CPU, for tests in processes joined by a gloo group.

verl picks its device layer from a platform registry that knows only accelerators (CUDA, ROCm,
NPU), and its engine registry has no CPU entry. :func:`install` (called in a fresh process before
verl builds an engine) registers a ``cpu`` platform and selects it (``VERL_PLATFORM``), and asks the
engine registry for the engine it would build on a GPU (``VERL_ENGINE_DEVICE=cuda``, verl's own
override): ``FSDPEngineWithLMHead``, wrapping the model in FSDP1 exactly as on a GPU.

One check of torch's FSDP1 is lifted as well: ``sync_module_states=True`` (verl always sets it)
refuses CPU tensors, only because NCCL cannot broadcast them; gloo can, and the broadcast itself
runs unchanged. Nothing else of verl or torch is replaced, so what these tests exercise (FSDP
wrapping, the sharded state dict, verl's checkpoint manager, ``FSDPEngine.initialize`` on reload)
is the code a GPU client runs; only the device (and NCCL) is not.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from typing import Any

import torch


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the memory queries verl's logging and cache clean-up call (all zero)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def memory_reserved(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def memory_allocated(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def max_memory_allocated(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def max_memory_reserved(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def mem_get_info(self, *args: Any) -> tuple[int, int]:
        return 0, 0

    def empty_cache(self) -> None:
        return None


def install() -> None:
    """Make verl build its FSDP engine on CPU in this process (idempotent)."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # the engine class a GPU gets: FSDPEngineWithLMHead
    if PlatformRegistry.get("cpu") is None:
        device = _CpuDeviceModule("verl_cpu_device")

        @PlatformRegistry.register(platform="cpu")
        class PlatformCPU(PlatformBase):  # noqa: F841  # registered by the decorator
            device_name = "cpu"
            vendor_name = "cpu"
            device_module = device

            def is_available(self) -> bool:
                return True

            def current_device(self) -> Any:
                return torch.device("cpu")  # FSDP1's device_id: CPU is accepted when named

            def device_count(self) -> int:
                return 1

            def set_device(self, device_index: int) -> None:
                return None

            def synchronize(self, device_index: int | None = None) -> None:
                return None

            def manual_seed(self, seed: int) -> None:
                torch.manual_seed(seed)

            def manual_seed_all(self, seed: int) -> None:
                torch.manual_seed(seed)

            def set_allocator_settings(self, settings: str) -> None:
                return None

            def empty_cache(self) -> None:
                return None

            def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
                return None, None

            def communication_backend_name(self) -> str:
                return "gloo"

            def visible_devices_envvar(self) -> str:
                return "CUDA_VISIBLE_DEVICES"

            @contextlib.contextmanager
            def nvtx_range(self, msg: str) -> Iterator[None]:
                yield

            def profiler_start(self) -> None:
                return None

            def profiler_stop(self) -> None:
                return None

            def ray_resource_name(self) -> str:
                return "CPU"

            def ray_noset_envvars(self) -> list[str]:
                return []

            def is_ipc_supported(self) -> bool:
                return False

            def cudart(self) -> Any:
                return None

    import torch.distributed.fsdp._init_utils as fsdp_init

    fsdp_init._check_module_states_for_sync_module_states = lambda module_states: None
