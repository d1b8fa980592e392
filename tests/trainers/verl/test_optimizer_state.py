"""``trainer.optimizer_state``: keep a client's AdamW and LR-scheduler state across the persistent
verl trainer's reloads (weights replaced, moments kept), or reset it (FedAgent's behaviour, the default).

The reload is driven on verl's own FSDP engine at world size 2 on CPU (:mod:`testkit.verl_optimizer`);
the state check, the session's metric and the refusals before round 0 (both backends) are tested
here directly. The reference trainer's session: ``tests/trainers/reference/test_session_optimizer.py``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.models.tiny import make_tiny_model
from fedagent_flwr.trainers.common import optimizer_state
from fedagent_flwr.trainers.verl.persistent_runner import optimizer_kept
from testkit import verl_optimizer

Reports = list[dict[str, Any]]


@pytest.fixture(scope="module")
def reports(tiny_model_dir: Path, smollm2_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Reports:
    """Each rank's report of a live world-size-2 actor reloaded with keep, then reset."""
    root = tmp_path_factory.mktemp("optimizer_state")
    model_b = make_tiny_model(root / "model_b", seed=1, tokenizer_dir=smollm2_tokenizer_dir)
    return verl_optimizer.run(root / "ranks", tiny_model_dir, model_b)


def test_keep_replaces_the_weights_and_keeps_every_shards_adamw_state(reports: Reports) -> None:
    for report in reports:
        rank = report["rank"]
        assert report["before_reload"]["from_b"] > 1e-3  # model A, trained: far from model B
        assert report["keep"]["actor"]["optimizer_state"] == "kept" and report["keep"]["rank"] == rank
        weights = report["keep_weights"]
        assert weights["missing"] == [] and weights["max_abs_error"] == 0.0, f"rank {rank}: {weights}"
        state = report["keep_state"]
        assert state["keys"] == ["exp_avg", "exp_avg_sq", "step"] and state["params"] > 0
        assert state["params_after"] == state["params"] and state["unequal"] == [], f"rank {rank}: {state}"
        assert state["steps_after"] == [2.0] and state["last_epoch"] == [2, 2] and state["lr"][0] == state["lr"][1]
        assert report["keep_bound"]  # on the new module's parameters, not the dropped ones
        after = report["keep_next_step"]  # the kept state drives the next update: step 3, moments moved
        assert after["steps_after"] == [3.0] and after["last_epoch"] == [2, 3] and after["unequal"]


def test_reset_gives_new_weights_a_fresh_optimiser_and_schedule(reports: Reports) -> None:
    for report in reports:
        assert report["reset"]["actor"]["optimizer_state"] == "fresh"
        assert report["reset_weights"]["max_abs_error"] == 0.0
        assert report["reset_state"] == {"params_with_state": 0, "last_epoch": 0}


def test_the_forward_only_reference_engine_has_no_optimiser_to_keep(reports: Reports) -> None:
    for report in reports:
        assert report["ref"]["optimizer_state"] == "none" and report["ref"]["path"].endswith("model_b")


def _engine(shape: tuple[int, int], steps: int) -> Any:
    """An engine as far as the state code reads it: a module, AdamW and LambdaLR, ``steps`` taken."""
    module = torch.nn.Linear(*shape)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for _ in range(steps):
        module(torch.ones(1, shape[0])).sum().backward()
        optimizer.step()
        scheduler.step()
    return SimpleNamespace(module=module, optimizer=optimizer, lr_scheduler=scheduler)


def test_state_that_does_not_fit_the_rebuilt_parameters_is_refused_not_loaded() -> None:
    kept = optimizer_state.take(_engine((4, 3), steps=1))
    assert kept is not None and kept.has_moments()
    other = _engine((4, 2), steps=0)  # another model: same parameter count, other shapes
    with pytest.raises(optimizer_state.OptimizerStateMismatch, match=r"rank 0: parameter 0 is \(2, 4\)"):
        optimizer_state.restore(other, kept, "rank 0")
    assert not other.optimizer.state  # nothing was loaded
    kept.shapes = optimizer_state.local_shapes(other.optimizer)  # shapes recorded wrongly: the tensors still tell
    with pytest.raises(optimizer_state.OptimizerStateMismatch, match=r"kept 'exp_avg' of parameter 0 is \(3, 4\)"):
        optimizer_state.restore(other, kept, "rank 0")
    assert optimizer_state.restore(_engine((4, 3), steps=0), optimizer_state.take(_engine((4, 3), steps=1)),
                                   "rank 0") == "kept"


def test_restored_moments_go_where_the_engine_trains_and_the_step_counters_stay_where_torch_keeps_them() -> None:
    """verl's param_offload leaves a rebuilt engine's parameters on CPU between steps while its
    optimiser state lives on the device: the moments follow the device named, not the parameters."""
    engine = _engine((4, 3), steps=0)
    assert optimizer_state.restore(engine, optimizer_state.take(_engine((4, 3), steps=2)), "rank 0",
                                   device="meta") == "kept"
    for state in engine.optimizer.state.values():
        assert state["exp_avg"].device.type == state["exp_avg_sq"].device.type == "meta"
        assert state["step"].device.type == "cpu" and float(state["step"]) == 2.0
    assert engine.lr_scheduler.last_epoch == 2  # the schedule goes on from the kept one


def test_the_jobs_hyper_parameters_win_over_the_kept_ones_and_the_schedule_goes_on() -> None:
    """torch's load_state_dict would put the previous round's lr, betas and weight decay back; a
    round's job sets them (a changed trainer.lr with a trainer that outlived a resumed server)."""
    def engine(lr: float, weight_decay: float, steps: int) -> Any:
        module = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))  # warm-up
        for _ in range(steps):
            module(torch.ones(1, 4)).sum().backward()
            optimizer.step()
            scheduler.step()
        return SimpleNamespace(module=module, optimizer=optimizer, lr_scheduler=scheduler)

    new = engine(lr=5e-2, weight_decay=0.0, steps=0)
    assert optimizer_state.restore(new, optimizer_state.take(engine(lr=1e-3, weight_decay=0.1, steps=3)),
                                   "rank 0") == "kept"
    (group,) = new.optimizer.param_groups
    assert (group["weight_decay"], group["initial_lr"]) == (0.0, 5e-2) and new.lr_scheduler.base_lrs == [5e-2]
    assert new.lr_scheduler.last_epoch == 3 and group["lr"] == pytest.approx(5e-2 * 0.4)  # warm-up step 3 of 10


def test_a_round_reports_kept_only_when_every_rank_of_every_engine_kept() -> None:
    def answers(role: str, *states: str) -> list[dict[str, Any]]:
        return [{"rank": rank, role: {"optimizer_state": state}} for rank, state in enumerate(states)]

    assert optimizer_kept({"actor": answers("actor", "kept", "kept")})
    assert not optimizer_kept({"actor": answers("actor", "kept", "fresh")})
    assert not optimizer_kept({"actor": answers("actor", "kept"), "critic": answers("critic", "fresh")})
    assert optimizer_kept({"actor": answers("actor", "kept"), "critic": answers("critic", "kept")})
    assert not optimizer_kept({})  # a session's first round: no reload, nothing kept


@pytest.mark.parametrize(("overrides", "words"), [
    ("trainer=verl trainer.optimizer_state=keep",
     "config key 'trainer.optimizer_state' = 'keep' needs trainer.mode=persistent: with trainer.mode=subprocess "
     "every client-round runs in a new verl process"),
    ("trainer.optimizer_state=keep",  # the reference backend
     "config key 'trainer.optimizer_state' = 'keep' needs trainer.mode=persistent: with trainer.mode=subprocess "
     "every client-round runs in a new reference process"),
    ("trainer=verl trainer.optimizer_state=later", "config key 'trainer.optimizer_state'"),
])
def test_keep_is_refused_before_round_0_where_nothing_can_be_kept(overrides: str, words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(overrides=overrides)
    assert words in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("backend", ["trainer=verl", "trainer=reference"])
def test_keep_with_a_persistent_trainer_is_accepted_and_reset_is_the_default(backend: str) -> None:
    settings = load_settings(overrides=f"{backend} trainer.mode=persistent trainer.optimizer_state=keep")
    assert settings.trainer_settings.optimizer_state == "keep"  # type: ignore[attr-defined]  # the backend's
    assert load_settings(overrides=backend).trainer_settings.optimizer_state == "reset"  # type: ignore[attr-defined]


def test_only_the_same_clients_next_round_keeps_its_state() -> None:
    from fedagent_flwr.trainers.verl.persistent_runner import PersistentTaskRunner

    runner = PersistentTaskRunner()  # the Ray actor's class, outside Ray: no workers needed for this
    plan = {"client_id": 3, "round": 2, "reload": True, "optimizer_state": "keep"}
    assert not runner._keeps_optimizer({**plan, "reload": False}, "r1")  # a session's first round: built fresh
    assert not runner._keeps_optimizer(plan, "r2")  # no completed round (a new session, or one that failed)
    first = {**plan, "round": 1}
    runner._round_started()  # train_round's bookkeeping for client 3's round 1 ...
    runner._round_fitted(first)  # ... whose fit() returned ...
    assert not runner._keeps_optimizer(plan, "r2")  # ... its result not collected yet (it may fail)
    runner.round_collected(4, 1)  # another client-round's confirmation does not complete this one
    assert not runner._keeps_optimizer(plan, "r2")
    runner._round_fitted(first)
    runner.round_collected(3, 1)  # the session collected round 1's result: completed
    assert runner._keeps_optimizer(plan, "r2")
    runner._round_started()  # round 2 begins: should it fail, round 1's state is not kept into round 3
    assert not runner._keeps_optimizer({**plan, "round": 3}, "r3")
    runner._round_fitted(first)
    runner.round_collected(3, 1)
    assert not runner._keeps_optimizer({**plan, "optimizer_state": "reset"}, "r2")
    assert not runner._keeps_optimizer({**plan, "round": 1}, "r1")  # round 1 again (a resumed run): fresh
    runner._state_from = (4, 1)  # the engines' state is another client's
    assert not runner._keeps_optimizer(plan, "r2")


@pytest.mark.parametrize(("setting", "kept", "metric", "collects"),
                         [("keep", True, 1.0, True), ("keep", False, 0.0, True), ("reset", False, None, True),
                          ("keep", True, None, False)])  # the last: its result cannot be collected
def test_each_round_of_a_session_reports_whether_its_optimiser_state_was_kept(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, kept: bool,
        metric: float | None, collects: bool) -> None:
    from fedagent_flwr.clientapp.job import TrainJob
    from fedagent_flwr.trainers.verl import job as verl_job
    from fedagent_flwr.trainers.verl.persistent import VerlSession, session_fingerprint

    job = TrainJob(model_path=str(tiny_model_dir), output_dir=str(tmp_path / "r2"), round=2, client_id=0,
                   num_clients=2, data_seed=7, local_steps=1, partition={"strategy": "none"},
                   env_spec={"envs": [{"name": "TinyGuess", "n_envs": 2, "max_turns": 2, "config": {}}]},
                   trainer={"rollout_n": 2, "max_prompt_length": 256, "max_response_length": 128,
                            "optimizer_state": setting})
    plans: list[dict[str, Any]] = []
    collected: list[tuple[int, int]] = []

    class Runner:  # the TaskRunner actor as the session calls it (Ray left out)
        class train_round:  # noqa: N801  # ray's actor-method shape: runner.train_round.remote(plan)
            @staticmethod
            def remote(plan: dict[str, Any]) -> dict[str, Any]:
                plans.append(plan)
                return {"records": [], "reload_s": 0.5, "optimizer_state_kept": kept}

        class round_collected:  # noqa: N801
            @staticmethod
            def remote(client_id: int, round_: int) -> None:
                collected.append((client_id, round_))

    session = VerlSession(work_dir=str(tmp_path / "session"))
    settings, spec, _, rule = verl_job.check_train_job(job)
    session.runner, session.fixed = Runner(), session_fingerprint(job, settings, rule, 2)  # a second round
    monkeypatch.setattr(session, "_get", lambda ref, what: ref)
    def collect_result(*args: Any, extra_metrics: dict[str, float]) -> dict[str, float]:
        if not collects:
            raise RuntimeError("no checkpoint")  # as collect_result does when verl saved none
        return extra_metrics

    monkeypatch.setattr(verl_job, "collect_result", collect_result)
    if not collects:  # the round failed after fit(): its optimiser state is not a completed round's
        with pytest.raises(RuntimeError, match="no checkpoint"):
            session.train(job)
        assert collected == []
        return
    metrics: Any = session.train(job)
    assert plans[0]["reload"] and plans[0]["optimizer_state"] == setting
    # reset: no such metric, as a subprocess-mode run reports none (the two modes' results must be equal)
    assert metrics.get("optimizer_state_kept") == metric and metrics["verl/persistent_round"] == 1.0
    # with keep, the round is confirmed complete once its result is collected (its state then keepable)
    assert collected == ([(0, 2)] if setting == "keep" else [])


@pytest.mark.parametrize(("setting", "metrics"), [("keep", {"optimizer_state_kept": 0.0}), ("reset", {})])
def test_a_subprocess_verl_job_asked_to_keep_trains_from_a_new_optimiser_and_says_so(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str,
        metrics: dict[str, float]) -> None:
    """The ClientApp reruns a persistent trainer's job in a fresh subprocess when that trainer died:
    a keep job then has nothing to keep, trains anyway, and reports it (verl itself left out)."""
    from fedagent_flwr.clientapp.job import TrainJob
    from fedagent_flwr.trainers.verl import entry

    job = TrainJob(model_path=str(tiny_model_dir), output_dir=str(tmp_path / "r2"), round=2, client_id=0,
                   num_clients=2, data_seed=7, local_steps=1, partition={"strategy": "none"},
                   env_spec={"envs": [{"name": "TinyGuess", "n_envs": 2, "max_turns": 2, "config": {}}]},
                   trainer={"rollout_n": 2, "max_prompt_length": 256, "max_response_length": 128,
                            "optimizer_state": setting})
    monkeypatch.setattr(entry, "run_verl", lambda *args: (0, 1.0, "", {}))
    monkeypatch.setattr(entry, "collect_result", lambda *args, extra_metrics: extra_metrics)
    assert entry.train(job) == metrics  # type: ignore[comparison-overlap]  # collect_result stands in
