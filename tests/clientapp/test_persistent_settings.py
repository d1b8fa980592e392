"""A persistent trainer's session may fix settings when it starts (a verl session: the algorithm and
every ``trainer.*`` key). A later job asking for other values (a second run on a SuperNode that
stayed up, with another ``trainer.lr``) gets a new trainer, as a job on other code does, instead of
failing every job of the client. Driven with real trainer server processes of the scripted backend
(``testkit.scripted_backend``: ``trainer.fixed`` is fixed by a session's first job)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from fedagent_flwr.clientapp import backend
from fedagent_flwr.clientapp.backend import TrainerFailed
from fedagent_flwr.clientapp.persistent import STARTS_FILE, PersistentTrainer
from fedagent_flwr.clientapp.trainer_server import SETTINGS_FIXED, serve
from fedagent_flwr.procs import ProcessRef
from testkit.scripted_backend import scripted_job

NEEDS = "a train job needs other values of settings fixed for its session's life: trainer.fixed"


@pytest.fixture()
def channel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setitem(backend.BACKEND_MODULES, "scripted", "testkit.scripted_backend")
    path = tmp_path / "channel"
    yield path
    PersistentTrainer("", path).stop(grace_s=5)


def test_a_job_needing_other_session_settings_gets_a_new_trainer_that_says_why(tmp_path: Path, channel: Path) -> None:
    first_run = PersistentTrainer("scripted", channel, idle_timeout_s=600)
    first_run.run("train", scripted_job(tmp_path, "a", script="ok", fixed="x"), tmp_path / "a.log", "c0 r1", 60)
    first = first_run.record()
    # Another job timeout and persistent_idle_s are no session settings: the same trainer serves.
    second_run = PersistentTrainer("scripted", channel, idle_timeout_s=300)
    second_run.run("train", scripted_job(tmp_path, "b", script="ok", fixed="x"), tmp_path / "b.log", "c0 r2", 90)
    assert second_run.record()["pid"] == first["pid"] and second_run.record()["starts"] == 1
    assert "idle timeout now 300 s (was 600 s; trainer.persistent_idle_s)" in (channel / "server.log").read_text()

    # A job the live session refuses for its fixed settings is run by a new trainer, once.
    second_run.run("train", scripted_job(tmp_path, "c", script="ok", fixed="y"), tmp_path / "c.log", "c0 r3", 60)
    replaced = second_run.record()
    assert replaced["pid"] != first["pid"] and replaced["starts"] == 2
    old = ProcessRef.from_json(first)
    assert old is not None and not old.alive()
    assert replaced["reason"] == f"restart: trainer pid {first['pid']} is gone ({NEEDS})"
    assert (tmp_path / "c" / "train_result.json").exists()
    log = (tmp_path / "c.log").read_text()
    assert f"[c0 r3] replacing the persistent trainer (pid {first['pid']}): this job needs trainer.fixed='y'" in log
    assert "scripted train round 1: ok (persistent)" in log  # served by the new trainer
    history = [json.loads(line) for line in (channel / STARTS_FILE).read_text().splitlines()]
    assert [h["pid"] for h in history] == [first["pid"], replaced["pid"]]

    # The new session fixed the new value: the next such job needs no new trainer.
    second_run.run("train", scripted_job(tmp_path, "d", script="ok", fixed="y"), tmp_path / "d.log", "c0 r4", 60)
    assert second_run.record()["pid"] == replaced["pid"] and second_run.record()["starts"] == 2


def test_a_fresh_trainer_refusing_the_job_too_fails_it(tmp_path: Path, channel: Path) -> None:
    trainer = PersistentTrainer("scripted", channel, idle_timeout_s=600)
    trainer.run("train", scripted_job(tmp_path, "a", script="ok", fixed="x"), tmp_path / "a.log", "c0 r1", 60)
    with pytest.raises(TrainerFailed, match=r"c0 r2: scripted trainer rejected the job \(a fresh trainer too\): "
                                            r"this job needs trainer.fixed='x', the scripted session started with "
                                            r"None"):
        trainer.run("train", scripted_job(tmp_path, "b", script="refuse_settings", fixed="x"), tmp_path / "b.log",
                    "c0 r2", 60)
    assert trainer.record()["starts"] == 2  # replaced once, not again
    assert trainer.alive_pid() == trainer.record()["pid"]  # a refusal leaves the session serving
    assert not (tmp_path / "b" / "train_result.json").exists()


def test_the_server_answers_a_refusal_for_fixed_settings_with_its_own_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The typed answer the ClientApp reads (no message matching): kind ``settings_fixed`` and the
    settings' names; the session is intact and serves on."""
    from fedagent_flwr.clientapp.trainer_server import CHANNEL_ENV
    from testkit.scripted_backend import ScriptedSession

    monkeypatch.delenv(CHANNEL_ENV, raising=False)  # serve() sets it for its session
    inbox = tmp_path / "channel" / "inbox"
    inbox.mkdir(parents=True)
    for seq, fixed in ((1, "x"), (2, "y"), (3, "x")):
        (inbox / f"{seq}.json").write_text(json.dumps({"seq": seq, "mode": "train",
                                                       "job": str(scripted_job(tmp_path, str(seq), script="ok",
                                                                               fixed=fixed))}))
    (inbox / "4.json").write_text(json.dumps({"seq": 4, "mode": "stop"}))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = serve(tmp_path / "channel", ScriptedSession, "scripted", (ValueError,), (), idle_timeout_s=60)
    finally:
        signal.signal(signal.SIGTERM, previous)
    answers = {int(p.stem): json.loads(p.read_text()) for p in (tmp_path / "channel" / "outbox").glob("*.json")}
    assert code == 0
    assert [answers[seq]["kind"] for seq in (1, 2, 3, 4)] == ["done", SETTINGS_FIXED, "done", "stopped"]
    assert answers[2]["ok"] is False and answers[2]["settings"] == ["trainer.fixed"]
    assert "trainer.fixed='y'" in answers[2]["error"]
