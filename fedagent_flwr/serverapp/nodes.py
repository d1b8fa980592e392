"""Which SuperNode serves which client partition, and telling them the run is over.

A client of this app is a *partition* (``partition-id`` in a SuperNode's node config), not a
node: the strategies select partitions with FedAgent's seeded rule and address each instruction to
the node that serves it. :class:`NodeRegistry` asks every newly connected node which partition it
serves (a ``query.partition`` message), asks again a node that has not answered yet (it failed, or
was restarted under the same node id after fixing its config), forgets nodes that left (asking them
again if they come back), leaves out (with a warning, and asks again later) a node whose partition
is not one of the run's ``clients.total``, and at the end of the run sends
every known node a ``query.shutdown`` so that it stops what it started (env services, persistent
trainers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from logging import INFO, WARNING
from typing import Any, TypeVar

from flwr.app import Message
from flwr.common import log
from flwr.serverapp import Grid

from fedagent_flwr.protocol import PartitionQuery, PartitionReply, ProtocolError, ShutdownInstruction, ShutdownReply
from fedagent_flwr.schema.run import StrategyKwargs
from fedagent_flwr.serverapp.exchange import send_and_receive
from fedagent_flwr.serverapp.failures import RunFailedError, reply_reason

R = TypeVar("R")

# In a simulation Flower registers every SuperNode at once; a node set unchanged for this long is the
# whole federation.
SIMULATION_SETTLE_S = 1.0
# How long a node that has not answered the partition query yet is waited for when it is asked again
# (each later discovery, so each round): short, so that a node that never answers delays a round by
# this much at most, not by the whole discovery timeout.
RETRY_TIMEOUT_S = 10.0
# ...and at most this often (the wait before round 1 checks every second; a node that answers with
# an error would otherwise log its reason every second).
RETRY_INTERVAL_S = 10.0


class NoClientsError(RunFailedError):
    """The federation does not serve the client partitions this run needs."""


def is_simulation(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's simulation runtime, where the ServerApp and every simulated
    SuperNode share this machine and all SuperNodes exist from the start."""
    from flwr.superlink.grid import InMemoryGrid  # on use: it adds ~1 s to importing the app

    return isinstance(grid, InMemoryGrid)


class NodeRegistry:
    """Client (partition) id -> node id of the SuperNodes of one run.

    Parameters
    ----------
    num_clients : int
        N, the number of client partitions (``partition-id`` 0..N-1 in node configs).
    discovery_timeout : float
        How long :meth:`discover` waits for the partitions a run needs, and for the nodes' answers.
    """

    def __init__(self, num_clients: int, discovery_timeout: float = StrategyKwargs.discovery_timeout) -> None:
        self.num_clients = num_clients
        self.discovery_timeout = discovery_timeout
        self._node_of_client: dict[int, int] = {}
        self._asked: set[int] = set()  # online nodes asked for their partition
        # The asked nodes that answered, with the partition each reported (used or not: a second node
        # of one partition waits here, and is asked again if the first leaves).
        self._answered: dict[int, int] = {}
        self._next_retry = 0.0  # time.monotonic() from which unanswered nodes may be asked again

    def node_of(self, client: int) -> int | None:
        """The node serving ``client`` as last seen, or None."""
        return self._node_of_client.get(client)

    def client_of(self, node: int) -> int:
        """The client (partition) served by ``node``; -1 for a node that never said."""
        for client, known in self._node_of_client.items():
            if known == node:
                return client
        return -1

    def online(self, grid: Grid) -> dict[int, int]:
        """Client -> node for the nodes connected now (asking any new node for its partition)."""
        return self.discover(grid, (), wait=False)

    def discover(self, grid: Grid, needed: Collection[int], wait: bool = True) -> dict[int, int]:
        """Map client (partition) id -> node id, asking each newly connected node, and each connected
        node that has not answered yet, for its partition.

        With ``wait`` (before the first round) it waits, up to ``discovery_timeout``, until every
        partition of ``needed`` is served; otherwise it takes whoever is connected, so a SuperNode
        that died costs its client that round, not the run. In a simulation, where all SuperNodes
        exist from the start, a missing partition is refused at once (:class:`NoClientsError`).
        """
        missing_set = set(needed)
        deadline = time.monotonic() + self.discovery_timeout
        simulated = wait and is_simulation(grid)
        seen: set[int] = set()
        settled_at = time.monotonic()
        while True:
            online = set(grid.get_node_ids())
            if simulated:
                # Flower registers all simulated SuperNodes at once, partitions 0..n-1: once the set
                # is stable, a partition it lacks will never come, so say so now, not after the timeout.
                if online != seen:
                    seen, settled_at = online, time.monotonic()
                if not online or time.monotonic() - settled_at < SIMULATION_SETTLE_S:
                    time.sleep(0.25)
                    continue
                self._check_simulation_size(len(online), missing_set)
                simulated = False
            # Forget nodes that left (deployment): one that comes back, under the same node id (a
            # restart with node authentication) or another, is asked again, as is an online node that
            # has not answered yet (its query failed or timed out), with a shorter wait, and at once a
            # stand-by node of a partition whose node left.
            self._node_of_client = {c: n for c, n in self._node_of_client.items() if n in online}
            self._asked &= online
            self._answered = {n: p for n, p in self._answered.items() if n in online}
            stand_bys = self._forget_stand_bys_of_left_partitions()
            due = time.monotonic() >= self._next_retry
            retry = sorted(self._asked - set(self._answered)) if due else stand_bys
            new_nodes = sorted(online - self._asked)
            if new_nodes:
                self._ask_partitions(grid, new_nodes, self.discovery_timeout)
                self._asked.update(new_nodes)
            if retry:
                self._ask_partitions(grid, retry, min(RETRY_TIMEOUT_S, self.discovery_timeout))
            if new_nodes or retry:
                self._next_retry = time.monotonic() + RETRY_INTERVAL_S
            missing = missing_set - set(self._node_of_client)
            if not missing or not wait:
                return dict(self._node_of_client)
            if time.monotonic() > deadline:
                raise NoClientsError(
                    f"no SuperNode serves client partition(s) {sorted(missing)} of "
                    f"{self.num_clients}: start one SuperNode per partition with "
                    f"--node-config 'partition-id=<i> num-partitions={self.num_clients}', or in "
                    f"simulation run with --federation-config 'num-supernodes={self.num_clients}'"
                )
            log(INFO, "Waiting for client partitions %s to connect", sorted(missing))
            time.sleep(1.0)

    def _check_simulation_size(self, supernodes: int, needed: set[int]) -> None:
        """Refuse a simulation with fewer SuperNodes than the partitions the run trains."""
        missing = sorted(needed - set(range(supernodes)))
        if missing:
            raise NoClientsError(
                f"config key 'clients.total' = {self.num_clients} needs client partition(s) {missing}, but this "
                f"simulation has {supernodes} SuperNode(s) (partitions 0-{supernodes - 1}): run with "
                f"--federation-config 'num-supernodes={self.num_clients}' or set clients.total={supernodes}"
            )

    def _ask_partitions(self, grid: Grid, node_ids: list[int], timeout: float) -> None:
        answers = _answers(grid, PartitionQuery(), node_ids, PartitionReply.from_record, timeout,
                           "report its partition")
        outside: list[tuple[int, int]] = []
        for node, answer in answers:
            partition, count = answer.partition_id, answer.num_partitions
            if not 0 <= partition < self.num_clients:
                # Not one of this run's clients: it would never train, yet it would count toward
                # min_available_nodes and be handed evaluation seeds. Left unanswered, so that it is
                # asked again as a failed node is: restarted under the same node id with a partition
                # of the run, it serves it.
                outside.append((node, partition))
                continue
            self._answered[node] = partition
            if partition in self._node_of_client and self._node_of_client[partition] != node:
                log(WARNING, "Partition %d is served by two nodes; using node %d, node %d stands by",
                    partition, self._node_of_client[partition], node)
                continue
            if count != self.num_clients and partition < self.num_clients:
                log(WARNING, "Node %d reports num-partitions=%d but the run has %d clients; "
                    "it trains partition %d of %d", node, count, self.num_clients, partition,
                    self.num_clients)
            self._node_of_client[partition] = node
        if outside:
            log(WARNING, "Node(s) %s serve partition(s) %s, outside this run's clients 0-%d (config key "
                "'clients.total' = %d); they get no work: restart them with a partition-id below %d, or "
                "raise clients.total", [n for n, _ in outside], [p for _, p in outside], self.num_clients - 1,
                self.num_clients, self.num_clients)

    def _forget_stand_bys_of_left_partitions(self) -> list[int]:
        """The online nodes that reported a partition whose node has left, forgotten as answered so
        that they are asked again: one still serving it takes it over (its answer is not trusted as
        it was, since it may have restarted under the same node id with another partition)."""
        stand_bys = sorted(n for n, p in self._answered.items() if p not in self._node_of_client)
        for node in stand_bys:
            log(INFO, "Partition %d lost its node; asking node %d, which reported it too",
                self._answered.pop(node), node)
        return stand_bys

    def shutdown(self, grid: Grid, instruction: ShutdownInstruction, timeout: float = 120.0) -> None:
        """Tell every known node the run is over, so it stops what it started (env services)."""
        nodes = sorted(set(self._node_of_client.values()))
        if not nodes:
            return
        answers = [a for _, a in _answers(grid, instruction, nodes, ShutdownReply.from_record, timeout,
                                          "shut down cleanly")]
        log(INFO, "[fedagent] run over: %d node(s) told, %d env service(s) and %d persistent trainer(s) stopped",
            len(nodes), sum(a.services_stopped for a in answers), sum(a.trainers_stopped for a in answers))


def _answers(grid: Grid, instruction: Any, node_ids: list[int], parse: Callable[[Any], R], timeout: float,
             what: str) -> Iterator[tuple[int, R]]:
    """Send ``instruction`` to every node of ``node_ids``; yield (node, parsed reply) for each
    answer ``parse`` accepts, logging a warning (``Node N did not <what>: ...``) for each other."""
    messages = [Message(instruction.to_record(), dst_node_id=node, message_type=instruction.message_type)
                for node in node_ids]
    for reply in send_and_receive(grid, messages, timeout):
        try:
            if reply.has_error():
                raise ProtocolError(reply_reason(reply))
            answer = parse(reply.content)
        except ProtocolError as exc:
            log(WARNING, "Node %d did not %s: %s", reply.metadata.src_node_id, what, exc)
            continue
        yield reply.metadata.src_node_id, answer
