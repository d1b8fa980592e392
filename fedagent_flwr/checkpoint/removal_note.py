"""Retention's note of what it is about to remove, as the run record keeps it and the audit reads it.

Retention (:mod:`fedagent_flwr.serverapp.retention`) writes what a round's commit lets go into that
round's summary entry before it removes anything: ``removing``, a list of ``{"round", "kind",
"path", "bytes"}`` (the round the file belongs to; ``client_checkpoints``, ``global_model``,
``global_critic`` or ``server_optimizer_state``; the path relative to the run directory; its size
then). Once the files are gone the note becomes the ``removed`` bytes per kind of the rounds they
belonged to. A crash in between (kill -9, OOM, a power cut) leaves the note, never files gone
without a record; and the note lives in the committing round's entry, so a round that never
committed (a re-run keeps only committed rounds' entries) takes its note with it. A directory goes
by one rename out of its name (then the removal of the renamed tree), so a listed path is whole or
gone, never half. Here, torch-free and apart from both, so that the server and the audit
(:mod:`.verify`) read the note the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["REMOVING", "noted_as_gone"]

#: A round entry's note of the removals its commit lets go, in progress.
REMOVING = "removing"


def noted_as_gone(rounds: list[dict[str, Any]], run_dir: Path) -> dict[int, set[str]]:
    """By round, the kinds that a ``removing`` note of the entries ``rounds`` lists with a path no
    longer under ``run_dir``: removed by the run, whose record did not get to say so (a path still
    there is whole and read as usual)."""
    gone: dict[int, set[str]] = {}
    for entry in rounds:
        for item in entry.get(REMOVING) or []:
            if not os.path.lexists(run_dir / item["path"]):
                gone.setdefault(int(item["round"]), set()).add(str(item["kind"]))
    return gone
