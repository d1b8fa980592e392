"""``trainer.optimizer_state`` in the reference trainer's persistent session: with ``keep`` a
client's next round starts from the round's global model with the AdamW state its previous round
ended with; with ``reset`` (the default) from a new AdamW, as a fresh trainer process does."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fedagent_flwr.clientapp.job import EvalJob, TrainJob, TrainResult, load
from fedagent_flwr.models.tiny import make_tiny_model
from fedagent_flwr.trainers.common import optimizer_state
from fedagent_flwr.trainers.reference import train as rt
from fedagent_flwr.trainers.reference.session import ReferenceSession
from testkit.reference_trainer import SPEC, TRAINER, run_trainer, train_job


def _job(model: Path, out: Path, round_: int, setting: str, client_id: int = 1) -> TrainJob:
    return TrainJob(model_path=str(model), output_dir=str(out), env_spec=SPEC, round=round_, client_id=client_id,
                    num_clients=2, data_seed=42 + 100 * round_ + client_id, local_steps=1,
                    partition={"strategy": "none"}, trainer={**TRAINER, "optimizer_state": setting})


def _steps(kept: optimizer_state.KeptState | None) -> set[float]:
    assert kept is not None
    return {float(state["step"]) for state in kept.optimizer["state"].values()}


def _weights(result: Any) -> dict[str, torch.Tensor]:
    return torch.load(Path(result.actor_dir) / "model_world_size_1_rank_0.pt", weights_only=False)


@pytest.fixture(scope="module")
def global_model(tiny_model_dir: Path, smollm2_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Round 2's global model: another model of the same architecture."""
    return make_tiny_model(tmp_path_factory.mktemp("global2"), seed=1, tokenizer_dir=smollm2_tokenizer_dir)


def test_keep_starts_the_next_round_from_the_global_model_with_the_previous_adamw_state(
        tiny_model_dir: Path, global_model: Path, tmp_path: Path) -> None:
    session = ReferenceSession()
    first = session.train(_job(tiny_model_dir, tmp_path / "k1", 1, "keep"))
    assert first.metrics["optimizer_state_kept"] == 0.0  # the session's first round: nothing to keep
    steps = _steps(session.kept)
    assert len(steps) == 1 and min(steps) > 0  # every parameter stepped, as often
    moments = {i: s["exp_avg"].clone() for i, s in session.kept.optimizer["state"].items()}  # type: ignore[union-attr]

    # what round 2 starts from: the global model's weights, round 1's moments and step counts
    model, _ = session.cache.get(global_model, 0)
    optimizer = rt.make_optimizer(model, rt.GRPOConfig())
    assert session._restore(optimizer, _job(global_model, tmp_path / "x", 2, "keep"), session.kept, session.kept_from)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    assert all(torch.equal(optimizer.state[params[i]]["exp_avg"], m) for i, m in moments.items())
    expected = load_file(str(global_model / "model.safetensors"))
    assert all(torch.equal(t, expected[name]) for name, t in model.state_dict().items() if name in expected)

    second = session.train(_job(global_model, tmp_path / "k2", 2, "keep"))
    assert second.metrics["optimizer_state_kept"] == 1.0

    # The same round 2 in a session of its own (nothing to keep: a new AdamW) takes as many steps;
    # the kept session's step counts go on from round 1's, and its update differs.
    alone = ReferenceSession()
    control = alone.train(_job(global_model, tmp_path / "a2", 2, "keep"))
    assert control.metrics["optimizer_state_kept"] == 0.0
    (round_1,), (round_2,) = steps, _steps(alone.kept)
    assert _steps(session.kept) == {round_1 + round_2}
    differences = [float((a.float() - b.float()).abs().max()) for a, b in
                   zip(_weights(second).values(), _weights(control).values(), strict=True)]
    assert max(differences) > 1e-4


def test_reset_keeps_nothing_and_reports_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    session = ReferenceSession()
    for round_ in (1, 2):
        result = session.train(_job(tiny_model_dir, tmp_path / f"r{round_}", round_, "reset"))
        # no metric at all, as a fresh trainer process reports none with reset: the modes' results are equal
        assert "optimizer_state_kept" not in result.metrics and session.kept is None


def test_only_an_earlier_round_of_the_same_client_is_loaded(tiny_model_dir: Path, tmp_path: Path) -> None:
    session = ReferenceSession()
    session.train(_job(tiny_model_dir, tmp_path / "c1", 1, "keep", client_id=1))
    other = session.train(_job(tiny_model_dir, tmp_path / "c0", 2, "keep", client_id=0))
    assert other.metrics["optimizer_state_kept"] == 0.0 and session.kept_from == (0, 2)
    again = session.train(_job(tiny_model_dir, tmp_path / "c0again", 2, "keep", client_id=0))
    assert again.metrics["optimizer_state_kept"] == 0.0  # round 2 again (a resumed run): not its own rerun's state
    third = session.train(_job(tiny_model_dir, tmp_path / "c0next", 3, "keep", client_id=0))
    assert third.metrics["optimizer_state_kept"] == 1.0


def test_a_reset_round_between_keep_rounds_drops_the_state(tiny_model_dir: Path, tmp_path: Path) -> None:
    session = ReferenceSession()
    session.train(_job(tiny_model_dir, tmp_path / "k1", 1, "keep"))
    session.train(_job(tiny_model_dir, tmp_path / "r2", 2, "reset"))
    assert session.kept is None  # else round 3 would start from round 1's moments, skipping round 2's
    third = session.train(_job(tiny_model_dir, tmp_path / "k3", 3, "keep"))
    assert third.metrics["optimizer_state_kept"] == 0.0


def test_a_refused_restore_leaves_no_state_to_the_next_round(tiny_model_dir: Path, tmp_path: Path) -> None:
    session = ReferenceSession()
    session.train(_job(tiny_model_dir, tmp_path / "k1", 1, "keep"))
    assert session.kept is not None
    session.kept.shapes = [[(1,)] * len(group) for group in session.kept.shapes]  # as if another model's
    with pytest.raises(optimizer_state.OptimizerStateMismatch):
        session.train(_job(tiny_model_dir, tmp_path / "k2", 2, "keep"))
    assert session.kept is None and session.kept_from is None  # not refused again in every later round
    third = session.train(_job(tiny_model_dir, tmp_path / "k3", 3, "keep"))
    assert third.metrics["optimizer_state_kept"] == 0.0


def test_a_fresh_trainer_process_trains_a_keep_job_from_a_new_adamw_and_says_so(tiny_model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """The ClientApp reruns a persistent trainer's job in a fresh subprocess when that trainer died
    (the server refuses keep with trainer.mode=subprocess, so that is the only way one gets there):
    the job trains, with nothing to keep, and its metrics say so."""
    job = train_job(tmp_path, tiny_model_dir, "fallback", trainer={**TRAINER, "optimizer_state": "keep"})
    proc = run_trainer("train", job)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = load(TrainResult, tmp_path / "fallback" / rt.TRAIN_RESULT)
    assert result.metrics["optimizer_state_kept"] == 0.0
    proc = run_trainer("train", train_job(tmp_path, tiny_model_dir, "plain"))
    assert proc.returncode == 0 and "optimizer_state_kept" not in load(
        TrainResult, tmp_path / "plain" / rt.TRAIN_RESULT).metrics  # reset, subprocess mode: as before


def _live_tensors() -> int:
    """How many torch tensors the interpreter holds (parameters, gradients, optimiser moments...)."""
    gc.collect()
    # type(obj), not isinstance: the latter reads __class__, which some torch objects warn about
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


@pytest.mark.parametrize("setting", ["reset", "keep"])
def test_a_long_session_holds_as_many_tensors_after_each_round(setting: str, tiny_model_dir: Path,
                                                              global_model: Path, tmp_path: Path) -> None:
    """A persistent trainer serves every round of a run: a round's optimiser, its moments and the
    gradients must go when the next round starts (with ``keep``, only the one kept state stays),
    or host memory grows each round as it did in verl's engine before the flat-parameter fix."""
    session = ReferenceSession()
    counts = []
    for round_ in range(1, 4):
        model = tiny_model_dir if round_ % 2 else global_model  # a new global model to load each round
        session.train(_job(model, tmp_path / f"t{round_}", round_, setting))
        session.evaluate(EvalJob(model_path=str(model), output_dir=str(tmp_path / f"e{round_}"), env_spec=SPEC,
                                 round=round_, seeds=[round_, round_ + 10], trainer=dict(TRAINER)))
        counts.append(_live_tensors())
    # round 1 may allocate once-only tensors (caches); from then on nothing accumulates
    assert counts[1] == counts[2], counts
    kept = session.kept
    assert (kept is not None) == (setting == "keep")
    parameters = len(list(session.cache.model.parameters()))
    session.close()
    del kept
    assert counts[-1] - _live_tensors() >= parameters  # the model at least was the session's, now freed
