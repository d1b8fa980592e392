"""The ALFWorld service's own virtual environment: built on demand, cached, never half-built.

ALFWorld's text engine (``alfworld`` 0.4.2 on ``textworld`` 1.7.0 with a Fast Downward build)
pins versions that the trainer stack must not share, so its env services run under a separate
interpreter. This module builds that interpreter's virtual environment once per machine, in the
per-user cache (:func:`fedagent_flwr.cache.cache_dir`), under a name keyed by the Python version
and the pinned requirements, so every checkout, worktree and run reuses it and a version change
builds a new one beside it.

The build installs an exact, closed list of pins with ``--no-deps``: reproducible, and without
the 130 MB of spaCy that ``jericho`` declares but the text engine never imports. Compiling
``fast-downward-textworld`` (C++) dominates: 3 to 12 minutes on 2 cores; pip's wheel cache makes
later builds take seconds. The venv is assembled in a temporary directory beside its final place,
checked by importing the engine, and renamed into place under a cache-wide lock: concurrent
callers build once, and a crash leaves only a temporary directory, never a half venv under the
final name.

The service code itself is not installed into the venv: the launcher appends the directory that
holds the ``fedagent_flwr`` package to the service's ``sys.path`` (after the venv's own packages),
so the venv serves any checkout.

``FEDAGENT_ALFWORLD_PYTHON`` names an existing interpreter to use instead (a user's own ALFWorld
environment with these packages installed); nothing is built then.

Command line::

    python -m fedagent_flwr.envs.alfworld.service_venv           # build if missing, print its python
    python -m fedagent_flwr.envs.alfworld.service_venv --check   # exit 1 if it is not built
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fedagent_flwr.cache import CacheEntryError, build_once, cache_dir, progress

ALFWORLD_VERSION = "0.4.2"
TEXTWORLD_VERSION = "1.7.0"
PYTHON_ENV_VAR = "FEDAGENT_ALFWORLD_PYTHON"

#: The complete closure the service needs, installed with ``--no-deps`` (see the module docstring).
REQUIREMENTS: tuple[str, ...] = (
    # the engine
    f"alfworld=={ALFWORLD_VERSION}",
    f"textworld=={TEXTWORLD_VERSION}",
    "fast-downward-textworld==20.6.4",
    "jericho==3.3.1",
    "TatSu==5.8.3",
    "numpy==2.4.6",
    "networkx==3.6.1",
    "more-itertools==11.2.1",
    "hashids==1.3.1",
    "mementos==1.3.1",
    "termcolor==3.3.0",
    "prompt_toolkit==3.0.53",
    "wcwidth==0.9.4",
    "tqdm==4.70.1",
    # the service framework (fedagent_flwr.envs.service): the trainer venv's versions
    "fastapi==0.138.2",
    "starlette==1.3.1",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "typing_extensions==4.16.0",
    "typing-inspection==0.4.5",
    "annotated-types==0.8.0",
    "annotated-doc==0.0.7",
    "anyio==4.16.0",
    "idna==3.20",
    "uvicorn==0.49.0",
    "click==8.5.1",
    "h11==0.16.0",
    "filelock==4.3.1",
)

#: What the finished venv must import; a build that cannot is discarded.
_IMPORT_CHECK = (
    "import alfworld, textworld, textworld.gym, fastapi, uvicorn, pydantic, filelock; "
    "from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos; "
    "from alfworld.info import ALFRED_PDDL_PATH; import fast_downward; "
    "import alfworld.info; print(alfworld.info.__version__, textworld.__version__)"
)
_MARKER = "fedagent-service-venv.json"


class ServiceVenvError(RuntimeError):
    """The ALFWorld service environment is missing, or could not be built."""


def venv_name() -> str:
    """Cache entry name: pinned versions, Python version and a digest of the whole pin list."""
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    digest = hashlib.sha256("\n".join((py, *REQUIREMENTS)).encode()).hexdigest()[:12]
    return f"alfworld-{ALFWORLD_VERSION}-textworld-{TEXTWORLD_VERSION}-{py}-{digest}"


def venv_dir() -> Path:
    """Where the venv lives (or will live) in the cache."""
    return cache_dir() / venv_name()


def _python_in(root: Path) -> Path:
    return root / "bin" / "python"


def existing_service_python() -> Path | None:
    """The service interpreter if one is available now (built, or named by the env var), else None."""
    explicit = os.environ.get(PYTHON_ENV_VAR, "").strip()
    if explicit:
        path = Path(explicit).expanduser()
        if not path.exists():
            raise ServiceVenvError(f"${PYTHON_ENV_VAR} names {path}, which does not exist")
        return path
    root = venv_dir()
    if (root / _MARKER).is_file() and _python_in(root).exists():
        return _python_in(root)
    return None


def ensure_service_python() -> Path:
    """The service interpreter, building its venv first if it is missing (minutes, once)."""
    found = existing_service_python()
    if found is not None:
        return found
    try:
        return _python_in(build_once(venv_name(), _build, _MARKER))
    except CacheEntryError as exc:
        raise ServiceVenvError(str(exc)) from None


def build_with_service_python(name: str, complete: str, module: str, args: Callable[[Path], list[str]],
                              error: type[Exception], failure: str) -> Path:
    """Cache entry ``name`` (done when it holds ``complete``), built by ``python -m module *args(work)``
    under the service interpreter (itself built first if missing); on failure ``error`` with
    ``failure`` and the output's tail. The one way the service venv's game sets are generated."""
    from fedagent_flwr.envs.service.launch import module_command

    python = str(ensure_service_python())

    def build(work: Path, _final: Path) -> None:
        proc = subprocess.run(module_command(module, python) + args(work), capture_output=True, text=True)
        if proc.returncode != 0:
            raise error(f"{failure}:\n{(proc.stderr or proc.stdout)[-3000:]}")

    return build_once(name, build, complete)


def _run(cmd: Sequence[str], what: str) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise ServiceVenvError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _base_python() -> str:
    # The interpreter this venv (if any) was made from: the service venv must not nest in ours.
    return getattr(sys, "_base_executable", None) or sys.executable


def _build(work: Path, final: Path) -> None:
    started = time.monotonic()
    progress(f"building the ALFWorld service venv in {final} (compiles Fast Downward: minutes, once)")
    _run([_base_python(), "-m", "venv", "--without-pip", str(work)], "python -m venv")
    _run(
        [sys.executable, "-m", "pip", "--python", str(_python_in(work)), "install", "--no-deps",
         "--disable-pip-version-check", "--no-input", *REQUIREMENTS],
        "pip install of the ALFWorld service requirements",
    )
    _retarget_scripts(work, final)
    _run([str(_python_in(work)), "-c", _IMPORT_CHECK], "import check of the ALFWorld service venv")
    marker = {
        "requirements": list(REQUIREMENTS),
        "python": sys.version.split()[0],
        "built_in_s": round(time.monotonic() - started, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (work / _MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    progress(f"ALFWorld service venv ready after {marker['built_in_s']} s")


def _retarget_scripts(work: Path, final: Path) -> None:
    """Point console scripts' ``#!`` lines at the final location (pip wrote the temporary one)."""
    old, new = f"#!{work}/bin/".encode(), f"#!{final}/bin/".encode()
    for script in (work / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        data = script.read_bytes()
        if data.startswith(old):
            script.write_bytes(new + data[len(old):])


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: build (if missing) and print the service interpreter, or only check for it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether it exists (exit 1 if not)")
    args = parser.parse_args(argv)
    try:
        python = existing_service_python() if args.check else ensure_service_python()
    except ServiceVenvError as exc:
        print(f"ALFWorld service venv: {exc}", file=sys.stderr)
        return 1
    if python is None:
        print(f"ALFWorld service venv: not built (would be {venv_dir()})", file=sys.stderr)
        return 1
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
