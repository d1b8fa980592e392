"""The clients' checkpoints a round averages, opened for another pass after a culprit is dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fedagent_flwr.checkpoint import CheckpointError, CheckpointReader, open_checkpoint
from fedagent_flwr.checkpoint.receipts import ReceiptCheck
from fedagent_flwr.protocol import TrainReply

M = TypeVar("M")


def reopened(opened: list[tuple[M, TrainReply, CheckpointReader]], run_root: str,
             refuse: Callable[[int, str], None],
             receipts: ReceiptCheck | None = None) -> list[tuple[M, TrainReply, CheckpointReader]]:
    """The same checkpoints, closed and opened afresh: a content hash checked while reading covers
    one pass only, so a retry reads (and hashes) every byte again, except files the store's
    ``receipts`` still vouch for (:mod:`fedagent_flwr.checkpoint.receipts`); a LoRA adapter on the same
    base model as before. One that no longer
    opens is passed to ``refuse(client, reason)`` and left out."""
    fresh = []
    for message, reply, reader in opened:
        reader.close()
        try:
            fresh.append((message, reply, open_checkpoint(reader.ref, root=run_root, check_hash="while-reading",
                                                          receipts=receipts, base=reader.base_ref)))
        except CheckpointError as exc:
            refuse(reply.client_id, str(exc))
    return fresh
