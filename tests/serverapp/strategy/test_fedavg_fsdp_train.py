"""FedAvgFSDP's aggregate_train on real FSDP checkpoints: good clients averaged, bad ones
refused by name, the previous global model kept when nothing is usable, and no earlier round's
output touched; PPO critics averaged like the actors, update statistics measured, and a custom
aggregate_train recorded from the global model it left."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from safetensors.torch import load_file

from fedagent_flwr.checkpoint import CheckpointRef, open_checkpoint, verify_mean
from fedagent_flwr.protocol import TrainReply
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.strategy import FedAvgFSDP
from testkit.ckpt_factory import Suite
from testkit.client_replies import failed_train_reply, train_reply
from testkit.round_harness import connect, train_round
from testkit.strategy_setup import client_slot, connected_strategy, initial_checkpoint


def test_good_clients_of_any_world_size_are_averaged_by_num_examples(suite: Suite, tmp_path: Path) -> None:
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), clients=3)
    refs = {c: CheckpointRef.for_directory(suite.copy(name, client_slot(run_root, c))) for c, name in
            enumerate(["qwen_a", "qwen_b", "qwen_plain"])}
    episodes = {0: 4, 1: 8, 2: 12}
    arrays, metrics = strategy.aggregate_train(1, [train_reply(c, refs[c], episodes[c]) for c in refs])
    assert arrays is None  # no weights travel: the new global model is a reference
    assert metrics is not None and metrics["reward-mean"] == pytest.approx(0.5)
    assert strategy.global_model.path == str(run_root / "round_1" / "global")
    sources = [(open_checkpoint(refs[c], root=run_root), float(episodes[c])) for c in refs]
    assert verify_mean(sources, strategy.global_model.path) < 1e-6
    result = strategy.last_aggregation
    assert result is not None and sorted(result.client_actors) == [0, 1, 2] and result.actor == strategy.global_model


def test_bad_clients_are_refused_by_name_and_the_round_goes_on(suite: Suite, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path))
    good = CheckpointRef.for_directory(suite.copy("qwen_a", client_slot(run_root, 0)))
    outside = CheckpointRef.for_directory(suite.copy("qwen_b", tmp_path))
    wrong_hash = CheckpointRef.for_directory(suite.copy("qwen_c", client_slot(run_root, 2)))
    wrong_hash = CheckpointRef(**{**wrong_hash.__dict__, "sha256": "0" * 64})
    truncated_dir = suite.copy("qwen_plain", client_slot(run_root, 3))
    shard = truncated_dir / "model_world_size_1_rank_0.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    truncated = CheckpointRef.for_directory(truncated_dir)  # hashed as truncated: the reader must catch it
    other_shapes = CheckpointRef.for_directory(suite.copy("llama_tied_a", client_slot(run_root, 4)))
    replies = [train_reply(0, good, 4), train_reply(1, outside, 4), train_reply(2, wrong_hash, 4),
               train_reply(3, truncated, 4), train_reply(4, other_shapes, 4), failed_train_reply(5)]
    with caplog.at_level(logging.WARNING):
        entry = train_round(strategy, 1, replies)
    assert entry is not None and entry["client_actor_ids"] == [0]
    rejected = entry["rejected"]
    assert "outside the run root" in rejected["1"]
    assert "hash" in rejected["2"]
    assert "model_world_size_1_rank_0.pt" in rejected["3"]
    assert "shape" in rejected["4"] or "keys" in rejected["4"]
    assert "exited with code 1" in rejected["5"]
    assert "client 2 refused" in caplog.text
    aggregate = load_file(str(Path(strategy.global_model.path) / "model.safetensors"))
    expected = suite.expected("qwen_a")
    assert max((aggregate[k] - expected[k].float()).abs().max().item() for k in aggregate) == 0.0


def test_no_valid_client_keeps_the_previous_model_and_earlier_rounds_are_untouched(
    suite: Suite, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path))
    first = CheckpointRef.for_directory(suite.copy("qwen_a", client_slot(run_root, 0)))
    train_round(strategy, 1, [train_reply(0, first, 4)], sent=[0])
    round_one = strategy.global_model
    digest = hashlib.sha256((Path(round_one.path) / "model.safetensors").read_bytes()).hexdigest()

    broken = CheckpointRef(**{**CheckpointRef.for_directory(suite.copy("qwen_b", tmp_path / "x")).__dict__})
    with caplog.at_level(logging.WARNING):
        train_round(strategy, 2, [train_reply(0, broken, 4), failed_train_reply(1)], sent=[0, 1])
    assert strategy.global_model == round_one
    assert "no valid client checkpoint; keeping the previous global model" in caplog.text
    assert not (run_root / "round_2" / "global").exists()
    summary = json.loads((run_root / "federated_summary.json").read_text())
    assert summary["rounds"][1]["aggregated_actor"] is None and summary["final_model"] == round_one.path
    assert hashlib.sha256((Path(round_one.path) / "model.safetensors").read_bytes()).hexdigest() == digest
    assert torch.equal(load_file(str(Path(round_one.path) / "model.safetensors"))["lm_head.weight"],
                       suite.expected("qwen_a")["lm_head.weight"].float())


def test_bad_weights_missing_metrics_silence_and_spoofed_ids_are_refused(suite: Suite, tmp_path: Path) -> None:
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), served=5)  # no node serves client 5
    ref = {c: CheckpointRef.for_directory(suite.copy(n, client_slot(run_root, c))) for c, n in
           [(0, "qwen_a"), (1, "qwen_b"), (2, "qwen_c"), (3, "qwen_plain")]}
    instruction = Message(RecordDict(), dst_node_id=103, message_type="train")
    spoofed = Message(TrainReply(client_id=0, actor=ref[3], metrics={"num-examples": 4}).to_record(),
                      reply_to=instruction)  # node of client 3 claims to be client 0
    replies = [train_reply(0, ref[0], 4), train_reply(1, ref[1], 0), train_reply(2, ref[2], 4, {"reward-mean": 1.0}),
               spoofed]
    entry = train_round(strategy, 1, replies)  # client 4 never answers, client 5 was absent
    assert entry is not None and entry["client_actor_ids"] == [0]
    rejected = entry["rejected"]
    assert "'num-examples' = 0.0 is not a positive number" in rejected["1"]
    assert "malformed reply" in rejected["2"] and "num-examples" in rejected["2"]
    assert "claims client 0" in rejected["3"]
    assert rejected["4"] == "no reply within the round timeout"
    assert rejected["5"] == "no SuperNode serves this partition now"


def test_a_train_reply_with_a_share_outside_0_1_is_refused_naming_the_metric(suite: Suite, tmp_path: Path) -> None:
    # A share of episodes above 1 (or NaN) would be recorded as is ("150%"), and its success rate
    # would enter the client curve and the learning checks.
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), clients=5)
    ref = {c: CheckpointRef.for_directory(suite.copy(n, client_slot(run_root, c))) for c, n in
           [(0, "qwen_a"), (1, "qwen_b"), (2, "qwen_c"), (3, "qwen_plain"), (4, "qwen_a")]}
    bad = {1: {"success-rate": 1.5}, 2: {"truncated-rate": float("nan")}, 3: {"client-val-success-rate": -0.1},
           4: {"truncated-rate": [0.5]}}
    replies = [train_reply(0, ref[0], 4)] + [train_reply(c, ref[c], 4, {"num-examples": 4, "reward-mean": 0.5,
                                                              "success-rate": 0.25, **m}) for c, m in bad.items()]
    entry = train_round(strategy, 1, replies)
    assert entry is not None and entry["client_actor_ids"] == [0]
    assert entry["rejected"]["1"] == "malformed reply: metric 'success-rate' = 1.5 is not between 0 and 1"
    assert entry["rejected"]["2"] == "malformed reply: metric 'truncated-rate' = nan is not between 0 and 1"
    assert "'client-val-success-rate' = -0.1" in entry["rejected"]["3"]
    # a list is a MetricRecord value too
    assert "'truncated-rate' = [0.5] is not between 0 and 1" in entry["rejected"]["4"]


class _DamageWhileStreaming(FedAvgFSDP):
    """Damages client 1's shard after every check passed, as a failing disk would."""

    def aggregate_checkpoints(self, server_round, sources, out_dir, reference):  # type: ignore[no-untyped-def]
        for reader, _ in sources:
            for shard in Path(reader.directory).glob("model_world_size_2_rank_1.pt"):
                os.truncate(shard, shard.stat().st_size // 2)
        return super().aggregate_checkpoints(server_round, sources, out_dir, reference)


def test_a_checkpoint_failing_mid_stream_is_dropped_and_the_mean_recomputed(suite: Suite, tmp_path: Path) -> None:
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), cls=_DamageWhileStreaming,
                                            clients=2)
    good = CheckpointRef.for_directory(suite.copy("qwen_a", client_slot(run_root, 0)))
    damaged = CheckpointRef.for_directory(suite.copy("qwen_b", client_slot(run_root, 1)))  # world size 2
    entry = train_round(strategy, 1, [train_reply(0, good, 4), train_reply(1, damaged, 4)])
    assert entry is not None and entry["client_actor_ids"] == [0]
    assert "model_world_size_2_rank_1.pt" in entry["rejected"]["1"]
    aggregate = load_file(str(Path(strategy.global_model.path) / "model.safetensors"))
    expected = suite.expected("qwen_a")
    assert max((aggregate[k] - expected[k].float()).abs().max().item() for k in aggregate) == 0.0
    assert not [p for p in (run_root / "round_1").iterdir() if p.name.startswith(".")]


def test_verify_command_recomputes_rounds_and_catches_tampering(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    from fedagent_flwr.checkpoint.verify import main as verify

    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), clients=2)
    refs = [CheckpointRef.for_directory(suite.copy(n, client_slot(run_root, c)))
            for c, n in enumerate(("qwen_a", "qwen_b"))]
    train_round(strategy, 1, [train_reply(0, refs[0], 3), train_reply(1, refs[1], 5)])
    assert verify([str(run_root)]) == 0
    summary_path = run_root / "federated_summary.json"
    summary = json.loads(summary_path.read_text())
    assert summary["content_hash"] == "v2"
    # a run recorded by an earlier version (content hash v1): no hash can be compared, which fails the
    # audit with one line naming the record, unless --allow-unhashed says the run predates them; then
    # its means are still recomputed
    summary_path.write_text(json.dumps({k: v for k, v in summary.items() if k != "content_hash"}))
    capsys.readouterr()
    assert verify([str(run_root)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [
        f"verify: {summary_path} records checkpoint content hashes v1 (no content_hash field) and this fedagent-flwr "
        "computes v2, so no hash "
        "can be checked; pass --allow-unhashed if the run predates content hashes v2 (the rounds are then "
        "recomputed without them)"], captured
    assert verify([str(run_root), "--allow-unhashed"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("note: this run recorded checkpoint content hashes v1") and out[1].endswith(" ok"), out
    summary_path.write_text(json.dumps(summary))
    shard = Path(refs[1].path) / "model_world_size_2_rank_0.pt"
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")  # a client file altered afterwards
    assert verify([str(run_root)]) == 1


def test_ppo_critics_are_averaged_like_the_actors_and_sent_with_the_next_round(suite: Suite, tmp_path: Path) -> None:
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), clients=2)
    episodes = {0: 3, 1: 9}

    def ppo_reply(client: int, server_round: int) -> Message:
        actor = CheckpointRef.for_directory(
            suite.copy(["qwen_a", "qwen_b"][client], client_slot(run_root, client, server_round) / "a"))
        critic_dir = suite.copy(["qwen_b", "qwen_plain"][client], client_slot(run_root, client, server_round) / "c")
        critic = CheckpointRef.for_directory(critic_dir, "critic")
        instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="train")
        content = TrainReply(client_id=client, actor=actor, critic=critic, metrics={"num-examples": episodes[client]})
        return Message(content.to_record(), reply_to=instruction)

    train_round(strategy, 1, [ppo_reply(0, 1), ppo_reply(1, 1)])
    assert strategy.global_critic is not None
    assert strategy.global_critic.path == str(run_root / "round_1" / "global_critic")
    assert strategy.global_critic.kind == "critic"
    critic_sources = [(open_checkpoint(CheckpointRef.for_directory(client_slot(run_root, c) / "c" / name, "critic"),
                                       root=run_root),
                       float(episodes[c])) for c, name in enumerate(["qwen_b", "qwen_plain"])]
    assert verify_mean(critic_sources, strategy.global_critic.path) < 1e-6
    entry = json.loads((run_root / "federated_summary.json").read_text())["rounds"][0]
    assert entry["aggregated_critic"] == strategy.global_critic.path and len(entry["client_critics"]) == 2

    # The next instruction carries the global critic next to the global actor.
    instruction = strategy.train_instruction(2, 0, ConfigRecord())
    assert instruction.global_critic == strategy.global_critic and instruction.global_critic.kind == "critic"
    # Round 2: the critics are checked against the global critic and averaged again.
    train_round(strategy, 2, [ppo_reply(0, 2), ppo_reply(1, 2)])
    assert strategy.global_critic.path == str(run_root / "round_2" / "global_critic")


def test_a_client_with_nan_weights_is_refused_by_name_and_updates_are_measured(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    initial = initial_checkpoint(tmp_path)
    strategy, run_root = connected_strategy(tmp_path, initial, clients=3)
    start = load_file(str(Path(initial.path) / "model.safetensors"))
    refs = {}
    for client, scale in ((0, 1.0), (1, -1.0), (2, 0.5)):
        directory = client_slot(run_root, client) / "actor"
        directory.mkdir(parents=True)
        for item in Path(initial.path).iterdir():
            if item.name != "model.safetensors":
                (directory / item.name).write_bytes(item.read_bytes())
        state = {k: v + scale * 1e-3 for k, v in start.items()}
        if client == 2:
            state[sorted(state)[0]].view(-1)[0] = float("nan")
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        refs[client] = CheckpointRef.for_directory(directory)
    entry = train_round(strategy, 1, [train_reply(c, refs[c], 4) for c in refs])
    assert entry is not None and entry["client_actor_ids"] == [0, 1]
    assert "non-finite" in entry["rejected"]["2"] and "client_2" in entry["rejected"]["2"]
    stats = entry["update_stats"]
    assert stats["clients"] == [0, 1] and stats["mode"] == "full"
    # +1e-3 and -1e-3 on every weight: equal norms, opposite directions, the mean did not move.
    numel = sum(v.numel() for v in start.values())
    assert stats["client_update_norm"] == pytest.approx([1e-3 * numel ** 0.5] * 2, rel=1e-3)
    assert stats["cosine"][0][1] == pytest.approx(-1.0, abs=1e-4)
    assert stats["mean_update_norm"] < 1e-3 * stats["client_update_norm"][0]
    events = [json.loads(line) for line in (run_root / "metrics.jsonl").read_text().splitlines()]
    (aggregate,) = [e for e in events if e["event"] == "aggregate"]
    assert aggregate["update_stats"] == stats


def test_a_custom_aggregate_train_that_reports_nothing_is_recorded_from_the_global_model_it_left(
    tmp_path: Path,
) -> None:
    """A subclass may replace ``aggregate_train`` without setting ``last_aggregation``. The round is
    still recorded, from the global model it left: a new one is the round's aggregate (the run can
    complete), an unchanged one is a round that aggregated nothing (never ``completed``)."""
    initial = initial_checkpoint(tmp_path)

    class OwnRule(FedAvgFSDP):
        def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[None, None]:
            if server_round == 1:  # a rule of its own that writes a new global model and says nothing
                target = Path(self.run_root) / "round_1" / "global"
                shutil.copytree(self.global_model.path, target)
                self.global_model = CheckpointRef.for_directory(target)
            return None, None  # round 2: nothing usable, the model stays

    run_root = tmp_path / "run"
    run_root.mkdir()
    recorder = RunRecorder(run_root, {"base_model": initial.path})
    strategy = connect(OwnRule(run_root=str(run_root), initial_model=initial, num_clients=2, clients_per_round=2),
                       recorder, [0, 1])
    first = train_round(strategy, 1, [train_reply(0, initial, 4), train_reply(1, initial, 4)])
    assert first is not None and first["aggregated_actor"] == str(run_root / "round_1" / "global")
    assert first["started_from"] == initial.path and first["aggregated_sha256"] == strategy.global_model.sha256
    second = train_round(strategy, 2, [train_reply(0, initial, 4), train_reply(1, initial, 4)])
    assert second is not None and second["round"] == 2 and second["aggregated_actor"] is None
    status, why = recorder.outcome()
    assert status == "degraded" and "round(s) [2] aggregated no client checkpoint" in why, (status, why)
