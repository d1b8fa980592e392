"""Reading a client's train reply: the checks a reply passes before its checkpoint is opened.

A train reply is a client id, a checkpoint reference and a few metrics (:class:`TrainReply`).
A reply far larger than that, one carrying arrays, one claiming another client's id, or one whose
weight is not a positive number of at most the episodes the client was assigned is refused with a
reason that names the problem; the strategy records it and aggregates the other clients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from logging import INFO

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp.strategy.strategy_utils import validate_message_reply_consistency

from fedagent_flwr.checkpoint import CheckpointError
from fedagent_flwr.protocol import SCORE_MEAN, ProtocolError, TrainReply
from fedagent_flwr.serverapp.failures import reply_reason

# A train reply is a client id, a checkpoint reference and a few metrics: well under a KiB.
# Anything far larger is not a reply this strategy asked for (weights smuggled in an array,
# a megabyte "path") and is refused before any of it is used.
MAX_REPLY_BYTES = 64 * 1024


def reply_bytes(content: RecordDict) -> int:
    """Approximate payload size of a reply: array bytes plus the length of every config value."""
    size = sum(len(array.data) for record in content.array_records.values() for array in record.values())
    records: list[ConfigRecord | MetricRecord] = [*content.config_records.values(), *content.metric_records.values()]
    for record in records:
        for key, value in record.items():
            items = value if isinstance(value, list) else [value]
            size += len(key) + sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in items)
    return size


def read_train_reply(reply: Message, client: int, weighted_by_key: str,
                     assigned: int | None) -> tuple[TrainReply | None, str]:
    """``(TrainReply, "")`` for a usable reply from client ``client``'s node, else ``(None, why)``.

    ``weighted_by_key`` names the metric that weighs the reply (Flower's ``weighted_by_key``);
    ``assigned`` is the most it may be (None: no limit beyond being a positive number).
    """
    if client < 0:
        return None, f"reply from unknown node {reply.metadata.src_node_id}"
    size = reply_bytes(reply.content)
    if size > MAX_REPLY_BYTES:
        return None, f"reply of {size} bytes exceeds the limit of {MAX_REPLY_BYTES} (checkpoints travel as references)"
    if any(len(record) for record in reply.content.array_records.values()):
        return None, "reply carries arrays; send a checkpoint reference instead"
    try:
        parsed = TrainReply.from_record(reply.content)
    except CheckpointError as exc:  # a malformed reference: its own message names the field
        return None, str(exc)
    except ProtocolError as exc:
        return None, f"malformed reply: {exc}"
    if parsed.client_id != client:
        return None, f"reply claims client {parsed.client_id} but comes from client {client}'s node"
    if weighted_by_key not in parsed.metrics:
        return None, f"malformed reply: no metric '{weighted_by_key}'"
    raw_weight = parsed.metrics[weighted_by_key]
    if isinstance(raw_weight, bool) or not isinstance(raw_weight, (int, float)):
        # a MetricRecord also carries lists: one client's odd value must not stop the run
        return None, f"malformed reply: metric '{weighted_by_key}' = {raw_weight!r} is not a number"
    weight = float(raw_weight)
    if not math.isfinite(weight) or weight <= 0:
        return None, f"'{weighted_by_key}' = {weight} is not a positive number"
    if assigned is not None and weight > assigned:
        return None, (f"'{weighted_by_key}' = {weight:g} is more than the {assigned} episodes client {client} "
                      "was assigned this round")
    return parsed, ""


def split_replies(replies: Iterable[Message], is_train: bool, validate: bool,
                  weighted_by_key: str) -> tuple[list[Message], list[Message]]:
    """Flower's split into (valid, error) replies, logging each failure as one readable line.

    Flower logs every error reply's whole text, which in simulation is a Ray traceback of tens of
    lines per client; the client's own error line says the same.
    """
    replies = list(replies)
    if not replies:
        return [], []
    valid = [msg for msg in replies if not msg.has_error()]
    errors = [msg for msg in replies if msg.has_error()]
    log(INFO, "%s: Received %s results and %s failures", "aggregate_train" if is_train else "aggregate_evaluate",
        len(valid), len(errors))
    for msg in errors:
        log(INFO, "\t> Node %d failed: %s", msg.metadata.src_node_id, reply_reason(msg))
    if validate and valid:
        validate_message_reply_consistency(
            replies=[msg.content for msg in valid], weighted_by_key=weighted_by_key, check_arrayrecord=is_train,
        )
    return valid, errors


def evaluation_contents(replies: Sequence[Message], weighted_by_key: str) -> list[RecordDict]:
    """The contents of the evaluation ``replies`` (none an error) to average, checked as Flower checks them.

    A client reports ``score-mean`` only when the env scored every one of its episodes (an episode
    cut off before its first turn has no score), so one reply may carry it and another not. The
    score is then left out of every reply: a mean over the scoring clients' share would read low,
    and Flower averages only replies whose metrics have the same keys (it would stop the run).
    """
    contents = [reply.content for reply in replies]
    if not all(SCORE_MEAN in record for c in contents for record in c.metric_records.values()):
        contents = [RecordDict({name: MetricRecord({k: v for k, v in record.items() if k != SCORE_MEAN})
                                if isinstance(record, MetricRecord) else record for name, record in c.items()})
                    for c in contents]
    validate_message_reply_consistency(replies=contents, weighted_by_key=weighted_by_key, check_arrayrecord=False)
    return contents
