"""FedAvg over checkpoint references (FedAvgFSDP).

Federated Averaging [McMahan et al., 2017, arxiv.org/abs/1602.05629] for models too large to
travel as arrays: clients train verl/FSDP (or reference-trainer) checkpoints on disk and reply
with typed :class:`CheckpointRef` s (:class:`~fedagent_flwr.protocol.TrainReply`); this strategy
resolves and checks them, averages the weights tensor by tensor in fp32 and sends the reference of
the new global model back. No ``ArrayRecord`` ever carries weights.

Like Flower's ``FedAvg`` it only selects, configures and aggregates; the ServerApp runs the rounds
(:mod:`fedagent_flwr.serverapp.rounds`: the run record, commits, resume, skipped evaluations) and knows
which SuperNode serves which client partition (:class:`~fedagent_flwr.serverapp.nodes.NodeRegistry`).
Compared with ``FedAvg`` it
- selects client partitions with FedAgent's seeded rule (``seeding.select_clients``), so runs are
  reproducible and comparable with FedAgent's; Flower's ``fraction_train`` is refused (set
  ``clients.per_round``), its ``min_*_nodes`` and ``fraction_evaluate`` are honoured;
- refuses a bad client checkpoint (outside the client's own slot of the round, missing, corrupt,
  wrong hash, shapes or a ``config.json`` that differ from the global model), a malformed or oversized
  reply, or a ``num-examples`` beyond the episodes the client was assigned, naming the client, and
  aggregates the rest; a malformed evaluation reply, or one beyond the client's share of the seeds, likewise;
- gives the global model the config, generation config, tokenizer and chat template of the run's base
  model, never a client's (:mod:`fedagent_flwr.checkpoint.model_files`);
- moves checkpoints through a :class:`~fedagent_flwr.checkpoint.store.ServerStore`: paths on a shared
  filesystem, or URLs of the ServerApp's HTTP store when the machines share none;
- keeps the previous global model when no client checkpoint is usable.

Subclasses change what is sent by overriding :meth:`train_instruction` / :meth:`eval_instruction` and
the rule by overriding :meth:`aggregation_weights` (weights per reply) or :meth:`aggregate_checkpoints`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedagent_flwr.checkpoint import (
    AggregateReport,
    CheckpointError,
    CheckpointReader,
    CheckpointRef,
    check_compatible,
    weighted_mean,
)
from fedagent_flwr.checkpoint.model_files import check_model_config, model_files_dir
from fedagent_flwr.checkpoint.store import ServerStore, SharedFsServerStore
from fedagent_flwr.checkpoint.update_stats import describe_update_stats
from fedagent_flwr.protocol import (
    PROXIMAL_MU,
    EvalInstruction,
    TrainInstruction,
    TrainReply,
    protocol_keys,
)
from fedagent_flwr.schema.run import Experiment, RunSchema
from fedagent_flwr.seeding import data_seed, select_clients
from fedagent_flwr.serverapp.nodes import NodeRegistry
from fedagent_flwr.serverapp.strategy.flower_settings import check_flower_settings
from fedagent_flwr.serverapp.strategy.plan import RunPlan
from fedagent_flwr.serverapp.strategy.replies import (
    evaluation_contents,
    read_train_reply,
    refusal_key,
    sender,
    split_replies,
    usable_evaluations,
)
from fedagent_flwr.serverapp.strategy.sources import (
    aggregation_culprits,
    global_model_unchanged,
    reopened,
    round_sources,
)


@dataclass
class TrainAggregation:
    """What one ``aggregate_train`` did, for the run record: the checkpoints it used and refused."""

    started_from: CheckpointRef
    actor: CheckpointRef | None = None  # the new global model; None: the previous one is kept
    critic: CheckpointRef | None = None  # PPO: the new global critic
    client_actors: dict[int, str] = field(default_factory=dict)
    client_critics: dict[int, str] = field(default_factory=dict)
    client_metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    update_stats: dict[str, Any] | None = None


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
    fixed_weights : Sequence[float]
        Per-client-id aggregation weights; empty means weighting by ``weighted_by_key``.
    plan : RunPlan | None
        The run-wide part of every instruction (trainer settings, env specs, ...).
    eval_seeds : Sequence[int]
        Validation episode seeds, split across the evaluating clients.
    store : ServerStore | None
        How checkpoints travel; None means a shared filesystem under ``run_root``.
    nodes : NodeRegistry | None
        Which node serves which client partition (the ServerApp's registry).
    initial_critic : CheckpointRef | None
        PPO: the global critic to start from (a resumed run's); None starts from the model.
    **kwargs
        Flower's ``FedAvg`` settings: ``weighted_by_key``, ``min_train_nodes``,
        ``min_evaluate_nodes``, ``min_available_nodes``, ``fraction_evaluate`` and the metric
        aggregation functions are honoured; ``fraction_train`` and the record keys are refused.
    """

    def __init__(
        self,
        *,
        run_root: str,
        initial_model: CheckpointRef,
        num_clients: int,
        clients_per_round: int,
        base_seed: int = RunSchema.seed,
        local_client_id: int = Experiment.local_client_id,
        fixed_weights: Sequence[float] = (),
        plan: RunPlan | None = None,
        eval_seeds: Sequence[int] = (),
        store: ServerStore | None = None,
        nodes: NodeRegistry | None = None,
        initial_critic: CheckpointRef | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("min_available_nodes", 1)
        kwargs.setdefault("min_train_nodes", 1)
        kwargs.setdefault("min_evaluate_nodes", 1)
        super().__init__(**kwargs)
        self.run_root = str(Path(run_root).resolve())
        self.global_model = initial_model
        self.global_critic = initial_critic  # PPO: sent with the actor once there is one
        self.num_clients = num_clients
        self.clients_per_round = clients_per_round
        self.base_seed = base_seed
        self.local_client_id = local_client_id
        self.fixed_weights = tuple(float(w) for w in fixed_weights)
        self.plan = plan if plan is not None else RunPlan()
        self.eval_seeds = list(eval_seeds)
        self.store = store if store is not None else SharedFsServerStore(self.run_root)
        self.nodes = nodes if nodes is not None else NodeRegistry(num_clients)
        # Config, generation config, tokenizer and chat template of every global model (actor and
        # critic): the initial model's, which is the base model or a global model that took them
        # from it. Client configs are checked against them.
        self.model_files: Path | None = model_files_dir(initial_model.path)
        # What the last aggregate_train did, why the last configure_evaluate sent nothing when it
        # should have evaluated ('' otherwise), and the clients whose evaluation replies the last
        # aggregate_evaluate refused (malformed) with why; the ServerApp records them (serverapp.rounds).
        self.last_aggregation: TrainAggregation | None = None
        self.evaluation_skipped = ""
        self.evaluation_refused: dict[int, str] = {}
        # The validation seeds the last configure_evaluate sent each client: {round: {client: seeds}}.
        self.evaluation_seeds: dict[int, dict[int, list[int]]] = {}
        check_flower_settings(self)

    # ----------------------------------------------------------------------------- selection
    def select_clients(self, server_round: int) -> list[int]:
        """Client ids trained in ``server_round`` (FedAgent's seeded rule)."""
        return select_clients(
            server_round, self.num_clients, self.clients_per_round, self.base_seed,
            self.local_client_id,
        )

    def required_clients(self, num_rounds: int) -> list[int]:
        """Every client id a run of ``num_rounds`` rounds trains: the union of all rounds' selections."""
        needed: set[int] = set()
        for server_round in range(1, num_rounds + 1):
            needed.update(self.select_clients(server_round))
        return sorted(needed)

    def _short_of_nodes(self, online: dict[int, int], wanted: int, setting: str, what: str) -> str:
        """Flower's ``min_available_nodes`` and ``min_{train,evaluate}_nodes``: why (logged) when short, else ''."""
        if len(online) < self.min_available_nodes:
            why = f"{len(online)} client node(s) connected, fewer than min_available_nodes = {self.min_available_nodes}"
        elif wanted < getattr(self, setting):
            why = f"{wanted} client(s) available, fewer than {setting} = {getattr(self, setting)}"
        else:
            return ""
        log(WARNING, "%s: %s; skipped", what, why)
        return why

    # ----------------------------------------------------------------------------- train
    def train_instruction(self, server_round: int, client: int, config: ConfigRecord) -> TrainInstruction:
        """What client ``client`` is asked to train in ``server_round``: the global model's reference
        (as the store shares it), its seeds, the run's plan and the store's upload grant. ``config``
        is Flower's train config; values the protocol does not know travel unchanged."""
        values = dict(config)
        return TrainInstruction(
            server_round=server_round,
            client_id=client,
            num_clients=self.num_clients,
            data_seed=data_seed(self.base_seed, server_round, client),
            base_seed=self.base_seed,
            algorithm=self.plan.algorithm,
            local_steps=self.plan.local_steps,
            epochs=self.plan.epochs,
            client_eval_seeds=list(self.plan.client_eval_seeds),
            val_env_spec=self.plan.val_env_spec if self.plan.client_eval_seeds else {},
            trainer=self.plan.trainer_for(client),
            env_spec=self.plan.train_env_spec,
            partition=self.plan.partition,
            service=self.plan.service,
            global_model=self.store.share(self.global_model),
            global_critic=self.store.share(self.global_critic) if self.global_critic is not None else None,
            proximal_mu=float(values.get(PROXIMAL_MU, 0.0)),  # type: ignore[arg-type]
            store={**self.store.instruction_fields(), **self.store.upload_grant(server_round, client)},
            extra={k: v for k, v in values.items() if k not in protocol_keys()},
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send each selected client that a node serves its :meth:`train_instruction`."""
        nodes = self.nodes.online(grid)
        clients = self.select_clients(server_round)
        present = [c for c in clients if c in nodes]
        absent = sorted(set(clients) - set(present))
        log(INFO, "configure_train: round %d trains clients %s (out of %d)%s", server_round, clients,
            self.num_clients, f"; absent: {absent}" if absent else "")
        if self._short_of_nodes(nodes, len(present), "min_train_nodes", f"training of round {server_round}"):
            return []
        return [Message(self.train_instruction(server_round, c, config).to_record(), dst_node_id=nodes[c],
                        message_type=MessageType.TRAIN) for c in present]

    def assigned_examples(self, server_round: int, client: int) -> int | None:
        """The most ``num-examples`` client ``client`` may report for ``server_round``: the episodes
        its instruction asks for (``epochs`` x ``local-steps`` x ``rollout_n`` x the env instances of
        the train env spec, what both trainers play); None when the plan does not say, which leaves only the
        check that it is a positive number."""
        return self.plan.train_episodes()

    def aggregation_weights(self, server_round: int, replies: Sequence[TrainReply]) -> list[float]:
        """One weight per accepted reply: fixed per client id if configured, else ``weighted_by_key``."""
        if self.fixed_weights:
            return [self.fixed_weights[reply.client_id] for reply in replies]
        return [float(reply.metrics[self.weighted_by_key]) for reply in replies]

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
        """Check the clients' replies and checkpoint references and average the good ones.

        Error replies are left to the ServerApp (they are the clients' own failures); every other
        refused client is in :attr:`last_aggregation` with its reason. The previous global model
        is kept when nobody is left. Returns no arrays (the new global model is a reference,
        :attr:`global_model`) and Flower's aggregate of the used clients' metrics.
        """
        result = TrainAggregation(started_from=self.global_model)
        self.last_aggregation = result
        candidates: list[tuple[Message, TrainReply]] = []
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        for reply in valid:
            client = self.nodes.client_of(reply.metadata.src_node_id)
            parsed, problem = read_train_reply(reply, client, self.weighted_by_key,
                                               self.assigned_examples(server_round, client))
            if parsed is None:
                log(WARNING, "round %d: reply of %s refused: %s", server_round,
                    sender(client, reply.metadata.src_node_id), problem)
                result.refused[refusal_key(client, reply.metadata.src_node_id)] = problem
            else:
                candidates.append((reply, parsed))
        # Client-id order, not arrival order: with three or more clients the float sums (and the
        # update statistics' layout) would otherwise depend on which reply came first.
        candidates.sort(key=lambda item: item[1].client_id)
        new_ref, used, report = self._aggregate_role(server_round, candidates, result.refused, "actor")
        if new_ref is not None:
            self.global_model = result.actor = new_ref
            log(INFO, "round %d: new global model %s", server_round, new_ref.path)
        else:
            log(WARNING, "round %d: no valid client checkpoint; keeping the previous global model %s",
                server_round, result.started_from.path)
        result.client_actors = {parsed.client_id: path for _, parsed, path in used}
        result.client_metrics = {parsed.client_id: dict(parsed.metrics) for _, parsed, _ in used}
        if report is not None and report.update_stats is not None:
            result.update_stats = report.update_stats.to_dict([parsed.client_id for _, parsed, _ in used])
        with_critic = [(m, parsed) for m, parsed, _ in used if parsed.critic is not None]
        if with_critic:
            # PPO: the critics of exactly the clients whose actors were averaged, with the same rule.
            critic_ref, critic_used, _ = self._aggregate_role(server_round, with_critic, result.refused, "critic")
            result.client_critics = {parsed.client_id: path for _, parsed, path in critic_used}
            if critic_ref is not None:
                self.global_critic = result.critic = critic_ref
                log(INFO, "round %d: new global critic %s", server_round, critic_ref.path)
        metrics = None
        if used:
            try:
                metrics = self.train_metrics_aggr_fn([m.content for m, _, _ in used], self.weighted_by_key)
            except (KeyError, TypeError, ValueError) as exc:  # metric keys differ between clients
                log(WARNING, "round %d: client metrics could not be averaged: %s", server_round, exc)
        return None, metrics

    def _aggregate_role(
        self, server_round: int, candidates: list[tuple[Message, TrainReply]], refused: dict[int, str], kind: str,
    ) -> tuple[CheckpointRef | None, list[tuple[Message, TrainReply, str]], AggregateReport | None]:
        """Open and check each candidate's ``kind`` (actor or critic) checkpoint, then average; a
        client whose checkpoint fails while streaming (a bad file, NaN or Inf values) is refused
        and the mean is recomputed without it. Shapes are checked against the current global
        actor (critic: the global critic, once there is one). Returns the new reference, the
        clients used (message, reply, checkpoint path) and the aggregation's report.

        The global model is checked before any client is blamed for the aggregation or the mean used (after
        each aggregation, :func:`.sources.aggregation_culprits`, and when no client is left): changed while the
        round read it, it failed them all (every LoRA adapter reads on it), and the run stops naming it
        (clients already refused as they opened stay in ``refused``, their reasons naming it)."""
        start = self.global_model if kind == "actor" else self.global_critic
        reference, open_client = round_sources(self.run_root, self.store.receipt_check(), start)  # hash-checked
        opened: list[tuple[Message, TrainReply, CheckpointReader]] = []
        try:
            for message, reply in candidates:
                client = reply.client_id
                ref = reply.actor if kind == "actor" else reply.critic
                assert ref is not None  # candidates for the critic all carry one
                try:
                    reader = open_client(self.store.resolve(ref, server_round, client))  # sources.round_sources
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
                    self._refuse(server_round, client, str(exc), refused)
                    continue
                opened.append((message, reply, reader))
            out_dir = Path(self.run_root) / f"round_{server_round}" / ("global" if kind == "actor" else "global_critic")
            while opened:
                weights = self.aggregation_weights(server_round, [r for _, r, _ in opened])
                bad = [i for i, w in enumerate(weights) if not (math.isfinite(w) and w > 0)]
                if bad:
                    for i in reversed(bad):
                        _, reply, reader = opened.pop(i)
                        reader.close()
                        self._refuse(server_round, reply.client_id, f"aggregation weight {weights[i]} is not positive",
                                     refused)
                    continue
                failure: CheckpointError | None = None
                try:
                    report = self.aggregate_checkpoints(
                        server_round, [(reader, w) for (_, _, reader), w in zip(opened, weights)], out_dir, reference
                    )
                except CheckpointError as exc:
                    failure = exc
                culprits = aggregation_culprits(reference, [reader for _, _, reader in opened], failure, out_dir)
                if failure is not None and not culprits:
                    log(WARNING, "round %d: aggregation failed: %s", server_round, failure)
                    for _, reply, _ in opened:
                        refused.setdefault(reply.client_id, f"aggregation failed: {failure}")
                    return None, [], None
                if culprits:
                    opened = self._drop(server_round, opened, culprits, refused, open_client)
                    continue
                log(INFO, "round %d: averaged %d %s checkpoints (%d tensors, weights %s) in %.1f s",
                    server_round, len(opened), kind, report.num_tensors,
                    [round(w, 4) for w in report.weights], report.seconds)
                used = [(message, reply, str(reader.directory)) for message, reply, reader in opened]
                if report.update_stats is not None:
                    log(INFO, "round %d: %s", server_round,
                        describe_update_stats(report.update_stats, [r.client_id for _, r, _ in used], kind))
                return CheckpointRef.for_directory(out_dir, kind, "hf-safetensors"), used, report  # type: ignore[arg-type]
            global_model_unchanged(reference, None)  # every client refused: perhaps for its sake (a LoRA base)
            return None, [], None
        finally:
            for _, _, reader in opened:
                reader.close()
            if reference is not None:
                reference.close()

    def _drop(self, server_round: int, opened: list[tuple[Message, TrainReply, CheckpointReader]],
              culprits: list[tuple[int, str]], refused: dict[int, str],
              open_client: Callable[[CheckpointRef], CheckpointReader]
              ) -> list[tuple[Message, TrainReply, CheckpointReader]]:
        """Refuse the culprits (index into ``opened``, reason); reopen the rest by ``open_client`` for another pass."""
        for i, reason in sorted(culprits, reverse=True):
            _, reply, reader = opened.pop(i)
            reader.close()
            self._refuse(server_round, reply.client_id, reason, refused)
        return reopened(opened, open_client, lambda client, why: self._refuse(server_round, client, why, refused))

    @staticmethod
    def _refuse(server_round: int, client: int, reason: str, refused: dict[int, str]) -> None:
        log(WARNING, "round %d: checkpoint of client %d refused: %s", server_round, client, reason)
        refused[client] = reason

    # ----------------------------------------------------------------------------- evaluate
    def eval_instruction(self, server_round: int, client: int, seeds: list[int],
                         config: ConfigRecord) -> EvalInstruction:
        """What client ``client`` is asked to evaluate: the global model on ``seeds``."""
        return EvalInstruction(
            server_round=server_round,
            client_id=client,
            trainer=self.plan.trainer_for(client),
            env_spec=self.plan.val_env_spec,
            service=self.plan.service,
            eval_seeds=seeds,
            global_model=self.store.share(self.global_model),
            global_critic=self.store.share(self.global_critic) if self.global_critic is not None else None,
            store=self.store.instruction_fields(),
            extra={k: v for k, v in dict(config).items() if k not in protocol_keys()},
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Split the validation seeds across ``fraction_evaluate`` of the connected clients (at least
        ``min_evaluate_nodes``; the lowest client ids, so the split is the same in every run)."""
        self.evaluation_skipped, self.evaluation_seeds = "", {}
        if not self.eval_seeds or self.fraction_evaluate == 0.0:
            return []
        nodes = self.nodes.online(grid)
        wanted = max(self.min_evaluate_nodes, int(len(nodes) * self.fraction_evaluate))
        what = f"configure_evaluate: evaluation of round {server_round}"
        # min_available_nodes >= 1, so no node connected is a shortage too
        self.evaluation_skipped = self._short_of_nodes(nodes, len(nodes), "min_evaluate_nodes", what)
        if self.evaluation_skipped:
            return []
        clients = sorted(nodes)[: max(1, min(wanted, len(self.eval_seeds)))]
        instructions = {client: self.eval_instruction(server_round, client, self.eval_seeds[index :: len(clients)],
                                                      config) for index, client in enumerate(clients)}
        self.evaluation_seeds = {server_round: {c: list(i.eval_seeds) for c, i in instructions.items()}}
        messages = [Message(instruction.to_record(), dst_node_id=nodes[client], message_type=MessageType.EVALUATE)
                    for client, instruction in instructions.items()]
        log(INFO, "configure_evaluate: round %d evaluates %s on clients %s (%d episodes)",
            server_round, Path(self.global_model.path).name, clients, len(self.eval_seeds))
        return messages

    def assigned_eval_examples(self, server_round: int, client: int) -> int | None:
        """The most ``num-examples`` client ``client`` may report for ``server_round``'s evaluation: one
        episode per seed :meth:`configure_evaluate` sent it in every env of the validation spec (0 when
        it sent it none); None when it split no seeds for that round or the plan has no validation spec."""
        split = self.evaluation_seeds.get(server_round)
        return None if split is None else self.plan.eval_episodes(len(split.get(client, [])))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Episode-weighted success rate, reward (and score) of the global model, with the episode count.
        A malformed reply, or one counting more episodes than :meth:`assigned_eval_examples`, is refused
        naming its client, who is in :attr:`evaluation_refused` with why."""
        valid, _ = self._check_and_log_replies(replies, is_train=False, validate=False)
        valid, self.evaluation_refused = usable_evaluations(
            server_round, valid, self.nodes.client_of, self.weighted_by_key,
            lambda client: self.assigned_eval_examples(server_round, client))
        if not valid:
            return None
        contents = evaluation_contents(valid, self.weighted_by_key)  # score-mean only if every client has it
        metrics = self.evaluate_metrics_aggr_fn(contents, self.weighted_by_key)
        # Flower's weighted mean drops the weight key; the episode count belongs in the curve.
        counts = [next(iter(c.metric_records.values()))[self.weighted_by_key] for c in contents]
        metrics[self.weighted_by_key] = sum(int(n) for n in counts)  # type: ignore[arg-type,misc]
        return metrics

    def _check_and_log_replies(
        self, replies: Iterable[Message], is_train: bool, validate: bool = True
    ) -> tuple[list[Message], list[Message]]:
        """Flower's split into (valid, error) replies, each failure logged as one readable line."""
        return split_replies(replies, is_train, validate, self.weighted_by_key)

    def summary(self) -> None:
        """Log the strategy's settings, as Flower's strategies do."""
        log(INFO, "\t├── %s: N=%d clients, M=%d per round, seed %d%s", type(self).__name__,
            self.num_clients, self.clients_per_round, self.base_seed,
            f", local client {self.local_client_id}" if self.local_client_id >= 0 else "")
        log(INFO, "\t├── Weights: %s", list(self.fixed_weights) or f"'{self.weighted_by_key}'")
        log(INFO, "\t├── Run root: %s", self.run_root)
        log(INFO, "\t├── Checkpoints: %s", self.store.describe())
        log(INFO, "\t└── Initial global model: %s", self.global_model.path)
