"""The HTTP env service's tests' shared fixture: one module-scoped service for the tests that do not
care about pool pressure. The service itself and the request helpers are :mod:`testkit.env_service`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.env_service import ThreadedService, service


@pytest.fixture(scope="module")
def shared_service() -> Iterator[ThreadedService]:
    """One pool-of-4 service for the tests that do not care about pool pressure."""
    with service(pool_size=4, partition={"name": "uniform", "client": 1}, variant={},
                 max_body_bytes=4096) as svc:
        yield svc
