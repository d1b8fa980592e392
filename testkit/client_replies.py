"""Replies as a client's node sends them to the ServerApp, for tests that hand them to a strategy
without a Flower grid: client ``c`` is served by node ``100 + c`` (as
:func:`testkit.round_harness.connect` assigns), and each reply answers an instruction sent to it.

Building a :class:`~flwr.app.Message` needs Flower's task identity, which real runs set; the
tests' ``conftest.py`` sets it (an autouse fixture).
"""

from __future__ import annotations

from flwr.app import Error, Message, MetricRecord, RecordDict

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.protocol import TrainReply


def _instruction(client: int, message_type: str) -> Message:
    """The instruction client ``client``'s node (node 100 + client) answers."""
    return Message(RecordDict(), dst_node_id=100 + client, message_type=message_type)


def train_reply(client: int, ref: CheckpointRef, episodes: float, metrics: dict | None = None) -> Message:
    """A train reply of client ``client``'s node: checkpoint ``ref`` trained on ``episodes`` episodes,
    with ``metrics`` (default: the episode count, a reward mean of 0.5 and a success rate of 0.25)."""
    instruction = _instruction(client, "train")
    values = {"num-examples": episodes, "reward-mean": 0.5, "success-rate": 0.25} if metrics is None else metrics
    return Message(TrainReply(client_id=client, actor=ref, metrics=values).to_record(), reply_to=instruction)


def failed_train_reply(client: int) -> Message:
    """A train reply of client ``client``'s node that is an error: its trainer exited with code 1."""
    instruction = _instruction(client, "train")
    return Message(Error(code=0, reason="trainer exited with code 1"), reply_to=instruction)


def eval_reply(client: int, metrics: dict) -> Message:
    """An evaluation reply of client ``client``'s node carrying ``metrics``."""
    instruction = _instruction(client, "evaluate")
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=instruction)


def failed_eval_reply(client: int, reason: str) -> Message:
    """An evaluation reply of client ``client``'s node that is an error with ``reason``."""
    instruction = _instruction(client, "evaluate")
    return Message(Error(code=0, reason=reason), reply_to=instruction)
