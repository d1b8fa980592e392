"""Driving a strategy's aggregation the way the ServerApp's round loop does, without a Flower grid.

The tests hand real replies to :func:`fedagent_flwr.serverapp.rounds.aggregate_round` /
``evaluate_round`` (the loop's own bookkeeping: the strategy aggregates, the recorder writes the
round) and read the run record it wrote.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedagent_flwr.clientapp.app import report_partition
from fedagent_flwr.protocol import QUERY_PARTITION
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.rounds import aggregate_round, evaluate_round
from fedagent_flwr.serverapp.strategy import FedAvgFSDP

_RECORDERS: weakref.WeakKeyDictionary[FedAvgFSDP, RunRecorder] = weakref.WeakKeyDictionary()


# Messages read their run id from the task identity Flower sets in a real run; tests that build
# them through this harness must not depend on another test module having set it first.
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


class _Federation:
    """Nodes 100 + c serving client partitions c (of ``num_partitions``) that answer the partition
    query with the ClientApp's own handler; they are sent nothing else."""

    def __init__(self, clients: Iterable[int], num_partitions: int) -> None:
        self.clients, self.num_partitions = list(clients), num_partitions

    def get_node_ids(self) -> list[int]:
        return [100 + c for c in self.clients]

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None) -> list[Message]:
        replies = []
        for message in messages:
            assert message.metadata.message_type == QUERY_PARTITION, message.metadata.message_type
            node = message.metadata.dst_node_id
            context = Context(run_id=1, node_id=node, run_config={}, state=RecordDict(),
                              node_config={"partition-id": node - 100, "num-partitions": self.num_partitions})
            replies.append(report_partition(message, context))
        return replies


def connect(strategy: FedAvgFSDP, recorder: RunRecorder, clients: Iterable[int]) -> FedAvgFSDP:
    """What the round loop establishes before a round: node 100 + c serves client c (for each of
    ``clients``), and the run's recorder.

    The strategy's node registry learns the mapping as in a run, through
    :meth:`~fedagent_flwr.serverapp.nodes.NodeRegistry.discover`: each node answers the partition
    query. Building that query, like any Flower message, needs Flower's task identity, which a real
    run sets and the calling test must have set."""
    clients = list(clients)
    found = strategy.nodes.discover(cast(Grid, _Federation(clients, strategy.nodes.num_clients)), clients)
    assert found == {c: 100 + c for c in clients}, found
    _RECORDERS[strategy] = recorder
    return strategy


def train_round(strategy: FedAvgFSDP, server_round: int, replies: Sequence[Message],
                sent: Sequence[int] | None = None) -> dict[str, Any] | None:
    """Aggregate and record ``replies`` as round ``server_round``; return the round's summary entry.

    ``sent`` (the clients sent an instruction) defaults to the selected clients a node serves.
    """
    if sent is None:
        sent = [c for c in strategy.select_clients(server_round) if strategy.nodes.node_of(c) is not None]
    recorder = _RECORDERS[strategy]
    aggregate_round(strategy, recorder, server_round, sent, replies)
    rounds = json.loads(Path(recorder.summary_path).read_text())["rounds"]
    return rounds[-1] if rounds else None


def recorder_of(strategy: FedAvgFSDP) -> RunRecorder:
    """The run recorder :func:`connect` gave ``strategy`` (for retention, as the round loop runs it)."""
    return _RECORDERS[strategy]


def eval_round(strategy: FedAvgFSDP, server_round: int, replies: Sequence[Message], sent: Sequence[int]) -> None:
    """Aggregate and record evaluation ``replies`` of the clients ``sent`` an instruction."""
    evaluate_round(strategy, _RECORDERS[strategy], server_round, sent, replies)
