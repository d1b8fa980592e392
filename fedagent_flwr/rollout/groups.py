"""How much learning signal a GRPO batch carried: the share of groups whose episodes all scored alike.

GRPO's advantage is an episode's reward minus its group's mean, so a group whose rollouts all
scored the same (all failed, or all succeeded) contributes no policy gradient at all. When most
groups are like that, what is left of the update is the KL and entropy terms, which Adam then
rescales to full step size: the model drifts instead of learning. Both trainers report this share
per client round (``zero_variance_group_share``), next to entropy and grad norm, over every GRPO
group of the round: one env instance's rollouts at one optimiser step, as verl's GRPO groups them
(by the ``uid`` its trainer gives each row of a step; the reference trainer by update and group
id). An instance replayed in a later epoch, or two spec entries' instances that share an env and a
seed, are separate groups: merged, two groups flat at different values would look like signal.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

#: Rewards within this relative distance of each other count as equal: float32 (verl's tensors)
#: keeps about 7 digits, so one value stored twice may differ in its last bit.
REL_TOL = 1e-6


def _sized_groups(rewards: Sequence[float], groups: Sequence[Hashable]) -> list[list[tuple[int, float]]]:
    """The (row, reward) members of each group of at least two episodes, in first-seen order."""
    members: dict[Hashable, list[tuple[int, float]]] = {}
    for row, (reward, group) in enumerate(zip(rewards, groups, strict=True)):
        members.setdefault(group, []).append((row, float(reward)))
    return [values for values in members.values() if len(values) >= 2]


def _is_flat(values: list[tuple[int, float]], rel_tol: float) -> bool:
    rewards = [reward for _, reward in values]
    return max(rewards) - min(rewards) <= rel_tol * max(1.0, max(abs(r) for r in rewards))


def flat_group_rows(rewards: Sequence[float], groups: Sequence[Hashable], rel_tol: float = REL_TOL) -> list[int]:
    """Rows of the episodes whose group (of at least two) all scored alike: the rows GRPO must give
    exactly zero advantage (``trainers.verl.flat_groups``)."""
    return sorted(row for values in _sized_groups(rewards, groups) if _is_flat(values, rel_tol)
                  for row, _ in values)


def zero_variance_group_share(rewards: Sequence[float], groups: Sequence[Hashable],
                              rel_tol: float = REL_TOL) -> float:
    """Share of groups with at least two episodes whose rewards all agree within ``rel_tol``.

    Groups of one episode are left out (they have no spread to measure); 0.0 when none is left.
    """
    sized = _sized_groups(rewards, groups)
    if not sized:
        return 0.0
    return sum(1 for values in sized if _is_flat(values, rel_tol)) / len(sized)


def row_scores(episode_return: float, invalid: Sequence[bool], penalty: float, windowed: bool) -> list[float]:
    """The scores one episode's GRPO rows get, as verl's agent loop sets them: concat mode has one row,
    the return less ``penalty`` per invalid action; windowed mode a row per turn (``invalid`` one flag a
    turn), the return less ``penalty`` on a turn whose own action was invalid."""
    if windowed:
        return [episode_return - (penalty if bad else 0.0) for bad in invalid]
    return [episode_return - penalty * sum(invalid)]
