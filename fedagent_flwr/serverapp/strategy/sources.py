"""The clients' checkpoints a round averages: opened, and opened for another pass after a culprit is dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fedagent_flwr.checkpoint import CheckpointError, CheckpointReader, CheckpointRef, open_checkpoint
from fedagent_flwr.checkpoint.audit_digests import AuditDigests
from fedagent_flwr.checkpoint.receipts import ReceiptCheck
from fedagent_flwr.protocol import TrainReply

M = TypeVar("M")


def client_opener(run_root: str, receipts: ReceiptCheck | None,
                  start: CheckpointRef | None) -> Callable[[CheckpointRef], CheckpointReader]:
    """How a round opens its clients' checkpoints: inside ``run_root``, the content hash checked while
    reading (verified before the mean is committed), from the http or s3 store's ``receipts`` where they
    hold. A LoRA adapter reads as the round's starting model ``start`` plus its update
    (:mod:`fedagent_flwr.checkpoint.lora_reader`), that model's content hash checked against ``start``
    from digests all the round's adapters share: it is hashed once per round while its files are unchanged."""
    base_digests = AuditDigests()
    return lambda ref: open_checkpoint(ref, run_root, check_hash="while-reading", receipts=receipts, base=start,
                                       base_digests=base_digests)


def reopened(opened: list[tuple[M, TrainReply, CheckpointReader]], run_root: str,
             refuse: Callable[[int, str], None],
             receipts: ReceiptCheck | None = None) -> list[tuple[M, TrainReply, CheckpointReader]]:
    """The same checkpoints, closed and opened afresh: a content hash checked while reading covers
    one pass only, so a retry reads (and hashes) every byte again, except files the store's
    ``receipts`` still vouch for (:mod:`fedagent_flwr.checkpoint.receipts`); a LoRA adapter on the same
    base model as before, its hash checked from the same digests. One that no longer
    opens is passed to ``refuse(client, reason)`` and left out."""
    fresh = []
    for message, reply, reader in opened:
        reader.close()
        try:
            fresh.append((message, reply, open_checkpoint(reader.ref, root=run_root, check_hash="while-reading",
                                                          receipts=receipts, base=reader.base_ref,
                                                          base_digests=reader.base_digests)))
        except CheckpointError as exc:
            refuse(reply.client_id, str(exc))
    return fresh
