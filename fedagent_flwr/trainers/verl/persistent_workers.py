"""verl's FSDP workers with one extra method: load a new round's weights into the live engines.

A persistent trainer (:mod:`.persistent`) keeps verl's worker processes alive across rounds, so
each round's global model must go into the running engines. verl 0.9.1 already has the primitive:
``TrainingWorker.reset()`` calls ``FSDPEngine.initialize()``, which builds the model from
``engine.model_config.local_path`` and a new optimiser and LR scheduler (FedAgent's
``reload_client_model`` does exactly this; ``trainer.optimizer_state: keep`` carries the old
optimiser's and scheduler's state into the new ones, :mod:`~fedagent_flwr.trainers.common.optimizer_state`).
The subclasses here add a ``fedagent_reload``
method registered with verl's ``@register(dispatch_mode=Dispatch.ONE_TO_ALL)``, so the trainer's
worker groups bind it like ``init_model``: one call, run on every rank, a list of per-rank answers.

They are subclasses rather than patches: the TaskRunner names them in its role-to-class mapping
(the extension point verl's own ``TaskRunner.add_actor_rollout_worker`` fills), and Ray imports
this module in each worker exactly where it would import ``verl.workers.engine_workers`` (after
it assigned the worker its GPU), so no ``sitecustomize`` hook is needed.

They also time their start-up for the session's phase table (:mod:`.phases`; inert outside a
persistent session): the worker process's start until its constructor runs (``worker_spawn_<role>``),
``init_model``, and inside it the first build of the reference, actor and critic engines
(``ref_init``, ``actor_init``, ``critic_init``; the rounds' reloads are timed by the TaskRunner).
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.device import get_device_name
from verl.utils.memory_utils import aggressive_empty_cache
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from fedagent_flwr.trainers.common import optimizer_state
from fedagent_flwr.trainers.common.seeds import reseed
from fedagent_flwr.trainers.verl import engine_hooks, phases

# What FSDPEngine.initialize() rebuilds; dropped first so a GPU never holds two copies of a model.
_ENGINE_STATE = ("module", "optimizer", "lr_scheduler", "checkpoint_manager")


def reload_training_worker(worker: Any, model_path: str, keep_optimizer: bool = False) -> dict[str, Any]:
    """Rebuild ``worker``'s engine from the HF directory ``model_path``: new weights and a fresh
    FedProx / client-rule state, so the hooks anchor on these weights at the round's first
    optimiser step. The optimiser and LR scheduler are new too, unless ``keep_optimizer``
    (``trainer.optimizer_state: keep``): then the old ones' state (moved to CPU before the old
    engine goes) is loaded into the new ones (:mod:`.optimizer_state`). A forward-only engine (the
    reference policy's) has neither. The answer's ``optimizer_state`` says which happened:
    ``kept``, ``fresh`` or ``none``."""
    started = time.monotonic()
    engine = worker.engine
    hooks = engine_hooks.reset_hook_state(engine)
    kept = optimizer_state.take(engine) if keep_optimizer else None
    engine.model_config.local_path = model_path
    release_flat_parameters(getattr(engine, "module", None))  # else the old weights outlive the engine
    for name in _ENGINE_STATE:
        if hasattr(engine, name):
            setattr(engine, name, None)
    gc.collect()
    aggressive_empty_cache(force_sync=True)
    worker.reset()  # TrainingWorker.reset -> FSDPEngine.initialize()
    if getattr(engine, "module", None) is None:
        raise RuntimeError(f"FSDPEngine.initialize() left no module after loading {model_path}")
    if kept is not None:
        state = optimizer_state.restore(engine, kept, f"rank {_rank(worker)} reloading {model_path}",
                                        device=get_device_name())
    elif getattr(engine, "optimizer", None) is not None:
        state = optimizer_state.FRESH
    else:
        state = optimizer_state.NO_OPTIMIZER
    return {"path": model_path, "hooks_reset": hooks, "optimizer_state": state,
            "seconds": round(time.monotonic() - started, 2)}


def release_flat_parameters(module: Any) -> int:
    """Let the old FSDP module's flat parameters be freed; return how many were released.

    Each FSDP1 ``FlatParameter`` keeps its original submodules in Python attributes (``_modules``,
    ``_param_infos``, ...), and those submodules hold views of it, whose base the view keeps in C++:
    a cycle Python's collector cannot see through, so without this every reload left the old weights
    and their gradients alive (twice the model per reload, measured on CPU; on a GPU they are GPU
    tensors, so how much of batch 12's host-memory growth per round this was is still to be measured).
    Dropping the gradient and the attributes breaks the cycle; the module is not used again."""
    if module is None:
        return 0
    flat = {id(p): p for p in module.parameters()}
    for sub in module.modules():
        handle = getattr(sub, "_handle", None)
        if handle is not None and getattr(handle, "flat_param", None) is not None:
            flat[id(handle.flat_param)] = handle.flat_param
    for param in flat.values():
        param.grad = None
        for name in list(vars(param)):
            delattr(param, name)
    return len(flat)


def _rank(worker: Any) -> int:
    return int(getattr(worker, "rank", os.environ.get("RANK", -1)))


def _timed_first_reset(worker: Any, name: str, reset: Any) -> None:
    """Run ``reset()`` (``FSDPEngine.initialize()``); the first time in ``worker``, as phase ``name``."""
    if getattr(worker, "_fedagent_built", False):
        reset()
        return
    with phases.from_environment().phase(name, rank=_rank(worker)):
        reset()
    worker._fedagent_built = True


class _ActorEngine(TrainingWorker):
    """The actor's engine inside the hybrid worker (its ``actor_worker_cls``), its build timed."""

    def reset(self) -> None:  # called directly by init_model and reload_training_worker, never dispatched
        _timed_first_reset(self, "actor_init", super().reset)


class _RefEngine(TrainingWorker):
    """The reference policy's engine inside the hybrid worker (its ``ref_worker_cls``), its build timed."""

    def reset(self) -> None:
        _timed_first_reset(self, "ref_init", super().reset)


class ReloadableActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's hybrid actor/rollout/ref worker, plus ``fedagent_reload`` (and start-up phases)."""

    actor_worker_cls = _ActorEngine
    ref_worker_cls = _RefEngine

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        phases.record_process_start(phases.from_environment(), "worker_spawn_actor_rollout",
                                    rank=os.environ.get("RANK", "?"))
        super().__init__(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[attr-defined]  # as the method it times
    def init_model(self) -> None:
        """verl's ``init_model`` (reference, actor, rollout adapter, checkpoint engine), timed."""
        with phases.from_environment().phase("init_model", rank=_rank(self)):
            super().init_model()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[attr-defined]  # verl builds Dispatch at runtime
    def fedagent_reload(self, model_path: str, seed: int, keep_optimizer: bool = False) -> dict[str, Any]:
        """Load ``model_path`` into the actor engine and, when there is one, the reference engine
        (the reference policy of a round is its global model). The vLLM replicas get the weights at
        the next ``checkpoint_manager.update_weights``, which ``fit()`` calls before step 1.
        ``keep_optimizer``: the actor keeps its optimiser state (the forward-only reference has none)."""
        reseed(seed)
        answer: dict[str, Any] = {"rank": _rank(self), "pid": os.getpid(), "actor": None, "ref": None}
        if self.actor is None:
            raise RuntimeError(f"fedagent_reload: worker role {self.role!r} has no actor engine")
        answer["actor"] = reload_training_worker(self.actor, model_path, keep_optimizer)
        if self.ref is not None:
            answer["ref"] = reload_training_worker(self.ref, model_path)
        aggressive_empty_cache(force_sync=True)  # as init_model ends: let vLLM see the freed memory
        return answer


class ReloadableTrainingWorker(TrainingWorker):
    """verl's TrainingWorker (the PPO critic), plus ``fedagent_reload`` (and start-up phases)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        phases.record_process_start(phases.from_environment(), "worker_spawn_critic",
                                    rank=os.environ.get("RANK", "?"))
        super().__init__(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[attr-defined]  # as TrainingWorker.reset
    def reset(self) -> None:
        """``TrainingWorker.reset`` (the critic's engine build, or a round's reload), the first timed."""
        _timed_first_reset(self, "critic_init", super().reset)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[attr-defined]  # verl builds Dispatch at runtime
    def fedagent_reload(self, model_path: str, seed: int, keep_optimizer: bool = False) -> dict[str, Any]:
        """Load the critic's start for the round (the aggregated critic, or the model in round 1);
        ``keep_optimizer``: keep its optimiser state, as the actor does."""
        reseed(seed)
        answer = {"rank": _rank(self), "pid": os.getpid(),
                  "critic": reload_training_worker(self, model_path, keep_optimizer)}
        aggressive_empty_cache(force_sync=True)
        return answer
