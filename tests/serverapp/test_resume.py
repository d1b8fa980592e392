"""Resume plumbing without a simulation: what a re-run keeps of an earlier attempt, what it
removes, how it refuses another config, how Flower's ``start`` skips completed rounds, the run
directory lock and the test-only crash point. The crash tests with real SIGKILLs are in
tests/e2e/test_resume_crash.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.config import load_settings
from fedagent_flwr.protocol import PartitionReply, TrainReply
from fedagent_flwr.serverapp.app import FINISHED_STATUSES, RunSetupError, build_strategy, run_directory, summary_header
from fedagent_flwr.serverapp.app import main as serverapp_main
from fedagent_flwr.serverapp.crashpoint import CRASH_FILE_ENV
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.resume import (
    ResumeError,
    config_fingerprint,
    discard_uncommitted,
    earlier_run_ids,
    exclusive_run_directory,
    load_previous_run,
)
from fedagent_flwr.serverapp.rounds import RoundLoop
from fedagent_flwr.serverapp.strategy import FedAvgFSDP
from testkit.ckpt_factory import ModelSpec, Suite, write_hf_checkpoint
from testkit.flower_harness import REPO
from testkit.round_harness import connect, train_round


def _header(tmp_path: Path, base: CheckpointRef, overrides: str = "", run_id: int = 1) -> dict[str, Any]:
    settings = load_settings(overrides=f"output_dir={tmp_path} run_name=job model.path={base.path} {overrides}")
    return summary_header(settings, run_id, base)


def _metrics(success: float) -> dict[str, Any]:
    return {"num-examples": 2, "success-rate": success, "reward-mean": success}


def _record_round(recorder: RunRecorder, server_round: int, aggregated: Path, commit: bool) -> None:
    """What one round writes: the train record, the evaluation and (if ``commit``) the commit."""
    recorder.record_round(
        server_round=server_round, clients=[0, 1], started_from="prev",
        client_actors={0: f"c0-r{server_round}", 1: f"c1-r{server_round}"}, aggregated=str(aggregated),
        rejected={}, client_metrics={0: _metrics(0.5), 1: _metrics(0.25)},
    )
    recorder.record_eval(server_round=server_round, model="aggregated", metrics=_metrics(0.5))
    if commit:
        recorder.complete_round(server_round)


@pytest.fixture
def base(tiny_model_dir: Path) -> CheckpointRef:
    return CheckpointRef.for_directory(tiny_model_dir, "actor")


def test_a_rerun_keeps_the_completed_rounds_only(tmp_path: Path, base: CheckpointRef) -> None:
    run_dir = tmp_path / "job"
    header = _header(tmp_path, base)
    recorder = RunRecorder(run_dir, header)
    recorder.record_eval(server_round=0, model="base", metrics=_metrics(0.0))
    recorder.complete_round(0)
    round_1 = shutil.copytree(base.path, run_dir / "round_1" / "global")
    _record_round(recorder, 1, round_1, commit=True)
    # Round 2 recorded its training and evaluation, then the process died before the commit.
    round_2 = shutil.copytree(base.path, run_dir / "round_2" / "global")
    _record_round(recorder, 2, round_2, commit=False)

    resumed_header = _header(tmp_path, base, run_id=2)
    previous = load_previous_run(run_dir, resumed_header)
    # what the ServerApp reads to resume rather than report the run done: not finished, round 1 the last kept
    assert previous is not None and previous.last_completed_round == 1 and previous.status not in FINISHED_STATUSES
    assert [e["round"] for e in previous.rounds] == [1]
    assert [p["round"] for p in previous.val_curve] == [0, 1]
    assert {e["round"] for e in previous.events} == {0, 1}
    assert previous.global_model(base).path == str(round_1)

    again = RunRecorder(run_dir, resumed_header, previous)
    summary = json.loads(again.summary_path.read_text())
    assert summary["run_id"] == 2 and summary["last_completed_round"] == 1
    # earlier_run_id: the attempt resumed (the summary's run_id until this re-run replaced it)
    assert summary["resumed"] == [{"run_id": 2, "after_round": 1, "earlier_run_id": 1}]
    assert earlier_run_ids(summary) == [1]
    assert summary["final_model"] == str(round_1)
    assert summary["status"] == "running"
    # Round 2 runs again: its lines appear once, not twice.
    _record_round(again, 2, round_2, commit=True)
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_round = [(e["event"], e["round"]) for e in events if e["event"] != "train"]
    assert per_round == [("evaluate", 0), ("aggregate", 1), ("evaluate", 1), ("aggregate", 2), ("evaluate", 2)]
    assert [(e["round"], e["client"]) for e in events if e["event"] == "train"] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    summary = json.loads(again.summary_path.read_text())
    assert [e["round"] for e in summary["rounds"]] == [1, 2]
    assert [p["round"] for p in summary["client_curve"]] == [1, 1, 2, 2]


def test_a_rerun_keeps_the_initial_evaluation_time_and_the_disk_freed(tmp_path: Path, base: CheckpointRef) -> None:
    """``initial_eval_seconds`` (written when round 0 commits) and ``disk_freed_bytes`` (written by
    retention after a commit) belong to completed rounds: a re-run keeps them, even when it never
    commits round 0 again nor frees anything more. It used to start the summary without them."""
    from fedagent_flwr.serverapp.retention import Retention

    run_dir = tmp_path / "job"
    header = _header(tmp_path, base)
    recorder = RunRecorder(run_dir, header)
    recorder.record_eval(server_round=0, model="base", metrics=_metrics(0.0))
    recorder.complete_round(0)
    checkpoint = run_dir / "round_1" / "client_0" / "checkpoints" / "global_step_1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.pt").write_bytes(b"w" * 1234)
    _record_round(recorder, 1, shutil.copytree(base.path, run_dir / "round_1" / "global"), commit=True)
    assert Retention(run_dir).after_commit(recorder, 1) == 1234
    # What an s3 store's release noted (tests/checkpoint/test_s3_store.py) is kept the same way.
    recorder.summary["rounds"][-1].update(store_removed={"client_checkpoints": 99}, store_removed_objects=3)
    recorder.summary.update(store_freed_bytes=99, store_freed_objects=3)
    recorder.write()
    _record_round(recorder, 2, shutil.copytree(base.path, run_dir / "round_2" / "global"), commit=False)  # killed
    before = json.loads(recorder.summary_path.read_text())
    assert before["disk_freed_bytes"] == 1234 and before["initial_eval_seconds"] >= 0

    for attempt in (2, 3):  # a re-run, and a re-run of that re-run
        previous = load_previous_run(run_dir, _header(tmp_path, base, run_id=attempt))
        assert previous is not None
        again = RunRecorder(run_dir, _header(tmp_path, base, run_id=attempt), previous)
        if attempt == 2:
            _record_round(again, 2, run_dir / "round_2" / "global", commit=True)
            assert Retention(run_dir, keep_client_checkpoints=True).after_commit(again, 2) == 0  # frees nothing
        summary = json.loads(again.summary_path.read_text())
        assert summary["initial_eval_seconds"] == before["initial_eval_seconds"], attempt
        assert summary["disk_freed_bytes"] == 1234, attempt
        assert (summary["store_freed_bytes"], summary["store_freed_objects"]) == (99, 3), attempt
        # every earlier attempt's run id, the first one's included (the store removes their objects)
        assert earlier_run_ids(summary) == list(range(1, attempt)), attempt
    # A run whose round 0 never committed has no initial evaluation time to keep.
    early = RunRecorder(tmp_path / "early", header)
    early.record_eval(server_round=0, model="base", metrics=_metrics(0.0))
    previous = load_previous_run(tmp_path / "early", header)
    assert previous is not None
    assert "initial_eval_seconds" not in json.loads(RunRecorder(tmp_path / "early", header, previous)
                                                    .summary_path.read_text())


def test_a_completed_run_has_nothing_left_and_a_crash_before_round_0_keeps_nothing(
    tmp_path: Path, base: CheckpointRef
) -> None:
    header = _header(tmp_path, base, "num_rounds=1")
    recorder = RunRecorder(tmp_path / "done", header)
    recorder.complete_round(0)
    _record_round(recorder, 1, shutil.copytree(base.path, tmp_path / "done" / "round_1" / "global"), commit=True)
    recorder.finish("completed")
    finished = load_previous_run(tmp_path / "done", header)
    # what the ServerApp reads to report the run done: a finished status with every round completed
    assert finished is not None and finished.status in FINISHED_STATUSES
    assert finished.last_completed_round == finished.total_rounds == 1

    early = RunRecorder(tmp_path / "early", header)
    early.record_eval(server_round=0, model="base", metrics=_metrics(0.0))  # not committed
    previous = load_previous_run(tmp_path / "early", header)
    assert previous is not None and previous.last_completed_round is None
    assert previous.val_curve == [] and previous.events == [] and previous.global_model(base) is base


def test_another_config_in_the_same_directory_is_refused_by_name(tmp_path: Path, base: CheckpointRef) -> None:
    run_dir = tmp_path / "job"
    RunRecorder(run_dir, _header(tmp_path, base))
    with pytest.raises(ResumeError,
                       match=r"another configuration \(config key 'num_rounds' = 2 there, 3 now\); "
                             r"choose another run_name"):
        load_previous_run(run_dir, _header(tmp_path, base, "num_rounds=3"))
    with pytest.raises(ResumeError, match=r"config key 'trainer.lr' = .* there, 0.5 now"):
        load_previous_run(run_dir, _header(tmp_path, base, "trainer.lr=0.5"))
    # An empty mapping there, a key under it now: the key is named, not the mapping.
    with pytest.raises(ResumeError, match=r"config key 'model.chat_template_kwargs.enable_thinking' = '<unset>' "
                                          r"there, False now"):
        load_previous_run(run_dir, _header(tmp_path, base, "model.chat_template_kwargs.enable_thinking=false"))
    # The same config with a base model whose content changed is another run too.
    with pytest.raises(ResumeError, match="base model's content differs"):
        load_previous_run(run_dir, _header(tmp_path, dataclasses.replace(base, sha256="0" * 64)))
    # A run whose hashes were computed by the earlier content-hash scheme (no "content_hash" field)
    # is refused as such, not as another base model or a damaged file.
    stored = json.loads((run_dir / "federated_summary.json").read_text())
    assert stored["content_hash"] == "v2"
    del stored["content_hash"]
    (run_dir / "federated_summary.json").write_text(json.dumps(stored))
    with pytest.raises(ResumeError,
                       match="recorded with checkpoint content hash v1, and this fedagent-flwr computes v2"):
        load_previous_run(run_dir, _header(tmp_path, base))
    # A summary without a fingerprint (an older version, or not ours) is never resumed.
    (run_dir / "federated_summary.json").write_text(json.dumps({"status": "completed"}))
    with pytest.raises(ResumeError, match="no config fingerprint"):
        load_previous_run(run_dir, _header(tmp_path, base))
    assert load_previous_run(tmp_path / "empty", _header(tmp_path, base)) is None


def test_uncommitted_server_outputs_are_removed_and_client_outputs_kept(tmp_path: Path) -> None:
    run_dir = tmp_path / "job"
    for r in (1, 2):
        (run_dir / f"round_{r}" / "global").mkdir(parents=True)
        (run_dir / f"round_{r}" / "global" / "model.safetensors").write_bytes(b"weights")
        (run_dir / f"round_{r}" / "client_0").mkdir()
        (run_dir / f"round_{r}" / "client_0" / "train_result.json").write_text("{}")
    (run_dir / "round_2" / ".global.staging-1a2b3c4d").mkdir()
    (run_dir / "round_2" / ".global.staging-1a2b3c4d" / "model.safetensors").write_bytes(b"half")
    (run_dir / ".federated_summary.json.x1y2.json").write_text("{")
    (run_dir / ".metrics.jsonl.abcd.jsonl").write_text("")
    (run_dir / "federated_summary.json").write_text("{}")

    removed = discard_uncommitted(run_dir, last_completed_round=1)
    assert sorted(p.relative_to(run_dir).as_posix() for p in removed) == [
        ".federated_summary.json.x1y2.json", ".metrics.jsonl.abcd.jsonl",
        "round_2/.global.staging-1a2b3c4d", "round_2/global",
    ]
    assert (run_dir / "round_1" / "global" / "model.safetensors").exists()  # committed: kept
    assert (run_dir / "round_2" / "client_0" / "train_result.json").exists()  # the client's: kept
    assert (run_dir / "federated_summary.json").exists()
    assert discard_uncommitted(run_dir, last_completed_round=None) == [run_dir / "round_1" / "global"]


class _Recording(FedAvgFSDP):
    """A user-style subclass that overrides every round method and notes each call."""

    calls: list[tuple[str, int]]
    recorder: RunRecorder

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.calls.append(("configure_train", server_round))
        return []

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[None, None]:
        self.calls.append(("aggregate_train", server_round))
        return None, None

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        self.calls.append(("configure_evaluate", server_round))
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        self.calls.append(("aggregate_evaluate", server_round))
        committed = json.loads(self.recorder.summary_path.read_text())["last_completed_round"]
        assert committed == server_round - 1  # the commit comes after this method returns
        return None


class _TwoNodes:
    """A federation of two nodes (100 and 101, serving partitions 0 and 1) that answers the partition
    query and is sent nothing else (the strategy under test sends nothing)."""

    def get_node_ids(self) -> list[int]:
        return [100, 101]

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None) -> list[Message]:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # set by Flower in real runs
        replies = []
        for message in messages:
            assert message.metadata.message_type == "query.partition"
            answer = PartitionReply(message.metadata.dst_node_id - 100, 2)
            replies.append(Message(answer.to_record(), reply_to=message))
        return replies


class _OneNode(_TwoNodes):
    """The same federation after node 101 (partition 1) went away."""

    def get_node_ids(self) -> list[int]:
        return [100]


def test_the_round_loop_skips_completed_rounds_before_any_override(tmp_path: Path, base: CheckpointRef) -> None:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # set by Flower in real runs
    recorder = RunRecorder(tmp_path, {"base_model": base.path})
    recorder.complete_round(2)  # an earlier attempt got this far
    strategy = _Recording(run_root=str(tmp_path), initial_model=base, num_clients=2, clients_per_round=2)
    strategy.calls, strategy.recorder = [], recorder
    hooks: list[tuple[str, int, int]] = []  # (hook, round, last_completed_round on disk when it ran)

    def hook(name: str) -> Any:
        return lambda r: hooks.append((name, r, json.loads(recorder.summary_path.read_text())["last_completed_round"]))

    # max_empty_rounds=0: this strategy trains nothing, which would otherwise stop the run at round 4
    RoundLoop(strategy, _TwoNodes(), recorder, timeout=10, last_completed=2,  # type: ignore[arg-type]
              max_empty_rounds=0, before_commit=hook("before"), after_commit=hook("after")).run(4)
    # retention notes what a commit lets go just before it (the commit's write records the note)
    # and removes it just after
    assert hooks == [("before", 3, 2), ("after", 3, 3), ("before", 4, 3), ("after", 4, 4)]
    assert strategy.nodes.client_of(101) == 1  # the loop found the partitions before round 3
    assert strategy.calls == [
        (name, r) for r in (3, 4)
        for name in ("configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate")
    ]
    summary = json.loads(recorder.summary_path.read_text())
    assert summary["last_completed_round"] == 4
    # Its aggregate_train set no last_aggregation and left the global model alone: the loop records
    # each round as one that aggregated nothing, so the run cannot end `completed`.
    assert [(e["round"], e["aggregated_actor"], e["started_from"]) for e in summary["rounds"]] == [
        (3, None, base.path), (4, None, base.path)]
    assert recorder.outcome()[0] == "failed"


def test_an_evaluation_the_strategy_could_not_send_is_recorded_and_makes_the_run_degraded(
    tmp_path: Path, base: CheckpointRef, caplog: pytest.LogCaptureFixture
) -> None:
    """``FedAvgFSDP`` sends no evaluation when fewer nodes are connected than ``min_evaluate_nodes``
    (Flower's rule; here one of the two SuperNodes is gone). The round then has no validation point:
    the loop logs it, records it in ``eval_failures`` with the strategy's reason, and the run cannot
    end ``completed``. An evaluation
    that is not wanted (no validation episodes) is not a failure."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # set by Flower in real runs
    recorder = RunRecorder(tmp_path, {"base_model": base.path})
    strategy = FedAvgFSDP(run_root=str(tmp_path), initial_model=base, num_clients=2, clients_per_round=2,
                          eval_seeds=[1, 2, 3, 4], min_evaluate_nodes=2)
    loop = RoundLoop(strategy, _OneNode(), recorder, timeout=10)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        loop.evaluate(1)
    why = "1 client(s) available, fewer than min_evaluate_nodes = 2"
    assert any("round 1: the evaluation of the aggregated model was skipped: " + why in r.getMessage()
               for r in caplog.records)
    summary = json.loads(recorder.summary_path.read_text())
    assert summary["val_curve"] == [] and summary["eval_failures"] == [
        {"round": 1, "model": "aggregated", "failed": {}, "reason": why}]
    status, reason = recorder.outcome()
    assert status == "degraded" and f"the evaluation of round(s) [1] recorded nothing (round 1: {why})" in reason
    unwanted = FedAvgFSDP(run_root=str(tmp_path), initial_model=base, num_clients=2, clients_per_round=2,
                          min_evaluate_nodes=2)  # no validation episodes: nothing to evaluate
    RoundLoop(unwanted, _OneNode(), recorder, timeout=10).evaluate(2)  # type: ignore[arg-type]
    assert json.loads(recorder.summary_path.read_text())["eval_failures"] == summary["eval_failures"]

    class EveryOtherRound(FedAvgFSDP):  # skips odd rounds by design, without calling super()
        def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                               grid: Grid) -> Iterable[Message]:
            return [] if server_round % 2 else super().configure_evaluate(server_round, arrays, config, grid)

    by_design = EveryOtherRound(run_root=str(tmp_path), initial_model=base, num_clients=2, clients_per_round=2,
                                eval_seeds=[1, 2, 3, 4], min_evaluate_nodes=2)
    by_design.evaluation_skipped = "a stale reason from an earlier round"
    RoundLoop(by_design, _OneNode(), recorder, timeout=10).evaluate(3)  # type: ignore[arg-type]
    assert json.loads(recorder.summary_path.read_text())["eval_failures"] == summary["eval_failures"]


def test_one_serverapp_at_a_time_per_run_directory(tmp_path: Path) -> None:
    with exclusive_run_directory(tmp_path):
        with pytest.raises(ResumeError, match="in use by another ServerApp"):
            with exclusive_run_directory(tmp_path):
                pass
    with exclusive_run_directory(tmp_path):  # released when the holder is done
        pass


def test_a_crash_point_kills_its_process_once(tmp_path: Path) -> None:
    trigger = tmp_path / "crash"
    code = "from fedagent_flwr.serverapp.crashpoint import crash_point; crash_point('commit@2'); print('alive')"
    env = {**os.environ, CRASH_FILE_ENV: str(trigger), "PYTHONPATH": str(REPO)}
    trigger.write_text("aggregated@2")  # another point: nothing happens
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout == "alive\n"
    trigger.write_text("commit@2\n")
    killed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL and killed.stdout == "" and not trigger.exists()
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert again.stdout == "alive\n"  # one shot: the re-run gets past the point


def test_a_ppo_run_resumes_with_its_last_aggregated_critic(tmp_path: Path, base: CheckpointRef) -> None:
    run_dir = tmp_path / "job"
    header = _header(tmp_path, base)
    recorder = RunRecorder(run_dir, header)
    recorder.complete_round(0)
    actor = shutil.copytree(base.path, run_dir / "round_1" / "global")
    critic = shutil.copytree(base.path, run_dir / "round_1" / "global_critic")
    recorder.record_round(
        server_round=1, clients=[0], started_from="base", client_actors={0: "c0"}, aggregated=str(actor),
        rejected={}, client_metrics={0: _metrics(0.5)}, client_critics={0: "c0-critic"},
        aggregated_critic=str(critic),
    )
    recorder.complete_round(1)
    previous = load_previous_run(run_dir, _header(tmp_path, base, run_id=2))
    assert previous is not None and previous.last_completed_round == 1
    restored = previous.global_critic()
    assert restored is not None and restored.path == str(critic) and restored.kind == "critic"
    shutil.rmtree(critic)
    with pytest.raises(ResumeError, match="global critic"):
        previous.global_critic()


def test_upload_slots_of_an_uncommitted_round_go_and_trainer_outputs_stay(tmp_path: Path) -> None:
    client_dir = tmp_path / "round_2" / "client_0"
    for path in ("actor", "critic", ".upload-actor", ".download-critic", "checkpoints/global_step_1/actor"):
        (client_dir / path).mkdir(parents=True)
        (client_dir / path / "model_world_size_1_rank_0.pt").write_bytes(b"x")
    (tmp_path / "round_2" / ".global_critic.staging-1234abcd").mkdir()
    removed = discard_uncommitted(tmp_path, last_completed_round=1)
    assert {p.relative_to(tmp_path).as_posix() for p in removed} == {
        "round_2/client_0/actor", "round_2/client_0/critic", "round_2/client_0/.upload-actor",
        "round_2/client_0/.download-critic",  # the s3 store's interrupted download
        "round_2/.global_critic.staging-1234abcd"}
    assert (client_dir / "checkpoints" / "global_step_1" / "actor").is_dir()


def test_a_resume_checks_the_global_model_against_the_hash_recorded_at_its_commit(
        suite: Suite, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Round 1 really aggregated and committed, then its global model truncated on disk: the re-run
    stops at start with one line naming the file and what to do (it used to resume from it and
    crash later, when the round's reference model would not open)."""
    write_hf_checkpoint(ModelSpec("global", "qwen2", seed=9), tmp_path / "base")
    base = CheckpointRef.for_directory(tmp_path / "base")
    overrides = f"output_dir={tmp_path / 'out'} run_name=job model.path={base.path} num_rounds=2"
    settings = load_settings(overrides=overrides)
    run_dir = run_directory(settings, 1)
    recorder = RunRecorder(run_dir, summary_header(settings, 1, base))
    recorder.complete_round(0)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # set by Flower in real runs
    strategy = connect(build_strategy(settings, run_dir, base), recorder, [0, 1])
    replies = []
    for client, name in enumerate(("qwen_a", "qwen_b")):
        ref = CheckpointRef.for_directory(suite.copy(name, run_dir / "round_1" / f"client_{client}"))
        instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="train")
        reply = TrainReply(client_id=client, actor=ref, metrics={"num-examples": 4})
        replies.append(Message(reply.to_record(), reply_to=instruction))
    train_round(strategy, 1, replies)
    recorder.complete_round(1)
    weights = run_dir / "round_1" / "global" / "model.safetensors"
    assert json.loads(recorder.summary_path.read_text())["rounds"][0]["aggregated_sha256"] == (
        strategy.global_model.sha256)
    os.truncate(weights, weights.stat().st_size // 2)  # a disk that filled up, a careless copy

    context = Context(run_id=2, node_id=0, node_config={}, state=RecordDict(), run_config={"overrides": overrides})
    with caplog.at_level(logging.ERROR), pytest.raises(RunSetupError) as failure:
        serverapp_main(None, context)  # type: ignore[arg-type]  # refused before any message is sent
    message = str(failure.value)
    assert "\n" not in message
    assert message.startswith(f"round 1's global model {weights.parent} is damaged: its content hash is ")
    assert "recorded when round 1 was committed" in message and "restore that directory" in message
    assert f"[fedagent] cannot start the run: {message}" in caplog.text


def test_a_run_recorded_before_a_setting_existed_resumes_at_its_default_only(
    tmp_path: Path, base: CheckpointRef
) -> None:
    """A run recorded by a version without ``max_empty_rounds``: the same run at the setting's
    default (what that version did), another configuration at any other value."""
    run_dir = tmp_path / "job"
    RunRecorder(run_dir, _header(tmp_path, base))
    stored = json.loads((run_dir / "federated_summary.json").read_text())
    del stored["config"]["max_empty_rounds"]
    stored["config_sha256"] = config_fingerprint(stored["config"], stored["base_model_sha256"])
    (run_dir / "federated_summary.json").write_text(json.dumps(stored))
    assert load_previous_run(run_dir, _header(tmp_path, base)) is not None
    with pytest.raises(ResumeError, match=r"config key 'max_empty_rounds' = '<unset>' there, 5 now"):
        load_previous_run(run_dir, _header(tmp_path, base, "max_empty_rounds=5"))
    with pytest.raises(ResumeError, match=r"config key 'num_rounds' = 2 there, 3 now"):
        load_previous_run(run_dir, _header(tmp_path, base, "num_rounds=3"))


def test_a_run_recorded_before_chat_template_kwargs_existed_resumes_at_its_default_only(
    tmp_path: Path, base: CheckpointRef
) -> None:
    """A setting whose default is an empty mapping (``model.chat_template_kwargs``), absent from a run
    recorded before it existed: the same run while it is empty, another configuration once set."""
    run_dir = tmp_path / "job"
    RunRecorder(run_dir, _header(tmp_path, base))
    stored = json.loads((run_dir / "federated_summary.json").read_text())
    del stored["config"]["model"]["chat_template_kwargs"]
    stored["config_sha256"] = config_fingerprint(stored["config"], stored["base_model_sha256"])
    (run_dir / "federated_summary.json").write_text(json.dumps(stored))
    assert load_previous_run(run_dir, _header(tmp_path, base)) is not None
    with pytest.raises(ResumeError, match=r"config key 'model.chat_template_kwargs.enable_thinking' = '<unset>' there, "
                                          r"False now"):
        load_previous_run(run_dir, _header(tmp_path, base, "model.chat_template_kwargs.enable_thinking=false"))
