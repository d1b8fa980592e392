"""Driving a strategy's aggregation the way the ServerApp's round loop does, without a Flower grid.

The tests hand real replies to :func:`fedagent_flwr.serverapp.rounds.aggregate_round` /
``evaluate_round`` (the loop's own bookkeeping: the strategy aggregates, the recorder writes the
round) and read the run record it wrote.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flwr.app import Message

from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.rounds import aggregate_round, evaluate_round
from fedagent_flwr.serverapp.strategy import FedAvgFSDP

_RECORDERS: weakref.WeakKeyDictionary[FedAvgFSDP, RunRecorder] = weakref.WeakKeyDictionary()


def connect(strategy: FedAvgFSDP, recorder: RunRecorder, clients: Sequence[int]) -> FedAvgFSDP:
    """What the round loop establishes before a round: node 100 + c serves client c (for each of
    ``clients``), and the run's recorder.

    The mapping goes straight into the node registry, as if those nodes had answered the partition
    query (the registry has no public setter: in a run only :meth:`NodeRegistry.discover` fills it)."""
    node_of_client = {c: 100 + c for c in clients}
    strategy.nodes._node_of_client.update(node_of_client)
    strategy.nodes._asked.update(node_of_client.values())
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


def eval_round(strategy: FedAvgFSDP, server_round: int, replies: Sequence[Message], sent: Sequence[int]) -> None:
    """Aggregate and record evaluation ``replies`` of the clients ``sent`` an instruction."""
    evaluate_round(strategy, _RECORDERS[strategy], server_round, sent, replies)
