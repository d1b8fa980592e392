"""The client sizes the coverage and hardness partitions start from, for tests that check them.

The package draws them inside :func:`~fedagent_flwr.hetero.task.coverage_assignment` and
:func:`~fedagent_flwr.hetero.task.hardness_assignment` and hands out only the assignments; the tests
compare these intermediate sizes with FedAgent's own numbers (and with their bounds), so they are read
here through the same setup functions the assignments use.
"""

from __future__ import annotations

from fedagent_flwr.hetero.common import DEFAULT_SEED
from fedagent_flwr.hetero.task import _coverage_setup, _hardness_setup


def coverage_sizes(num_clients: int, num_goals: int, min_goals_per_client: int, size_std: float,
                   base_seed: int = DEFAULT_SEED) -> list[int]:
    """Every client's target size under ``coverage`` (§7): ``generate_client_sizes(N, L, 500, 1000,
    s, 500 N)`` on ``default_rng(S)``; they depend on ``(N, L, s, S)``, not on the pool."""
    return _coverage_setup(num_clients, num_goals, min_goals_per_client, size_std, base_seed)[2]


def hardness_sizes(num_clients: int, num_goals: int, min_goals_per_client: int, success_std: float,
                   base_seed: int = DEFAULT_SEED) -> list[int]:
    """Every client's easy quota (§8.3 step 4): ``generate_client_sizes(N, 0, L // 2, L, s, N (L // 2))``."""
    return _hardness_setup(num_clients, num_goals, min_goals_per_client, success_std, base_seed)[2]
