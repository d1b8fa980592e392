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
    engine_cls = getattr(module, "FSDPEngine", None)
    original = getattr(engine_cls, "optimizer_step", None)
    if engine_cls is None or original is None:
        raise FedProxHookError(
            f"FedProx: {module.__name__} has no FSDPEngine.optimizer_step to patch (verl version "
            "mismatch?); refusing to run FedProx as plain FedAvg"
        )
    if getattr(engine_cls, "_fedagent_fedprox_mu", None) is not None:
        return
    critic_cls = getattr(module, "FSDPEngineWithValueHead", None)

    def optimizer_step(self: Any) -> Any:
        if critic_cls is not None and isinstance(self, critic_cls):
            return original(self)
        term = self.__dict__.get("_fedagent_prox")
        if term is None:
            term = self.__dict__["_fedagent_prox"] = ProximalTerm(mu)
        first = term.anchor is None
        squared = term.apply(self.module.named_parameters())
        if first:
            write_marker(marker_dir, {
                "pid": os.getpid(), "rank": os.environ.get("RANK", ""), "mu": mu,
                "engine": type(self).__name__, "tensors": len(term.anchor or {}),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            })
            print(f"[fedprox] hook active in {type(self).__name__} pid {os.getpid()} rank "
                  f"{os.environ.get('RANK', '?')}: mu={mu}, {len(term.anchor or {})} tensors anchored",
                  flush=True)
        else:
            print(f"[fedprox] step {term.steps} pid {os.getpid()}: local ||w - w_t||^2 = {squared:.6e}",
                  flush=True)
        return original(self)

    engine_cls.optimizer_step = optimizer_step
    engine_cls._fedagent_fedprox_mu = mu


class PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``target`` with the normal machinery, then runs ``patch(module)`` right after the
    module executes, in whichever process first imports it (verl's Ray workers included)."""

    def __init__(self, target: str, patch: Callable[[Any], None]) -> None:
        self.target = target
        self.patch = patch
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
        self.patch(module)


def patch_when_imported(target: str, patch: Callable[[Any], None]) -> None:
    """Apply ``patch`` to module ``target`` now if it is loaded, else as soon as it is imported."""
    if target in sys.modules:
        patch(sys.modules[target])
    else:
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
