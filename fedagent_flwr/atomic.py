"""Atomic file writes: write to a temporary name in the same directory, fsync, rename.

A reader (or a crash) then sees either the old file or the complete new one, never a half.
Temporary files and directories get the permissions a plain ``open``/``mkdir`` gives (0666/0777
less the umask: 0644/0755 under the usual 022), not ``tempfile``'s private 0600/0700, because
they become a run's results, which the group reads.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed to ``path``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _create_unique(target.parent, f".{target.name}.", target.suffix, directory=False)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def temporary_dir(parent: str | os.PathLike[str], prefix: str) -> Path:
    """A new empty directory ``<parent>/<prefix><random>``, like ``tempfile.mkdtemp`` but with a
    plain ``mkdir``'s permissions (it is renamed into place as a result)."""
    return _create_unique(Path(parent), prefix, "", directory=True)


def _create_unique(parent: Path, prefix: str, suffix: str, directory: bool) -> Path:
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            if directory:
                os.mkdir(path, 0o777)  # the umask applies, as for any mkdir
            else:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free temporary name {prefix}*{suffix} in {parent}")


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a written file to disk, so that a rename after it never exposes missing bytes."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync a directory so that renames inside it survive a crash (best effort).

    Here, not beside the safetensors writer, so that the modules which only move files (the http
    store's client and server) fsync without importing torch."""
    # Some filesystems (and non-POSIX hosts) refuse to open or fsync a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def json_text(payload: Any) -> str:
    """``payload`` as the indented, key-sorted JSON that every JSON file of a run uses."""
    return json.dumps(payload, indent=2, sort_keys=True)


def write_json_atomic(path: str | os.PathLike[str], payload: Any) -> None:
    """Replace ``path`` with ``payload`` as indented, key-sorted JSON, atomically."""
    write_text_atomic(path, json_text(payload))


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync ``root`` and every directory below it, so that the renames done inside them (each
    checked file's ``.part`` to its name) are on disk before ``root`` itself is renamed into place."""
    for directory in (Path(root), *sorted(p for p in Path(root).rglob("*") if p.is_dir())):
        fsync_dir(directory)


def parent_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path``'s directory can neither be found nor made for a write (a path through a regular
    file or a dangling link, a directory one may not write), or None. A command checks this with
    its inputs, before its work, because :func:`atomic_path` and the like make the parent only when
    they write: after the work, which the failure would then cost, as an OSError traceback."""
    for ancestor in Path(path).parents:
        if ancestor.is_symlink() and not ancestor.exists():  # mkdir would fail on the dangling link
            return f"{ancestor} is a broken symbolic link; give a path inside an existing directory"
        if not ancestor.exists():
            continue  # made by the write, as are the ones below it
        if not ancestor.is_dir():
            return f"{ancestor} is a file, not a directory; give a path inside a directory"
        # write to make the temporary file (or the missing parents) in it, search to reach it
        if not os.access(ancestor, os.W_OK | os.X_OK):
            return f"cannot write in {ancestor} (permission denied); give a path inside a directory you may write"
        return None
    return None


def replace_dir(out: str | os.PathLike[str], write: Callable[[Path], None]) -> None:
    """Have ``write`` fill a temporary directory beside ``out``, fsync every file and directory in
    it, then rename it to ``out`` and fsync the parent: an error midway leaves ``out`` as it was, and
    it is never half written. An existing ``out`` is moved aside first (two renames: a directory
    cannot replace a non-empty one) and removed only once the new one is in place; if that last
    rename fails it is moved back, and a crash between the two leaves it under ``.<name>.old-*``
    (a crash before leaves the temporary ``.<name>.tmp-*`` beside it). A link at ``out`` is replaced,
    not followed: resolve it first to write where it points."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = temporary_dir(out.parent, f".{out.name}.tmp-")
    aside: Path | None = None
    try:
        write(staged)
        for path in sorted(staged.rglob("*"), reverse=True):  # files before the directories holding them
            (fsync_dir if path.is_dir() else fsync_file)(path)
        fsync_dir(staged)
        if out.exists():
            aside = temporary_dir(out.parent, f".{out.name}.old-")
            os.replace(out, aside / out.name)
        try:
            os.replace(staged, out)
        except BaseException:
            if aside is not None:  # put the previous one back; if even that fails, leave it aside
                previous, aside = aside, None
                os.replace(previous / out.name, out)
                shutil.rmtree(previous, ignore_errors=True)
            raise
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
