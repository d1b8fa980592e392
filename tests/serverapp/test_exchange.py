"""How the ServerApp collects its SuperNodes' replies on Flower's deployment grid.

Flower's ``HttpGrid.send_and_receive`` sleeps 3 s between two pulls, so every exchange of a
deployment run (partition query, each round's training and evaluation, shutdown) went on up to 3 s
after its last reply had arrived. The round loop and the node registry pull every
``exchange.REPLY_POLL_S`` instead. These tests drive them on a real ``HttpGrid`` whose two transport
calls (push, pull) answer as a SuperLink would; tests/e2e/test_deployment.py runs them against a real
SuperLink.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from types import SimpleNamespace

import pytest
from flwr.app import Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.grid.http_grid import HttpGrid

from fedagent_flwr.protocol import PartitionReply, ShutdownInstruction, ShutdownReply
from fedagent_flwr.serverapp import exchange, nodes, rounds
from fedagent_flwr.serverapp.nodes import NodeRegistry


class ScriptedSuperLink:
    """The SuperLink side of an ``HttpGrid``: it keeps the pushed messages, and each node replies
    (with ``answer(message)``) once the grid has pulled ``silent_pulls`` times without a reply."""

    def __init__(self, grid: HttpGrid, silent_pulls: dict[int, int], answer=None) -> None:  # type: ignore[no-untyped-def]
        self.silent_pulls = dict(silent_pulls)
        self.answer = answer or (lambda message: Message(RecordDict(), reply_to=message))
        self.pushed: dict[str, Message] = {}
        self.pulls: list[set[str]] = []
        # The grid's own push_messages runs (it names and checks each message); only its network
        # calls are answered here.
        grid._run = SimpleNamespace(run_id=1)  # type: ignore[assignment]
        grid._try_push_messages = self.push  # type: ignore[method-assign]
        grid.pull_messages = self.pull  # type: ignore[method-assign]

    def push(self, run_id: int, messages: Iterable[Message]) -> list[str]:
        batch = list(messages)
        self.pushed.update((message.metadata.message_id, message) for message in batch)
        return [message.metadata.message_id for message in batch]

    def pull(self, message_ids: Iterable[str]) -> list[Message]:
        wanted = set(message_ids)
        self.pulls.append(wanted)
        replies = []
        for message_id in sorted(wanted):
            node = self.pushed[message_id].metadata.dst_node_id
            if self.silent_pulls[node] > 0:
                self.silent_pulls[node] -= 1
            else:
                replies.append(self.answer(self.pushed[message_id]))
        return replies


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every ``time.sleep`` requested (Flower's grid and ours alike), answered at once."""
    asked: list[float] = []
    real_sleep, test_thread = time.sleep, threading.get_ident()

    def sleep(seconds: float) -> None:  # another thread's sleep (a reminder, a logger) is left alone
        if threading.get_ident() == test_thread:
            asked.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # set by Flower in real runs
    return asked


def test_a_round_pulls_its_replies_every_reply_poll_interval_until_all_came(sleeps: list[float]) -> None:
    grid = HttpGrid(token="test")
    link = ScriptedSuperLink(grid, silent_pulls={100: 1, 102: 2})
    strategy = SimpleNamespace(nodes=SimpleNamespace(client_of=lambda node: node - 100))
    loop = rounds.RoundLoop(strategy, grid, recorder=None, timeout=600)  # type: ignore[arg-type]
    messages = [Message(RecordDict(), dst_node_id=node, message_type="train") for node in (100, 102)]
    replies = loop._send(messages, 1, "training")
    assert sorted(reply.metadata.reply_to_message_id for reply in replies) == sorted(link.pushed)
    # Three pulls: none answered, then node 100, then node 102 (asked for alone), with a short pause
    # between two pulls (Flower's HttpGrid pauses 3 s).
    assert [len(pulled) for pulled in link.pulls] == [2, 2, 1]
    assert sleeps == [exchange.REPLY_POLL_S] * 2


def test_the_shutdown_query_is_collected_the_same_way(sleeps: list[float]) -> None:
    grid = HttpGrid(token="test")
    link = ScriptedSuperLink(grid, silent_pulls={100: 1, 101: 0},
                             answer=lambda message: Message(ShutdownReply(1, 1).to_record(), reply_to=message))
    registry = NodeRegistry(num_clients=2)
    registry._node_of_client = {0: 100, 1: 101}
    registry.shutdown(grid, ShutdownInstruction(store={"store-kind": "shared-fs", "run-root": "/nowhere"}))
    assert [len(pulled) for pulled in link.pulls] == [2, 1]
    assert sleeps == [exchange.REPLY_POLL_S]


def test_a_timeout_of_zero_pulls_nothing_as_flowers_grid_does(sleeps: list[float]) -> None:
    grid = HttpGrid(token="test")
    link = ScriptedSuperLink(grid, silent_pulls={100: 0})
    message = Message(RecordDict(), dst_node_id=100, message_type="train")
    assert exchange.send_and_receive(grid, [message], timeout=0) == []
    assert list(link.pushed) == [message.metadata.message_id] and link.pulls == [] and sleeps == []


def test_a_node_that_failed_to_answer_or_left_and_came_back_is_asked_again(
        sleeps: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    """A SuperNode whose partition query failed (a bad node config) is asked again at the next
    discovery: restarted with a good config under the same node id (node authentication keeps the
    id), it serves its client from that round on. A node that left and came back is asked again; one
    that answered is not."""
    grid = HttpGrid(token="test")
    online, broken, partition = {100, 101}, {101}, {100: 0, 101: 1}
    monkeypatch.setattr(grid, "get_node_ids", lambda: set(online))
    monkeypatch.setattr(nodes, "RETRY_INTERVAL_S", 0.0)  # each discovery may ask again (a round apart in a run)

    def answer(message: Message) -> Message:
        node = message.metadata.dst_node_id
        if node in broken:
            return Message(Error(code=0, reason="config key 'cache-keep' must be a whole number"), reply_to=message)
        return Message(PartitionReply(partition[node], 2).to_record(), reply_to=message)

    link = ScriptedSuperLink(grid, silent_pulls={100: 0, 101: 0}, answer=answer)
    registry = NodeRegistry(num_clients=2)
    assert registry.online(grid) == {0: 100}
    broken.clear()  # restarted with a good config, under the same node id
    assert registry.online(grid) == {0: 100, 1: 101}
    asked = len(link.pushed)
    assert registry.online(grid) == {0: 100, 1: 101} and len(link.pushed) == asked  # both answered: no query
    online.discard(100)
    assert registry.online(grid) == {1: 101}
    online.add(100)  # back under the same id
    assert registry.online(grid) == {0: 100, 1: 101} and len(link.pushed) == asked + 1


def test_a_second_node_of_one_partition_serves_it_once_the_first_left(
        sleeps: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two SuperNodes started for partition 0 (a stand-by, or a restart under a new node id before
    the old one timed out): the first to answer serves it; once it leaves, the other is asked again at
    once and takes over (before: it had answered, so it was never asked again, and partition 0 went
    untrained for the rest of the run). A stand-by restarted meanwhile with another partition, under
    the same node id, is not given partition 0 on the strength of its old answer."""
    grid = HttpGrid(token="test")
    online: set[int] = set()  # the SuperLink's nodes, and the partition each node reports
    partition: dict[int, int] = {}
    monkeypatch.setattr(grid, "get_node_ids", lambda: set(online))

    def answer(message: Message) -> Message:
        return Message(PartitionReply(partition[message.metadata.dst_node_id], 2).to_record(), reply_to=message)

    link = ScriptedSuperLink(grid, silent_pulls={100: 0, 101: 0, 102: 0}, answer=answer)
    for restarted_as in (0, 1):
        online.clear(), online.update({100, 101, 102})
        partition.clear(), partition.update({100: 0, 101: 1, 102: 0})
        registry = NodeRegistry(num_clients=2)
        first = registry.online(grid)
        assert first[1] == 101 and first[0] in (100, 102)  # whichever answered first
        other = ({100, 102} - {first[0]}).pop()
        asked = len(link.pushed)
        assert registry.online(grid) == first and len(link.pushed) == asked  # all answered: no query
        partition[other] = restarted_as
        online.discard(first[0])
        expected = {0: other, 1: 101} if restarted_as == 0 else {1: 101}
        assert registry.online(grid) == expected and len(link.pushed) == asked + 1
        assert registry.client_of(other) == (0 if restarted_as == 0 else -1)


def test_a_node_of_a_partition_outside_the_run_gets_no_work_until_it_serves_one_of_the_runs(
        sleeps: list[float], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A SuperNode started with ``partition-id=2`` for a run of ``clients.total=2`` (partitions 0-1) is
    no client of the run: before, it was mapped as client 2, counted toward ``min_available_nodes``
    and handed evaluation seeds though no round ever selects it. It is left out with a warning naming
    it and the config key, and asked again as a node that failed to answer is: restarted under the
    same node id with partition 1, as the warning advises, it serves partition 1."""
    grid = HttpGrid(token="test")
    partition = {100: 0, 101: 2}
    monkeypatch.setattr(grid, "get_node_ids", lambda: set(partition))
    monkeypatch.setattr(nodes, "RETRY_INTERVAL_S", 0.0)  # each discovery may ask again (a round apart in a run)

    def answer(message: Message) -> Message:
        return Message(PartitionReply(partition[message.metadata.dst_node_id], 3).to_record(), reply_to=message)

    link = ScriptedSuperLink(grid, silent_pulls={100: 0, 101: 0}, answer=answer)
    registry = NodeRegistry(num_clients=2)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert registry.online(grid) == {0: 100}
    assert registry.client_of(101) == -1
    outside = [r.getMessage() for r in caplog.records if "outside this run's clients" in r.getMessage()]
    assert outside == ["Node(s) [101] serve partition(s) [2], outside this run's clients 0-1 (config key "
                       "'clients.total' = 2); they get no work: restart them with a partition-id below 2, "
                       "or raise clients.total"]
    asked = len(link.pushed)
    partition[101] = 1  # restarted with a partition of the run, under the same node id
    assert registry.online(grid) == {0: 100, 1: 101} and len(link.pushed) == asked + 1
    assert registry.online(grid) == {0: 100, 1: 101} and len(link.pushed) == asked + 1  # both answered
