"""How much learning signal a GRPO batch carried: the share of groups whose episodes all scored alike.

GRPO's advantage is an episode's reward minus its group's mean, so a group whose rollouts all
scored the same (all failed, or all succeeded) contributes no policy gradient at all. When most
groups are like that, what is left of the update is the KL and entropy terms, which Adam then
rescales to full step size: the model drifts instead of learning. Both trainers report this share
per client round (``zero_variance_group_share``), next to entropy and grad norm.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def zero_variance_group_share(rewards: Sequence[float], groups: Sequence[Hashable], tol: float = 1e-9) -> float:
    """Share of groups with at least two episodes whose rewards all lie within ``tol``.

    Groups of one episode are left out (they have no spread to measure); 0.0 when none is left.
    """
    members: dict[Hashable, list[float]] = {}
    for reward, group in zip(rewards, groups, strict=True):
        members.setdefault(group, []).append(float(reward))
    sized = [values for values in members.values() if len(values) >= 2]
    if not sized:
        return 0.0
    flat = sum(1 for values in sized if max(values) - min(values) <= tol)
    return flat / len(sized)
