"""FedAvg over checkpoint references (FedAvgFSDP).

Federated Averaging [McMahan et al., 2017, arxiv.org/abs/1602.05629] for models too large to
travel as arrays: clients train verl/FSDP (or reference-trainer) checkpoints on disk and reply
with typed :class:`CheckpointRef` s in a ``ConfigRecord``; this strategy resolves and checks
them, averages the weights tensor by tensor in fp32 and sends the reference of the new global
model back. No ``ArrayRecord`` ever carries weights.

Compared with Flower's ``FedAvg`` it also
- selects clients with FedAgent's seeded rule over partition ids (``seeding.select_clients``),
  so runs are reproducible and comparable with FedAgent's;
- refuses a bad client checkpoint (outside the client's own slot of the round, missing,
  corrupt, wrong hash, shapes or a ``config.json`` that differ from the global model), a
  malformed or oversized reply, or a ``num-examples`` beyond the episodes the client was
  assigned, with a message naming the client, and aggregates the rest;
- gives the global model the config, generation config, tokenizer and chat template of the
  run's base model, never a client's (:mod:`fedagent_flwr.checkpoint.model_files`);
- moves checkpoints through a :class:`~fedagent_flwr.checkpoint.store.ServerStore`: paths on a
  shared filesystem, or URLs of the ServerApp's HTTP store when the machines share none;
- keeps the previous global model when no client checkpoint is usable, and stops the run
  (:class:`RoundFailedError`) when every client of a round failed for the same reason;
- logs each client failure as one line, the client's own error (:func:`readable_reason`).

Subclasses change the rule by overriding :meth:`aggregation_weights` (weights per reply) or
:meth:`aggregate_checkpoints` (the tensor computation).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterable, Sequence
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import validate_message_reply_consistency

from fedagent_flwr.checkpoint import (
    AggregateReport,
    CheckpointError,
    CheckpointReader,
    CheckpointRef,
    check_compatible,
    open_checkpoint,
    weighted_mean,
)
from fedagent_flwr.checkpoint.model_files import check_model_config, model_files_dir
from fedagent_flwr.checkpoint.store import ServerStore, SharedFsServerStore
from fedagent_flwr.checkpoint.update_stats import describe_update_stats
from fedagent_flwr.seeding import data_seed, select_clients
from fedagent_flwr.serverapp.recorder import RunRecorder

QUERY_PARTITION = "query.partition"
QUERY_SHUTDOWN = "query.shutdown"
# A train reply is a client id, a checkpoint reference and a few metrics: well under a KiB.
# Anything far larger is not a reply this strategy asked for (weights smuggled in an array,
# a megabyte "path") and is refused before any of it is used.
MAX_REPLY_BYTES = 64 * 1024


# In a simulation Flower registers every SuperNode at once; a node set unchanged for this long is the
# whole federation.
SIMULATION_SETTLE_S = 1.0


class RunFailedError(RuntimeError):
    """The run cannot go on; the message is the one line the log and the summary carry."""


class NoClientsError(RunFailedError):
    """The federation does not serve the client partitions this run needs."""


class RoundFailedError(RunFailedError):
    """Every client of a round failed for the same reason: the next rounds would fail the same way."""


def is_simulation(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's simulation runtime, where the ServerApp and every simulated
    SuperNode share this machine and all SuperNodes exist from the start."""
    try:
        from flwr.superlink.grid import InMemoryGrid
    except ImportError:  # a Flower without it: treat the run as a deployment (the safe side)
        return False
    return isinstance(grid, InMemoryGrid)


class FedAvgFSDP(FedAvg):
    """Federated Averaging of checkpoint references.

    Parameters
    ----------
    run_root : str
        Absolute directory of this run; every client and global checkpoint lives under it.
    initial_model : CheckpointRef
        The global model of round 1 (an HF directory, possibly outside ``run_root``).
    num_clients : int
        N, the number of client partitions (``partition-id`` 0..N-1 in node configs).
    clients_per_round : int
        M, clients trained per round (all when M >= N).
    base_seed : int
        Seeds client selection (``base_seed + r - 1``) and data (``base_seed + 100 r + c``).
    local_client_id : int
        >= 0 pins one client (FedAgent's local baseline); -1 samples.
    num_rounds : int
        T, used to know which partitions must be online before round 1.
    fixed_weights : Sequence[float]
        Per-client-id aggregation weights; empty means weighting by ``num-examples``.
    train_payload, eval_payload : dict
        ConfigRecord values added to every train / evaluate instruction (trainer settings,
        env specs as JSON strings).
    eval_seeds : Sequence[int]
        Validation episode seeds, split across the evaluating clients.
    recorder : RunRecorder | None
        Receives provenance and curves and writes the run summary after every step.
    store : ServerStore | None
        How checkpoints travel; None means a shared filesystem under ``run_root``.
    **kwargs
        Passed to Flower's ``FedAvg`` (e.g. ``weighted_by_key``).
    """

    def __init__(
        self,
        *,
        run_root: str,
        initial_model: CheckpointRef,
        num_clients: int,
        clients_per_round: int,
        base_seed: int = 42,
        local_client_id: int = -1,
        num_rounds: int = 1,
        fixed_weights: Sequence[float] = (),
        train_payload: dict[str, Any] | None = None,
        eval_payload: dict[str, Any] | None = None,
        eval_seeds: Sequence[int] = (),
        recorder: RunRecorder | None = None,
        discovery_timeout: float = 600.0,
        store: ServerStore | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("min_available_nodes", 1)
        kwargs.setdefault("min_train_nodes", 1)
        kwargs.setdefault("min_evaluate_nodes", 1)
        super().__init__(**kwargs)
        self.run_root = str(Path(run_root).resolve())
        self.global_model = initial_model
        self.num_clients = num_clients
        self.clients_per_round = clients_per_round
        self.base_seed = base_seed
        self.local_client_id = local_client_id
        self.num_rounds = num_rounds
        self.fixed_weights = tuple(float(w) for w in fixed_weights)
        self.train_payload = dict(train_payload or {})
        self.eval_payload = dict(eval_payload or {})
        self.eval_seeds = list(eval_seeds)
        self.recorder = recorder
        self.discovery_timeout = discovery_timeout
        self.store = store if store is not None else SharedFsServerStore(self.run_root)
        # Config, generation config, tokenizer and chat template of every global model (actor and
        # critic): the initial model's, which is the base model or a global model that took them
        # from it. Client configs are checked against them.
        self.model_files: Path | None = model_files_dir(initial_model.path)
        self._assigned_episodes = planned_train_episodes(self.train_payload)
        self._node_of_client: dict[int, int] = {}
        self._asked_nodes: set[int] = set()
        self._selected: list[int] = []
        self._absent: dict[int, str] = {}
        self._eval_clients: list[int] = []
        # PPO: the aggregated critic, sent with the actor from the round after the first.
        self.global_critic: CheckpointRef | None = None

    # ----------------------------------------------------------------------------- selection
    def select_clients(self, server_round: int) -> list[int]:
        """Client ids trained in ``server_round`` (FedAgent's seeded rule)."""
        return select_clients(
            server_round, self.num_clients, self.clients_per_round, self.base_seed,
            self.local_client_id,
        )

    def required_clients(self) -> list[int]:
        """Every client id this run will train: the union of all rounds' selections."""
        needed: set[int] = set()
        for server_round in range(1, self.num_rounds + 1):
            needed.update(self.select_clients(server_round))
        return sorted(needed)

    def discover_clients(self, grid: Grid, wait: bool = True) -> dict[int, int]:
        """Map client (partition) id -> node id, asking each newly connected node once.

        With ``wait`` (the first round) it waits, up to ``discovery_timeout``, until every
        partition this run will train is served; later rounds take whoever is connected, so a
        SuperNode that died costs its client that round, not the run. In a simulation, where all
        SuperNodes exist from the start, a missing partition is refused at once
        (:class:`NoClientsError`).
        """
        needed = set(self.required_clients())
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
                self._check_simulation_size(len(online), needed)
                simulated = False
            # Forget nodes that left (deployment), ask nodes we have not asked yet.
            self._node_of_client = {c: n for c, n in self._node_of_client.items() if n in online}
            new_nodes = sorted(online - self._asked_nodes)
            if new_nodes:
                self._ask_partitions(grid, new_nodes)
                self._asked_nodes.update(new_nodes)
            missing = needed - set(self._node_of_client)
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

    def _ask_partitions(self, grid: Grid, node_ids: list[int]) -> None:
        messages = [
            Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=node, message_type=QUERY_PARTITION)
            for node in node_ids
        ]
        for reply in grid.send_and_receive(messages, timeout=self.discovery_timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log(WARNING, "Node %d did not report its partition: %s", node, readable_reason(reply.error.reason))
                continue
            config = reply.content["config"]
            partition, count = int(config["partition-id"]), int(config["num-partitions"])
            if partition in self._node_of_client and self._node_of_client[partition] != node:
                log(WARNING, "Partition %d is served by two nodes; using node %d", partition,
                    self._node_of_client[partition])
                continue
            if count != self.num_clients and partition < self.num_clients:
                log(WARNING, "Node %d reports num-partitions=%d but the run has %d clients; "
                    "it trains partition %d of %d", node, count, self.num_clients, partition,
                    self.num_clients)
            self._node_of_client[partition] = node

    def _instruction(self, message_type: str, node: int, values: dict[str, Any]) -> Message:
        """One instruction: the global model's reference (as the store shares it), what the client
        needs to open the store, and ``values``; an empty ArrayRecord."""
        values = {**values, **self.store.share(self.global_model).to_config("global"),
                  **self.store.instruction_fields()}
        if self.global_critic is not None:
            values.update(self.store.share(self.global_critic).to_config("global-critic"))
        record = RecordDict({self.arrayrecord_key: ArrayRecord(), self.configrecord_key: ConfigRecord(values)})
        return Message(record, dst_node_id=node, message_type=message_type)

    # ----------------------------------------------------------------------------- train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send each selected client the global model's reference, its seeds and the knobs."""
        nodes = self.discover_clients(grid, wait=not self._asked_nodes)
        clients = self.select_clients(server_round)
        self._selected = clients
        self._absent = {c: "no SuperNode serves this partition now" for c in clients if c not in nodes}
        log(INFO, "configure_train: round %d trains clients %s (out of %d)%s", server_round, clients,
            self.num_clients, f"; absent: {sorted(self._absent)}" if self._absent else "")
        messages = []
        for client in clients:
            if client in self._absent:
                continue
            values = {
                **dict(config),
                **self.train_payload,
                "server-round": server_round,
                "client-id": client,
                "num-clients": self.num_clients,
                "data-seed": data_seed(self.base_seed, server_round, client),
                "base-seed": self.base_seed,
                **self.store.upload_grant(server_round, client),
            }
            messages.append(self._instruction(MessageType.TRAIN, nodes[client], values))
        return messages

    def assigned_examples(self, server_round: int, client: int) -> int | None:
        """The most ``num-examples`` client ``client`` may report for ``server_round``: the episodes
        its instruction asks for (``local-steps`` x ``rollout_n`` x the env instances of the train
        env spec, what both trainers play); None when the train payload does not say, which leaves
        only the check that it is a positive number."""
        return self._assigned_episodes

    def aggregation_weights(self, server_round: int, replies: Sequence[Message]) -> list[float]:
        """One weight per accepted reply: fixed per client id if configured, else num-examples."""
        weights = []
        for reply in replies:
            if self.fixed_weights:
                weights.append(self.fixed_weights[int(reply.content[self.configrecord_key]["client-id"])])
            else:
                weights.append(float(_single_metrics(reply)[self.weighted_by_key]))
        return weights

    def aggregate_checkpoints(
        self, server_round: int, sources: Sequence[tuple[CheckpointReader, float]], out_dir: Path,
        reference: CheckpointReader | None,
    ) -> AggregateReport:
        """Write the new global checkpoint (actor, or PPO critic); the default is the weighted
        mean. ``reference`` is the current global checkpoint of that kind (None for the first
        critic)."""
        return weighted_mean(sources, out_dir, reference=reference, model_files=self.model_files)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check the clients' checkpoint references and average the good ones.

        Every refused client is recorded with its reason (failed, malformed reply, bad
        checkpoint, no reply, absent); the round goes on with the rest, and keeps the previous
        global model when nobody is left.
        """
        valid, errors = self._check_and_log_replies(list(replies), is_train=True, validate=False)
        rejected: dict[int, str] = dict(self._absent)
        client_of_node = {node: client for client, node in self._node_of_client.items()}
        for reply in errors:
            client = client_of_node.get(reply.metadata.src_node_id, -1)
            rejected[client] = readable_reason(str(reply.error.reason))
            log(WARNING, "round %d: client %d failed: %s", server_round, client, rejected[client])
        candidates: list[tuple[Message, int]] = []
        for reply in valid:
            client = client_of_node.get(reply.metadata.src_node_id, -1)
            problem = self._reply_problem(reply, client, server_round)
            if problem:
                log(WARNING, "round %d: reply of client %d refused: %s", server_round, client, problem)
                rejected[client] = problem
            else:
                candidates.append((reply, client))
        for client in self._selected:
            if client not in rejected and client not in {c for _, c in candidates}:
                rejected[client] = "no reply within the round timeout"
                log(WARNING, "round %d: client %d did not reply in time", server_round, client)

        # Client-id order, not arrival order: with three or more clients the float sums (and the
        # update statistics' layout) would otherwise depend on which reply came first.
        candidates.sort(key=lambda item: item[1])
        started = self.global_model
        new_ref, used, report = self._aggregate_role(server_round, candidates, rejected, "actor")
        if new_ref is not None:
            self.global_model = new_ref
            log(INFO, "round %d: new global model %s", server_round, new_ref.path)
        else:
            log(WARNING, "round %d: no valid client checkpoint; keeping the previous global model %s",
                server_round, started.path)
        critic_used: list[tuple[Message, int, str]] = []
        with_critic = [(r, c) for r, c, _ in used if "critic-path" in r.content[self.configrecord_key]]
        if with_critic:
            # PPO: the critics of exactly the clients whose actors were averaged, with the same rule.
            critic_ref, critic_used, _ = self._aggregate_role(server_round, with_critic, rejected, "critic")
            if critic_ref is not None:
                self.global_critic = critic_ref
                log(INFO, "round %d: new global critic %s", server_round, critic_ref.path)
        metrics = None
        if used:
            try:
                metrics = self.train_metrics_aggr_fn([r.content for r, _, _ in used], self.weighted_by_key)
            except (KeyError, TypeError, ValueError) as exc:  # metric keys differ between clients
                log(WARNING, "round %d: client metrics could not be averaged: %s", server_round, exc)
        if self.recorder is not None:
            self.recorder.record_round(
                server_round=server_round,
                clients=list(self._selected),
                started_from=started.path,
                client_actors={c: path for _, c, path in used},
                aggregated=new_ref.path if new_ref is not None else None,
                rejected=rejected,
                client_metrics={c: dict(_single_metrics(r)) for r, c, _ in used},
                client_critics={c: path for _, c, path in critic_used},
                aggregated_critic=self.global_critic.path if critic_used and self.global_critic else None,
                update_stats=(report.update_stats.to_dict([c for _, c, _ in used])
                              if report is not None and report.update_stats is not None else None),
                aggregated_sha256=new_ref.sha256 if new_ref is not None else None,
                aggregated_critic_sha256=self.global_critic.sha256 if critic_used and self.global_critic else None,
            )
        if new_ref is None:  # an absent client was not asked, so it did not fail: absence never stops the run
            self._stop_if_all_failed_alike(f"round {server_round}", self._selected,
                                           {c: r for c, r in rejected.items() if c not in self._absent})
        return None, metrics

    @staticmethod
    def _stop_if_all_failed_alike(what: str, clients: Sequence[int], reasons: dict[int, str]) -> None:
        """Raise :class:`RoundFailedError` when every client of ``clients`` failed for the same reason.

        A cause every client shares (a bad setting, missing data, a broken install) fails every later
        round the same way, so the run stops with that reason instead of running on without
        training. Different reasons (one client out of memory, another timed out) let it go on.
        """
        if not clients or any(c not in reasons for c in clients):
            return
        if len({reason_key(reasons[c]) for c in clients}) != 1:
            return
        first = min(clients)
        raise RoundFailedError(
            f"{what}: every client ({len(clients)}) failed the same way, so the run stops: {reasons[first]}"
        )

    def _check_and_log_replies(
        self, replies: Iterable[Message], is_train: bool, validate: bool = True
    ) -> tuple[list[Message], list[Message]]:
        """Flower's split into (valid, error) replies, logging each failure as one readable line.

        Flower logs every error reply's whole text, which in simulation is a Ray traceback of tens of
        lines per client; the client's own error line says the same.
        """
        replies = list(replies)
        if not replies:
            return [], []
        valid = [msg for msg in replies if not msg.has_error()]
        errors = [msg for msg in replies if msg.has_error()]
        log(INFO, "%s: Received %s results and %s failures", "aggregate_train" if is_train else "aggregate_evaluate",
            len(valid), len(errors))
        for msg in errors:
            log(INFO, "\t> Node %d failed: %s", msg.metadata.src_node_id, readable_reason(str(msg.error.reason)))
        if validate and valid:
            validate_message_reply_consistency(
                replies=[msg.content for msg in valid], weighted_by_key=self.weighted_by_key,
                check_arrayrecord=is_train,
            )
        return valid, errors

    def _reply_problem(self, reply: Message, client: int, server_round: int) -> str:
        """Why a (non-error) train reply cannot be used, or "" if it can."""
        if client < 0:
            return f"reply from unknown node {reply.metadata.src_node_id}"
        size = _reply_bytes(reply.content)
        if size > MAX_REPLY_BYTES:
            return f"reply of {size} bytes exceeds the limit of {MAX_REPLY_BYTES} (checkpoints travel as references)"
        if any(len(record) for record in reply.content.array_records.values()):
            return "reply carries arrays; send a checkpoint reference instead"
        try:
            config = reply.content[self.configrecord_key]
            if int(config["client-id"]) != client:
                return f"reply claims client {config['client-id']} but comes from client {client}'s node"
            weight = float(_single_metrics(reply)[self.weighted_by_key])
        except (KeyError, TypeError, ValueError) as exc:
            return f"malformed reply: {exc}"
        if not math.isfinite(weight) or weight <= 0:
            return f"'{self.weighted_by_key}' = {weight} is not a positive number"
        assigned = self.assigned_examples(server_round, client)
        if assigned is not None and weight > assigned:
            return (f"'{self.weighted_by_key}' = {weight:g} is more than the {assigned} episodes client {client} "
                    "was assigned this round")
        return ""

    def _aggregate_role(
        self, server_round: int, candidates: list[tuple[Message, int]], rejected: dict[int, str],
        kind: str,
    ) -> tuple[CheckpointRef | None, list[tuple[Message, int, str]], AggregateReport | None]:
        """Open and check each candidate's ``kind`` (actor or critic) checkpoint, then average; a
        client whose checkpoint fails while streaming (a bad file, NaN or Inf values) is refused
        and the mean is recomputed without it. Shapes are checked against the current global
        actor (critic: the global critic, once there is one). Returns the new reference, the
        clients used (reply, client, checkpoint path) and the aggregation's report."""
        start = self.global_model if kind == "actor" else self.global_critic
        reference = open_checkpoint(start, check_hash=False) if start is not None else None
        opened: list[tuple[Message, int, CheckpointReader]] = []
        try:
            for reply, client in candidates:
                try:
                    ref = CheckpointRef.from_config(reply.content[self.configrecord_key], kind)
                    if ref.kind != kind:
                        raise CheckpointError(f"reference says kind '{ref.kind}', expected '{kind}'")
                    reader = open_checkpoint(self.store.resolve(ref, server_round, client), root=self.run_root,
                                             check_hash="while-reading")  # verified before the mean is committed
                    try:
                        if reference is not None:
                            check_compatible(reader, reference)
                        if self.model_files is not None:
                            check_model_config(reader.huggingface_dir(), self.model_files, kind,
                                               who=f"client {client}'s {kind} checkpoint")
                    except CheckpointError:
                        reader.close()
                        raise
                except CheckpointError as exc:
                    self._refuse(server_round, client, str(exc), rejected)
                    continue
                opened.append((reply, client, reader))
            out_dir = Path(self.run_root) / f"round_{server_round}" / ("global" if kind == "actor" else "global_critic")
            while opened:
                weights = self.aggregation_weights(server_round, [r for r, _, _ in opened])
                bad = [i for i, w in enumerate(weights) if not (math.isfinite(w) and w > 0)]
                if bad:
                    for i in reversed(bad):
                        _, client, reader = opened.pop(i)
                        reader.close()
                        self._refuse(server_round, client, f"aggregation weight {weights[i]} is not positive", rejected)
                    continue
                try:
                    report = self.aggregate_checkpoints(
                        server_round, [(reader, w) for (_, _, reader), w in zip(opened, weights)], out_dir, reference
                    )
                except CheckpointError as exc:
                    culprits = [i for i, (_, _, reader) in enumerate(opened) if str(reader.directory) in str(exc)]
                    if not culprits:
                        log(WARNING, "round %d: aggregation failed: %s", server_round, exc)
                        for _, client, _ in opened:
                            rejected.setdefault(client, f"aggregation failed: {exc}")
                        return None, [], None
                    for i in reversed(culprits):
                        _, client, reader = opened.pop(i)
                        reader.close()
                        self._refuse(server_round, client, str(exc), rejected)
                    continue
                log(INFO, "round %d: averaged %d %s checkpoints (%d tensors, weights %s) in %.1f s",
                    server_round, len(opened), kind, report.num_tensors,
                    [round(w, 4) for w in report.weights], report.seconds)
                used = [(reply, client, str(reader.directory)) for reply, client, reader in opened]
                if report.update_stats is not None:
                    log(INFO, "round %d: %s", server_round,
                        describe_update_stats(report.update_stats, [c for _, c, _ in used], kind))
                return CheckpointRef.for_directory(out_dir, kind, "hf-safetensors"), used, report  # type: ignore[arg-type]
            return None, [], None
        finally:
            for _, _, reader in opened:
                reader.close()
            if reference is not None:
                reference.close()

    @staticmethod
    def _refuse(server_round: int, client: int, reason: str, rejected: dict[int, str]) -> None:
        log(WARNING, "round %d: checkpoint of client %d refused: %s", server_round, client, reason)
        rejected[client] = reason

    # ----------------------------------------------------------------------------- evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Split the validation seeds across the available clients' nodes."""
        self._eval_clients = []
        if not self.eval_seeds or self.fraction_evaluate == 0.0:
            return []
        nodes = self.discover_clients(grid, wait=not self._asked_nodes)
        if not nodes:
            log(WARNING, "configure_evaluate: round %d: no client is connected; skipping evaluation", server_round)
            return []
        clients = sorted(nodes)[: max(1, min(len(nodes), len(self.eval_seeds)))]
        self._eval_clients = clients
        messages = []
        for index, client in enumerate(clients):
            values = {
                **dict(config),
                **self.eval_payload,
                "server-round": server_round,
                "client-id": client,
                "eval-seeds": self.eval_seeds[index :: len(clients)],
            }
            messages.append(self._instruction(MessageType.EVALUATE, nodes[client], values))
        log(INFO, "configure_evaluate: round %d evaluates %s on clients %s (%d episodes)",
            server_round, Path(self.global_model.path).name, clients, len(self.eval_seeds))
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Episode-weighted success rate and reward of the global model; stops the run when every
        evaluating client failed for the same reason."""
        replies = list(replies)
        metrics = super().aggregate_evaluate(server_round, replies)
        if metrics is None:
            client_of_node = {node: client for client, node in self._node_of_client.items()}
            reasons = {client_of_node.get(r.metadata.src_node_id, -1): readable_reason(str(r.error.reason))
                       for r in replies if r.has_error()}
            for client in self._eval_clients:
                reasons.setdefault(client, "no reply within the round timeout")
            self._stop_if_all_failed_alike(f"evaluation of round {server_round}", self._eval_clients, reasons)
        else:
            # Flower's weighted mean drops the weight key; the episode count belongs in the curve.
            metrics[self.weighted_by_key] = sum(
                int(_single_metrics(r)[self.weighted_by_key]) for r in replies if not r.has_error()
            )
            if self.recorder is not None:
                self.recorder.record_eval(
                    server_round=server_round,
                    model="base" if server_round == 0 else "aggregated",
                    metrics=dict(metrics),
                )
        return metrics

    def evaluate_initial(self, grid: Grid, timeout: float) -> MetricRecord | None:
        """Round-0 evaluation of the base model (Flower's ``start`` only evaluates server-side)."""
        messages = list(self.configure_evaluate(0, ArrayRecord(), ConfigRecord(), grid))
        if not messages:
            return None
        log(INFO, "")
        log(INFO, "[ROUND 0]")
        return self.aggregate_evaluate(0, grid.send_and_receive(messages, timeout=timeout))

    def shutdown_clients(self, grid: Grid, timeout: float = 120.0) -> None:
        """Tell every known node the run is over, so it stops what it started (env services)."""
        messages = [
            Message(RecordDict({"config": ConfigRecord(self.store.instruction_fields())}), dst_node_id=node,
                    message_type=QUERY_SHUTDOWN)
            for node in sorted(set(self._node_of_client.values()))
        ]
        if not messages:
            return
        stopped = trainers = 0
        for reply in grid.send_and_receive(messages, timeout=timeout):
            if reply.has_error():
                log(WARNING, "Node %d did not shut down cleanly: %s", reply.metadata.src_node_id, reply.error.reason)
            else:
                stopped += int(reply.content["metrics"]["services-stopped"])
                trainers += int(reply.content["metrics"].get("trainers-stopped", 0))
        log(INFO, "[fedagent] run over: %d node(s) told, %d env service(s) and %d persistent trainer(s) stopped",
            len(messages), stopped, trainers)

    def summary(self) -> None:
        """Log the strategy's settings, as Flower's strategies do."""
        log(INFO, "\t├── %s: N=%d clients, M=%d per round, seed %d%s", type(self).__name__,
            self.num_clients, self.clients_per_round, self.base_seed,
            f", local client {self.local_client_id}" if self.local_client_id >= 0 else "")
        log(INFO, "\t├── Weights: %s", list(self.fixed_weights) or f"'{self.weighted_by_key}'")
        log(INFO, "\t├── Run root: %s", self.run_root)
        log(INFO, "\t├── Checkpoints: %s", self.store.describe())
        log(INFO, "\t└── Initial global model: %s", self.global_model.path)


def _reply_bytes(content: RecordDict) -> int:
    """Approximate payload size of a reply: array bytes plus the length of every config value."""
    size = sum(len(array.data) for record in content.array_records.values() for array in record.values())
    for record in [*content.config_records.values(), *content.metric_records.values()]:
        for key, value in record.items():
            items = value if isinstance(value, list) else [value]
            size += len(key) + sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in items)
    return size


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CLIENT_LABEL = re.compile(r"client \d+ (?:eval )?round \d+: ")
# Flower's reply error: "<class 'pkg.Type'>:<'message'>" (deployment: the ClientApp's exception;
# simulation: Ray's task error around the ClientApp's traceback).
_FLOWER_ERROR = re.compile(r"^<class '(?P<type>[^']+)'>:<'(?P<body>.*)'>$", re.S)
# What Flower's ClientAppException (and the deployment runtime) adds around the ClientApp's message.
_WRAPPED_MESSAGE = re.compile(r"Exception \w+ occurred\. Message: ", re.S)
_EXCEPTION_LINE = re.compile(r"^\s*(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Failed|Exit|Interrupt|Warning)\w*): "
                             r"(?P<message>\S.*)$", re.M)
_WRAPPERS = ("ClientAppException", "RayTaskError", "RayActorError")


def _is_wrapper(error_type: str) -> bool:
    """Whether an exception type is Flower's or Ray's wrapping of the ClientApp's own exception."""
    return any(name in error_type for name in _WRAPPERS)


def readable_reason(reason: str, limit: int = 1500) -> str:
    """A client failure as one readable line: the ClientApp's own error, without what Flower and Ray
    wrap around it.

    The reason is Flower's ``<class 'T'>:<'message'>``; in simulation the message is Ray's task error,
    a traceback whose end repeats the ClientApp's message after ``Exception ClientAppException
    occurred. Message:``. Our ClientApp's own failures start with ``client <c> round <r>:``, and are
    returned from that label on; any other exception is returned as ``Type: message`` (the type found
    in the traceback, without its module); a text that is none of these is returned as it is. Line
    breaks become spaces.
    """
    text = _ANSI.sub("", reason).strip()
    error_type = ""
    wrapper = _FLOWER_ERROR.match(text)
    if wrapper:
        text = wrapper.group("body")
        if not _is_wrapper(wrapper.group("type")):
            error_type = wrapper.group("type")
    wrapped = list(_WRAPPED_MESSAGE.finditer(text))
    if wrapped:
        traceback, text = text[: wrapped[-1].start()], text[wrapped[-1].end():]
        first_line = text.strip().splitlines()[0] if text.strip() else ""
        for line in reversed(list(_EXCEPTION_LINE.finditer(traceback))):  # the exception behind the message
            if line.group("message").strip() == first_line.strip() and not _is_wrapper(line.group("type")):
                error_type = line.group("type")
                break
    elif not error_type:
        lines = [m for m in _EXCEPTION_LINE.finditer(text) if not _is_wrapper(m.group("type"))]
        if lines:
            error_type, text = lines[-1].group("type"), lines[-1].group("message")
    labels = list(_CLIENT_LABEL.finditer(text))
    if labels:
        text, error_type = text[labels[-1].start():], ""
    text = " ".join(text.split())
    if text.endswith("'>"):  # the end of a Ray error repr that was cut short
        text = text[:-2].rstrip()
    if error_type:
        text = f"{error_type.rsplit('.', 1)[-1]}: {text}"
    return text[:limit]


_VARYING = re.compile(r"\b(client|round|node|pid)([ _=])\d+")


def reason_key(reason: str) -> str:
    """``reason`` with what differs between clients failing the same way blanked out: the leading
    ``client <c> round <r>:`` label, client/round/node numbers and process ids (in paths and text)."""
    text = _CLIENT_LABEL.sub("", reason, count=1) if _CLIENT_LABEL.match(reason) else reason
    return _VARYING.sub(lambda m: f"{m.group(1)}{m.group(2)}#", text)


def _single_metrics(reply: Message) -> MetricRecord:
    records = list(reply.content.metric_records.values())
    if len(records) != 1:
        raise ValueError(f"expected exactly one MetricRecord, got {len(records)}")
    return records[0]


def planned_train_episodes(payload: dict[str, Any]) -> int | None:
    """Episodes one client plays in a round, from the train payload every instruction carries:
    ``local-steps`` x ``rollout_n`` x the env instances (``n_envs``) of the train env spec. None
    when the payload lacks any of them (a strategy built without the ServerApp's payload)."""
    try:
        steps = int(payload["local-steps"])
        trainer = json.loads(str(payload["trainer-json"]))
        spec = json.loads(str(payload["env-spec-json"]))
        rollout_n = trainer.get("rollout_n")
        if rollout_n is None:  # the backend's own default
            if trainer.get("backend") == "verl":
                from fedagent_flwr.trainers.verl.settings import VerlSettings

                rollout_n = VerlSettings.rollout_n
            else:
                from fedagent_flwr.trainers.reference.config import GRPOConfig

                rollout_n = GRPOConfig.rollout_n
        instances = sum(int(entry["n_envs"]) for entry in spec["envs"])
        return steps * int(rollout_n) * instances
    except (KeyError, TypeError, ValueError):
        return None
