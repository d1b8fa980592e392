"""Uniform goal partition: FedAgent's contiguous ``n // N`` slice per client, widened to a floor.

FedAgent's ``uniform_partition`` (specs/partitions.md §4; also the goal slice of WebShop's
``catalog_split`` and ``task_disjoint``): with ``b = n // N`` client ``c`` gets ``[c*b, (c+1)*b)``.
The last ``n - N*b`` goals (fewer than ``N``) belong to no client. A slice shorter than the floor
``L`` (``min_goals_per_client``, FedAgent's default 100) is widened by ``need = L - b``: ``need // 2``
on the left and the rest on the right, whatever one side cannot hold spilling to the other, so that
every client gets exactly ``L`` goals and neighbours overlap. A pool smaller than the floor
(``n < L``, e.g. TinyGuess's 10 secrets against FedAgent's 100) gives every client the whole pool.
With ``N = 100`` clients and 3,553 ALFWorld games every client gets 100 goals.

The function is pure arithmetic: no RNG, so it is identical across processes, machines and runs.
"""

from __future__ import annotations

from typing import Any

from fedagent_flwr.schema.run import Partition

#: FedAgent's ``min_samples_per_client`` default (``MIN_GOALS_PER_CLIENT``), declared in the schema.
DEFAULT_MIN_GOALS = Partition.min_goals_per_client


class PartitionError(ValueError):
    """Partition arguments that cannot describe a valid client slice."""


def check_int(name: str, value: Any, minimum: int, kinds: type[Any] | tuple[type[Any], ...] = int) -> int:
    """``value`` as an int, or PartitionError unless it is a ``kinds`` instance (not a bool) >= ``minimum``:
    the one check (and message) of every partition argument; :mod:`.common` adds numpy's integers."""
    if isinstance(value, bool) or not isinstance(value, kinds) or value < minimum:
        raise PartitionError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_client(client_id: Any, num_clients: int, kinds: type[Any] | tuple[type[Any], ...] = int) -> None:
    """PartitionError unless ``client_id`` is a ``kinds`` integer in ``[0, num_clients)``."""
    check_int("client_id", client_id, 0, kinds)
    if client_id >= num_clients:
        raise PartitionError(f"client_id {client_id} is out of range for {num_clients} clients")


def uniform_bounds(client_id: int, num_clients: int, num_goals: int,
                   min_goals_per_client: int = DEFAULT_MIN_GOALS) -> tuple[int, int]:
    """``(start, end)`` of ``client_id``'s slice of a pool of ``num_goals`` (specs/partitions.md §4)."""
    check_int("num_clients", num_clients, 1)
    check_int("num_goals", num_goals, 0)
    check_int("min_goals_per_client", min_goals_per_client, 0)
    check_client(client_id, num_clients)
    n = num_goals
    if n == 0:
        return 0, 0
    base = n // num_clients
    start, end = client_id * base, client_id * base + base
    if base < min_goals_per_client:
        need = min_goals_per_client - base
        left, right = start, n - end
        if left + right >= need:
            grow_left = min(need // 2, left)
            grow_right = min(need - grow_left, right)
            if grow_right < need - grow_left:
                grow_left += min(need - grow_left - grow_right, left - grow_left)
            start, end = start - grow_left, end + grow_right
        elif left > 0:
            start, end = 0, end + min(need - left, right)
        elif right > 0:
            end += min(need, right)
        else:
            start, end = 0, n
    return max(start, 0), min(end, n)


def uniform_partition(
    client_id: int,
    num_clients: int,
    num_goals: int,
    min_goals_per_client: int = DEFAULT_MIN_GOALS,
) -> list[int]:
    """Goal indices (ascending, contiguous) of ``client_id`` among ``num_clients``: see the module doc."""
    start, end = uniform_bounds(client_id, num_clients, num_goals, min_goals_per_client)
    return list(range(start, end))
