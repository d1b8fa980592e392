"""User code inside a verl job's processes, armed by the job's ``sitecustomize`` like FedProx.

verl runs its trainer loop and its workers in Ray processes that start fresh: a registration made
in the process that launches verl never reaches them. Two kinds of user code are therefore armed
from environment variables in every process of the job (``entry.job_environment`` sets them):

* **plugin modules** (``trainer.plugin_modules``, ``FEDAGENT_VERL_PLUGINS``): imported right after
  ``verl.trainer.ppo.core_algos`` in each process that imports it, so a module can call verl's
  ``register_adv_est`` / ``register_policy_loss`` where verl looks the name up (the advantage is
  computed in the TaskRunner, a Ray worker). A plugin module should import only from
  ``core_algos`` (and torch/numpy) at module level;
* **the client rule** (``trainer.client_rule``, ``FEDAGENT_CLIENT_RULE``): the same rule object
  the reference trainer uses, run before every actor optimiser step of verl's FSDP engine, with a
  marker per patched worker so the entry module can refuse a job in which it never ran.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Sequence
from typing import Any

from fedagent_flwr.trainers.common.client_rule import load_client_rule
from fedagent_flwr.trainers.verl.fedprox import (
    TARGET_MODULE,
    FedProxHookError,
    patch_when_imported,
    wrap_actor_optimizer_step,
)

ENV_PLUGINS = "FEDAGENT_VERL_PLUGINS"
ENV_RULE = "FEDAGENT_CLIENT_RULE"
ENV_RULE_MARKERS = "FEDAGENT_CLIENT_RULE_MARKERS"
CORE_ALGOS = "verl.trainer.ppo.core_algos"


def import_modules(names: Sequence[str]) -> None:
    """Import each plugin module (their import registers what they define)."""
    for name in names:
        importlib.import_module(name)


def install_from_environment() -> list[str]:
    """Arm the plugin imports and the client rule that the job's environment asks for; returns
    what was armed. Processes that never import verl's modules pay nothing."""
    armed = []
    modules = [name for name in os.environ.get(ENV_PLUGINS, "").split(",") if name.strip()]
    if modules:
        patch_when_imported(CORE_ALGOS, lambda _module: import_modules(modules))
        armed.append("plugins")
    raw = os.environ.get(ENV_RULE, "").strip()
    if raw:
        settings: dict[str, Any] = json.loads(raw)
        marker_dir = os.environ.get(ENV_RULE_MARKERS, "")
        if not marker_dir:
            raise FedProxHookError(f"client rule: {ENV_RULE} is set but {ENV_RULE_MARKERS} is not")
        patch_when_imported(TARGET_MODULE, lambda module: wrap_actor_optimizer_step(
            module, "client_rule", lambda: load_client_rule(settings), marker_dir,
            {"rule": settings["client_rule"]}))
        armed.append("client_rule")
    return armed
