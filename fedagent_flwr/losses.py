"""Which clients a recorded round or evaluation lost, read from a run's summary entries.

One reading for the run's own status (``serverapp.failures``) and for ``tools/gpu/arms_report.py``,
which runs on a GPU node's bare ``python3``: so the standard library only, like ``intervals``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_client_key(key: object) -> bool:
    """Whether a recorded key names a client: not an unknown node's negative key (``refusal_key``)
    nor a key of a user strategy's own."""
    return str(key).isdigit()


def round_losses(entry: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """A recorded round's (``rounds[]`` entry) lost clients, client -> why: those whose update the
    round lacks, and (PPO) those whose actor it averaged but whose critic it refused.

    Only the clients the round selected and recorded a reason for count (failed, no reply, refused,
    no node): a client not selected (``fraction_train`` below 1) was never part of the round, and an
    ``aggregate_train`` of a user's own that names no client checkpoints still has its losses
    recorded by the loop. A round that aggregated nothing has its own reason and gives none here.
    """
    if entry.get("aggregated_actor") is None:
        return {}, {}
    rejected = {str(c): str(r) for c, r in (entry.get("rejected") or {}).items()}
    averaged = {str(c) for c in entry.get("client_actor_ids") or []}
    lost = {str(c): rejected[str(c)] for c in entry.get("clients") or [] if str(c) in rejected}
    return ({c: why for c, why in lost.items() if c not in averaged},
            {c: why for c, why in lost.items() if c in averaged})


def evaluation_losses(point: Mapping[str, Any]) -> dict[str, str]:
    """A validation point's (``val_curve[]`` entry) clients whose slice of the episodes it lacks,
    client -> why; a failed reply from a node no client is on lost no slice."""
    return {str(c): str(why) for c, why in (point.get("failed") or {}).items() if is_client_key(c)}
