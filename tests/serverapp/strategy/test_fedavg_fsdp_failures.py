"""FedAvgFSDP's failed clients: failures recorded as the ClientApp worded them, a run stopped when
every client (training or evaluating) fails the same way, and refused or error replies of nodes
the registry does not know recorded one per node."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from flwr.app import Error, Message, RecordDict

from fedagent_flwr.checkpoint import CheckpointRef
from testkit.client_replies import eval_reply, failed_eval_reply, failed_train_reply, train_reply
from testkit.round_harness import eval_round, train_round
from testkit.strategy_setup import client_slot, connected_strategy, initial_checkpoint, stub_model


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

    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), clients=2)
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


def test_every_evaluating_client_failing_alike_stops_the_run(tmp_path: Path) -> None:
    from fedagent_flwr.serverapp.failures import RoundFailedError

    model = stub_model(tmp_path)
    strategy, _ = connected_strategy(tmp_path, CheckpointRef.for_directory(model), clients=2)
    eval_error = ("client {c} eval round 0: reference trainer exited with code 2: "
                  "error: TinyGuess config 'hi' (10) must be >= 'lo' (20)")
    # One client failed, the other never answered: different reasons, the run goes on.
    assert strategy.aggregate_evaluate(0, [failed_eval_reply(0, eval_error.format(c=0))]) is None
    eval_round(strategy, 0, [failed_eval_reply(0, eval_error.format(c=0))], sent=[0, 1])
    with pytest.raises(RoundFailedError,
                       match=r"^evaluation of round 0: every client \(2\) failed the same way, "
                             r"so the run stops: client 0 eval round 0: .*'hi' \(10\) must be >= 'lo'"):
        eval_round(strategy, 0, [failed_eval_reply(c, eval_error.format(c=c)) for c in (0, 1)], sent=[0, 1])


def test_refused_replies_from_nodes_the_registry_does_not_know_are_recorded_one_per_node(tmp_path: Path) -> None:
    """Replies from nodes that serve no known partition are refused (a train reply at once, an
    evaluation reply that is malformed), each under its own key, minus its node id: they all used
    to be keyed -1, so only the last one was recorded and the others' reasons were lost."""
    model = initial_checkpoint(tmp_path)
    # nodes 100 and 101; 200 and 201 are no client's
    strategy, run_root = connected_strategy(tmp_path, model, clients=2)
    good = {"num-examples": 4, "success-rate": 0.25, "reward-mean": 2.5}
    replies = [eval_reply(0, good), eval_reply(1, good), eval_reply(100, {"success-rate": 0.5, "reward-mean": 5.0}),
               eval_reply(101, {**good, "success-rate": 2.0})]
    eval_round(strategy, 1, replies, sent=[0, 1])
    assert strategy.evaluation_refused == {
        -200: "malformed evaluation reply from unknown node 200: reply field 'num-examples' is missing",
        -201: "malformed evaluation reply from unknown node 201: 'success-rate' = 2.0 is not between 0 and 1",
    }
    (point,) = json.loads((run_root / "federated_summary.json").read_text())["val_curve"]
    assert point["n"] == 8 and sorted(point["failed"]) == ["-200", "-201"], point
    assert strategy.aggregate_train(1, [train_reply(100, model, 4), train_reply(101, model, 4)]) == (None, None)
    assert strategy.last_aggregation is not None and strategy.last_aggregation.refused == {
        -200: "reply from unknown node 200", -201: "reply from unknown node 201"}


def test_error_replies_from_nodes_the_registry_does_not_know_are_recorded_one_per_node(tmp_path: Path) -> None:
    """Error replies (a failed train or evaluation) of two unknown nodes are both recorded, under
    minus their node ids: keyed by ``client_of`` (-1 for both), the second one overwrote the first."""
    model = initial_checkpoint(tmp_path)
    # nodes 100 and 101; 200 and 201 are no client's
    strategy, run_root = connected_strategy(tmp_path, model, clients=2)
    client_slot(run_root, 0).mkdir(parents=True)
    shutil.copytree(model.path, client_slot(run_root, 0) / "huggingface")
    ref = CheckpointRef.for_directory(client_slot(run_root, 0) / "huggingface")
    entry = train_round(strategy, 1, [train_reply(0, ref, 4), failed_train_reply(100), failed_train_reply(101)],
                        sent=[0, 1])
    assert entry is not None
    rejected = entry["rejected"]
    # the recorded reason names the unknown node (the summary lists its key as "client -200")
    assert rejected.get("-200") == "error reply from unknown node 200: trainer exited with code 1", entry
    assert rejected.get("-201") == "error reply from unknown node 201: trainer exited with code 1", entry
    good = {"num-examples": 4, "success-rate": 0.25, "reward-mean": 2.5}
    eval_round(strategy, 1, [eval_reply(0, good), eval_reply(1, good), failed_eval_reply(100, "out of memory"),
                             failed_eval_reply(101, "env service gone")], sent=[0, 1])
    (point,) = json.loads((run_root / "federated_summary.json").read_text())["val_curve"]
    assert point["failed"] == {"-200": "error reply from unknown node 200: out of memory",
                               "-201": "error reply from unknown node 201: env service gone"}, point
