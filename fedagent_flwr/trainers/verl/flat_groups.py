"""GRPO gives a group whose episodes all scored alike an advantage of exactly zero, in verl too.

verl 0.9.1's ``compute_grpo_outcome_advantage`` computes ``(score - mean) / (std + 1e-6)`` per
group in float32. When the equal scores are not exact in binary, float32's mean lands one rounding
step away from them and the std is ~6e-8 instead of 0, so every episode of the group gets the same
*non-zero* advantage: eight episodes at -0.6 (six invalid turns at -0.1 each) get -0.0560 each.
That is a uniform push on every sampled response, from a group that carried no information at
all; it was every gradient of the WebShop run of 2026-12-02 (``actor/pg_loss`` 0.0560341 in every
client round, docs/results.md batch 6) and it touches any flat group scored with the invalid-action
penalty. The reference trainer computes in float64 and is not affected in practice.

``grpo_vectorized`` (``compute_grpo_vectorized_outcome_advantage``, the same formula computed with
scatter operations) gives the same -0.0560, so it is wrapped the same way.

The job's ``sitecustomize`` therefore wraps verl's functions, in every process that imports
``core_algos``: it calls verl's own computation and then sets the advantages (and returns) of the
rows of every flat group (two or more episodes whose scores agree within a relative ``1e-6``:
:func:`fedagent_flwr.rollout.groups.flat_group_rows`, the definition the zero-variance share uses) to
zero, the value GRPO's formula has in exact arithmetic. Groups with any spread are left as verl
computed them. ``ray_trainer`` calls the functions through the module attributes and the registry
serves ``grpo`` and ``grpo_vectorized`` by name; both are replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedagent_flwr.trainers.verl.engine_hooks import patch_when_imported

TARGET_MODULE = "verl.trainer.ppo.core_algos"
#: verl's group-mean estimators: the registry's name and the module's function for each.
FUNCTIONS = {"grpo": "compute_grpo_outcome_advantage",
             "grpo_vectorized": "compute_grpo_vectorized_outcome_advantage"}


def zero_flat_groups(compute: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[Any, Any]]:
    """``compute`` (verl's GRPO advantage), with the rows of flat groups set to exactly zero."""

    def flat_groups_zeroed(token_level_rewards: Any, response_mask: Any, index: Any,
                           *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        # Imported here: the sitecustomize imports this module in every process of the job.
        from fedagent_flwr.rollout.groups import flat_group_rows

        advantages, returns = compute(token_level_rewards, response_mask, index, *args, **kwargs)
        rows = flat_group_rows(token_level_rewards.sum(dim=-1).tolist(), list(index))
        if rows:
            advantages[rows] = 0.0
            returns[rows] = 0.0
        return advantages, returns

    flat_groups_zeroed._fedagent_flat_groups = compute  # type: ignore[attr-defined]
    flat_groups_zeroed.__name__ = flat_groups_zeroed.__qualname__ = compute.__name__
    flat_groups_zeroed.__doc__ = compute.__doc__
    return flat_groups_zeroed


def patch_core_algos(module: Any) -> None:
    """Replace each of ``FUNCTIONS`` the module has, and its registry entry (once each)."""
    registry = getattr(module, "ADV_ESTIMATOR_REGISTRY", None)
    for name, function in FUNCTIONS.items():
        original = getattr(module, function, None)
        if original is None or getattr(original, "_fedagent_flat_groups", None) is not None:
            continue
        wrapped = zero_flat_groups(original)
        setattr(module, function, wrapped)
        if isinstance(registry, dict) and registry.get(name) is original:
            registry[name] = wrapped


def install() -> None:
    """Arm the patch for every process of the job (always: it is a correctness fix, not an option)."""
    patch_when_imported(TARGET_MODULE, patch_core_algos)
