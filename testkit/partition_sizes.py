"""The client sizes the coverage and hardness partitions start from, for tests that check them.

The package draws them inside :func:`~fedagent_flwr.hetero.task.coverage_assignment` and
:func:`~fedagent_flwr.hetero.task.hardness_assignment` and hands out only the assignments (no
package caller needs the sizes alone). The tests compare these intermediate sizes with FedAgent's
own numbers, their bounds and the assignments, so they are derived here from the specification
(specs/partitions.md §6-§8) with the package's public building blocks, ``default_r`` and
``generate_client_sizes``: a restatement of §6-§8 (the same few lines the package's own setup runs,
written from the specification), not a read of the package's private setup, so a package that drifts
from the specification disagrees with it. Arguments are checked by the assignments, not here.
"""

from __future__ import annotations

import numpy as np

from fedagent_flwr.hetero.common import DEFAULT_SEED, default_r, generate_client_sizes
from fedagent_flwr.hetero.task import COVERAGE_CENTER, COVERAGE_HIGH


def _beta_sizes(num_clients: int, num_goals: int, low: int, center: int, high: int, std: float,
                base_seed: int) -> list[int]:
    """``generate_client_sizes(N, low, center, high, s, round(r n))`` on a fresh ``default_rng(S)``,
    ``r`` from ``default_r`` (§6.1-§6.2): the first draws of the generator the assignment goes on with."""
    total = int(round(default_r(num_goals, num_clients, low, center, high) * num_goals))
    return generate_client_sizes(num_clients, low, center, high, std, total, np.random.default_rng(base_seed))


def coverage_sizes(num_clients: int, num_goals: int, min_goals_per_client: int, size_std: float,
                   base_seed: int = DEFAULT_SEED) -> list[int]:
    """Every client's target size under ``coverage`` (§7): ``generate_client_sizes(N, L, 500, 1000,
    s, 500 N)`` on ``default_rng(S)``; they depend on ``(N, L, s, S)``, not on the pool."""
    return _beta_sizes(num_clients, num_goals, min_goals_per_client, COVERAGE_CENTER, COVERAGE_HIGH, size_std,
                       base_seed)


def hardness_sizes(num_clients: int, num_goals: int, min_goals_per_client: int, success_std: float,
                   base_seed: int = DEFAULT_SEED) -> list[int]:
    """Every client's easy quota (§8.3 step 4): ``generate_client_sizes(N, 0, L // 2, L, s, N (L // 2))``."""
    return _beta_sizes(num_clients, num_goals, 0, min_goals_per_client // 2, min_goals_per_client, success_std,
                       base_seed)
