"""The clients' checkpoints a round averages: opened, the culprits of a failed pass found (the round's global
model checked first), and opened for another pass after a culprit is dropped."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from fedagent_flwr.checkpoint import CheckpointError, CheckpointReader, CheckpointRef, open_checkpoint
from fedagent_flwr.checkpoint.audit_digests import AuditDigests
from fedagent_flwr.checkpoint.open_ref import content_mismatches, global_role, open_global_model
from fedagent_flwr.checkpoint.receipts import ReceiptCheck
from fedagent_flwr.protocol import TrainReply
from fedagent_flwr.serverapp.failures import RunFailedError
from fedagent_flwr.serverapp.resume import state_file

M = TypeVar("M")


def round_sources(run_root: str, receipts: ReceiptCheck | None, start: CheckpointRef | None
                  ) -> tuple[CheckpointReader | None, Callable[[CheckpointRef], CheckpointReader]]:
    """The round's global model ``start`` opened as the reference its checkpoints are checked and
    measured against (shapes, update statistics, a server optimiser's step), and how the round opens
    its clients' checkpoints.

    The reference's content hash must be ``start``'s; otherwise its files changed on disk since the run
    recorded it, every client trained on it as recorded, and no update of the round can be measured
    against it: RunFailedError naming it, and the run stops (a PPO run's critic alike). A client's
    checkpoint is opened inside ``run_root``, its content hash checked while reading (verified before
    the mean is committed), from the http or s3 store's ``receipts`` where they hold. A LoRA adapter
    reads as ``start`` plus its update (:mod:`fedagent_flwr.checkpoint.lora_reader`), ``start`` checked
    from the digests the reference was: the global model is hashed once per round while its files are
    unchanged."""
    digests = AuditDigests()
    try:
        reference = open_global_model(start, True, digests) if start is not None else None
    except CheckpointError as exc:
        raise RunFailedError(str(exc)) from None

    def open_client(ref: CheckpointRef) -> CheckpointReader:
        return open_checkpoint(ref, run_root, check_hash="while-reading", receipts=receipts, base=start,
                               base_digests=digests)

    return reference, open_client


def global_model_unchanged(reference: CheckpointReader | None, out_dir: Path | None) -> None:
    """RunFailedError, the round's mean in ``out_dir`` (built from it; None: none was) removed with its
    optimiser state (:func:`discard_mean`), if the round's global model ``reference`` (:func:`round_sources`)
    changed while the round read it: its files' stat since
    their hash at opening (:meth:`~CheckpointReader.verify_content`). Checked before the mean is used and
    before the round blames its clients for the aggregation (:func:`aggregation_culprits`). Every file the
    opening hashed is watched, one written moments before too
    (:meth:`~fedagent_flwr.checkpoint.audit_digests.AuditDigests.hashed_stats`)."""
    if reference is None:
        return
    try:
        reference.verify_content()
    except CheckpointError as exc:
        if out_dir is not None:
            discard_mean(out_dir)
        raise RunFailedError(f"{exc}: it is the round's global {global_role(reference.ref)}, so the round's mean is "
                             f"not used and the run stops; restore {reference.directory} from a copy, or start the run "
                             "over") from None


def aggregation_culprits(reference: CheckpointReader | None, readers: Sequence[CheckpointReader],
                         failure: CheckpointError | None, out_dir: Path) -> list[tuple[int, str]]:
    """The sources to refuse, (index into ``readers``, reason), after an aggregation over ``readers`` into
    ``out_dir`` raised ``failure`` (None: it wrote the mean): those ``failure`` names, or those whose content
    no longer checks out (:func:`~fedagent_flwr.checkpoint.open_ref.content_mismatches`; the built-in rules
    check every hash before they rename the mean into place, a custom rule may not), the mean then removed.
    The round's global model ``reference`` is checked first (:func:`global_model_unchanged`): changed while
    the round read it, it failed the round, not the clients (every LoRA adapter reads on it, so each would
    fail), and the run stops."""
    global_model_unchanged(reference, out_dir if failure is None else None)  # a failed rule's out_dir is not ours
    if failure is not None:
        return [(i, str(failure)) for i, reader in enumerate(readers) if str(reader.directory) in str(failure)]
    culprits = [(i, str(exc)) for i, exc in content_mismatches(readers)]
    if culprits:
        discard_mean(out_dir)
    return culprits


def discard_mean(out_dir: Path) -> None:
    """Remove a round's mean written to ``out_dir`` that is not used, and the server optimiser's state
    written just before it (:func:`~fedagent_flwr.serverapp.resume.state_file`; none for a rule without
    one): a state left without its global model would outlive a stopped run until a resume removed it."""
    shutil.rmtree(out_dir, ignore_errors=True)
    state_file(out_dir).unlink(missing_ok=True)


def reopened(opened: list[tuple[M, TrainReply, CheckpointReader]],
             open_client: Callable[[CheckpointRef], CheckpointReader],
             refuse: Callable[[int, str], None]) -> list[tuple[M, TrainReply, CheckpointReader]]:
    """The same checkpoints, closed and opened afresh by the round's ``open_client``
    (:func:`round_sources`): a content hash checked while reading covers one pass only, so a retry
    reads (and hashes) every byte again, except files the store's receipts still vouch for
    (:mod:`fedagent_flwr.checkpoint.receipts`); a LoRA adapter on the same base model as before, its
    hash checked from the same digests. One that no longer opens is passed to ``refuse(client,
    reason)`` and left out."""
    fresh = []
    for message, reply, reader in opened:
        reader.close()
        try:
            fresh.append((message, reply, open_client(reader.ref)))
        except CheckpointError as exc:
            refuse(reply.client_id, str(exc))
    return fresh
