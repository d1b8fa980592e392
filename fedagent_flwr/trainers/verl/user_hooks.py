"""Client rules and plugin modules inside a verl job's processes, armed by the job's ``sitecustomize``.

verl runs its trainer loop and its workers in Ray processes that start fresh: a registration made
in the process that launches verl never reaches them. Two kinds of code are therefore armed from
environment variables in every process of the job (``job.job_environment`` sets them):

* **plugin modules** (``trainer.plugin_modules``, ``FEDAGENT_VERL_PLUGINS``): imported right after
  ``verl.trainer.ppo.core_algos`` in each process that imports it, so a module can call verl's
  ``register_adv_est`` / ``register_policy_loss`` where verl looks the name up (the advantage is
  computed in the TaskRunner, a Ray worker). A plugin module should import only from
  ``core_algos`` (and torch/numpy) at module level;
* **the client rules** (``FEDAGENT_CLIENT_RULES``, a JSON list of ``{client_rule,
  client_rule_args}``): the job's rules, FedProx's first when the strategy sent ``proximal-mu``,
  then ``trainer.client_rule`` (:func:`fedagent_flwr.trainers.common.client_rule.job_rule_specs`).
  They are the same rule objects the reference trainer runs, chained in one
  :class:`~fedagent_flwr.trainers.common.client_rule.RuleChain` before every actor optimiser step
  of verl's FSDP engine, with a marker per patched worker (``FEDAGENT_CLIENT_RULE_MARKERS``) so
  the backend can refuse a job in which they did not run.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fedagent_flwr.trainers.common.client_rule import RuleChain
from fedagent_flwr.trainers.verl.engine_hooks import (
    TARGET_MODULE,
    HookError,
    patch_when_imported,
    wrap_actor_optimizer_step,
)

ENV_PLUGINS = "FEDAGENT_VERL_PLUGINS"
ENV_RULES = "FEDAGENT_CLIENT_RULES"
ENV_RULE_MARKERS = "FEDAGENT_CLIENT_RULE_MARKERS"
CORE_ALGOS = "verl.trainer.ppo.core_algos"
#: The tag of the optimiser-step wrapper (and of its per-engine state, ``_fedagent_client_rule``).
RULE_TAG = "client_rule"


def import_modules(names: Sequence[str]) -> None:
    """Import each plugin module (their import registers what they define)."""
    for name in names:
        importlib.import_module(name)


def patch_engine_with_rules(module: Any, specs: Sequence[Mapping[str, Any]], marker_dir: str) -> None:
    """Run the client rules ``specs`` before every actor optimiser step of ``module``'s FSDP engine.

    Each engine builds its own chain at its first step (so FedProx anchors on the round's
    starting weights) and writes a marker naming the rules and their arguments.
    """
    wrap_actor_optimizer_step(
        module, RULE_TAG, lambda: RuleChain.from_specs(specs), marker_dir,
        {"rules": [str(spec["client_rule"]) for spec in specs],
         "rule_args": [dict(spec.get("client_rule_args") or {}) for spec in specs]})


def install_from_environment() -> list[str]:
    """Arm the plugin imports and the client rules that the job's environment asks for; returns
    what was armed. Processes that never import verl's modules pay nothing."""
    armed = []
    modules = [name for name in os.environ.get(ENV_PLUGINS, "").split(",") if name.strip()]
    if modules:
        patch_when_imported(CORE_ALGOS, lambda _module: import_modules(modules))
        armed.append("plugins")
    raw = os.environ.get(ENV_RULES, "").strip()
    if raw:
        specs: list[dict[str, Any]] = json.loads(raw)
        marker_dir = os.environ.get(ENV_RULE_MARKERS, "")
        if not marker_dir:
            raise HookError(f"client rules: {ENV_RULES} is set but {ENV_RULE_MARKERS} is not")
        if specs:
            patch_when_imported(TARGET_MODULE, lambda module: patch_engine_with_rules(module, specs, marker_dir))
            armed.append("client_rules")
    return armed
