"""Real installs for the code-identity tests: distribution metadata as pip writes it, wheels as a
local build makes them, installed by pip itself, and shell scripts standing in for an interpreter
(one that cannot answer, for the failure paths)."""

from __future__ import annotations

import base64
import hashlib
import stat
import subprocess
import sys
import zipfile
from pathlib import Path


def install(site_dir: Path, name: str, version: str) -> None:
    """Install (metadata only) ``name`` ``version`` in ``site_dir`` as pip does, replacing another version."""
    for old in site_dir.glob(f"{name}-*.dist-info"):
        for file in old.iterdir():
            file.unlink()
        old.rmdir()
    info = site_dir / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def build_wheel(folder: Path, name: str, version: str, code: str) -> Path:
    """A wheel of ``name`` ``version`` whose one module holds ``code``, as a local build makes it."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": code,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    rows = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
            f"{len(text.encode())}" for path, text in files.items()]
    files[f"{info}/RECORD"] = "\n".join([*rows, f"{info}/RECORD,,"]) + "\n"
    folder.mkdir(parents=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def pip_install(wheel: Path, target: Path) -> None:
    """``pip install`` ``wheel`` into the folder ``target``, replacing what is there (pip, for real)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
                    "--no-input", "--quiet", "--upgrade", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)


def make_interpreter(path: Path, script: str) -> Path:
    """An executable shell script at ``path`` (the interpreter a launch names)."""
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


#: An interpreter that cannot even start, as one with a broken site module fails.
BROKEN = "echo 'Fatal Python error: init_import_site: Failed to import the site module' >&2; exit 1"
