"""A round's global model is checked against its content hash before the round is aggregated against it
(:func:`fedagent_flwr.serverapp.strategy.sources.round_sources`), in runs without LoRA too: its values
enter every client's update statistics and a server optimiser's step (FedAdam's pseudo-gradient), and
every client trained on it as the run recorded it. Changed while the round reads it, the run stops naming it,
in a LoRA run too, where every adapter then fails its own check: the clients are not refused for it. Real
strategies on real FSDP client checkpoints (:mod:`testkit.ckpt_factory`) and peft adapters
(:mod:`testkit.lora_adapters`); the content hash is wrapped, never replaced (``count_hashed_files``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.checkpoint import CheckpointError, CheckpointRef, audit_digests
from fedagent_flwr.serverapp.failures import RoundFailedError, RunFailedError
from fedagent_flwr.serverapp.strategy import FedAdamFSDP, FedAvgFSDP
from fedagent_flwr.serverapp.strategy.server_optimizer import state_file
from testkit.ckpt_factory import ModelSpec, Suite, write_hf_checkpoint
from testkit.client_replies import train_reply
from testkit.file_change import flip_byte
from testkit.hash_count import count_hashed_files
from testkit.lora_adapters import write_adapter
from testkit.round_harness import train_round
from testkit.strategy_setup import (
    client_slot,
    connected_strategy,
    initial_checkpoint,
    suite_ppo_reply,
    suite_replies,
)

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


def test_a_ppo_runs_global_critic_changed_while_the_round_reads_it_stops_the_run_naming_the_critic(
        suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The critic's check while the round reads it, as the actor's below: rewritten once the critics' mean is
    built from it, the run stops naming the critic, and the critics' mean is not kept."""
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), clients=2)
    train_round(strategy, 1, [suite_ppo_reply(run_root, suite, client, 1) for client in (0, 1)])
    critic_1 = Path(strategy.global_critic.path)
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)  # round 1's critic was written a moment ago
    aggregate = strategy.aggregate_checkpoints

    def rewritten_meanwhile(*args: Any) -> Any:
        report = aggregate(*args)
        if Path(args[2]).name == "global_critic":  # (server_round, sources, out_dir, reference)
            flip_byte(critic_1 / "model.safetensors", restore_mtime=False, at=-1)
        return report

    monkeypatch.setattr(strategy, "aggregate_checkpoints", rewritten_meanwhile)
    changed = r"model\.safetensors changed while it was read \(.*\): it is the round's global critic, so the"
    with pytest.raises(RunFailedError, match=changed) as stopped:
        train_round(strategy, 2, [suite_ppo_reply(run_root, suite, client, 2) for client in (0, 1)])
    assert not isinstance(stopped.value, RoundFailedError), stopped.value
    assert f"restore {critic_1} from a copy, or start the run over" in str(stopped.value)
    assert strategy.global_critic.path == str(critic_1) and not (run_root / "round_2" / "global_critic").exists()


@pytest.mark.parametrize("written", ["long-before", "moments-before"])
@pytest.mark.parametrize(("cls", "settings"), STRATEGIES, ids=IDS)
def test_a_global_model_changed_while_the_round_reads_it_stops_the_run_and_drops_the_mean(
        suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cls: type[FedAvgFSDP],
        settings: dict[str, float], written: str) -> None:
    """Checked at opening, then rewritten once the round's mean is built from it (before its sources
    are checked): its stat is no longer the one it was hashed with, so the run stops and the mean is
    not kept. Also when it was written moments before the round hashed it (a tiny model's fast round):
    its digest is not reused then (``RACY_NS``), but its stat is still watched."""
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), cls, clients=2, **settings)
    train_round(strategy, 1, suite_replies(run_root, suite, ("qwen_a", "qwen_b"), (4, 12), 1))
    global_1 = Path(strategy.global_model.path)
    # as if round 1's model had been written long before the round hashed it (its digest trusted), or
    # moments before, whatever this machine's speed (its digest never reused: the benchmark's setting)
    monkeypatch.setattr(audit_digests, "RACY_NS", 0 if written == "long-before" else 1 << 62)
    aggregate = strategy.aggregate_checkpoints

    def rewritten_meanwhile(*args: Any) -> Any:
        report = aggregate(*args)
        flip_byte(global_1 / "model.safetensors", restore_mtime=False, at=-1)
        return report

    monkeypatch.setattr(strategy, "aggregate_checkpoints", rewritten_meanwhile)
    changed = r"model\.safetensors changed while it was read \(.*\): it is the round's global model"
    with pytest.raises(RunFailedError, match=changed) as stopped:
        train_round(strategy, 2, suite_replies(run_root, suite, ("qwen_b", "qwen_c"), (6, 6), 2))
    assert f"restore {global_1} from a copy, or start the run over" in str(stopped.value)
    assert strategy.global_model.path == str(global_1) and not (run_root / "round_2" / "global").exists()
    # FedAdam's state was written just before the mean: it goes with it (before stop 54 it was left behind)
    assert not state_file(run_root / "round_2" / "global").exists()
    if cls is FedAdamFSDP:
        assert state_file(global_1).exists()  # round 1's, which the stopped run keeps


def _lora_round_2(tmp_path: Path) -> tuple[FedAvgFSDP, Path, Path, list[Any]]:
    """A LoRA run (a tiny tied Llama) after round 1, and round 2's replies: two adapters trained on round 1's
    global model. The strategy, its run dir, round 1's global model and the replies."""
    write_hf_checkpoint(ModelSpec("global", "llama", seed=9, tie=True), tmp_path / "base")
    strategy, run_root = connected_strategy(tmp_path, CheckpointRef.for_directory(tmp_path / "base"), clients=2)
    train_round(strategy, 1, [train_reply(c, CheckpointRef.for_directory(write_adapter(
        tmp_path / "base", client_slot(run_root, c) / "actor", seed=c)), 2) for c in (0, 1)])
    global_1 = Path(strategy.global_model.path)
    replies = [train_reply(c, CheckpointRef.for_directory(write_adapter(
        global_1, client_slot(run_root, c, 2) / "actor", seed=10 + c)), 2) for c in (0, 1)]
    return strategy, run_root, global_1, replies


@pytest.mark.parametrize("when", ["as-the-adapters-open", "before-the-mean-reads-it", "once-the-mean-is-built"])
def test_a_lora_runs_global_model_changed_while_the_round_reads_it_stops_the_run_naming_it_not_the_clients(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """Every adapter is read on the round's global model, so a change of it while the round reads it (opened
    and hashed, then one byte flipped, only its ctime showing it) fails every adapter: as they open, each on a
    base that no longer has its hash; before the mean's reads, in the rule's own check before it renames the
    mean into place (the aggregation fails naming no client); once the mean is built (a rule that checks
    nothing), in the sources' check (each adapter mismatches). Either way the run stops naming the global
    model, as for a full model (before, every client was refused and the run stopped as 'every client
    failed alike'); once the adapters opened, no client is refused at all."""
    strategy, run_root, global_1, replies = _lora_round_2(tmp_path)
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)  # round 1's model was written a moment ago
    weights = global_1 / "model.safetensors"
    resolve, aggregate = strategy.store.resolve, strategy.aggregate_checkpoints

    flipped: list[Path] = []

    def opened_meanwhile(*args: Any) -> Any:  # the round's reference is open and hashed by now
        if not flipped:  # once, before the first adapter opens
            flip_byte(weights, restore_mtime=True, at=-1)
            flipped.append(weights)
        return resolve(*args)

    def rewritten_meanwhile(*args: Any) -> Any:
        if when == "before-the-mean-reads-it":
            flip_byte(weights, restore_mtime=True, at=-1)
        report = aggregate(*args)
        if when == "once-the-mean-is-built":
            flip_byte(weights, restore_mtime=True, at=-1)
        return report

    if when == "as-the-adapters-open":
        monkeypatch.setattr(strategy.store, "resolve", opened_meanwhile)
    monkeypatch.setattr(strategy, "aggregate_checkpoints", rewritten_meanwhile)
    changed = rf"{re.escape(str(weights))} changed while it was read \(.*\): it is the round's global model, so the"
    with pytest.raises(RunFailedError, match=changed) as stopped:
        train_round(strategy, 2, replies)
    assert not isinstance(stopped.value, RoundFailedError), stopped.value  # not 'every client failed alike'
    assert f"restore {global_1} from a copy, or start the run over" in str(stopped.value)
    result = strategy.last_aggregation
    assert result is not None and result.actor is None
    if when == "as-the-adapters-open":  # each adapter was refused as it opened, naming the global model
        assert set(result.refused) == {0, 1} and all(str(global_1) in why for why in result.refused.values())
    else:
        assert result.refused == {}
    assert strategy.global_model.path == str(global_1) and not (run_root / "round_2" / "global").exists()


def test_a_rule_failing_without_naming_a_source_refuses_every_client_and_keeps_the_global_model(
        suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side of the check above: with the global model unchanged, a rule's CheckpointError that
    names no client's checkpoint refuses every client with it ("aggregation failed: ...") and the round
    keeps the previous global model (the run goes on or stops by the failure policy, not by the model)."""
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), clients=2)
    train_round(strategy, 1, suite_replies(run_root, suite, ("qwen_a", "qwen_b"), (4, 12), 1))
    global_1 = strategy.global_model.path
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)  # round 1's model was written a moment ago: trust it

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise CheckpointError("the rule's own scratch disk is full")

    monkeypatch.setattr(strategy, "aggregate_checkpoints", fails)
    with pytest.raises(RunFailedError) as stopped:  # every client refused alike: the failure policy stops it
        train_round(strategy, 2, suite_replies(run_root, suite, ("qwen_b", "qwen_c"), (6, 6), 2))
    assert isinstance(stopped.value, RoundFailedError), stopped.value  # not the global model's message
    assert "every client (2) failed the same way" in str(stopped.value)
    assert "aggregation failed: the rule's own scratch disk is full" in str(stopped.value)
    result = strategy.last_aggregation
    assert result is not None and result.actor is None
    assert result.refused == {c: "aggregation failed: the rule's own scratch disk is full" for c in (0, 1)}
    assert strategy.global_model.path == global_1 and not (run_root / "round_2" / "global").exists()
