"""The server optimisers (FedAvgMFSDP, FedAdamFSDP, FedYogiFSDP, FedAdagradFSDP) on real FSDP
checkpoints: three rounds against the update computed independently in float64 on the full
tensors and against Flower's own strategy fed the same tensors as arrays; FedAvgM without momentum
and learning rate 1 is FedAvg bit for bit; a redone round (as a resumed run redoes it) gives the
same bits without touching the previous round's state, a lost state stops the run; PPO critics
keep their own state and a committed round keeps only the newest; bad settings are refused naming
the key."""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from safetensors import safe_open
from safetensors.torch import load_file

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.serverapp.app import build_strategy
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.resume import discard_uncommitted
from fedagent_flwr.serverapp.retention import Retention
from fedagent_flwr.serverapp.strategy import (
    FedAdagradFSDP,
    FedAdamFSDP,
    FedAvgFSDP,
    FedAvgMFSDP,
    FedYogiFSDP,
)
from fedagent_flwr.serverapp.strategy.server_optimizer import ServerOptimizerStateError, state_file
from testkit.ckpt_factory import Suite
from testkit.client_replies import train_reply
from testkit.round_harness import connect, train_round
from testkit.strategy_setup import client_slot, connected_strategy, initial_checkpoint, suite_ppo_reply, suite_replies

# (client checkpoint names, episodes) of client 0 and 1 in rounds 1, 2, 3
ROUNDS = [(("qwen_a", "qwen_b"), (4, 12)), (("qwen_b", "qwen_c"), (6, 6)), (("qwen_plain", "qwen_a"), (10, 2))]


def _play(strategy: FedAvgFSDP, run_root: Path, suite: Suite, server_round: int) -> Path:
    """Round ``server_round`` of :data:`ROUNDS`: the clients' copies, their replies, the aggregation."""
    replies = suite_replies(run_root, suite, *ROUNDS[server_round - 1], server_round)
    strategy.aggregate_train(server_round, replies)
    assert strategy.global_model.path == str(run_root / f"round_{server_round}" / "global")
    return Path(strategy.global_model.path)


def _oracle(rule: str, settings: dict[str, float], x0: dict[str, torch.Tensor], suite: Suite,
            rounds: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The global model and buffers after ``rounds`` rounds, in float64, from Flower's formulas."""
    x = {k: v.double() for k, v in x0.items()}
    buffers: dict[str, dict[str, torch.Tensor]] = {}
    for server_round in range(1, rounds + 1):
        names, episodes = ROUNDS[server_round - 1]
        states = [suite.expected(n) for n in names]
        for key in x:
            mean = sum(w / sum(episodes) * s[key].double() for s, w in zip(states, episodes))
            delta = mean - x[key]
            b = buffers.setdefault(key, {})
            if rule == "fedavgm":
                gradient = -delta
                if settings["server_momentum"] > 0:
                    previous = b.get("momentum")
                    b["momentum"] = gradient if previous is None else settings["server_momentum"] * previous + gradient
                    gradient = b["momentum"]
                x[key] = x[key] - settings["server_learning_rate"] * gradient
                continue
            beta_1, beta_2 = settings.get("beta_1", 0.0), settings.get("beta_2", 0.0)
            m = beta_1 * b.get("m", 0.0) + (1 - beta_1) * delta
            if beta_1 > 0:  # with beta_1 = 0, m is delta: no buffer is kept
                b["m"] = m
            v = b.get("v", torch.zeros_like(delta))
            if rule == "fedadam":
                b["v"] = beta_2 * v + (1 - beta_2) * delta**2
                eta = settings["eta"] * math.sqrt(1 - beta_2 ** (server_round + 1)) / (1 - beta_1 ** (server_round + 1))
            elif rule == "fedyogi":
                b["v"] = v - (1 - beta_2) * delta**2 * torch.sign(v - delta**2)
                eta = settings["eta"]
            else:
                b["v"] = v + delta**2
                eta = settings["eta"]
            x[key] = x[key] + eta * m / (b["v"].sqrt() + settings["tau"])
    return x, buffers


CASES: list[tuple[type[FedAvgFSDP], dict[str, float]]] = [
    (FedAvgMFSDP, {"server_learning_rate": 0.7, "server_momentum": 0.9}),
    (FedAdamFSDP, {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}),
    (FedYogiFSDP, {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}),
    (FedAdagradFSDP, {"eta": 1e-2, "tau": 1e-3}),
]


@pytest.mark.parametrize(("cls", "settings"), CASES, ids=[c.__name__ for c, _ in CASES])
def test_three_rounds_match_the_update_computed_independently(
    suite: Suite, tmp_path: Path, cls: type[FedAvgFSDP], settings: dict[str, float],
) -> None:
    initial = initial_checkpoint(tmp_path)
    strategy, run_root = connected_strategy(tmp_path, initial, cls, clients=2, **settings)
    rule = cls.rule_name  # type: ignore[attr-defined]
    x0 = load_file(str(Path(initial.path) / "model.safetensors"))
    for server_round in (1, 2, 3):
        global_dir = _play(strategy, run_root, suite, server_round)
        written = load_file(str(global_dir / "model.safetensors"))
        expected, buffers = _oracle(rule, settings, {k: x0[k] for k in written}, suite, server_round)
        error = max(float((written[k].double() - expected[k]).abs().max()) for k in expected)
        assert error < 2e-6, (server_round, error)
        moved = max(float((written[k].double() - x0[k].double()).abs().max()) for k in expected)
        assert moved > 1e-3  # the step is far larger than the tolerance
        with safe_open(str(global_dir / "model.safetensors"), framework="pt") as handle:
            assert (handle.metadata() or {})["fedagent.aggregation"] == rule
        state = state_file(global_dir)
        assert state.parent == run_root / f"round_{server_round}" / "server_optimizer"
        stored = load_file(str(state))
        names = sorted({k.split("/", 1)[0] for k in stored})
        assert names == sorted(next(iter(buffers.values())))
        for key, values in buffers.items():
            for name, value in values.items():
                scale = float(value.abs().max()) or 1.0
                assert float((stored[f"{name}/{key}"].double() - value).abs().max()) / scale < 1e-5, (name, key)
        with safe_open(str(state), framework="pt") as handle:
            metadata = handle.metadata() or {}
        assert metadata["fedagent.server_optimizer"] == rule and metadata["fedagent.step"] == str(server_round)
        assert not any(p.name == "server_optimizer" for p in global_dir.iterdir())  # clients download global/


@pytest.mark.parametrize(("cls", "settings"), CASES, ids=[c.__name__ for c, _ in CASES])
def test_three_rounds_match_flowers_own_strategy_on_the_same_tensors(
    suite: Suite, tmp_path: Path, cls: type[FedAvgFSDP], settings: dict[str, float],
) -> None:
    from flwr.serverapp import strategy as flower

    initial = initial_checkpoint(tmp_path)
    strategy, run_root = connected_strategy(tmp_path, initial, cls, clients=2, **settings)
    reference = getattr(flower, cls.__name__.removesuffix("FSDP"))(**settings)  # Flower's FedAdam, ...
    x0 = load_file(str(Path(initial.path) / "model.safetensors"))
    current: dict[str, torch.Tensor] = {}
    for server_round in (1, 2, 3):
        written = load_file(str(_play(strategy, run_root, suite, server_round) / "model.safetensors"))
        if not current:
            current = {k: x0[k] for k in written}
        # Flower's strategy keeps the model it sent (configure_train) and steps from it.
        if isinstance(reference, flower.FedAvgM):
            reference.current_arrays = reference.current_arrays or ArrayRecord(current)
        else:
            reference.current_arrays = {k: v.numpy() for k, v in current.items()}
        names, episodes = ROUNDS[server_round - 1]
        replies = []
        for client, (name, count) in enumerate(zip(names, episodes)):
            state = suite.expected(name)
            content = RecordDict({"arrays": ArrayRecord({k: state[k].float() for k in written}),
                                  "metrics": MetricRecord({"num-examples": count})})
            replies.append(Message(content, reply_to=Message(RecordDict(), dst_node_id=100 + client,
                                                             message_type="train")))
        arrays, _ = reference.aggregate_train(server_round, replies)
        assert arrays is not None
        current = {k: torch.from_numpy(v.numpy()) for k, v in arrays.items()}
        error = max(float((written[k].double() - current[k].double()).abs().max()) for k in written)
        assert error < 2e-6, (server_round, error)


def test_fedavgm_with_learning_rate_1_and_no_momentum_is_fedavg_bit_for_bit(suite: Suite, tmp_path: Path) -> None:
    initial = initial_checkpoint(tmp_path)
    outputs = {}
    for cls, kwargs in ((FedAvgFSDP, {}), (FedAvgMFSDP, {"server_learning_rate": 1, "server_momentum": 0.0})):
        work = tmp_path / cls.__name__
        work.mkdir()
        strategy, run_root = connected_strategy(work, initial, cls, clients=2, **kwargs)
        for server_round in (1, 2):
            global_dir = _play(strategy, run_root, suite, server_round)
        outputs[cls] = load_file(str(global_dir / "model.safetensors"))
        assert not (run_root / "round_2" / "server_optimizer").exists()
    fedavg, fedavgm = outputs[FedAvgFSDP], outputs[FedAvgMFSDP]
    assert fedavg.keys() == fedavgm.keys() and all(torch.equal(fedavg[k], fedavgm[k]) for k in fedavg)
    # a learning rate alone (no buffer) changes it: x + lr (mean - x)
    work = tmp_path / "lr"
    work.mkdir()
    strategy, run_root = connected_strategy(work, initial, FedAvgMFSDP, clients=2, server_learning_rate=0.5)
    assert not torch.equal(load_file(str(_play(strategy, run_root, suite, 1) / "model.safetensors"))
                           ["model.norm.weight"], outputs[FedAvgFSDP]["model.norm.weight"])
    assert not (run_root / "round_1" / "server_optimizer").exists()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_redone_round_gives_the_same_bits_and_leaves_the_previous_state_alone(suite: Suite, tmp_path: Path) -> None:
    settings: dict[str, Any] = {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99}
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), FedAdamFSDP, clients=2,
                                            **settings)
    _play(strategy, run_root, suite, 1)
    round_1_state = state_file(run_root / "round_1" / "global")
    before = (_digest(round_1_state), round_1_state.stat().st_mtime_ns)
    first = _play(strategy, run_root, suite, 2)
    model, state = _digest(first / "model.safetensors"), _digest(state_file(first))

    # A crash before round 2 committed: the re-run removes round 2's outputs and redoes it from round 1's model.
    removed = discard_uncommitted(run_root, 1)
    assert run_root / "round_2" / "server_optimizer" in removed and not first.exists()
    restored = CheckpointRef.for_directory(run_root / "round_1" / "global")  # what resume restores
    again = FedAdamFSDP(run_root=str(run_root), initial_model=restored, num_clients=2, clients_per_round=2, **settings)
    connect(again, RunRecorder(tmp_path / "rerun", {"strategy": "fedadam"}), range(2))
    redone = _play(again, run_root, suite, 2)
    assert _digest(redone / "model.safetensors") == model and _digest(state_file(redone)) == state
    assert (_digest(round_1_state), round_1_state.stat().st_mtime_ns) == before

    # Round 1's state lost: going on would silently restart the moments, so the run stops naming it.
    discard_uncommitted(run_root, 1)
    round_1_state.unlink()
    lost = FedAdamFSDP(run_root=str(run_root), initial_model=restored, num_clients=2, clients_per_round=2, **settings)
    connect(lost, RunRecorder(tmp_path / "lost", {"strategy": "fedadam"}), range(2))
    with pytest.raises(ServerOptimizerStateError, match="optimiser state .*round_1/server_optimizer/global.safetensors "
                                                        "is missing"):
        _play(lost, run_root, suite, 2)
    assert not (run_root / "round_2" / "global").exists()
    assert not list((run_root / "round_2" / "server_optimizer").glob("*"))  # no partial file left


def test_bad_settings_are_refused_naming_the_key(tmp_path: Path, tiny_model_dir: Path) -> None:
    base = CheckpointRef.for_directory(tiny_model_dir)
    cases = [
        ("strategy=fedadam +strategy.kwargs.eta=0", "strategy.kwargs.eta = 0 must be a number > 0.0"),
        ("strategy=fedadam +strategy.kwargs.beta_1=1.0", "strategy.kwargs.beta_1 = 1.0 must be a number >= 0.0 and <"),
        ("strategy=fedyogi +strategy.kwargs.beta_2=-0.1", r"strategy.kwargs.beta_2 = -0.1 must be a number >= 0.0"),
        ("strategy=fedadagrad +strategy.kwargs.tau=abc", "strategy.kwargs.tau = 'abc' must be a number > 0.0"),
        ("strategy=fedavgm +strategy.kwargs.server_momentum=1", "strategy.kwargs.server_momentum = 1 must be"),
        ("strategy=fedavgm +strategy.kwargs.server_learning_rate=-2", "strategy.kwargs.server_learning_rate = -2 must"),
        ("strategy=fedadagrad +strategy.kwargs.beta_1=0.5", "strategy.kwargs.beta_1 cannot be set: FedAdagrad fixes"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=f"rejected its arguments: .*{message}"):
            build_strategy(load_settings(overrides=overrides), tmp_path, base)
    strategy = build_strategy(load_settings(overrides="strategy=fedadam +strategy.kwargs.eta=1e-5 "
                                            "+strategy.kwargs.beta_2=0.999"), tmp_path, base)
    assert isinstance(strategy, FedAdamFSDP)
    assert (strategy.eta, strategy.beta_1, strategy.beta_2, strategy.tau) == (1e-5, 0.9, 0.999, 1e-3)
    strategy = build_strategy(load_settings(overrides="strategy=fedavgm +strategy.kwargs.server_momentum=0.9"),
                              tmp_path, base)
    assert isinstance(strategy, FedAvgMFSDP) and strategy.buffers() == ("momentum",)


def test_a_step_far_larger_than_fedavgs_is_warned_about(
        tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Flower's defaults (eta / tau = 100, FedYogi's 10) and Adam's regime with a large eta are
    warned about, with the factor; eta of FedAvg's order (3 tau) is not."""
    base = CheckpointRef.for_directory(tiny_model_dir)
    expected = {
        "strategy=fedadam": "eta / tau = 100: where the clients' change is below tau = 0.001",
        "strategy=fedadagrad": "step tends to 100 times FedAvg's change",
        "strategy=fedadam +strategy.kwargs.eta=1e-3 +strategy.kwargs.tau=1e-8": "every weight moves by about 0.001",
        "strategy=fedadam +strategy.kwargs.eta=3e-3": None,
        "strategy=fedyogi": "eta / tau = 10:",  # Flower's FedYogi: 6.5 times FedAvg's change by round 10
    }
    for overrides, needle in expected.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="flwr"):
            build_strategy(load_settings(overrides=overrides), tmp_path, base)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "eta" in r.getMessage()]
        if needle is None:
            assert warned == [], (overrides, warned)
        else:
            assert len(warned) == 1 and needle in warned[0], (overrides, warned)


def test_ppo_critic_keeps_its_own_state_and_committed_rounds_keep_only_the_newest_state(
    suite: Suite, tmp_path: Path,
) -> None:
    run_root = tmp_path / "run"
    run_root.mkdir()
    initial = initial_checkpoint(tmp_path)
    recorder = RunRecorder(run_root, {"base_model": initial.path, "env_kind": "test", "mode": "federated",
                                      "strategy": "fedadam"})
    strategy = FedAdamFSDP(run_root=str(run_root), initial_model=initial, num_clients=2, clients_per_round=2, eta=1e-3)
    connect(strategy, recorder, range(2))

    def ppo_reply(client: int, server_round: int) -> Message:
        return suite_ppo_reply(run_root, suite, client, server_round)

    def step_of(path: Path) -> str:
        with safe_open(str(path), framework="pt") as handle:
            return (handle.metadata() or {})["fedagent.step"]

    for server_round in (1, 2, 3):
        train_round(strategy, server_round, [ppo_reply(0, server_round), ppo_reply(1, server_round)])
    states = run_root / "round_1" / "server_optimizer"
    # Round 1's critics have no global critic to step from: FedAvg's mean, and no critic state yet.
    assert sorted(p.name for p in states.iterdir()) == ["global.safetensors"]
    with safe_open(str(run_root / "round_1" / "global_critic" / "model.safetensors"), framework="pt") as handle:
        assert (handle.metadata() or {})["fedagent.aggregation"] == "weighted_mean"
    round_3 = run_root / "round_3" / "server_optimizer"
    assert (step_of(round_3 / "global.safetensors"), step_of(round_3 / "global_critic.safetensors")) == ("3", "2")
    actor_state, critic_state = load_file(str(round_3 / "global.safetensors")), load_file(
        str(round_3 / "global_critic.safetensors"))
    assert actor_state.keys() == critic_state.keys()
    assert not torch.equal(actor_state["v/model.norm.weight"], critic_state["v/model.norm.weight"])

    # Once round 3 is committed only its states are needed; every global model stays (keep_last_k 0).
    freed = Retention(run_root).after_commit(recorder, 3)
    kept = sorted(p.relative_to(run_root).as_posix() for p in run_root.glob("round_*/server_optimizer/*"))
    assert freed > 0 and kept == ["round_3/server_optimizer/global.safetensors",
                                  "round_3/server_optimizer/global_critic.safetensors"]
    assert all((run_root / f"round_{r}" / "global").is_dir() for r in (1, 2, 3))
    assert recorder.summary["rounds"][1]["removed"]["server_optimizer_state"] > 0
    # Round 4 keeps round 3's model (a refused reply, a silent client): round 3's states stay; a
    # state round 4 left without its model (an aggregation redone without success) goes.
    slot = client_slot(run_root, 0, 4)
    train_round(strategy, 4, [train_reply(0, CheckpointRef.for_directory(suite.copy("qwen_a", slot)), 0)])
    assert strategy.global_model.path == str(run_root / "round_3" / "global")
    stray = run_root / "round_4" / "server_optimizer" / "global.safetensors"
    stray.parent.mkdir(parents=True)
    stray.write_bytes((round_3 / "global.safetensors").read_bytes())
    Retention(run_root).after_commit(recorder, 4)
    assert not stray.exists() and sorted(p.name for p in round_3.iterdir()) == ["global.safetensors",
                                                                                 "global_critic.safetensors"]
