"""Retention's note of what it is about to remove, as the run record keeps it and the audit reads it.

Retention (:mod:`fedagent_flwr.serverapp.retention`) writes what a round's commit lets go into that
round's summary entry before it removes anything: ``removing``, a list of ``{"round", "kind",
"path", "bytes"}`` (the round the file belongs to; ``client_checkpoints``, ``global_model``,
``global_critic`` or ``server_optimizer_state``; the path relative to the run directory, in posix
form; its size then). Once the files are gone the note becomes the ``removed`` bytes per kind of the
rounds they belonged to. A crash in between (kill -9, OOM, a power cut) leaves the note, never files
gone without a record; and the note lives in the committing round's entry, so a round that never
committed (a re-run keeps only committed rounds' entries) takes its note with it. A directory goes
by one rename out of its name (then the removal of the renamed tree), so a listed path is whole or
gone, never half. Here, torch-free and apart from both, so that the server and the audit
(:mod:`.verify`) read the note the same way.

The audit reads the note path by path (:func:`noted_as_gone`, :func:`gone_by_note`): a missing
input counts as removed by the run only when the note lists that very path, or a directory holding
it (a client's ``checkpoints/`` holds the trainer's ``global_step_<n>/actor``), and that listed
path is gone. A note is not read per round and kind: one listed path gone (a receipt, say, the
first thing a crash let go) says nothing of the other files of its round and kind, and an input
that no note lists and that is missing (lost, deleted by hand) is not the run's doing.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = ["REMOVING", "gone_by_note", "noted_as_gone", "noted_path"]

#: A round entry's note of the removals its commit lets go, in progress.
REMOVING = "removing"


def noted_as_gone(rounds: list[dict[str, Any]], run_dir: Path) -> frozenset[str]:
    """The paths that a ``removing`` note of the entries ``rounds`` lists and that are no longer
    under ``run_dir``: removed by the run, whose record did not get to say so (a path still there is
    whole and read as usual). Relative to ``run_dir``, posix and normalised, as retention writes
    them; a listed path that would lead out of ``run_dir`` is ignored (retention writes none)."""
    gone: set[str] = set()
    for entry in rounds:
        for item in entry.get(REMOVING) or []:
            path = noted_path(item["path"])
            if path is not None and not os.path.lexists(run_dir / path):
                gone.add(path)
    return frozenset(gone)


def noted_path(path: object) -> str | None:
    """A note's ``path`` normalised (posix, ``..`` folded), or None when it would lead out of the
    run directory (absolute, or up through ``..``) or name the run directory itself: retention
    writes none such, so a note that lists one is damaged (or edited by hand) and that path is
    neither read as removed (:func:`noted_as_gone`) nor removed (retention)."""
    normal = posixpath.normpath(str(path))
    if normal.startswith(("/", "..")) or normal == ".":
        return None
    return normal


def gone_by_note(path: str | os.PathLike[str], run_dir: Path, gone: frozenset[str]) -> bool:
    """Whether ``path`` (an input the audit looks for: absolute, or relative to the working
    directory) is one of the noted paths ``gone`` (:func:`noted_as_gone` of ``run_dir``) or lies
    inside one: removed by the run with it. A path outside ``run_dir`` never is. Compared both as
    written (``..`` folded) and with symlinks resolved, so a run directory reached through a link
    matches either way."""
    if not gone:
        return False
    for inside in _relative(Path(path), run_dir):
        if any(part.as_posix() in gone for part in (inside, *inside.parents) if part.as_posix() != "."):
            return True
    return False


def _relative(path: Path, run_dir: Path) -> list[PurePosixPath]:
    """``path`` relative to ``run_dir``, lexically and resolved (each form that lies inside)."""
    found = []
    for there, root in ((Path(os.path.abspath(path)), Path(os.path.abspath(run_dir))),
                        (path.resolve(), run_dir.resolve())):
        try:
            found.append(PurePosixPath(there.relative_to(root).as_posix()))
        except ValueError:
            continue
    return found
