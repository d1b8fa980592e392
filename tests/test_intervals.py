"""Wilson intervals and the GRPO flat-group share, against values computed by hand."""

from __future__ import annotations

import pytest

from fedagent_flwr.intervals import wilson_interval
from fedagent_flwr.rollout.groups import zero_variance_group_share


def test_wilson_interval_matches_the_textbook_values() -> None:
    # 3 successes in 32 (the base model's rate in the GPU probe): Wilson 95% = [0.0324, 0.2422].
    low, high = wilson_interval(3, 32)
    assert (low, high) == pytest.approx((0.03240, 0.24218), abs=1e-4)
    # 26 of 64 (0.406): [0.2946, 0.5285].
    assert wilson_interval(26, 64) == pytest.approx((0.29457, 0.52855), abs=1e-4)
    # The edges stay inside [0, 1] (a normal approximation would not).
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    assert wilson_interval(0, 10)[1] == pytest.approx(0.27753, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_zero_variance_group_share_counts_groups_that_give_no_gradient() -> None:
    rewards = [0, 0, 0, 0, 1, 0, 1, 1, 1, 0.5]
    groups = ["a", "a", "a", "a", "b", "b", "c", "c", "c", "d"]
    # a: all 0 (flat), b: 1 and 0 (signal), c: all 1 (flat), d: a single episode (left out).
    assert zero_variance_group_share(rewards, groups) == pytest.approx(2 / 3)
    assert zero_variance_group_share([1.0], [0]) == 0.0
    with pytest.raises(ValueError):
        zero_variance_group_share([1.0, 2.0], [0])
