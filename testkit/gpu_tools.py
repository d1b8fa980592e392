"""The GPU tools of ``tools/gpu`` as modules for tests: that folder is scripts, not a package."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

GPU_TOOLS = Path(__file__).resolve().parents[1] / "tools" / "gpu"


def gpu_tool(name: str) -> ModuleType:
    """``tools/gpu/<name>.py`` loaded by path as a new module object on every call (so a test may patch
    it freely). Only that module is fresh, and it is not put in ``sys.modules``: the sibling tools it
    imports by name (arms.py's ``from arms_pool import ...``, after it puts ``tools/gpu`` on
    ``sys.path``) are imported once, stay cached in ``sys.modules`` and are shared by every later
    load; a module this returns for such a sibling is a separate copy, so patching it does not reach them."""
    spec = importlib.util.spec_from_file_location(name, GPU_TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def collected(out: Path, work: Path) -> Path:
    """``out``'s runs packed by the real ``tools/gpu/collect.sh`` (into ``work/r.tgz``) and unpacked
    under ``work/unpacked``, as a device session returns them: the ``results`` folder."""
    env = {**os.environ, "OUT": str(out), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(GPU_TOOLS / "collect.sh"), str(work / "r.tgz")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    with tarfile.open(work / "r.tgz") as archive:
        archive.extractall(work / "unpacked", filter="data")
    return work / "unpacked" / "results"
