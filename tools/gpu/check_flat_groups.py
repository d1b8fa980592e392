"""Run verl 0.9.1's own GRPO advantage on one flat group, with and without the project's fix.

On the staged node, from the checkout's root (verl in /tmp/site, the package from the checkout):
``PYTHONPATH=/tmp/site:$PWD python3 tools/gpu/check_flat_groups.py``.
It arms the same import hook the jobs' ``sitecustomize`` arms, imports verl's ``core_algos``, and
feeds it eight episodes that all scored -0.6 (six invalid WebShop turns) plus a group with spread.
It prints verl's unpatched advantages and the patched ones, and exits 1 unless the flat group's
advantages and returns are exactly zero after the fix and the spread group's are unchanged.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from fedagent_flwr.trainers.verl import flat_groups


def main() -> int:
    """Compare verl's advantages for a flat and a non-flat group before and after the fix."""
    flat_groups.install()
    import verl.trainer.ppo.core_algos as core_algos  # noqa: PLC0415 (after the hook is armed)

    patched = core_algos.compute_grpo_outcome_advantage
    original = getattr(patched, "_fedagent_flat_groups", None)
    if original is None:
        print("FAIL: verl's compute_grpo_outcome_advantage was not wrapped by the import hook")
        return 1
    scores = [-0.6] * 8 + [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    rewards = torch.zeros(len(scores), 4, dtype=torch.float32)
    rewards[:, -1] = torch.tensor(scores, dtype=torch.float32)
    mask = torch.ones_like(rewards)
    index = np.array(["flat"] * 8 + ["spread"] * 8, dtype=object)
    before, _ = original(rewards.clone(), mask, index)
    after, returns = patched(rewards.clone(), mask, index)
    registry = getattr(core_algos, "ADV_ESTIMATOR_REGISTRY", {})
    print(f"registry['grpo'] is the fix: {registry.get('grpo') is patched}")
    print(f"flat group   (-0.6 x 8) verl: {before[:8, -1].tolist()}")
    print(f"flat group   (-0.6 x 8) fix : {after[:8, -1].tolist()}")
    print(f"spread group            verl: {[round(v, 4) for v in before[8:, -1].tolist()]}")
    print(f"spread group            fix : {[round(v, 4) for v in after[8:, -1].tolist()]}")
    ok = bool((after[:8] == 0).all()) and bool((returns[:8] == 0).all()) and torch.equal(after[8:], before[8:])
    print("OK: flat group exactly zero (advantages and returns), spread group unchanged" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
