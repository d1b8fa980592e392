"""What code a process started now would run, so a long-lived one started earlier can be checked.

A persistent trainer (:mod:`fedagent_flwr.clientapp.persistent`) and an env service
(:mod:`fedagent_flwr.envs.service.manager`) outlive the ClientApp process that started them, and
run the code they imported at their start. When the app is updated (a resumed run on a SuperNode
that stayed up, or a ``pip install -U`` of torch or verl in the same venv), a process started now
would import other code; each start therefore records :func:`code_identity`, and whoever would
reuse the process compares it with the identity a new one would have (:func:`code_change`). A
reinstall of a library with other files under the same version (a locally built wheel) is other
code too (:func:`record_digest`). What cannot be determined now (an env's interpreter that cannot
say where its packages are) reads :data:`UNKNOWN` and is no reason to replace a running process
(:func:`code_change` says why). Lives outside ``clientapp`` and ``envs`` so both can use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import Distribution
from pathlib import Path
from typing import Any

#: This copy of the package: the one a trainer or service started by this process imports (each
#: puts the folder holding it first on its PYTHONPATH).
PACKAGE_DIR = Path(__file__).resolve().parent

#: The installed distributions whose version shapes what a trainer or an env service does (the
#: trainers' numerics, the federation, the env services and the envs they serve); their versions
#: (key ``dist:<name>``) and installed files (key ``files:<name>``, :func:`record_digest`) are part
#: of the identity, ``absent`` where one is not installed.
DISTRIBUTIONS = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "flwr", "verl", "vllm", "ray",
                 "fastapi", "uvicorn", "httpx", "alfworld", "textworld", "bm25s", "spacy")
ABSENT = "absent"
UNKNOWN = "unknown"  # could not be determined (the interpreter could not say where its packages are)
NO_RECORD = "no RECORD"
#: The key of an identity whose distributions read :data:`UNKNOWN`, saying why; never compared.
UNKNOWN_REASON = "versions_unknown"


def package_digest(package_dir: Path) -> str:
    """A hash of the code in ``package_dir``: the relative path and content of each ``.py`` file
    below it (``__pycache__`` left out), in a fixed order. Contents, not modification times: a
    reinstall of the same code is the same code. A ``.py`` entry that cannot be read (a dangling
    symlink, a file removed while this runs) counts as such, by name: no process can import it,
    and a start must not fail on it. About 3 ms of CPU (165 files, 1.2 MB)."""
    digest = hashlib.sha256()
    for folder, subfolders, files in os.walk(package_dir):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = Path(folder) / name
            try:
                data = path.read_bytes()
            except OSError:
                data = b"\0unreadable"
            digest.update(f"{path.relative_to(package_dir).as_posix()}\0{len(data)}\0".encode())
            digest.update(data)
    return digest.hexdigest()[:16]


#: The variables of a process's environment that decide where its interpreter looks for packages
#: besides ``PYTHONPATH`` (its prefix, its user site); another interpreter is asked anew for each.
_SITE_ENV = ("PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONPLATLIBDIR", "PYTHONPATH", "HOME")
SITE_QUERY_TIMEOUT_S = 60.0  # the answer takes ~20 ms; an interpreter on a busy network filesystem, seconds
_SITE_DIRS: dict[tuple[str, ...], tuple[str, ...]] = {}  # other interpreters' answers, kept for this process


class SiteQueryError(RuntimeError):
    """Another interpreter could not say where its packages are (it crashed, hung or is gone)."""


#: Run by :func:`interpreter_site` in another interpreter (standard library only) and, for this one,
#: by :func:`_site_dirs_in_path_order`: its version, then its site-packages folders (the user site
#: among them when enabled) in ``sys.path`` order, which :mod:`site` builds as user site first, then
#: the others; folders not on ``sys.path`` (not existing) last, in the order ``site`` lists them.
_SITE_QUERY = """
import json, os, site, sys
def site_dirs():
    dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    where = {}
    for index, entry in enumerate(sys.path):
        where.setdefault(os.path.normcase(os.path.abspath(entry)), index)
    return sorted(dirs, key=lambda d: where.get(os.path.normcase(os.path.abspath(d)), len(sys.path)))
if __name__ == "__main__":
    print(json.dumps([sys.version] + site_dirs()))
"""


def _site_dirs_in_path_order() -> list[str]:
    """This interpreter's site-packages folders in the order it searches them (:data:`_SITE_QUERY`)."""
    namespace: dict[str, Any] = {"__name__": "_site_query"}
    exec(_SITE_QUERY, namespace)  # our own constant: one definition for both interpreters
    return list(namespace["site_dirs"]())


def interpreter_site(executable: str, env: Mapping[str, str] | None = None) -> tuple[str, tuple[str, ...]]:
    """The version (``sys.version``) and site-packages folders of the interpreter ``executable``
    started with environment ``env`` (this process's when None): this process's own when it is this
    interpreter; another one, such as an env's own venv, is asked (~20 ms) once per process and
    environment. The interpreter is compared as given, not resolved (two venvs' interpreters may
    link to one binary), so its version tells when the binary behind a path was replaced (a Python
    patch release installed in place under a venv).

    Raises :class:`SiteQueryError` when another interpreter cannot answer. Its packages are then
    not known, which is not the same as none being installed: reading every version as
    :data:`ABSENT` would make a running service look like it ran other code, and the healthy
    service would be stopped for a restart under an interpreter that had just failed to run
    (:func:`code_identity`, :func:`code_change`). A failure is not remembered: the next call asks
    again.

    The folders come in the order the interpreter searches them (:data:`_SITE_QUERY`): a user site
    precedes the system's site-packages (a venv's own folder precedes both), so a library installed
    in both is found where that interpreter imports it from."""
    if executable == sys.executable:
        return sys.version, tuple(_site_dirs_in_path_order())
    env = os.environ if env is None else env
    key = (executable, *(f"{name}={env.get(name)}" for name in _SITE_ENV))
    if key not in _SITE_DIRS:
        try:
            done = subprocess.run([executable, "-c", _SITE_QUERY], capture_output=True, text=True, env=dict(env),
                                  timeout=SITE_QUERY_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise SiteQueryError(f"{executable} did not say where its packages are within "
                                 f"{SITE_QUERY_TIMEOUT_S:g} s") from None
        except OSError as exc:
            raise SiteQueryError(f"{executable} could not be run: {exc}") from None
        if done.returncode != 0:
            said = done.stderr.strip().splitlines()[-1:] or ["no error output"]
            raise SiteQueryError(f"{executable} failed to say where its packages are (exit status "
                                 f"{done.returncode}: {said[0][:300]})")
        try:
            answer = json.loads(done.stdout.strip().splitlines()[-1])
            if not isinstance(answer, list) or not answer or not all(isinstance(d, str) for d in answer):
                raise ValueError("not its version and a list of folders")
        except (ValueError, IndexError) as exc:
            raise SiteQueryError(f"{executable} answered {done.stdout[-300:]!r} when asked where its "
                                 f"packages are ({exc})") from None
        _SITE_DIRS[key] = tuple(answer)
    version, *dirs = _SITE_DIRS[key]
    return version, tuple(dirs)


def with_pth_dirs(dirs: Sequence[str]) -> list[str]:
    """``dirs`` (site-packages folders), each followed by the folders its ``.pth`` files add, as
    :mod:`site` adds them to ``sys.path`` at start-up: a legacy editable install (``easy-install.pth``
    naming a checkout whose ``.egg-info`` holds the version), a venv extended with another's
    packages. Lines starting with ``import`` run code and are skipped; only existing folders count."""
    found: list[str] = []
    for folder in dirs:
        found.append(folder)
        try:
            names = sorted(name for name in os.listdir(folder) if name.endswith(".pth"))
        except OSError:
            continue
        for name in names:
            try:
                lines = (Path(folder) / name).read_text(encoding="utf-8", errors="replace").splitlines()
            except OSError:
                continue
            for line in lines:
                line = line.rstrip()  # as site reads it
                if line and not line.startswith(("#", "import ", "import\t")):
                    path = os.path.join(folder, line)
                    if os.path.isdir(path) and path not in found:
                        found.append(path)
    return found


def record_digest(found: Distribution) -> str:
    """A hash of the files a distribution installed, as its ``RECORD`` lists them (each one's path
    and sha256), so a reinstall with other files under the same version is seen: a locally built
    torch or verl wheel, an editable install of verl from another checkout (its ``.pth`` file or
    finder module names the checkout). Only rows with a hash outside the top-level ``.dist-info``
    folder count, so a reinstall of the same files is the same code whoever installed them
    (``INSTALLER``, ``REQUESTED``, ``direct_url.json``: the wheel's path; unhashed ``.pyc`` rows:
    pip compiles, uv does not), in the order the installer wrote them. ``no RECORD`` for a
    distribution installed without one (conda, ``setup.py develop``): only its version tells.
    Edits inside an editable install's checkout are not seen."""
    try:
        text = found.read_text("RECORD")
    except ValueError:  # not UTF-8
        return "unreadable RECORD"
    if text is None:
        return NO_RECORD
    rows = [row for row in text.splitlines()
            if not row.endswith(",,") and not row.partition("/")[0].endswith(".dist-info")]
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


def installed_versions(search_path: Sequence[str], names: Sequence[str] = DISTRIBUTIONS) -> dict[str, str]:
    """The version (key ``dist:<name>``) and :func:`record_digest` (key ``files:<name>``) of each
    distribution in ``names`` (:data:`ABSENT` if none) that a process importing from
    ``search_path`` finds first (:mod:`importlib.metadata`, which reads each one's metadata anew:
    an in-place upgrade shows at once). About 20 ms of CPU for the 16 :data:`DISTRIBUTIONS`, 14 of
    them installed (the test venv: 2.8 MB of ``RECORD``, 20,000 rows), 14 ms of it the digests."""
    versions = {}
    for name in names:
        found = next(iter(Distribution.discover(name=name, path=list(search_path))), None)
        versions[f"dist:{name}"] = str(found.version) if found is not None else ABSENT
        versions[f"files:{name}"] = record_digest(found) if found is not None else ABSENT
    return versions


def code_identity(env: Mapping[str, str], executable: str = sys.executable) -> dict[str, str]:
    """What a process started now by ``executable`` with environment ``env`` would run: this
    package's code (:func:`package_digest`, computed anew each time: the files on disk are what a
    new process imports), the interpreter and its version (key ``python``), the ``PYTHONPATH``
    (which copy of the package, and of anything else found through it, is imported) and the
    versions and files of the :data:`DISTRIBUTIONS` it would import (:func:`installed_versions`,
    from its ``PYTHONPATH``, its site-packages and the folders their ``.pth`` files add:
    :func:`with_pth_dirs`).

    If ``executable`` cannot say where its site-packages are (:class:`SiteQueryError`), what it
    would import is not known: its version and every ``dist:``/``files:`` entry read
    :data:`UNKNOWN` and :data:`UNKNOWN_REASON` says why (:func:`versions_unknown`). Such an
    identity neither forces a restart nor blocks a start (:func:`code_change`); the caller warns."""
    pythonpath = env.get("PYTHONPATH", "")
    identity = {"package_sha256": package_digest(PACKAGE_DIR), "executable": executable, "pythonpath": pythonpath}
    try:
        version, dirs = interpreter_site(executable, env)
    except SiteQueryError as exc:
        unknown = {f"{kind}:{name}": UNKNOWN for name in DISTRIBUTIONS for kind in ("dist", "files")}
        return {**identity, "python": UNKNOWN, **unknown, UNKNOWN_REASON: str(exc)}
    search = [p for p in pythonpath.split(os.pathsep) if p] + with_pth_dirs(dirs)
    return {**identity, "python": version, **installed_versions(search)}


def versions_unknown(identity: Mapping[str, str]) -> str:
    """Why the installed versions in ``identity`` are :data:`UNKNOWN` ("" when they are known)."""
    why = identity.get(UNKNOWN_REASON)
    return f"the installed library versions are unknown: {why}" if why else ""


def code_change(ran: object, identity: Mapping[str, str], subject: str = "the process") -> str:
    """Why a process that recorded ``ran`` (its :func:`code_identity`, or None for a record written
    before identities were kept) runs other code than ``identity`` ("" if it runs the same).

    An entry of ``identity`` that reads :data:`UNKNOWN` is no change: that interpreter could not
    say what it would import now (it crashed or hung when asked), so there is no evidence that the
    running process is out of date, while stopping it would trade a healthy process for a start
    under an interpreter that just failed to run; the caller keeps the process and warns
    (:func:`versions_unknown`). A first start goes ahead the same way, its record reading
    :data:`UNKNOWN`. The reverse is a change: a process whose own record reads :data:`UNKNOWN` (or
    lacks an entry: an older fedagent_flwr) never said what it imported, so once its interpreter
    answers it is replaced, like one whose code is unknown altogether. A query that failed only by
    chance (a timeout on a busy node) thus costs one more start later; keeping the process instead
    would leave one that was never checked running for the rest of the run. A ``files:`` entry is
    named only when the version stayed the same (a reinstall of other files)."""
    if not isinstance(ran, dict):
        return f"code changed: {subject}'s code is unknown (started by an older fedagent_flwr)"
    words = {"package_sha256": "fedagent_flwr's .py files", "executable": "the Python interpreter",
             "python": "the Python version", "pythonpath": "PYTHONPATH"}
    changed, missing, unknown = [], [], False
    for key, value in identity.items():
        if key == UNKNOWN_REASON or value == UNKNOWN or ran.get(key) == value:
            continue
        if key not in ran:
            missing.append(key)
        elif ran[key] == UNKNOWN:
            unknown = True  # said once, below, not for each of the distributions
        elif key.startswith("files:"):
            version = f"dist:{key.removeprefix('files:')}"
            if ran.get(version) == identity.get(version):
                changed.append(f"the installed {key.removeprefix('files:')}'s files (RECORD digest) "
                               f"{ran[key]!r} -> {value!r}, same version {identity.get(version)!r}")
        else:
            changed.append(f"{words.get(key, _installed(key))} {ran[key]!r} -> {value!r}")
    if unknown:
        changed.append(f"the library versions {subject} imported are unknown (when it started: "
                       f"{ran.get(UNKNOWN_REASON) or 'no reason recorded'})")
    if missing:
        changed.append(f"{subject}'s record lacks {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''} "
                       f"(started by an older fedagent_flwr)")
    return f"code changed: {'; '.join(changed)}" if changed else ""


def _installed(key: str) -> str:
    """How :func:`code_change` names an identity key: ``dist:torch`` as "the installed torch"."""
    return f"the installed {key.removeprefix('dist:')}" if key.startswith("dist:") else key
