"""Confidence intervals for success rates, and the seeds a comparison needs: every learning claim
carries its uncertainty, and a planned experiment its sample size.

Validation success is a binomial proportion over ``n`` episodes; with the small ``n`` of agent
evaluations (tens of episodes) and rates near 0, the normal approximation gives intervals that
leave [0, 1]. Wilson's score interval stays inside and keeps close to its nominal coverage there.
"""

from __future__ import annotations

import math

Z_95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


def wilson_interval(successes: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``successes / n`` (``(0.0, 1.0)`` when ``n`` is 0)."""
    if n <= 0:
        return 0.0, 1.0
    p = min(max(successes / n, 0.0), 1.0)
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


# Two-sided 95% quantiles of Student's t for 1-30 degrees of freedom (t_{0.975, df}).
_T_975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
          2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
          2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272)


# One-sided 80% quantiles of Student's t for 1-30 degrees of freedom (t_{0.80, df}): the power term
# of a sample-size plan.
_T_80 = (1.376382, 1.060660, 0.978472, 0.940965, 0.919544, 0.905703, 0.896030, 0.888890, 0.883404, 0.879058,
         0.875530, 0.872609, 0.870152, 0.868055, 0.866245, 0.864667, 0.863279, 0.862049, 0.860951, 0.859964,
         0.859074, 0.858266, 0.857530, 0.856855, 0.856236, 0.855665, 0.855137, 0.854647, 0.854192, 0.853767)
Z_80 = 0.8416212335729143


def _t_quantile(table: tuple[float, ...], normal: float, df: float) -> float:
    """A quantile from ``table`` at ``df`` rounded down to a whole number (a larger quantile, never a
    smaller one); past the table, the normal quantile ``normal`` corrected for those degrees of freedom."""
    whole = math.floor(df)
    if whole < 1:
        raise ValueError(f"need at least 1 degree of freedom, got {df}")
    return table[whole - 1] if whole <= len(table) else _t_from_normal(normal, whole)


def _t_from_normal(z: float, df: int) -> float:
    """Student's t quantile at ``df`` degrees of freedom from the normal's quantile ``z`` by the
    Cornish-Fisher expansion in 1/df (Abramowitz & Stegun 26.7.5), within 1e-7 of the exact value past
    30 degrees of freedom. The normal's own quantile there would be up to 4% smaller (1.96 against
    t_{0.975, 31} = 2.040): an interval narrower than its stated 95%."""
    z2 = z * z
    g1 = z * (z2 + 1) / 4
    g2 = z * ((5 * z2 + 16) * z2 + 3) / 96
    g3 = z * (((3 * z2 + 19) * z2 + 17) * z2 - 15) / 384
    g4 = z * ((((79 * z2 + 776) * z2 + 1482) * z2 - 1920) * z2 - 945) / 92160
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4


def t_quantile_95(df: float) -> float:
    """Student's t two-sided 95% quantile for ``df`` degrees of freedom, rounded down to a whole
    number of them (a wider interval, never a narrower one)."""
    return _t_quantile(_T_975, Z_95, df)


def t_quantile_80(df: float) -> float:
    """Student's t one-sided 80% quantile for ``df`` degrees of freedom (rounded down, as
    :func:`t_quantile_95`)."""
    return _t_quantile(_T_80, Z_80, df)


def seed_difference_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Mean of ``a`` minus mean of ``b`` (one value per seed, e.g. final success rates) with its 95%
    Welch interval: the spread between seeds, which includes how differently two runs of one
    config end on a GPU, not only the episodes' binomial noise that a pooled Wilson interval counts.
    Needs at least two values on each side."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"need at least 2 values per side, got {len(a)} and {len(b)}")
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    var_a = sum((x - mean_a) ** 2 for x in a) / (len(a) - 1) / len(a)
    var_b = sum((x - mean_b) ** 2 for x in b) / (len(b) - 1) / len(b)
    diff, se2 = mean_a - mean_b, var_a + var_b
    if se2 == 0:
        return diff, diff, diff
    # Welch-Satterthwaite degrees of freedom; a side without spread contributes none.
    df = se2 ** 2 / sum(v ** 2 / (n - 1) for v, n in ((var_a, len(a)), (var_b, len(b))) if v > 0)
    # never below the smaller side's n - 1, which Welch's degrees of freedom cannot be: rounding must not
    # take them under it (nor under the quantile table's 1)
    df = max(df, min(len(a), len(b)) - 1)
    half = t_quantile_95(df) * math.sqrt(se2)
    return diff, diff - half, diff + half


def paired_difference_interval(differences: list[float]) -> tuple[float, float, float, float]:
    """Mean of paired ``differences`` (one a pair: arm A's run minus arm B's run of one seed, both run
    in one session from one shared start, so what the session's luck gave both cancels in each), their
    sample standard deviation, and the mean's 95% t-interval over pairs: ``(mean, sd, low, high)``.

    mean ± t_{0.975, n−1} · sd / √n, with sd = sqrt(Σ (d_i − mean)² / (n − 1)) over the n differences.
    Needs at least two; differences that are all equal give no interval (low = high = mean), as
    :func:`seed_difference_interval` without spread."""
    n = len(differences)
    if n < 2:
        raise ValueError(f"need at least 2 paired differences, got {n}")
    mean = sum(differences) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    half = t_quantile_95(n - 1) * sd / math.sqrt(n)
    return mean, sd, mean - half, mean + half

def pooled_difference_interval(successes_a: float, n_a: int, successes_b: float, n_b: int,
                               z: float = Z_95) -> tuple[float, float, float]:
    """Difference of two pooled success rates with its 95% normal-approximation interval (the
    episodes' binomial noise only)."""
    if n_a <= 0 or n_b <= 0:
        raise ValueError(f"need episodes on both sides, got {n_a} and {n_b}")
    p_a, p_b = successes_a / n_a, successes_b / n_b
    half = z * math.sqrt(p_a * (1 - p_a) / n_a + p_b * (1 - p_b) / n_b)
    return p_a - p_b, p_a - p_b - half, p_a - p_b + half


def seeds_for_difference(sd_a: float, sd_b: float, difference: float, most: int = 200) -> int | None:
    """Seeds per arm (as many on each side) for the Welch 95% interval of :func:`seed_difference_interval`
    to exclude 0 with 80% power, if the arms' true difference and spreads between seeds were the ones
    given (usually those observed: a planning figure, as uncertain as the spreads it starts from).

    The smallest n >= 2 with (t_0.975 + t_0.80) * sqrt((sd_a² + sd_b²) / n) <= |difference|, the
    t quantiles at Welch's degrees of freedom for n seeds a side. None when no n up to ``most`` is
    enough (a difference of 0 never is)."""
    if sd_a < 0 or sd_b < 0:
        raise ValueError(f"spreads must not be negative, got {sd_a} and {sd_b}")
    var = sd_a ** 2 + sd_b ** 2
    if var == 0:
        return 2 if difference != 0 else None
    for n in range(2, most + 1):
        # Welch's degrees of freedom with n a side are n - 1 or more ((x + y)² >= x² + y²); the bound keeps
        # rounding (one side without spread: 0.9999... for 1) from dropping below it and the quantile table
        df = max(var ** 2 * (n - 1) / (sd_a ** 4 + sd_b ** 4), n - 1)
        if (t_quantile_95(df) + t_quantile_80(df)) * math.sqrt(var / n) <= abs(difference):
            return n
    return None
