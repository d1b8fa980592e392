"""Where vLLM's source can be read on this machine, for the optional cross-checks of the GPU tools
against it (vLLM cannot be installed on the CPU machines; its source can be at hand all the same)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: Where ``../shared/gpu/stage.sh`` stages the GPU wheel set: the node312 set's folder (docs/gpu.md,
#: §1), then the script's default. An installed vLLM, if any, is read first.
STAGE_ROOTS = (Path("/tmp/gpu-stage-node312"), Path("/tmp/gpu-stage-work"))


def vllm_source_file(relative: str) -> Path | None:
    """The file ``relative`` (e.g. ``"v1/worker/gpu_worker.py"``) of an installed or staged vLLM, or
    None when no copy of vLLM's source is here (the tests that need it then skip)."""
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    folders = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    folders += [root / "site" / "vllm" for root in STAGE_ROOTS]
    for folder in folders:
        if (folder / relative).is_file():
            return folder / relative
    return None
