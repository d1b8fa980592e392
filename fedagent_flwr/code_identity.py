"""What code a process started now would run, so a long-lived one started earlier can be checked.

A persistent trainer (:mod:`fedagent_flwr.clientapp.persistent`) and an env service
(:mod:`fedagent_flwr.envs.service.manager`) outlive the ClientApp process that started them, and
run the code they imported at their start. When the app is updated (a resumed run on a SuperNode
that stayed up, or a ``pip install -U`` of torch or verl in the same venv), a process started now
would import other code; each start therefore records :func:`code_identity`, and whoever would
reuse the process compares it with the identity a new one would have (:func:`code_change`). Lives
outside ``clientapp`` and ``envs`` so both can use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import Distribution
from pathlib import Path

#: This copy of the package: the one a trainer or service started by this process imports (each
#: puts the folder holding it first on its PYTHONPATH).
PACKAGE_DIR = Path(__file__).resolve().parent

#: The installed distributions whose version shapes what a trainer or an env service does (the
#: trainers' numerics, the federation, the env services and the envs they serve); their versions
#: are part of the identity (key ``dist:<name>``), ``absent`` where one is not installed.
DISTRIBUTIONS = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "flwr", "verl", "vllm", "ray",
                 "fastapi", "uvicorn", "httpx", "alfworld", "textworld", "bm25s", "spacy")
ABSENT = "absent"


def package_digest(package_dir: Path) -> str:
    """A hash of the code in ``package_dir``: the relative path and content of each ``.py`` file
    below it (``__pycache__`` left out), in a fixed order. Contents, not modification times: a
    reinstall of the same code is the same code. About 3 ms of CPU (165 files, 1.2 MB)."""
    digest = hashlib.sha256()
    for folder, subfolders, files in os.walk(package_dir):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = Path(folder) / name
            data = path.read_bytes()
            digest.update(f"{path.relative_to(package_dir).as_posix()}\0{len(data)}\0".encode())
            digest.update(data)
    return digest.hexdigest()[:16]


_SITE_DIRS: dict[str, tuple[str, ...]] = {}  # another interpreter's site-packages, asked once per process


def site_dirs(executable: str) -> tuple[str, ...]:
    """The site-packages folders of the interpreter ``executable`` (this process's own when it is
    this interpreter; another one, such as an env's own venv, is asked once per process, ~20 ms).
    Compared as given, not resolved: two venvs' interpreters may link to one binary."""
    if executable == sys.executable:
        user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
        return tuple(site.getsitepackages() + user)
    if executable not in _SITE_DIRS:
        ask = "import json, site; print(json.dumps(site.getsitepackages() + ([site.getusersitepackages()] " \
              "if site.ENABLE_USER_SITE else [])))"
        try:
            done = subprocess.run([executable, "-c", ask], capture_output=True, text=True, timeout=60, check=True)
            _SITE_DIRS[executable] = tuple(str(p) for p in json.loads(done.stdout.strip().splitlines()[-1]))
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return ()  # cannot run now (not remembered): every version reads absent, as nothing would start
    return _SITE_DIRS[executable]


def installed_versions(search_path: Sequence[str], names: Sequence[str] = DISTRIBUTIONS) -> dict[str, str]:
    """The version of each distribution in ``names`` (``absent`` if none) that a process importing
    from ``search_path`` finds first (:mod:`importlib.metadata`, which reads each one's metadata
    anew: an in-place upgrade shows at once). About 4-9 ms of CPU for the 16 :data:`DISTRIBUTIONS`."""
    versions = {}
    for name in names:
        found = next(iter(Distribution.discover(name=name, path=list(search_path))), None)
        versions[f"dist:{name}"] = str(found.version) if found is not None else ABSENT
    return versions


def code_identity(env: Mapping[str, str], executable: str = sys.executable) -> dict[str, str]:
    """What a process started now by ``executable`` with environment ``env`` would run: this
    package's code (:func:`package_digest`, computed anew each time: the files on disk are what a
    new process imports), the interpreter, the ``PYTHONPATH`` (which copy of the package, and of
    anything else found through it, is imported) and the versions of the :data:`DISTRIBUTIONS` it
    would import (:func:`installed_versions`, from its ``PYTHONPATH`` and its site-packages)."""
    pythonpath = env.get("PYTHONPATH", "")
    search = [p for p in pythonpath.split(os.pathsep) if p] + list(site_dirs(executable))
    return {"package_sha256": package_digest(PACKAGE_DIR), "executable": executable, "pythonpath": pythonpath,
            **installed_versions(search)}


def code_change(ran: object, identity: Mapping[str, str], subject: str = "the process") -> str:
    """Why a process that recorded ``ran`` (its :func:`code_identity`, or None for a record written
    before identities were kept) runs other code than ``identity`` ("" if it runs the same)."""
    if not isinstance(ran, dict):
        return f"code changed: {subject}'s code is unknown (started by an older fedagent_flwr)"
    words = {"package_sha256": "fedagent_flwr's .py files", "executable": "the Python interpreter",
             "pythonpath": "PYTHONPATH"}
    changed = [f"{words.get(key, _installed(key))} {ran.get(key)!r} -> {value!r}" for key, value in identity.items()
               if ran.get(key) != value]
    return f"code changed: {'; '.join(changed)}" if changed else ""


def _installed(key: str) -> str:
    """How :func:`code_change` names an identity key: ``dist:torch`` as "the installed torch"."""
    return f"the installed {key.removeprefix('dist:')}" if key.startswith("dist:") else key
