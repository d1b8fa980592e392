"""Client step lines relayed to the ServerApp's log while a round trains.

* with the http store: a real store, a real client store sending the progress file while the
  "trainer" (this test) appends steps, and the real round loop relaying them, live;
* the store refuses a report without the slot's token, or one too large.

The relay in runs of the whole app: a simulation in tests/e2e/test_simulation_client_val.py, a
deployment with the http store in tests/e2e/test_deployment.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from flwr.app import Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedagent_flwr.checkpoint.http_server import HttpServerStore
from fedagent_flwr.checkpoint.store import StorageSettings, progress_url
from fedagent_flwr.clientapp.progress import forward_progress
from fedagent_flwr.progress import MAX_PROGRESS_BYTES, PROGRESS_FILE, StepProgress, parse_progress, report_step
from fedagent_flwr.serverapp import rounds
from fedagent_flwr.serverapp.progress_relay import MAX_LINES_PER_POLL, ProgressRelay
from testkit.store_harness import RUN, auth, node


class TrainingGrid:
    """A federation of one http-store client that trains ``steps`` steps, ``step_s`` seconds each,
    sending its progress file as the ClientApp does; it replies nothing (only the wait matters).
    ``logged`` is the server log's messages so far; :attr:`logged_at_reply` how many there were
    when the client replied."""

    def __init__(self, store: HttpServerStore, work: Path, steps: int, step_s: float, logged: list[str]) -> None:
        self.client = node(store, work, server_round=3, client=1)
        self.out_dir = work / "round_3" / "client_1"
        self.steps, self.step_s = steps, step_s
        self.logged = logged
        self.logged_at_reply = -1

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None) -> list[Message]:
        with forward_progress(self.client, self.out_dir / PROGRESS_FILE, 3, 1, every_s=0.05):
            for step in range(1, self.steps + 1):
                time.sleep(self.step_s)
                report_step(self.out_dir, StepProgress(step, self.steps, 10.0 * step, 0.25 * step))
        self.logged_at_reply = len(self.logged)
        return []


def test_http_clients_step_lines_reach_the_server_log_while_they_train(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # set by Flower in real runs
    monkeypatch.setattr(rounds, "PROGRESS_POLL_S", 0.05)
    run_root = tmp_path / "run"
    with HttpServerStore(StorageSettings(kind="http"), run_root, RUN) as store:
        relayed: list[str] = []
        grid = TrainingGrid(store, tmp_path / "node", steps=3, step_s=0.4, logged=relayed)
        strategy = SimpleNamespace(nodes=SimpleNamespace(client_of=lambda node_id: node_id - 100))
        loop = rounds.RoundLoop(strategy, grid, recorder=None, timeout=600,  # type: ignore[arg-type]
                                run_root=run_root.resolve())
        stale = run_root / "round_3" / "client_1" / PROGRESS_FILE
        stale.parent.mkdir(parents=True)
        stale.write_text(json.dumps({"step": 9, "steps": 9, "seconds": 1.0}) + "\n")  # an earlier attempt's

        class Collect(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                relayed.append(record.getMessage())

        handler = Collect()
        logging.getLogger("flwr").addHandler(handler)
        try:
            with caplog.at_level(logging.INFO, logger="flwr"):
                loop._send([Message(RecordDict(), dst_node_id=101, message_type="train")], 3, "training")
        finally:
            logging.getLogger("flwr").removeHandler(handler)
    lines = [m for m in relayed if m.startswith("client 1 round 3: ")]
    assert lines == ["client 1 round 3: step 1/3, success 0.25, 10 s",
                     "client 1 round 3: step 2/3, success 0.50, 20 s",
                     "client 1 round 3: step 3/3, success 0.75, 30 s"]
    # relayed while the client trained, not only after its reply
    assert lines[0] in relayed[:grid.logged_at_reply], (grid.logged_at_reply, relayed)
    # the store kept the copy where a shared filesystem's trainer would have written it
    assert [r.step for r in parse_progress(stale.read_text())] == [1, 2, 3]


def test_the_store_takes_a_progress_report_only_with_the_slots_token_and_within_its_size(tmp_path: Path) -> None:
    with HttpServerStore(StorageSettings(kind="http"), tmp_path / "run", RUN) as store:
        url = progress_url(store.url, RUN, 2, 0)
        body = b'{"step": 1, "steps": 2, "seconds": 5}\n'
        assert httpx.put(url, content=body, headers=auth(store.upload_token(2, 1))).status_code == 403
        assert httpx.put(url, content=body, headers=auth(store.read_token())).status_code == 403
        too_big = httpx.put(url, content=b"x" * (MAX_PROGRESS_BYTES + 1), headers=auth(store.upload_token(2, 0)))
        assert too_big.status_code == 413
        assert not (tmp_path / "run" / "round_2" / "client_0" / PROGRESS_FILE).exists()
        assert httpx.put(url, content=body, headers=auth(store.upload_token(2, 0))).status_code == 200
        assert (tmp_path / "run" / "round_2" / "client_0" / PROGRESS_FILE).read_bytes() == body


def test_malformed_progress_records_are_skipped_not_relayed() -> None:
    text = "\n".join([json.dumps({"step": 1, "steps": 2, "seconds": 3.5}), "{cut", json.dumps([1]),
                      json.dumps({"step": "2", "steps": 2, "seconds": 1}), json.dumps({"step": 2, "steps": 2}),
                      json.dumps({"step": 2, "steps": 2, "seconds": 7, "success_rate": float("nan")}),
                      '{"step": 1, "steps": 2, "seconds": ' + "9" * 400 + "}",  # would overflow float()
                      "[" * 60000 + "]" * 60000])  # nested past Python's recursion limit
    records = parse_progress(text)
    assert [r.line("client 0 round 1") for r in records] == ["client 0 round 1: step 1/2, 4 s",
                                                             "client 0 round 1: step 2/2, 7 s"]


def test_a_client_rewriting_its_file_cannot_flood_the_log_nor_fail_the_round(tmp_path: Path) -> None:
    relay = ProgressRelay(tmp_path, server_round=2, clients=[0, 1])
    flood = tmp_path / "round_2" / "client_0" / PROGRESS_FILE
    flood.parent.mkdir(parents=True)
    record = json.dumps({"step": 1, "steps": 2, "seconds": 1.0}) + "\n"
    flood.write_text(record * 500)
    unreadable = tmp_path / "round_2" / "client_1" / PROGRESS_FILE
    unreadable.mkdir(parents=True)  # a directory where the file should be: reading it fails
    lines = relay.poll()
    assert len(lines) == MAX_LINES_PER_POLL + 1
    assert lines[-1] == f"client 0 round 2: {500 - MAX_LINES_PER_POLL} more progress records not shown"
    flood.write_text("")  # the client empties its file and writes it again: capped again
    assert relay.poll() == []
    flood.write_text(record * 500)
    assert len(relay.poll()) == MAX_LINES_PER_POLL + 1
