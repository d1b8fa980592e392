"""Code run inside verl's processes: the import hook that patches verl where it must, and the
wrapper of the actor engine's optimiser step that runs a job's client rules (FedProx's included).

verl has no hook before its optimiser step, so the actor engine's ``FSDPEngine.optimizer_step`` is
wrapped (:func:`wrap_actor_optimizer_step`):

* in **every Ray worker process**, through a ``sitecustomize`` module (``site/``) that the job's
  environment puts on its ``PYTHONPATH`` (Ray workers inherit it). It only arms a one-shot import
  hook (:func:`patch_when_imported`); the patch is applied when verl itself imports
  ``verl.workers.engine.fsdp.transformer_impl``, i.e. after Ray assigned the worker its GPU
  (patching earlier made FedAgent's workers see duplicate GPUs);
* **per local shard**: a rule that anchors (FedProx) clones each parameter's local (FSDP/DTensor)
  shard at the first optimiser step, before any update, so the arithmetic is element-wise on
  what the rank owns and needs no communication;
* **actor only**: the critic (``FSDPEngineWithValueHead``) is left alone;
* **fail closed**: if the engine class or its ``optimizer_step`` is missing the worker raises, and
  every patched actor worker writes a marker file at its first step, which the backend counts
  (:func:`read_markers`): a FedProx job whose workers did not all report the hook fails instead of
  silently being FedAvg.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

TARGET_MODULE = "verl.workers.engine.fsdp.transformer_impl"
SITE_DIR = str(Path(__file__).resolve().parent / "site")


class HookError(RuntimeError):
    """A hook cannot be installed where it must be (fail closed)."""


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
        raise HookError(
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
            term = state[0]
            tensors = term.anchored() if hasattr(term, "anchored") else len(getattr(term, "anchor", None) or {})
            write_marker(marker_dir, {
                "pid": os.getpid(), "rank": os.environ.get("RANK", ""), **record,
                "engine": type(self).__name__, "tensors": tensors,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            })
            settings = ", ".join(f"{k}={v}" for k, v in record.items())
            print(f"[{tag}] hook active in {type(self).__name__} pid {os.getpid()} rank "
                  f"{os.environ.get('RANK', '?')}: {settings}, {tensors} tensors anchored", flush=True)
        else:
            values = getattr(state[0], "values", None) or [value]
            print(f"[{tag}] step {state[1]} pid {os.getpid()}: {', '.join(f'{v:.6e}' for v in values)}", flush=True)
        return original(self)

    engine_cls.optimizer_step = optimizer_step
    engine_cls._fedagent_wrapped = (*wrapped, tag)


def reset_hook_state(engine: Any) -> list[str]:
    """Forget ``engine``'s per-instance hook state (the client rules, FedProx's anchor with them).

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

    def __init__(self, target: str, patch: Callable[[Any], object]) -> None:  # a return value is ignored
        self.target = target
        self.patches = [patch]
        self._inner: Any = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            raise HookError(f"cannot locate {self.target} to patch")
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        for patch in self.patches:
            patch(module)


def patch_when_imported(target: str, patch: Callable[[Any], object]) -> None:
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
