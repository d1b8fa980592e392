"""The round loop's progress lines: whom a round waits on, every interval, and the ETA."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from types import SimpleNamespace

import pytest
from flwr.app import Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedagent_flwr.serverapp import rounds


class SlowGrid:
    """A federation whose replies take ``seconds`` to come (none come back: only the wait matters)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None) -> list[Message]:
        time.sleep(self.seconds)
        return []


def test_a_waiting_round_says_so_every_interval_and_stops_when_the_replies_come(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # set by Flower in real runs
    monkeypatch.setattr(rounds, "WAITING_LINE_EVERY_S", 0.2)
    strategy = SimpleNamespace(nodes=SimpleNamespace(client_of=lambda node: node - 100))
    loop = rounds.RoundLoop(strategy, SlowGrid(0.7), recorder=None, timeout=600)  # type: ignore[arg-type]
    messages = [Message(RecordDict(), dst_node_id=node, message_type="train") for node in (100, 102)]
    with caplog.at_level(logging.INFO, logger="flwr"):
        assert loop._send(messages, 3, "training") == []
        waiting = [r.getMessage() for r in caplog.records if "waiting on clients" in r.getMessage()]
        assert 2 <= len(waiting) <= 3, waiting  # 0.7 s of waiting at one line per 0.2 s
        assert waiting[0].startswith("round 3: training: waiting on clients [0, 2], 0 min so far (round timeout 10 min)")
        time.sleep(0.5)  # the reminder stopped with the replies
        assert len([r for r in caplog.records if "waiting on clients" in r.getMessage()]) == len(waiting)
    assert loop._send([], 3, "training") == []


def test_a_loop_built_without_max_empty_rounds_stops_as_a_default_run_does() -> None:
    """The loop's default is the run config's (declared once, in the schema): a loop built without
    the setting (an embedding, a test) stops after as many empty rounds as ``make run`` does."""
    from fedagent_flwr.config import load_settings

    loop = rounds.RoundLoop(SimpleNamespace(), SlowGrid(0), recorder=None, timeout=600)  # type: ignore[arg-type]
    assert loop.max_empty_rounds == load_settings().run.max_empty_rounds == 2
