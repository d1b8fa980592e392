"""The round loop's progress lines: whom a round waits on, every interval, and the ETA."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from types import SimpleNamespace

import pytest
from flwr.app import Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedagent_flwr.serverapp import rounds


class WaitingGrid:
    """A federation that replies (nothing: only the wait matters) once the round has said ``lines``
    times whom it waits on, as read from the log records of ``caplog``."""

    def __init__(self, caplog: pytest.LogCaptureFixture, lines: int) -> None:
        self.caplog, self.lines = caplog, lines

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None) -> list[Message]:
        deadline = time.monotonic() + 120  # a hang guard: a reminder that never speaks fails here
        while len(_waiting_lines(self.caplog)) < self.lines:
            assert time.monotonic() < deadline, "the round never said whom it waits on"
            time.sleep(0.02)
        return []


def _waiting_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in list(caplog.records) if "waiting on clients" in r.getMessage()]


def test_a_waiting_round_says_so_every_interval_and_stops_when_the_replies_come(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # set by Flower in real runs
    monkeypatch.setattr(rounds, "WAITING_LINE_EVERY_S", 0.2)
    strategy = SimpleNamespace(nodes=SimpleNamespace(client_of=lambda node: node - 100))
    loop = rounds.RoundLoop(strategy, WaitingGrid(caplog, 2), recorder=None, timeout=600)  # type: ignore[arg-type]
    messages = [Message(RecordDict(), dst_node_id=node, message_type="train") for node in (100, 102)]
    with caplog.at_level(logging.INFO, logger="flwr"):
        assert loop._send(messages, 3, "training") == []
        waiting = _waiting_lines(caplog)
        assert len(waiting) >= 2, waiting  # it said so again after the first interval
        assert waiting[0].startswith("round 3: training: waiting on clients [0, 2], 0 min so far "
                                     "(round timeout 10 min)")
        # The reminder stopped with the replies: its thread is gone, so no line can follow.
        assert not [t.name for t in threading.enumerate() if t.name == "waiting-round-3"]
        assert _waiting_lines(caplog) == waiting
    assert loop._send([], 3, "training") == []


def test_a_loop_built_without_max_empty_rounds_stops_as_a_default_run_does() -> None:
    """The loop's default is the run config's (declared once, in the schema): a loop built without
    the setting (an embedding, a test) stops after as many empty rounds as ``make run`` does."""
    from fedagent_flwr.config import load_settings

    loop = rounds.RoundLoop(SimpleNamespace(), SimpleNamespace(), recorder=None, timeout=600)  # type: ignore[arg-type]
    assert loop.max_empty_rounds == load_settings().run.max_empty_rounds == 2
