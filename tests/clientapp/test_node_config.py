"""The node config a SuperNode is started with (``--node-config 'partition-id=<i> num-partitions=<N>'``):
a bad value is refused naming the key, never read as another partition."""

from __future__ import annotations

from typing import Any

import pytest
from flwr.app import Context, RecordDict

from fedagent_flwr.clientapp.app import node_cache_keep, node_partition


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


def test_cache_keep_is_read_and_a_bad_value_is_refused_naming_the_key() -> None:
    assert node_cache_keep(_context()) == 0  # absent: the cache keeps every model
    assert node_cache_keep(_context(**{"cache-keep": 3})) == 3
    assert node_cache_keep(_context(**{"cache-keep": "2"})) == 2
    for bad in (-1, 1.5, True, "two"):
        with pytest.raises(ValueError) as info:
            node_cache_keep(_context(**{"cache-keep": bad}))
        assert f"node config 'cache-keep' = {bad!r} is not a whole number >= 0" in str(info.value)
        assert "(2 or more advised; 0 keeps all)" in str(info.value)
