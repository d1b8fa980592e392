"""Wilson intervals and the GRPO flat-group share, against values computed by hand."""

from __future__ import annotations

import pytest

from fedagent_flwr.intervals import (
    paired_difference_interval,
    pooled_difference_interval,
    seed_difference_interval,
    seeds_for_difference,
    t_quantile_80,
    t_quantile_95,
    wilson_interval,
)
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


def _t_cdf(x: float, df: int, steps: int = 20000) -> float:
    """Student's t CDF at ``x`` > 0 by Simpson's rule over its density (an oracle independent of the table)."""
    import math

    const = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    h = x / steps
    density = [const * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(steps + 1)]
    area = h / 3 * (density[0] + density[-1] + 4 * sum(density[1:-1:2]) + 2 * sum(density[2:-1:2]))
    return 0.5 + area


@pytest.mark.parametrize("df", [1, 2, 3, 5, 10, 30, 31, 45, 100, 150])
def test_t_quantiles_leave_2_5_percent_in_each_tail(df: int) -> None:
    assert _t_cdf(t_quantile_95(df), df) == pytest.approx(0.975, abs=2e-6)


@pytest.mark.parametrize("df", [1, 2, 3, 5, 10, 30, 31, 45, 100, 150])
def test_t_80_quantiles_leave_20_percent_above(df: int) -> None:
    assert _t_cdf(t_quantile_80(df), df) == pytest.approx(0.80, abs=2e-6)


def test_seeds_for_difference_matches_the_normal_plan_and_its_t_correction() -> None:
    # Normal approximation: n = (1.96 + 0.8416)^2 * (0.1^2 + 0.1^2) / 0.1^2 = 15.7 seeds a side; the t
    # quantiles at n = 16 (df 30: 2.0423 + 0.8538 = 2.8961, half-width 2.8961 * sqrt(0.02 / 16) = 0.1024)
    # are not yet enough, at n = 17 (df 32: 2.0369 + 0.8531 = 2.8900, * 0.0343 = 0.0991) they are.
    assert seeds_for_difference(0.1, 0.1, 0.1) == 17
    # The batches' round-10 spreads (federated 0.1064, local 0.009) at their difference 0.0883: 14 a side;
    # half the difference needs about four times the seeds: at n = 47 (df 46: t 2.0129 + 0.8495 = 2.8624,
    # * sqrt(0.011402 / 47) = 2.8624 * 0.015575 = 0.04458) not yet, at 48 (df 47: 2.8611 * sqrt(0.011402 / 48)
    # = 2.8611 * 0.015412 = 0.04410 <= 0.04415) yes; the normal's quantiles past 30 df (2.8016) stopped at 46,
    # with an interval narrower than 95%.
    assert seeds_for_difference(0.1064, 0.009, 0.0883) == 14
    assert seeds_for_difference(0.1064, 0.009, 0.0883 / 2) == 48
    assert seeds_for_difference(0.1, 0.1, -0.1) == 17  # the sign does not matter
    assert seeds_for_difference(0.0, 0.0, 0.1) == 2  # no spread: any two seeds show it
    assert seeds_for_difference(0.1, 0.1, 0.0) is None
    assert seeds_for_difference(0.3, 0.3, 0.01, most=50) is None
    with pytest.raises(ValueError):
        seeds_for_difference(-0.1, 0.1, 0.1)


def test_t_quantile_rounds_the_degrees_of_freedom_down_and_is_wider_than_the_normal_past_30() -> None:
    assert t_quantile_95(2.9) == t_quantile_95(2) > t_quantile_95(3)
    # t_{0.975, 31} = 2.039513 (tables), not the normal's 1.959964; it nears the normal from above
    assert t_quantile_95(31.7) == t_quantile_95(31) == pytest.approx(2.039513, abs=1e-6)
    assert t_quantile_95(30) > t_quantile_95(31) > t_quantile_95(500) > 1.959964
    with pytest.raises(ValueError):
        t_quantile_95(0.5)


def test_seed_and_pooled_differences_match_hand_computations() -> None:
    # The GPU batches' three seeds at round 10 (docs/results.md): federated 0.484, 0.328, 0.281 and
    # local 0.266, 0.281, 0.281 (n = 64 each). Welch: se = sqrt(0.01128/3 + 0.0000750/3) = 0.06143,
    # df = 2.03 -> 2, t = 4.3027: +0.0883 +/- 0.2643.
    diff, low, high = seed_difference_interval([0.484, 0.328, 0.281], [0.266, 0.281, 0.281])
    assert (diff, low, high) == pytest.approx((0.08833, -0.17652, 0.35319), abs=1e-4)
    # Pooled 70/192 against 53/192: +0.0885, normal approximation +/- 0.0929.
    assert pooled_difference_interval(70, 192, 53, 192) == pytest.approx((0.08854, -0.00437, 0.18146), abs=1e-4)
    # No spread on either side: the interval is the point.
    assert seed_difference_interval([0.5, 0.5], [0.25, 0.25]) == (0.25, 0.25, 0.25)
    with pytest.raises(ValueError):
        seed_difference_interval([0.5], [0.25, 0.3])


def test_the_paired_interval_is_the_mean_difference_with_t_over_n_minus_1_degrees_of_freedom() -> None:
    """Differences 0.10, 0.12, 0.14: mean 0.12, sd 0.02, t_{0.975, 2} = 4.302653, half-width
    4.302653 × 0.02 / √3 = 0.049683: [0.070317, 0.169683]. Equal differences give no interval."""
    mean, sd, low, high = paired_difference_interval([0.10, 0.12, 0.14])
    assert (mean, sd) == pytest.approx((0.12, 0.02))
    assert (low, high) == pytest.approx((0.070317, 0.169683), abs=1e-6)
    assert paired_difference_interval([0.1, 0.1]) == pytest.approx((0.1, 0.0, 0.1, 0.1))
    with pytest.raises(ValueError, match="at least 2 paired differences, got 1"):
        paired_difference_interval([0.1])


def test_an_arm_without_spread_beside_one_with_it_gets_its_plan_not_a_rounding_error() -> None:
    """Runs 0.4, 0.5, 0.6 (sd 0.09999999999999998 in floating point) against runs that all score the
    same: Welch's degrees of freedom are exactly n - 1, which rounding made 0.9999999999999999 at n = 2
    and the t table refused (``fedagent compare`` then ended in a traceback). By hand at sd 0.1, gap 0.15:
    n = 6, (2.571 + 0.920) × 0.1 / √6 = 0.1425 <= 0.15, where n = 5 gives 0.1662."""
    sd = (sum((v - 0.5) ** 2 for v in (0.4, 0.5, 0.6)) / 2) ** 0.5
    assert sd < 0.1
    assert seeds_for_difference(sd, 0.0, 0.15) == seeds_for_difference(0.0, sd, 0.15) == 6
    difference, low, high = seed_difference_interval([0.4, 0.5, 0.6], [0.3, 0.3])
    assert (difference, low, high) == pytest.approx((0.2, 0.2 - 4.302653 * 0.1 / 3 ** 0.5,
                                                     0.2 + 4.302653 * 0.1 / 3 ** 0.5))
