"""Reading a client's reply: the checks a reply passes before it is used.

A train reply is a client id, a checkpoint reference and a few metrics (:class:`TrainReply`).
A reply far larger than that, one carrying arrays, one claiming another client's id, or one whose
weight is not a positive number of at most the episodes the client was assigned is refused with a
reason that names the problem; the strategy records it and aggregates the other clients.
An evaluation reply (:class:`EvalReply`) that is not one (a metric missing or of the wrong type,
no episode, a rate outside [0, 1]) or that counts more episodes than the client was assigned in
that evaluation is refused the same way, naming the client and its node, and is one of the
evaluation's failed clients (:func:`usable_evaluations`). A refused reply from a node the registry
does not know is recorded under a key of its own (:func:`refusal_key`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp.strategy.strategy_utils import validate_message_reply_consistency

from fedagent_flwr.checkpoint import CheckpointError
from fedagent_flwr.protocol import (
    CLIENT_VAL_PREFIX,
    NUM_EXAMPLES,
    SCORE_MEAN,
    SUCCESS_RATE,
    TRUNCATED_RATE,
    EvalReply,
    ProtocolError,
    TrainReply,
    single_metrics,
)
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


def refusal_key(client: int, node: int) -> int:
    """The key a refused reply is recorded under: its client, or minus its node's id for a node the
    registry does not know (``client`` -1). Flower's node ids are positive, so such a key is no
    client's and each unknown node has its own: one -1 for all would keep only the last."""
    return client if client >= 0 else -node


def sender(client: int, node: int) -> str:
    """Who sent a reply, for a log line: its client and node, or the node the registry does not know."""
    return f"client {client} (node {node})" if client >= 0 else f"unknown node {node}"


def error_reason(client: int, node: int, reason: str) -> str:
    """The recorded reason of an error reply: ``reason``, prefixed for a node the registry does not
    know (its key, :func:`refusal_key`, is no client's, and the summary lists it as ``client -N``)."""
    return reason if client >= 0 else f"error reply from {sender(client, node)}: {reason}"


def _envelope_problem(reply: Message) -> str:
    """Why ``reply`` is not a reply this strategy asked for (oversized, carrying arrays), or ''."""
    size = reply_bytes(reply.content)
    if size > MAX_REPLY_BYTES:
        return f"reply of {size} bytes exceeds the limit of {MAX_REPLY_BYTES} (checkpoints travel as references)"
    if any(len(record) for record in reply.content.array_records.values()):
        return "reply carries arrays; send a checkpoint reference instead"
    return ""


def read_train_reply(reply: Message, client: int, weighted_by_key: str,
                     assigned: int | None) -> tuple[TrainReply | None, str]:
    """``(TrainReply, "")`` for a usable reply from client ``client``'s node, else ``(None, why)``.

    ``weighted_by_key`` names the metric that weighs the reply (Flower's ``weighted_by_key``);
    ``assigned`` is the most it may be (None: no limit beyond being a positive number).
    """
    if client < 0:
        return None, f"reply from unknown node {reply.metadata.src_node_id}"
    problem = _envelope_problem(reply)
    if problem:
        return None, problem
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
    # Shares of episodes, its own and its per-client validation's: 1.5 would be recorded as 150%.
    for key in (SUCCESS_RATE, TRUNCATED_RATE, CLIENT_VAL_PREFIX + SUCCESS_RATE, CLIENT_VAL_PREFIX + TRUNCATED_RATE):
        if problem := share_problem(key, parsed.metrics.get(key)):
            return None, f"malformed reply: metric {problem}"
    return parsed, ""


def share_problem(key: str, rate: object) -> str:
    """Why metric ``key`` = ``rate`` is no share of episodes (not a number in [0, 1]; NaN is not),
    or "" when it is one or is absent (None)."""
    if rate is None or (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0.0 <= rate <= 1.0):
        return ""
    return f"'{key}' = {rate!r} is not between 0 and 1"


def eval_reply_problem(reply: Message, weighted_by_key: str, assigned: int | None = None) -> str:
    """Why the evaluation reply ``reply`` (not an error) cannot be averaged, or '' when it can: an
    :class:`EvalReply` of at least one episode, its success rate in [0, 1], its means finite, and
    ``weighted_by_key`` (Flower's, ``num-examples`` unless set) a positive number. ``assigned`` is the
    most episodes its ``num-examples`` (and weight) may count (None: no limit): a client reporting
    more would outweigh the others in the episode-weighted mean."""
    problem = _envelope_problem(reply)
    if problem:
        return problem
    try:
        parsed = EvalReply.from_record(reply.content)
        weight = single_metrics(reply.content).get(weighted_by_key)
    except ProtocolError as exc:
        return str(exc)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        return f"'{weighted_by_key}' = {weight!r} is not a positive number of episodes"
    if parsed.num_examples < 1:
        return f"'{NUM_EXAMPLES}' = {parsed.num_examples} is not a positive number of episodes"
    for key, value in ((NUM_EXAMPLES, parsed.num_examples), (weighted_by_key, weight)):
        if assigned is not None and value > assigned:
            return f"'{key}' = {value:g} is more than the {assigned} episode(s) it was assigned in this evaluation"
    for key, rate in ((SUCCESS_RATE, parsed.success_rate), (TRUNCATED_RATE, parsed.truncated_rate)):
        if problem := share_problem(key, rate):
            return problem
    not_finite = [key for key, value in parsed.metrics().items() if not math.isfinite(value)]
    return f"{', '.join(repr(key) for key in not_finite)} not finite" if not_finite else ""


def usable_evaluations(server_round: int, replies: Sequence[Message], client_of: Callable[[int], int],
                       weighted_by_key: str, assigned: Callable[[int], int | None] = lambda client: None,
                       ) -> tuple[list[Message], dict[int, str]]:
    """The evaluation ``replies`` (none an error) that can be averaged, and the refused clients with
    why. A refused reply is logged naming its client and node; ``client_of`` maps a node to its client,
    ``assigned`` a client to the most episodes it may report (:func:`eval_reply_problem`)."""
    usable: list[Message] = []
    refused: dict[int, str] = {}
    for reply in replies:
        node = reply.metadata.src_node_id
        client = client_of(node)
        problem = eval_reply_problem(reply, weighted_by_key, assigned(client))
        if not problem:
            usable.append(reply)
            continue
        who = sender(client, node)
        key = refusal_key(client, node)
        refused[key] = f"malformed evaluation reply from {who}: {problem}"
        log(WARNING, "round %d: evaluation reply refused: %s", server_round, refused[key])
    return usable, refused


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
    ``truncated-rate`` is left out the same way when an older client's reply lacks it.
    """
    contents = [reply.content for reply in replies]
    partial = {key for key in (SCORE_MEAN, TRUNCATED_RATE)
               if not all(key in record for c in contents for record in c.metric_records.values())}
    if partial:
        contents = [RecordDict({name: MetricRecord({k: v for k, v in record.items() if k not in partial})
                                if isinstance(record, MetricRecord) else record for name, record in c.items()})
                    for c in contents]
    validate_message_reply_consistency(replies=contents, weighted_by_key=weighted_by_key, check_arrayrecord=False)
    return contents


def truncated_shares(replies: Sequence[Message], client_of: Callable[[int], int]) -> dict[int, tuple[float, int]]:
    """Each evaluating client's ``(truncated-rate, num-examples)`` from its usable ``replies``: the
    share of its validation episodes that ran out of the context budget; clients whose reply does
    not report it (an older client) are left out, so the shares may cover fewer episodes than the
    evaluation (the recorder's point then says how many, ``truncated_n``)."""
    shares: dict[int, tuple[float, int]] = {}
    for reply in replies:
        try:
            parsed = EvalReply.from_record(reply.content)
        except ProtocolError:
            continue
        if parsed.truncated_rate is not None:
            shares[client_of(reply.metadata.src_node_id)] = (float(parsed.truncated_rate), parsed.num_examples)
    return shares
