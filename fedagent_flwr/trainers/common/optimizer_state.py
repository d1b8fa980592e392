"""A client's optimiser state carried from one of its rounds to the next (``trainer.optimizer_state: keep``).

Each client-round starts from the round's global model, and by default (``reset``, FedAgent's
behaviour) from a new AdamW and LR scheduler too: its first steps are then bias-corrected,
sign-like steps from zero moments. With ``keep`` a persistent trainer takes the optimiser's and
scheduler's state at the end of a client's round and loads it into the next round's new ones, so
the weights are the round's global model and the moments, step counts and LR schedule continue
from the client's previous round. Both backends use this module on an object with ``optimizer``
and ``lr_scheduler`` attributes: verl's FSDP engine, whose reload (``FSDPEngine.initialize()``,
:func:`fedagent_flwr.trainers.verl.persistent_workers.reload_training_worker`) rebuilds both, and
the reference trainer's persistent session (:mod:`fedagent_flwr.trainers.reference.session`).

Everything here works on the rank's own shard: the optimiser of an FSDP engine holds the state of
the parameters this rank owns (FSDP1's flat shards, FSDP2's DTensor shards), and the rebuilt
engine has the same architecture, sharding and parameter order, so state ``i`` belongs to
parameter ``i`` again. That is checked (group sizes, every parameter's local shape, every state
tensor's shape against its new parameter) and a mismatch raises :class:`OptimizerStateMismatch`
instead of loading state onto the wrong tensors.

GPU memory: :func:`take` moves the state tensors to CPU in the old optimiser itself, so the GPU
copies are freed with the old engine and the GPU never holds two copies; :func:`restore` puts them
where the new optimiser keeps its state (on the training device, or on CPU when verl offloads the
optimiser), which is where they were during the previous round's later steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: what a reload reports per engine: state loaded from the previous round, a new optimiser, or none
#: at all (a forward-only engine, such as the reference policy's)
KEPT, FRESH, NO_OPTIMIZER = "kept", "fresh", "none"


class OptimizerStateMismatch(RuntimeError):
    """The rebuilt engine's parameters do not match the optimiser state taken from the old one."""


@dataclass
class KeptState:
    """An engine's optimiser and LR-scheduler state, on CPU, and the local parameter shapes it was taken against."""

    optimizer: dict[str, Any]  # torch.optim.Optimizer.state_dict(), state tensors on CPU
    lr_scheduler: dict[str, Any] | None
    shapes: list[list[tuple[int, ...]]]  # per parameter group, each parameter's local (this rank's) shape

    def has_moments(self) -> bool:
        """Whether the optimiser had taken a step (AdamW creates its state lazily at the first one)."""
        return bool(self.optimizer.get("state"))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard (FSDP2), else the tensor (FSDP1's flat shard)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def local_shapes(optimizer: Any) -> list[list[tuple[int, ...]]]:
    """Each parameter group's parameters' local shapes, in the optimiser's order."""
    return [[tuple(_local(p).shape) for p in group["params"]] for group in optimizer.param_groups]


@torch.no_grad()
def _move(optimizer: Any, device: str, steps_too: bool = True) -> None:
    """Replace every state tensor of ``optimizer`` by its copy on ``device`` (in place: the old
    copies are freed as soon as nothing else holds them), as verl's ``offload_fsdp_optimizer`` /
    ``load_fsdp_optimizer`` do; ``steps_too=False`` leaves AdamW's ``step`` counters where torch
    keeps them for a new optimiser (on CPU, unless capturable or fused)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and (steps_too or key != "step"):
                state[key] = value.to(device)


def _to_cpu(optimizer: Any) -> None:
    _move(optimizer, "cpu")


def take(engine: Any) -> KeptState | None:
    """``engine``'s optimiser and scheduler state, moved to CPU; None for an engine without an
    optimiser (forward-only). Call before the engine's optimiser is dropped."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        return None
    _to_cpu(optimizer)
    scheduler = getattr(engine, "lr_scheduler", None)
    return KeptState(optimizer=optimizer.state_dict(),
                     lr_scheduler=scheduler.state_dict() if scheduler is not None else None,
                     shapes=local_shapes(optimizer))


def check_fits(kept: KeptState, optimizer: Any, where: str) -> None:
    """Raise :class:`OptimizerStateMismatch` unless ``kept`` belongs, tensor by tensor, to
    ``optimizer``'s parameters."""
    new = local_shapes(optimizer)
    if [len(group) for group in new] != [len(group) for group in kept.shapes]:
        raise OptimizerStateMismatch(
            f"{where}: the rebuilt optimiser has parameter groups of sizes {[len(g) for g in new]}, the kept state "
            f"{[len(g) for g in kept.shapes]}")
    flat_new = [shape for group in new for shape in group]
    flat_kept = [shape for group in kept.shapes for shape in group]
    for index, (now, before) in enumerate(zip(flat_new, flat_kept, strict=True)):
        if now != before:
            raise OptimizerStateMismatch(
                f"{where}: parameter {index} is {now} on this rank now but was {before} when its state was kept "
                "(another model or sharding)")
    for index, state in kept.optimizer.get("state", {}).items():
        if not isinstance(index, int) or not 0 <= index < len(flat_new):
            raise OptimizerStateMismatch(f"{where}: kept state for parameter {index!r}, the optimiser has "
                                         f"{len(flat_new)} parameters")
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or key == "step":
                continue  # AdamW's step is a scalar per parameter
            if tuple(_local(value).shape) != flat_new[index]:
                raise OptimizerStateMismatch(
                    f"{where}: kept {key!r} of parameter {index} is {tuple(_local(value).shape)}, the parameter "
                    f"is {flat_new[index]}")


def restore(engine: Any, kept: KeptState, where: str, device: str | None = None) -> str:
    """Load ``kept`` into ``engine``'s new optimiser and scheduler; returns :data:`KEPT`, or
    :data:`FRESH` when the old optimiser had not stepped yet (nothing to carry).

    torch puts each state tensor next to its parameter. ``device`` is where the engine trains
    (verl's device name): a new engine's parameters may sit on CPU between steps (verl's
    ``param_offload``) while its optimiser state lives on the device (created there at the first
    step), so the state goes to ``device``, or to CPU when verl offloads the optimiser itself."""
    optimizer = getattr(engine, "optimizer", None)
    scheduler = getattr(engine, "lr_scheduler", None)
    if optimizer is None:
        raise OptimizerStateMismatch(f"{where}: the rebuilt engine has no optimiser for the kept state")
    if (scheduler is None) != (kept.lr_scheduler is None):
        raise OptimizerStateMismatch(f"{where}: the kept state {'has' if kept.lr_scheduler else 'lacks'} an LR "
                                     "scheduler state, the rebuilt engine " + ("lacks" if scheduler is None else "has")
                                     + " a scheduler")
    check_fits(kept, optimizer, where)
    # torch's load_state_dict also replaces the groups' hyper-parameters (lr, betas, weight decay)
    # with the kept ones: this round's job sets them, so they are put back after the load
    settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    # torch moves each state tensor to its parameter's device and dtype (the step stays on CPU)
    optimizer.load_state_dict(kept.optimizer)
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)
    if scheduler is not None and kept.lr_scheduler is not None:
        scheduler.load_state_dict(dict(kept.lr_scheduler))  # LambdaLR pops from what it is given
        scheduler.base_lrs = [own.get("initial_lr", own["lr"]) for own in settings]  # the job's lr, as above
        for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs,
                                       getattr(scheduler, "lr_lambdas", ()), strict=False):
            group["lr"] = base * factor(scheduler.last_epoch)  # where the kept schedule has got to (LambdaLR)
    if getattr(engine, "_is_offload_optimizer", False):
        _to_cpu(optimizer)  # where verl keeps an offloaded optimiser between its steps
    elif getattr(engine, "_uses_fsdp2_cpu_offload_policy", False):
        pass  # FSDP2's CPU offload policy steps on CPU: the state stays by its parameters, where torch put it
    elif device is not None:
        _move(optimizer, device, steps_too=False)
    return KEPT if kept.has_moments() else FRESH
