"""A round's global model is checked against its content hash before the round is aggregated against it
(:func:`fedagent_flwr.serverapp.strategy.sources.round_sources`), in runs without LoRA too: its values
enter every client's update statistics and a server optimiser's step (FedAdam's pseudo-gradient), and
every client trained on it as the run recorded it. Real strategies on real FSDP client checkpoints
(:mod:`testkit.ckpt_factory`); the content hash is wrapped, never replaced (``count_hashed_files``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.checkpoint import CheckpointRef, audit_digests
from fedagent_flwr.serverapp.failures import RunFailedError
from fedagent_flwr.serverapp.strategy import FedAdamFSDP, FedAvgFSDP, fedavg_fsdp
from testkit.ckpt_factory import Suite
from testkit.file_change import flip_byte
from testkit.hash_count import count_hashed_files
from testkit.round_harness import train_round
from testkit.strategy_setup import connected_strategy, initial_checkpoint, suite_ppo_reply, suite_replies

ADAM = {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}
STRATEGIES: list[tuple[type[FedAvgFSDP], dict[str, float]]] = [(FedAvgFSDP, {}), (FedAdamFSDP, ADAM)]
IDS = [cls.__name__ for cls, _ in STRATEGIES]


@pytest.mark.parametrize(("cls", "settings"), STRATEGIES, ids=IDS)
def test_a_global_model_changed_on_disk_stops_the_round_naming_it(
        suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cls: type[FedAvgFSDP],
        settings: dict[str, float]) -> None:
    """Round 1's global model changes on disk (one byte, its mtime put back) after the clients trained
    round 2 on it: round 2 stops the run, naming the model and what to do, and aggregates nothing;
    without the change the same round aggregates, the model hashed once for the round."""
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), cls, clients=2, **settings)
    train_round(strategy, 1, suite_replies(run_root, suite, ("qwen_a", "qwen_b"), (4, 12), 1))
    global_1 = Path(strategy.global_model.path)
    replies = suite_replies(run_root, suite, ("qwen_b", "qwen_c"), (6, 6), 2)
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)  # round 1's model was written a moment ago
    weights = global_1 / "model.safetensors"
    flip_byte(weights, restore_mtime=True, at=-1)
    with pytest.raises(RunFailedError) as stopped:
        train_round(strategy, 2, replies)
    message = str(stopped.value)
    assert f"{global_1}, the round's global model, has content hash" in message
    assert f"restore {global_1} from a copy, or start the run over" in message
    assert strategy.global_model.path == str(global_1) and not (run_root / "round_2" / "global").exists()

    flip_byte(weights, restore_mtime=True, at=-1)  # the byte back: the model is as the server wrote it
    hashed = count_hashed_files(monkeypatch, Path.resolve)
    train_round(strategy, 2, replies)
    assert strategy.global_model.path == str(run_root / "round_2" / "global")
    assert hashed[weights.resolve()] == 1


def test_the_initial_model_changed_since_the_run_started_stops_round_1(
        suite: Suite, tmp_path: Path) -> None:
    """The run's starting model (``model.path``, hashed when the run started) is checked the same way:
    a file of it rewritten meanwhile (a second warm start into the same directory, say) is named."""
    initial = initial_checkpoint(tmp_path)
    strategy, run_root = connected_strategy(tmp_path, initial, clients=2)
    replies = suite_replies(run_root, suite, ("qwen_a", "qwen_b"), (4, 12), 1)
    flip_byte(Path(initial.path) / "model.safetensors", restore_mtime=False, at=-1)
    with pytest.raises(RunFailedError, match=f"{initial.path}, the round's global model, has content hash"):
        train_round(strategy, 1, replies)
    assert isinstance(strategy.global_model, CheckpointRef) and strategy.global_model.path == initial.path


def test_a_ppo_runs_global_critic_changed_on_disk_stops_the_run_naming_the_critic(
        suite: Suite, tmp_path: Path) -> None:
    """The critic is checked like the actor: changed on disk, the run stops naming it (before, the round
    refused every client's critic, kept the actor's mean and went on with the critic frozen)."""
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), clients=2)
    train_round(strategy, 1, [suite_ppo_reply(run_root, suite, client, 1) for client in (0, 1)])
    critic_1 = Path(strategy.global_critic.path)
    flip_byte(critic_1 / "model.safetensors", restore_mtime=False, at=-1)
    with pytest.raises(RunFailedError, match=f"{critic_1}, the round's global critic, has content hash"):
        train_round(strategy, 2, [suite_ppo_reply(run_root, suite, client, 2) for client in (0, 1)])
    assert not (run_root / "round_2" / "global_critic").exists()


@pytest.mark.parametrize(("cls", "settings"), STRATEGIES, ids=IDS)
def test_a_global_model_changed_while_the_round_reads_it_stops_the_run_and_drops_the_mean(
        suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cls: type[FedAvgFSDP],
        settings: dict[str, float]) -> None:
    """Checked at opening, then rewritten once the round's mean is built from it (before its sources
    are checked): its stat is no longer the one it was hashed with, so the run stops and the mean is
    not kept."""
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), cls, clients=2, **settings)
    train_round(strategy, 1, suite_replies(run_root, suite, ("qwen_a", "qwen_b"), (4, 12), 1))
    global_1 = Path(strategy.global_model.path)
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)  # round 1's model was written a moment ago
    checked = fedavg_fsdp.content_mismatches

    def rewritten_meanwhile(readers: list[Any]) -> list[Any]:
        flip_byte(global_1 / "model.safetensors", restore_mtime=False, at=-1)
        return checked(readers)

    monkeypatch.setattr(fedavg_fsdp, "content_mismatches", rewritten_meanwhile)
    changed = r"model\.safetensors changed while it was read \(.*\): it is the round's global model"
    with pytest.raises(RunFailedError, match=changed) as stopped:
        train_round(strategy, 2, suite_replies(run_root, suite, ("qwen_b", "qwen_c"), (6, 6), 2))
    assert f"restore {global_1} from a copy, or start the run over" in str(stopped.value)
    assert strategy.global_model.path == str(global_1) and not (run_root / "round_2" / "global").exists()
