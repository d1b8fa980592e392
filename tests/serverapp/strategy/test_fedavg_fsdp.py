"""FedAvgFSDP's aggregate_train on real FSDP checkpoints: good clients averaged, bad ones
refused by name, the previous global model kept when nothing is usable, and no earlier round's
output touched."""

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
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from safetensors.torch import load_file

from fedagent_flwr.checkpoint import CheckpointRef, open_checkpoint, verify_mean
from fedagent_flwr.protocol import TrainReply
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.strategy import FedAvgFSDP
from testkit.ckpt_factory import ModelSpec, Suite, write_hf_checkpoint
from testkit.round_harness import connect, eval_round, train_round


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    # Flower sets this inside real runs; building Messages in a unit test needs it too.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


def _reply(client: int, ref: CheckpointRef, episodes: float, metrics: dict | None = None) -> Message:
    """A train reply as client ``client``'s node (node 100 + client) would send it."""
    instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="train")
    values = {"num-examples": episodes, "reward-mean": 0.5, "success-rate": 0.25} if metrics is None else metrics
    return Message(TrainReply(client_id=client, actor=ref, metrics=values).to_record(), reply_to=instruction)


def _error_reply(client: int) -> Message:
    instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="train")
    return Message(Error(code=0, reason="trainer exited with code 1"), reply_to=instruction)


def _strategy(tmp_path: Path, initial: CheckpointRef, cls: type[FedAvgFSDP] = FedAvgFSDP,
              clients: int = 6, served: int | None = None) -> tuple[FedAvgFSDP, Path]:
    """All ``clients`` selected every round; node 100 + c serves client c for the first ``served``."""
    run_root = tmp_path / "run"
    run_root.mkdir()
    recorder = RunRecorder(run_root, {"base_model": initial.path, "env_kind": "test", "mode": "federated",
                                      "strategy": "fedavg"})
    strategy = cls(run_root=str(run_root), initial_model=initial, num_clients=clients, clients_per_round=clients)
    connect(strategy, recorder, range(clients if served is None else served))
    return strategy, run_root


def _slot(run_root: Path, client: int, server_round: int = 1) -> Path:
    """Where client ``client`` writes its checkpoints of ``server_round`` (the only place the server
    takes them from)."""
    return run_root / f"round_{server_round}" / f"client_{client}"


def _failed_eval(client: int, reason: str) -> Message:
    """An evaluation reply of client ``client``'s node that is an error with ``reason``."""
    instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="evaluate")
    return Message(Error(code=0, reason=reason), reply_to=instruction)


def _stub_model(tmp_path: Path) -> Path:
    """A model directory with one (unreadable) weight file: enough where no weight is read."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x")
    return model


def _initial(tmp_path: Path) -> CheckpointRef:
    write_hf_checkpoint(ModelSpec("global", "qwen2", seed=9), tmp_path / "base")
    return CheckpointRef.for_directory(tmp_path / "base")


def test_good_clients_of_any_world_size_are_averaged_by_num_examples(suite: Suite, tmp_path: Path) -> None:
    strategy, run_root = _strategy(tmp_path, _initial(tmp_path), clients=3)
    refs = {c: CheckpointRef.for_directory(suite.copy(name, _slot(run_root, c))) for c, name in
            enumerate(["qwen_a", "qwen_b", "qwen_plain"])}
    episodes = {0: 4, 1: 8, 2: 12}
    arrays, metrics = strategy.aggregate_train(1, [_reply(c, refs[c], episodes[c]) for c in refs])
    assert arrays is None  # no weights travel: the new global model is a reference
    assert metrics is not None and metrics["reward-mean"] == pytest.approx(0.5)
    assert strategy.global_model.path == str(run_root / "round_1" / "global")
    sources = [(open_checkpoint(refs[c], root=run_root), float(episodes[c])) for c in refs]
    assert verify_mean(sources, strategy.global_model.path) < 1e-6
    result = strategy.last_aggregation
    assert result is not None and sorted(result.client_actors) == [0, 1, 2] and result.actor == strategy.global_model


def test_bad_clients_are_refused_by_name_and_the_round_goes_on(suite: Suite, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    strategy, run_root = _strategy(tmp_path, _initial(tmp_path))
    good = CheckpointRef.for_directory(suite.copy("qwen_a", _slot(run_root, 0)))
    outside = CheckpointRef.for_directory(suite.copy("qwen_b", tmp_path))
    wrong_hash = CheckpointRef.for_directory(suite.copy("qwen_c", _slot(run_root, 2)))
    wrong_hash = CheckpointRef(**{**wrong_hash.__dict__, "sha256": "0" * 64})
    truncated_dir = suite.copy("qwen_plain", _slot(run_root, 3))
    shard = truncated_dir / "model_world_size_1_rank_0.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    truncated = CheckpointRef.for_directory(truncated_dir)  # hashed as truncated: the reader must catch it
    other_shapes = CheckpointRef.for_directory(suite.copy("llama_tied_a", _slot(run_root, 4)))
    replies = [_reply(0, good, 4), _reply(1, outside, 4), _reply(2, wrong_hash, 4), _reply(3, truncated, 4),
               _reply(4, other_shapes, 4), _error_reply(5)]
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
    strategy, run_root = _strategy(tmp_path, _initial(tmp_path))
    first = CheckpointRef.for_directory(suite.copy("qwen_a", _slot(run_root, 0)))
    train_round(strategy, 1, [_reply(0, first, 4)], sent=[0])
    round_one = strategy.global_model
    digest = hashlib.sha256((Path(round_one.path) / "model.safetensors").read_bytes()).hexdigest()

    broken = CheckpointRef(**{**CheckpointRef.for_directory(suite.copy("qwen_b", tmp_path / "x")).__dict__})
    with caplog.at_level(logging.WARNING):
        train_round(strategy, 2, [_reply(0, broken, 4), _error_reply(1)], sent=[0, 1])
    assert strategy.global_model == round_one
    assert "no valid client checkpoint; keeping the previous global model" in caplog.text
    assert not (run_root / "round_2" / "global").exists()
    summary = json.loads((run_root / "federated_summary.json").read_text())
    assert summary["rounds"][1]["aggregated_actor"] is None and summary["final_model"] == round_one.path
    assert hashlib.sha256((Path(round_one.path) / "model.safetensors").read_bytes()).hexdigest() == digest
    assert torch.equal(load_file(str(Path(round_one.path) / "model.safetensors"))["lm_head.weight"],
                       suite.expected("qwen_a")["lm_head.weight"].float())


def test_bad_weights_missing_metrics_silence_and_spoofed_ids_are_refused(suite: Suite, tmp_path: Path) -> None:
    strategy, run_root = _strategy(tmp_path, _initial(tmp_path), served=5)  # no node serves client 5
    ref = {c: CheckpointRef.for_directory(suite.copy(n, _slot(run_root, c))) for c, n in
           [(0, "qwen_a"), (1, "qwen_b"), (2, "qwen_c"), (3, "qwen_plain")]}
    instruction = Message(RecordDict(), dst_node_id=103, message_type="train")
    spoofed = Message(TrainReply(client_id=0, actor=ref[3], metrics={"num-examples": 4}).to_record(),
                      reply_to=instruction)  # node of client 3 claims to be client 0
    replies = [_reply(0, ref[0], 4), _reply(1, ref[1], 0), _reply(2, ref[2], 4, {"reward-mean": 1.0}), spoofed]
    entry = train_round(strategy, 1, replies)  # client 4 never answers, client 5 was absent
    assert entry is not None and entry["client_actor_ids"] == [0]
    rejected = entry["rejected"]
    assert "'num-examples' = 0.0 is not a positive number" in rejected["1"]
    assert "malformed reply" in rejected["2"] and "num-examples" in rejected["2"]
    assert "claims client 0" in rejected["3"]
    assert rejected["4"] == "no reply within the round timeout"
    assert rejected["5"] == "no SuperNode serves this partition now"


class _DamageWhileStreaming(FedAvgFSDP):
    """Damages client 1's shard after every check passed, as a failing disk would."""

    def aggregate_checkpoints(self, server_round, sources, out_dir, reference):  # type: ignore[no-untyped-def]
        for reader, _ in sources:
            for shard in Path(reader.directory).glob("model_world_size_2_rank_1.pt"):
                os.truncate(shard, shard.stat().st_size // 2)
        return super().aggregate_checkpoints(server_round, sources, out_dir, reference)


def test_a_checkpoint_failing_mid_stream_is_dropped_and_the_mean_recomputed(suite: Suite, tmp_path: Path) -> None:
    strategy, run_root = _strategy(tmp_path, _initial(tmp_path), cls=_DamageWhileStreaming, clients=2)
    good = CheckpointRef.for_directory(suite.copy("qwen_a", _slot(run_root, 0)))
    damaged = CheckpointRef.for_directory(suite.copy("qwen_b", _slot(run_root, 1)))  # world size 2
    entry = train_round(strategy, 1, [_reply(0, good, 4), _reply(1, damaged, 4)])
    assert entry is not None and entry["client_actor_ids"] == [0]
    assert "model_world_size_2_rank_1.pt" in entry["rejected"]["1"]
    aggregate = load_file(str(Path(strategy.global_model.path) / "model.safetensors"))
    expected = suite.expected("qwen_a")
    assert max((aggregate[k] - expected[k].float()).abs().max().item() for k in aggregate) == 0.0
    assert not [p for p in (run_root / "round_1").iterdir() if p.name.startswith(".")]


def test_verify_command_recomputes_rounds_and_catches_tampering(suite: Suite, tmp_path: Path) -> None:
    from fedagent_flwr.checkpoint.verify import main as verify

    strategy, run_root = _strategy(tmp_path, _initial(tmp_path), clients=2)
    refs = [CheckpointRef.for_directory(suite.copy(n, _slot(run_root, c))) for c, n in enumerate(("qwen_a", "qwen_b"))]
    train_round(strategy, 1, [_reply(0, refs[0], 3), _reply(1, refs[1], 5)])
    assert verify([str(run_root)]) == 0
    summary_path = run_root / "federated_summary.json"
    summary = json.loads(summary_path.read_text())
    assert summary["content_hash"] == "v2"
    # a run recorded by an earlier version (content hash v1) still gets its means recomputed
    summary_path.write_text(json.dumps({k: v for k, v in summary.items() if k != "content_hash"}))
    assert verify([str(run_root)]) == 0
    summary_path.write_text(json.dumps(summary))
    shard = Path(refs[1].path) / "model_world_size_2_rank_0.pt"
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")  # a client file altered afterwards
    assert verify([str(run_root)]) == 1


def test_client_failures_are_recorded_as_the_clientapp_worded_them() -> None:
    from fedagent_flwr.serverapp.failures import readable_reason

    # What Flower's simulation reported on an H200 when a client's verl job failed (shortened).
    ray_wrapped = (
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m "
        "(pid=2142, ip=192.0.2.2)\n  File \"/x/fedagent_flwr/clientapp/app.py\", line 131, in train\n"
        "fedagent_flwr.clientapp.backend.TrainerFailed: client 1 round 1: verl trainer exited with code 1: "
        "verl_backend: error: verl ran out of GPU memory (CUDA out of memory) (log: /r/verl.log) (log: /r/train.log)\n"
        "Exception ClientAppException occurred. Message: client 1 round 1: verl trainer exited with code 1: "
        "verl_backend: error: verl ran out of GPU memory (CUDA out of memory) (log: /r/verl.log) (log: /r/train.log)'>"
    )
    assert readable_reason(ray_wrapped) == (
        "client 1 round 1: verl trainer exited with code 1: verl_backend: error: verl ran out of GPU memory "
        "(CUDA out of memory) (log: /r/verl.log) (log: /r/train.log)")
    assert readable_reason("Traceback (most recent call last):\n  ...\nKeyError: 'x'\n") == "KeyError: 'x'"
    assert readable_reason("plain words") == "plain words"


def test_a_clientapp_error_without_our_label_is_its_own_line_not_flowers_wrapper() -> None:
    """An exception the ClientApp raised itself (not a trainer failure), as a 2-client simulation
    reported it (shortened): Flower's ClientAppException line ends empty, the message follows on the
    next line, and the real exception line sits in the traceback."""
    from fedagent_flwr.serverapp.failures import readable_reason

    message = "WebShop data directory /nonexistent has no items_shuffle_1000.json; fetch the data with: " \
              "python -m fedagent_flwr.envs.webshop.download /nonexistent"
    simulation = (
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m "
        "(pid=10122, ip=192.0.2.2, actor_id=b220, repr=<flwr.simulation.ray_transport.ray_actor.ClientAppActor "
        "object at 0x7f9e024d6290>)\n  File \"/x/fedagent_flwr/clientapp/app.py\", line 155, in train\n"
        f"    env_spec, managers = serve_env_spec(\nfedagent_flwr.envs.base.EnvDataError: {message}\n\n"
        "The above exception was the direct cause of the following exception:\n\n"
        "ray::ClientAppActor.run() (pid=10122)\n  File \"/x/flwr/simulation/ray_transport/ray_actor.py\", "
        "line 65, in run\n    raise ClientAppException(str(ex)) from ex\n"
        "flwr.clientapp.client_app.ClientAppException: \n"
        f"Exception ClientAppException occurred. Message: {message}'>"
    )
    assert readable_reason(simulation) == f"EnvDataError: {message}"
    # Deployment: flwr-clientapp's "<class 'T'>:<'message'>".
    assert readable_reason(f"<class 'fedagent_flwr.envs.base.EnvDataError'>:<'{message}'>") == (
        f"EnvDataError: {message}")
    assert readable_reason("<class 'fedagent_flwr.clientapp.backend.TrainerFailed'>:<'client 0 round 2: "
                           "reference trainer exited with code 2\nsecond line'>") == (
        "client 0 round 2: reference trainer exited with code 2 second line")


def test_every_client_failing_alike_stops_the_run_after_recording_the_round(tmp_path: Path) -> None:
    from fedagent_flwr.serverapp.failures import RoundFailedError

    def failed(client: int, reason: str) -> Message:
        instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="train")
        return Message(Error(code=0, reason=reason), reply_to=instruction)

    def trainer_error(client: int, server_round: int, problem: str) -> str:
        return (f"client {client} round {server_round}: reference trainer exited with code 2: reference_trainer: "
                f"error: {problem} (log: /r/round_{server_round}/client_{client}/train.log)")

    strategy, run_root = _strategy(tmp_path, _initial(tmp_path), clients=2)
    # Different reasons: the round keeps the previous model and the run goes on.
    train_round(strategy, 1, [failed(0, trainer_error(0, 1, "out of memory")),
                              failed(1, trainer_error(1, 1, "killed"))])
    # The same reason (up to the client's number): nothing later can go better, so the run stops.
    with pytest.raises(RoundFailedError) as info:
        train_round(strategy, 2, [failed(c, trainer_error(c, 2, "unknown environment 'NoSuchEnv'")) for c in (0, 1)])
    assert str(info.value) == (
        "round 2: every client (2) failed the same way, so the run stops: client 0 round 2: reference trainer exited "
        "with code 2: reference_trainer: error: unknown environment 'NoSuchEnv' (log: /r/round_2/client_0/train.log)")
    summary = json.loads((run_root / "federated_summary.json").read_text())
    assert [entry["round"] for entry in summary["rounds"]] == [1, 2]  # the failed round is on record
    assert "NoSuchEnv" in summary["rounds"][1]["rejected"]["1"]


def test_ppo_critics_are_averaged_like_the_actors_and_sent_with_the_next_round(suite: Suite, tmp_path: Path) -> None:
    strategy, run_root = _strategy(tmp_path, _initial(tmp_path), clients=2)
    episodes = {0: 3, 1: 9}

    def ppo_reply(client: int, server_round: int) -> Message:
        actor = CheckpointRef.for_directory(
            suite.copy(["qwen_a", "qwen_b"][client], _slot(run_root, client, server_round) / "a"))
        critic_dir = suite.copy(["qwen_b", "qwen_plain"][client], _slot(run_root, client, server_round) / "c")
        critic = CheckpointRef.for_directory(critic_dir, "critic")
        instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="train")
        content = TrainReply(client_id=client, actor=actor, critic=critic, metrics={"num-examples": episodes[client]})
        return Message(content.to_record(), reply_to=instruction)

    train_round(strategy, 1, [ppo_reply(0, 1), ppo_reply(1, 1)])
    assert strategy.global_critic is not None
    assert strategy.global_critic.path == str(run_root / "round_1" / "global_critic")
    assert strategy.global_critic.kind == "critic"
    critic_sources = [(open_checkpoint(CheckpointRef.for_directory(_slot(run_root, c) / "c" / name, "critic"),
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

    initial = _initial(tmp_path)
    strategy, run_root = _strategy(tmp_path, initial, clients=3)
    start = load_file(str(Path(initial.path) / "model.safetensors"))
    refs = {}
    for client, scale in ((0, 1.0), (1, -1.0), (2, 0.5)):
        directory = _slot(run_root, client) / "actor"
        directory.mkdir(parents=True)
        for item in Path(initial.path).iterdir():
            if item.name != "model.safetensors":
                (directory / item.name).write_bytes(item.read_bytes())
        state = {k: v + scale * 1e-3 for k, v in start.items()}
        if client == 2:
            state[sorted(state)[0]].view(-1)[0] = float("nan")
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        refs[client] = CheckpointRef.for_directory(directory)
    entry = train_round(strategy, 1, [_reply(c, refs[c], 4) for c in refs])
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


def test_every_evaluating_client_failing_alike_stops_the_run(tmp_path: Path) -> None:
    from fedagent_flwr.serverapp.failures import RoundFailedError

    model = _stub_model(tmp_path)
    strategy, _ = _strategy(tmp_path, CheckpointRef.for_directory(model), clients=2)
    eval_error = ("client {c} eval round 0: reference trainer exited with code 2: "
                  "error: TinyGuess config 'hi' (10) must be >= 'lo' (20)")
    # One client failed, the other never answered: different reasons, the run goes on.
    assert strategy.aggregate_evaluate(0, [_failed_eval(0, eval_error.format(c=0))]) is None
    eval_round(strategy, 0, [_failed_eval(0, eval_error.format(c=0))], sent=[0, 1])
    with pytest.raises(RoundFailedError,
                       match=r"^evaluation of round 0: every client \(2\) failed the same way, "
                             r"so the run stops: client 0 eval round 0: .*'hi' \(10\) must be >= 'lo'"):
        eval_round(strategy, 0, [_failed_eval(c, eval_error.format(c=c)) for c in (0, 1)], sent=[0, 1])


def test_an_evaluation_where_only_some_clients_report_a_score_is_recorded_without_it(tmp_path: Path) -> None:
    """An evaluating client reports ``score-mean`` only when the env scored every one of its
    episodes (an episode cut off before its first turn has no score), so one client's reply may
    carry it and another's not: the round's evaluation is recorded, episode-weighted, without the
    score (a mean over the scoring clients' share would read low), instead of Flower's
    all-replies-alike check stopping the run."""
    from fedagent_flwr.protocol import EvalReply

    def evaluated(client: int, reply: EvalReply) -> Message:
        instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="evaluate")
        return Message(reply.to_record(), reply_to=instruction)

    model = _stub_model(tmp_path)
    strategy, run_root = _strategy(tmp_path, CheckpointRef.for_directory(model), clients=2)
    replies = [evaluated(0, EvalReply(num_examples=2, success_rate=0.5, reward_mean=5.0, score_mean=0.75)),
               evaluated(1, EvalReply(num_examples=6, success_rate=0.0, reward_mean=0.0))]
    eval_round(strategy, 1, replies, sent=[0, 1])
    (point,) = json.loads((run_root / "federated_summary.json").read_text())["val_curve"]
    assert point["n"] == 8 and point["success_rate"] == pytest.approx(0.125)
    assert point["reward_mean"] == pytest.approx(1.25) and "score_mean" not in point
    # every client scored: the score is the episode-weighted mean
    scored = [evaluated(0, EvalReply(num_examples=2, success_rate=0.5, reward_mean=5.0, score_mean=0.75)),
              evaluated(1, EvalReply(num_examples=6, success_rate=0.0, reward_mean=0.0, score_mean=0.25))]
    eval_round(strategy, 2, scored, sent=[0, 1])
    last = json.loads((run_root / "federated_summary.json").read_text())["val_curve"][-1]
    assert last["n"] == 8 and last["score_mean"] == pytest.approx(0.375)


def _evaluated(client: int, metrics: dict) -> Message:
    """An evaluation reply of client ``client``'s node (node 100 + client) carrying ``metrics``."""
    instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="evaluate")
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=instruction)


def test_a_malformed_evaluation_reply_is_a_failure_of_the_client_that_sent_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An evaluation reply without a usable ``num-examples`` (missing, a fraction, a list) is refused
    as a bad train reply is: by the client's and node's name, recorded as that client's failure, the
    other clients' episodes averaged. It used to stop the run with Flower's 'All MetricRecords must
    have the same keys', naming nobody, or was silently counted (4.5 episodes read as 4)."""
    from fedagent_flwr.serverapp.failures import RoundFailedError

    model = _stub_model(tmp_path)
    strategy, run_root = _strategy(tmp_path, CheckpointRef.for_directory(model), clients=2)
    good = {"num-examples": 4, "success-rate": 0.25, "reward-mean": 2.5}
    missing = {"success-rate": 0.5, "reward-mean": 5.0}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        eval_round(strategy, 1, [_evaluated(0, good), _evaluated(1, missing)], sent=[0, 1])
        eval_round(strategy, 2, [_evaluated(0, good), _evaluated(1, {**good, "num-examples": 4.5})], sent=[0, 1])
    summary = json.loads((run_root / "federated_summary.json").read_text())
    first, second = summary["val_curve"]
    assert first["n"] == 4 and first["success_rate"] == pytest.approx(0.25), first  # client 0's episodes only
    assert list(first["failed"]) == ["1"] and "client 1 (node 101)" in first["failed"]["1"]
    assert "'num-examples' is missing" in first["failed"]["1"], first["failed"]
    assert second["n"] == 4 and "'num-examples' must be int, got float '4.5'" in second["failed"]["1"], second
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("round 1" in w and "client 1 (node 101)" in w and "num-examples" in w for w in warnings), warnings
    # Every client's reply malformed in different ways: the evaluation recorded nothing, the run is degraded.
    eval_round(strategy, 3, [_evaluated(0, missing), _evaluated(1, {**good, "num-examples": [4]})], sent=[0, 1])
    lost = json.loads((run_root / "federated_summary.json").read_text())["eval_failures"]
    assert [(e["round"], sorted(e["failed"])) for e in lost] == [(3, ["0", "1"])]
    assert "client 1 (node 101)" in lost[0]["failed"]["1"] and "'num-examples' must be int" in lost[0]["failed"]["1"]
    # ... in the same way: the run stops, naming the problem.
    with pytest.raises(RoundFailedError, match=r"^evaluation of round 4: every client \(2\) failed the same way, "
                                               r"so the run stops: malformed evaluation reply from client 0 "
                                               r"\(node 100\): .*'num-examples' is missing"):
        eval_round(strategy, 4, [_evaluated(0, missing), _evaluated(1, missing)], sent=[0, 1])


def test_refused_replies_from_nodes_the_registry_does_not_know_are_recorded_one_per_node(tmp_path: Path) -> None:
    """Replies from nodes that serve no known partition are refused (a train reply at once, an
    evaluation reply that is malformed), each under its own key, minus its node id: they all used
    to be keyed -1, so only the last one was recorded and the others' reasons were lost."""
    model = _initial(tmp_path)
    strategy, run_root = _strategy(tmp_path, model, clients=2)  # nodes 100 and 101; 200 and 201 are no client's
    good = {"num-examples": 4, "success-rate": 0.25, "reward-mean": 2.5}
    replies = [_evaluated(0, good), _evaluated(1, good), _evaluated(100, {"success-rate": 0.5, "reward-mean": 5.0}),
               _evaluated(101, {**good, "success-rate": 2.0})]
    eval_round(strategy, 1, replies, sent=[0, 1])
    assert strategy.evaluation_refused == {
        -200: "malformed evaluation reply from unknown node 200: reply field 'num-examples' is missing",
        -201: "malformed evaluation reply from unknown node 201: 'success-rate' = 2.0 is not between 0 and 1",
    }
    (point,) = json.loads((run_root / "federated_summary.json").read_text())["val_curve"]
    assert point["n"] == 8 and sorted(point["failed"]) == ["-200", "-201"], point
    assert strategy.aggregate_train(1, [_reply(100, model, 4), _reply(101, model, 4)]) == (None, None)
    assert strategy.last_aggregation is not None and strategy.last_aggregation.refused == {
        -200: "reply from unknown node 200", -201: "reply from unknown node 201"}


def test_error_replies_from_nodes_the_registry_does_not_know_are_recorded_one_per_node(tmp_path: Path) -> None:
    """Error replies (a failed train or evaluation) of two unknown nodes are both recorded, under
    minus their node ids: keyed by ``client_of`` (-1 for both), the second one overwrote the first."""
    model = _initial(tmp_path)
    strategy, run_root = _strategy(tmp_path, model, clients=2)  # nodes 100 and 101; 200 and 201 are no client's
    _slot(run_root, 0).mkdir(parents=True)
    shutil.copytree(model.path, _slot(run_root, 0) / "huggingface")
    entry = train_round(strategy, 1, [_reply(0, CheckpointRef.for_directory(_slot(run_root, 0) / "huggingface"), 4),
                                      _error_reply(100), _error_reply(101)], sent=[0, 1])
    assert entry is not None
    rejected = entry["rejected"]
    # the recorded reason names the unknown node (the summary lists its key as "client -200")
    assert rejected.get("-200") == "error reply from unknown node 200: trainer exited with code 1", entry
    assert rejected.get("-201") == "error reply from unknown node 201: trainer exited with code 1", entry
    good = {"num-examples": 4, "success-rate": 0.25, "reward-mean": 2.5}
    eval_round(strategy, 1, [_evaluated(0, good), _evaluated(1, good), _failed_eval(100, "out of memory"),
                             _failed_eval(101, "env service gone")], sent=[0, 1])
    (point,) = json.loads((run_root / "federated_summary.json").read_text())["val_curve"]
    assert point["failed"] == {"-200": "error reply from unknown node 200: out of memory",
                               "-201": "error reply from unknown node 201: env service gone"}, point


@pytest.mark.parametrize(("change", "why"), [
    ({"num-examples": 0}, "'num-examples' = 0 is not a positive number of episodes"),
    ({"success-rate": 1.5}, "'success-rate' = 1.5 is not between 0 and 1"),
    ({"reward-mean": float("nan")}, "'reward-mean' not finite"),
    ({"score-mean": float("inf")}, "'score-mean' not finite"),
])
def test_an_evaluation_reply_with_impossible_values_is_refused(tmp_path: Path, change: dict, why: str) -> None:
    strategy, _ = _strategy(tmp_path, CheckpointRef.for_directory(_stub_model(tmp_path)), clients=2)
    good = {"num-examples": 4, "success-rate": 0.25, "reward-mean": 2.5}
    metrics = strategy.aggregate_evaluate(1, [_evaluated(0, good), _evaluated(1, {**good, **change})])
    assert metrics is not None and metrics["num-examples"] == 4
    assert strategy.evaluation_refused == {1: f"malformed evaluation reply from client 1 (node 101): {why}"}


def test_evaluating_clients_that_failed_are_in_the_log_the_summary_and_metrics_and_survive_a_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An evaluation that lost clients for different reasons goes on (only a shared reason stops the
    run), but is not silent: a partial one's point names the clients it lacks, and one that
    recorded nothing at all (its round has no point in ``val_curve``) is in ``eval_failures``."""
    from fedagent_flwr.protocol import EvalReply
    from fedagent_flwr.serverapp.resume import load_previous_run

    def evaluated(client: int) -> Message:
        instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="evaluate")
        return Message(EvalReply(num_examples=4, success_rate=0.25, reward_mean=2.5).to_record(), reply_to=instruction)

    model = _stub_model(tmp_path)
    run_root = tmp_path / "run"
    header = {"base_model": str(model), "total_rounds": 2, "config_sha256": None}
    recorder = RunRecorder(run_root, header)
    strategy = FedAvgFSDP(run_root=str(run_root), initial_model=CheckpointRef.for_directory(model), num_clients=2,
                          clients_per_round=2)
    connect(strategy, recorder, [0, 1])
    disk = "client 1 eval round 1: OSError: [Errno 28] No space left on device"
    with caplog.at_level(logging.WARNING, logger="flwr"):
        eval_round(strategy, 1, [evaluated(0), _failed_eval(1, disk)], sent=[0, 1])
        recorder.complete_round(1)
        # round 2: client 0 failed, client 1 never answered; different reasons, so the run goes on
        eval_round(strategy, 2, [_failed_eval(0, "client 0 eval round 2: TrainerFailed: killed")], sent=[0, 1])
        recorder.complete_round(2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("round 1" in w and "client 1" in w and "No space left" in w for w in warnings), warnings
    assert any("round 2" in w and "recorded nothing" in w and "no reply" in w for w in warnings), warnings
    summary = json.loads(recorder.summary_path.read_text())
    (point,) = summary["val_curve"]
    assert point["round"] == 1 and point["n"] == 4 and point["failed"] == {"1": disk}
    assert summary["eval_failures"] == [{"round": 2, "model": "aggregated", "failed": {
        "0": "client 0 eval round 2: TrainerFailed: killed", "1": "no reply within the round timeout"}}]
    events = [json.loads(line) for line in (run_root / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["round"]) for e in events] == [("evaluate", 1), ("evaluate_failed", 2)]
    assert events[0]["failed"] == {"1": disk} and events[1]["failed"] == summary["eval_failures"][0]["failed"]
    # A round without a validation point makes the run degraded (exit 3), saying which and why.
    status, why = recorder.outcome()
    assert status == "degraded", (status, why)
    assert "the evaluation of round(s) [2] recorded nothing" in why and "TrainerFailed: killed" in why, why
    # A re-run keeps what the committed rounds recorded.
    previous = load_previous_run(run_root, header)
    assert previous is not None
    again = json.loads(RunRecorder(run_root, header, previous).summary_path.read_text())
    assert again["eval_failures"] == summary["eval_failures"] and again["val_curve"] == summary["val_curve"]


def test_a_custom_aggregate_train_that_reports_nothing_is_recorded_from_the_global_model_it_left(
    tmp_path: Path,
) -> None:
    """A subclass may replace ``aggregate_train`` without setting ``last_aggregation``. The round is
    still recorded, from the global model it left: a new one is the round's aggregate (the run can
    complete), an unchanged one is a round that aggregated nothing (never ``completed``)."""
    initial = _initial(tmp_path)

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
    first = train_round(strategy, 1, [_reply(0, initial, 4), _reply(1, initial, 4)])
    assert first is not None and first["aggregated_actor"] == str(run_root / "round_1" / "global")
    assert first["started_from"] == initial.path and first["aggregated_sha256"] == strategy.global_model.sha256
    second = train_round(strategy, 2, [_reply(0, initial, 4), _reply(1, initial, 4)])
    assert second is not None and second["round"] == 2 and second["aggregated_actor"] is None
    status, why = recorder.outcome()
    assert status == "degraded" and "round(s) [2] aggregated no client checkpoint" in why, (status, why)
