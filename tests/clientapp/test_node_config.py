"""The node config a SuperNode is started with (``--node-config 'partition-id=<i> num-partitions=<N>'``):
a bad value is refused naming the key, never read as another partition."""

from __future__ import annotations

from typing import Any

import pytest
from flwr.app import Context, RecordDict

from fedagent_flwr.clientapp.app import node_partition


def _context(**node_config: Any) -> Context:
    return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})


def test_a_good_partition_is_read() -> None:
    assert node_partition(_context(**{"partition-id": 1, "num-partitions": 2})) == (1, 2)
    assert node_partition(_context(**{"partition-id": "0", "num-partitions": "3"})) == (0, 3)


@pytest.mark.parametrize(("config", "needle"), [
    ({"partition-id": 1.5, "num-partitions": 2}, "node config 'partition-id' = 1.5 is not a whole number"),
    ({"partition-id": True, "num-partitions": 2}, "node config 'partition-id' = True is not a whole number"),
    ({"partition-id": -1, "num-partitions": 2}, "node config 'partition-id' = -1 is not a whole number"),
    ({"partition-id": 0, "num-partitions": "two"}, "node config 'num-partitions' = 'two' is not a whole number"),
    ({"partition-id": 2, "num-partitions": 2}, "'partition-id' = 2 is out of range for 'num-partitions' = 2"),
    ({"partition-id": 0, "num-partitions": 0}, "'partition-id' = 0 is out of range for 'num-partitions' = 0"),
    ({"partition-id": "\u00b2", "num-partitions": 2}, "node config 'partition-id' = '\u00b2' is not a whole number"),
    ({"num-partitions": 2}, "this SuperNode has no partition"),
])
def test_a_bad_partition_is_refused_naming_the_key(config: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as info:
        node_partition(_context(**config))
    assert needle in str(info.value) and "--node-config 'partition-id=<i> num-partitions=<N>'" in str(info.value)
