"""Confidence intervals for success rates: every learning claim carries its uncertainty.

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
