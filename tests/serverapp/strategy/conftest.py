"""The FedAvgFSDP tests' (test_fedavg_fsdp_*.py) Flower task identity, which building Messages
needs; their replies and strategy come from :mod:`testkit.client_replies` and
:mod:`testkit.strategy_setup`."""

from __future__ import annotations

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    # Flower sets this inside real runs; building Messages in a unit test needs it too.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
