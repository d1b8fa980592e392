"""FedProx inside verl: the proximal gradient ``mu * (w - w_t)`` added before every actor optimiser step.

FedProx [Li et al., 2020, arxiv.org/abs/1812.06127] adds ``mu/2 * ||w - w_t||^2`` to the local
objective, ``w_t`` being the round's starting (global) weights; its gradient ``mu * (w - w_t)`` is
added to each parameter's gradient. verl has no hook for that, so the actor engine's
``FSDPEngine.optimizer_step`` is wrapped:

* in **every Ray worker process**, through a ``sitecustomize`` module that the entry module puts
  on the job's ``PYTHONPATH`` (Ray workers inherit it). It only arms a one-shot import hook; the
  patch is applied when verl itself imports ``verl.workers.engine.fsdp.transformer_impl``, i.e.
  after Ray assigned the worker its GPU (patching earlier made FedAgent's workers see duplicate
  GPUs);
* **per local shard**: the anchor is a clone of each parameter's local (FSDP/DTensor) shard taken
  at the first optimiser step, before any update, so the arithmetic is element-wise on what the
  rank owns and needs no communication;
* **actor only**: the critic (``FSDPEngineWithValueHead``) is left alone;
* **fail closed**: if the engine class or its ``optimizer_step`` is missing the worker raises, and
  every patched actor worker writes a marker file at its first step, which the entry module counts:
  a FedProx job whose workers did not all report the hook fails instead of silently being FedAvg.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ENV_MU = "FEDAGENT_FEDPROX_MU"
ENV_MARKERS = "FEDAGENT_FEDPROX_MARKERS"
TARGET_MODULE = "verl.workers.engine.fsdp.transformer_impl"
SITE_DIR = str(Path(__file__).resolve().parent / "site")


class FedProxHookError(RuntimeError):
    """The FedProx hook cannot be installed where it must be (fail closed)."""


class ProximalTerm:
    """Adds ``mu * (w - w_t)`` to the gradients; ``w_t`` is captured at the first call."""

    def __init__(self, mu: float) -> None:
        if not mu > 0:
            raise ValueError(f"proximal mu must be > 0, got {mu}")
        self.mu = float(mu)
        self.anchor: dict[str, Any] | None = None
        self.steps = 0

    def apply(self, named_parameters: Iterable[tuple[str, Any]]) -> float:
        """Add the proximal gradient in place; returns the local ``||w - w_t||^2`` (before the step)."""
        import torch

        params = [(n, p) for n, p in named_parameters if p.requires_grad]
        with torch.no_grad():
            if self.anchor is None:
                self.anchor = {n: p.detach().clone() for n, p in params}
            squared = 0.0
            for name, param in params:
                if param.grad is None:
                    continue
                delta = param.detach() - self.anchor[name]
                param.grad.add_(delta, alpha=self.mu)
                squared += float(_local(delta).float().pow(2).sum())
        self.steps += 1
        return squared

    def reset(self) -> None:
        """Forget the anchor (a new round starts from new global weights)."""
        self.anchor = None
        self.steps = 0


def _local(tensor: Any) -> Any:
    """The rank's own shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def write_marker(marker_dir: str, record: dict[str, Any]) -> Path:
    """One JSON file per patched worker process (temporary name, then rename)."""
    directory = Path(marker_dir)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"actor-{os.getpid()}.json"
    tmp = final.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, sort_keys=True))
    os.replace(tmp, final)
    return final


def read_markers(marker_dir: str) -> list[dict[str, Any]]:
    """Markers the patched actor workers wrote (empty when none did)."""
    directory = Path(marker_dir)
    if not directory.is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(directory.glob("actor-*.json"))]


def patch_engine_module(module: Any, mu: float, marker_dir: str) -> None:
    """Wrap ``module.FSDPEngine.optimizer_step`` with the proximal term (actor engines only)."""
    if getattr(getattr(module, "FSDPEngine", None), "_fedagent_fedprox_mu", None) is not None:
        return
    wrap_actor_optimizer_step(module, "fedprox", lambda: ProximalTerm(mu), marker_dir, {"mu": mu})
    module.FSDPEngine._fedagent_fedprox_mu = mu


def wrap_actor_optimizer_step(module: Any, tag: str, make_term: Callable[[], Any], marker_dir: str,
                              record: dict[str, Any]) -> None:
    """Run ``term.apply(named_parameters)`` before every actor optimiser step of verl's FSDP engine.

    ``make_term`` builds one term per engine instance, at its first step (so a term that anchors
    captures the round's starting weights); critic engines are left alone. Each patched worker
    writes a marker with ``record`` at its first step, so the entry module can tell a hook that
    never ran from one that did. Wrappers of different ``tag`` s stack (the last applied runs first).
    """
    engine_cls = getattr(module, "FSDPEngine", None)
    original = getattr(engine_cls, "optimizer_step", None)
    if engine_cls is None or original is None:
        raise FedProxHookError(
            f"{tag}: {module.__name__} has no FSDPEngine.optimizer_step to patch (verl version "
            f"mismatch?); refusing to run without the {tag} hook"
        )
    wrapped = tuple(getattr(engine_cls, "_fedagent_wrapped", ()))
    if tag in wrapped:
        return
    critic_cls = getattr(module, "FSDPEngineWithValueHead", None)
    slot = f"_fedagent_{tag}"

    def optimizer_step(self: Any) -> Any:
        if critic_cls is not None and isinstance(self, critic_cls):
            return original(self)
        first = slot not in self.__dict__
        if first:
            self.__dict__[slot] = [make_term(), 0]  # the term and its step count
        state = self.__dict__[slot]
        value = state[0].apply(self.module.named_parameters())
        state[1] += 1
        if first:
            tensors = len(getattr(state[0], "anchor", None) or {})
            write_marker(marker_dir, {
                "pid": os.getpid(), "rank": os.environ.get("RANK", ""), **record,
                "engine": type(self).__name__, "tensors": tensors,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            })
            settings = ", ".join(f"{k}={v}" for k, v in record.items())
            print(f"[{tag}] hook active in {type(self).__name__} pid {os.getpid()} rank "
                  f"{os.environ.get('RANK', '?')}: {settings}, {tensors} tensors anchored", flush=True)
        else:
            print(f"[{tag}] step {state[1]} pid {os.getpid()}: {value:.6e}", flush=True)
        return original(self)

    engine_cls.optimizer_step = optimizer_step
    engine_cls._fedagent_wrapped = (*wrapped, tag)


def reset_hook_state(engine: Any) -> list[str]:
    """Forget ``engine``'s per-instance hook state (the FedProx anchor, a client rule's term).

    A persistent trainer reloads new global weights into the same engine object every round; the
    next optimiser step then builds a fresh term (capturing the new ``w_t``) and writes its marker
    again. Returns the tags of the hooks wrapped on the engine's class.
    """
    tags = list(getattr(type(engine), "_fedagent_wrapped", ()))
    for tag in tags:
        engine.__dict__.pop(f"_fedagent_{tag}", None)
    return tags


class PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``target`` with the normal machinery, then runs each of its patches right after the
    module executes, in whichever process first imports it (verl's Ray workers included)."""

    def __init__(self, target: str, patch: Callable[[Any], None]) -> None:
        self.target = target
        self.patches = [patch]
        self._inner: Any = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            raise FedProxHookError(f"cannot locate {self.target} to patch")
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        for patch in self.patches:
            patch(module)


def patch_when_imported(target: str, patch: Callable[[Any], None]) -> None:
    """Apply ``patch`` to module ``target`` now if it is loaded, else as soon as it is imported.

    Several patches of one module run in the order they were asked for.
    """
    if target in sys.modules:
        patch(sys.modules[target])
        return
    for finder in sys.meta_path:
        if isinstance(finder, PatchOnImport) and finder.target == target:
            finder.patches.append(patch)
            return
    sys.meta_path.insert(0, PatchOnImport(target, patch))


def install_from_environment() -> bool:
    """Arm the deferred patch when ``FEDAGENT_FEDPROX_MU`` > 0 (called by the job's sitecustomize).

    Returns whether it was armed. Processes without verl never import the target, so arming costs
    them nothing.
    """
    raw = os.environ.get(ENV_MU, "").strip()
    if not raw:
        return False
    mu = float(raw)
    if mu <= 0:
        return False
    marker_dir = os.environ.get(ENV_MARKERS, "")
    if not marker_dir:
        raise FedProxHookError(f"FedProx: {ENV_MU} is set but {ENV_MARKERS} is not")
    patch_when_imported(TARGET_MODULE, lambda module: patch_engine_module(module, mu, marker_dir))
    return True
