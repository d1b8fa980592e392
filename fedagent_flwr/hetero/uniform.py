"""Uniform (IID-style) goal partition: a contiguous slice per client, widened to a floor.

FedAgent's ``uniform`` arm (ALFWorld, and the goal slice of WebShop's ``catalog_split``) gives
client ``c`` of ``N`` a contiguous slice of about ``n / N`` goals and, when that slice is smaller
than ``min_goals_per_client``, widens it symmetrically (neighbouring clients then overlap). With
``N = 100`` clients and 3,553 ALFWorld games every client gets 100 goals.

The function is pure arithmetic: no RNG, so it is identical across processes, machines and runs.
"""

from __future__ import annotations


class PartitionError(ValueError):
    """Partition arguments that cannot describe a valid client slice."""


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PartitionError(f"{name} must be an integer >= {minimum}, got {value!r}")


def uniform_partition(
    client_id: int,
    num_clients: int,
    num_goals: int,
    min_goals_per_client: int = 0,
) -> list[int]:
    """Goal indices (sorted, contiguous) of ``client_id`` among ``num_clients``.

    Slice boundaries are ``floor(c * n / N)`` .. ``floor((c + 1) * n / N)``: sizes differ by at most
    one and every goal belongs to some client. (FedAgent uses ``floor(n / N)`` for every client
    and leaves the ``n mod N`` tail goals unused; the two agree whenever ``N`` divides ``n``.)
    A slice shorter than ``min_goals_per_client`` grows by the same amount on both sides (the
    extra odd goal on the right) and is shifted back inside ``[0, n)`` at the pool's edges; a floor
    at or above ``n`` gives every goal.
    """
    _check_int("num_clients", num_clients, 1)
    _check_int("num_goals", num_goals, 1)
    _check_int("min_goals_per_client", min_goals_per_client, 0)
    _check_int("client_id", client_id, 0)
    if client_id >= num_clients:
        raise PartitionError(f"client_id {client_id} is out of range for {num_clients} clients")

    start = client_id * num_goals // num_clients
    end = (client_id + 1) * num_goals // num_clients
    size = max(end - start, min(min_goals_per_client, num_goals))
    if size > end - start:
        extra = size - (end - start)
        start -= extra // 2
        end = start + size
        # Keep the widened window inside the pool; its size is preserved by shifting.
        if start < 0:
            start, end = 0, size
        if end > num_goals:
            start, end = num_goals - size, num_goals
    return list(range(start, end))
