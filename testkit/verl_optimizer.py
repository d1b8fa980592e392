"""A live verl actor at FSDP world size 2 reloaded with ``trainer.optimizer_state`` keep, then reset, on CPU.

:func:`run` spawns two gloo processes (verl's own FSDP engine, :mod:`testkit.verl_cpu`), each
one rank of the actor a persistent session keeps alive:

1. the actor (the persistent trainer's worker class) is built from model A and takes two real
   AdamW steps; each rank snapshots its optimiser state (``exp_avg``, ``exp_avg_sq``, ``step`` of
   every parameter shard it owns) and its LR scheduler's counters;
2. ``fedagent_reload(model B, keep_optimizer=True)``, as a keep session's second round: the rank
   reports how far its shards are from model B and whether the state equals the snapshot, then
   takes one more step (the kept state must drive a real update: steps go up by one);
3. ``fedagent_reload(model A)`` (reset): weights from A, an optimiser that has not stepped;
4. the reference policy's forward-only engine, reloaded with keep: it has no optimiser to keep.

Each process writes ``rank<R>.json``; the test asserts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from testkit import verl_world
from testkit.verl_world import _config, _join, _leave, _shard_errors, _step

SEED = 11


def _snapshot(engine: Any) -> dict[str, Any]:
    """A copy of the engine's optimiser state per parameter index, and its scheduler's counters."""
    optimizer = engine.optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {index: {key: value.detach().clone() for key, value in optimizer.state[p].items()}
             for index, p in enumerate(params) if p in optimizer.state}
    scheduler = engine.lr_scheduler.state_dict()
    return {"state": state, "last_epoch": scheduler["last_epoch"], "step_count": scheduler["_step_count"],
            "lr": [group["lr"] for group in optimizer.param_groups]}


def _compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """How the optimiser state ``after`` differs from ``before`` (all equal: nothing differs)."""
    keys = sorted({key for s in before["state"].values() for key in s})
    unequal = [f"{index}.{key}" for index, state in before["state"].items() for key, value in state.items()
               if index not in after["state"] or not torch.equal(value, after["state"][index].get(key, torch.empty(0)))]
    steps = sorted({float(s["step"]) for s in after["state"].values() if "step" in s})
    return {"keys": keys, "params": len(before["state"]), "params_after": len(after["state"]), "unequal": unequal,
            "steps_after": steps, "last_epoch": [before["last_epoch"], after["last_epoch"]],
            "step_count": [before["step_count"], after["step_count"]], "lr": [before["lr"], after["lr"]]}


def _bound_to_module(engine: Any) -> bool:
    """Whether the optimiser's parameters are the (new) module's own: state loaded onto the old
    parameters would train nothing."""
    mine = {id(p) for p in engine.module.parameters()}
    return all(id(p) in mine for group in engine.optimizer.param_groups for p in group["params"])


def rank_main(rank: int, root_text: str, model_a: str, model_b: str) -> None:
    """The program of process ``rank`` (0 or 1); see the module docstring."""
    from fedagent_flwr.trainers.verl.persistent_workers import ReloadableActorRolloutRefWorker, reload_training_worker
    from testkit import verl_cpu

    torch.set_num_threads(1)
    os.environ["FEDAGENT_WEIGHT_SYNC_LOCK"] = "off"  # no vLLM here
    verl_cpu.install()
    root = Path(root_text)
    report: dict[str, Any] = {"rank": rank}
    _join(root / "init", rank, 2)

    # 1. a live actor from model A, two real AdamW steps
    config = _config(root, model_a, 2)
    worker = ReloadableActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
    worker.init_model()
    engine = worker.actor.engine
    for step in range(2):
        _step(worker, SEED + 10 * step + rank)
        engine.lr_scheduler_step()  # as TrainingWorker.train_batch does when told to update_lr_scheduler
    before = _snapshot(engine)
    report["before_reload"] = {"from_b": _shard_errors(worker, Path(model_b))["max_abs_error"]}

    # 2. keep: model B's weights, the optimiser state of step 1
    report["keep"] = worker.fedagent_reload(model_b, SEED, keep_optimizer=True)
    report["keep_weights"] = _shard_errors(worker, Path(model_b))
    report["keep_state"] = _compare(before, _snapshot(engine))
    report["keep_bound"] = _bound_to_module(engine)
    _step(worker, SEED + 100 + rank)
    engine.lr_scheduler_step()
    report["keep_next_step"] = _compare(before, _snapshot(engine))

    # 3. reset: model A's weights, a new optimiser
    report["reset"] = worker.fedagent_reload(model_a, SEED)
    report["reset_weights"] = _shard_errors(worker, Path(model_a))
    report["reset_state"] = {"params_with_state": len(engine.optimizer.state),
                             "last_epoch": engine.lr_scheduler.state_dict()["last_epoch"]}
    del worker

    # 4. the reference policy's engine is forward-only: nothing to keep
    ref = ReloadableActorRolloutRefWorker(config.actor_rollout_ref, role="ref")
    ref.init_model()
    report["ref"] = reload_training_worker(ref.ref, model_b, keep_optimizer=True)
    del ref
    _leave()
    (root / f"rank{rank}.json").write_text(json.dumps(report, indent=1, default=str))


def run(root: Path, model_a: Path, model_b: Path) -> list[dict[str, Any]]:
    """Spawn the two processes and return their reports (rank order)."""
    return verl_world.spawn_ranks(rank_main, (str(root), str(model_a), str(model_b)), root)
