"""The audit's rule for a hash the run did not record (``--allow-unhashed``).

A hash that was never recorded (an empty or missing entry: a source's ``sha256``, a round's
committed content hash, the previous global model's, the run's ``base_model_sha256``, an optimiser
state's) cannot be compared, and skipping it silently would pass a file that changed.
:func:`unhashed` fails the round with one line naming what is missing unless the audit was run with
``--allow-unhashed`` (a run recorded before fedagent-flwr recorded that hash), which turns it into a
note on the round's line.
"""

from __future__ import annotations

from fedagent_flwr.checkpoint.ref import CheckpointError

__all__ = ["UNHASHED", "unhashed"]

#: The advice every such failure ends with.
UNHASHED = "pass --allow-unhashed if the run predates content hashes"


def unhashed(what: str, allow_unhashed: bool, notes: list[str]) -> None:
    """CheckpointError ``"<what>, so it cannot be checked; pass --allow-unhashed ..."`` unless
    ``allow_unhashed``, which appends ``"<what>: not checked"`` to ``notes`` instead."""
    if not allow_unhashed:
        raise CheckpointError(f"{what}, so it cannot be checked; {UNHASHED}")
    notes.append(f"{what}: not checked")
