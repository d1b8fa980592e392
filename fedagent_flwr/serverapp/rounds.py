"""The ServerApp's round loop: Flower's ``Strategy.start`` plus the run's bookkeeping.

The loop calls the strategy's four Flower methods exactly as ``Strategy.start`` does
(``configure_train`` -> send -> ``aggregate_train`` -> ``configure_evaluate`` -> send ->
``aggregate_evaluate``), so a strategy is written as for Flower and knows nothing of what the loop
adds around it:
- before the first round it waits until every client partition the run trains is served
  (:class:`~fedagent_flwr.serverapp.nodes.NodeRegistry`), and evaluates the base model (round 0);
- it records every round in the run record (:class:`~fedagent_flwr.serverapp.recorder.RunRecorder`):
  the clients selected, absent, failed (their own error line), refused by the strategy or silent,
  the checkpoints used and the new global model, then the evaluation;
- it commits a round once its evaluation is recorded, and skips the rounds an earlier attempt at the
  same run committed (:mod:`.resume`): a completed round never reaches strategy code;
- it stops the run (:class:`~fedagent_flwr.serverapp.failures.RoundFailedError`) when every client
  of a round failed for the same reason, and (:class:`~fedagent_flwr.serverapp.failures.EmptyRoundsError`)
  after ``max_empty_rounds`` rounds in a row that aggregated nothing;
- it shows progress: a line every minute while it waits on clients, the clients' step lines while
  they train (:mod:`.progress_relay`), and each round's time with an ETA for the rest of the run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common import log
from flwr.serverapp import Grid

from fedagent_flwr.schema import declared_default
from fedagent_flwr.serverapp.exchange import send_and_receive
from fedagent_flwr.serverapp.failures import reply_reason, stop_after_empty_rounds, stop_if_all_failed_alike
from fedagent_flwr.serverapp.progress_relay import ProgressRelay
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.strategy import FedAvgFSDP, TrainAggregation
from fedagent_flwr.serverapp.strategy.replies import error_reason, refusal_key, sender, truncated_shares

NO_NODE = "no SuperNode serves this partition now"
NOT_SENT = "selected but sent no instruction (fewer clients connected than the strategy's minimum)"
NO_REPLY = "no reply within the round timeout"
# How often a round that waits on its clients says so (clients train for minutes, silently).
WAITING_LINE_EVERY_S = 60.0
# How often a training round looks for new client step records to relay.
PROGRESS_POLL_S = 5.0
# The run config's default (the schema declares it once), so a loop built without the setting
# stops after empty rounds as a configured run does.
MAX_EMPTY_ROUNDS: int = declared_default("max_empty_rounds")


def _clients(strategy: FedAvgFSDP, messages: Sequence[Message]) -> list[int]:
    """The clients the instructions ``messages`` went to."""
    return [strategy.nodes.client_of(message.metadata.dst_node_id) for message in messages]


def aggregate_round(strategy: FedAvgFSDP, recorder: RunRecorder, server_round: int, sent: Sequence[int],
                    replies: Sequence[Message]) -> None:
    """Have the strategy aggregate one training round's ``replies`` and record the round.

    ``sent`` are the clients that were sent an instruction. Every selected client that is not in the
    aggregate is recorded with its reason; when no new global model came out and every client that
    was asked failed the same way, the run stops (an absent client was not asked, so it did not fail).
    """
    selected = strategy.select_clients(server_round)
    rejected: dict[int, str] = {c: NO_NODE if strategy.nodes.node_of(c) is None else NOT_SENT
                                for c in selected if c not in sent}
    absent = set(rejected)
    replied: set[int] = set()
    for reply in replies:
        client = strategy.nodes.client_of(reply.metadata.src_node_id)
        replied.add(client)
        if reply.has_error():
            node = reply.metadata.src_node_id
            key = refusal_key(client, node)  # an unknown node: its own key
            rejected[key] = error_reason(client, node, reply_reason(reply))
            log(WARNING, "round %d: %s failed: %s", server_round, sender(client, node), reply_reason(reply))
    before = strategy.global_model
    strategy.last_aggregation = None
    _, metrics = strategy.aggregate_train(server_round, replies)
    if metrics is not None:
        log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
    result = strategy.last_aggregation
    if result is None:
        # An aggregate_train of its own that says nothing of what it used: the round is recorded
        # from what the loop sees, the global model it left, so that a round that produced none
        # counts as one that aggregated nothing (degraded, or failed if no round did).
        after = strategy.global_model
        result = TrainAggregation(started_from=before, actor=after if after != before else None)
        log(INFO if result.actor is not None else WARNING, "round %d: %s's aggregate_train set no last_aggregation; "
            "recorded from the global model it left: %s", server_round, type(strategy).__name__,
            after.path if result.actor is not None else "unchanged (the round aggregated nothing)")
    rejected.update(result.refused)
    for client in sent:
        if client not in replied:
            rejected[client] = NO_REPLY
            log(WARNING, "round %d: client %d did not reply in time", server_round, client)
    recorder.record_round(
        server_round=server_round,
        clients=list(selected),
        started_from=result.started_from.path,
        client_actors=result.client_actors,
        aggregated=result.actor.path if result.actor is not None else None,
        rejected=rejected,
        client_metrics=result.client_metrics,
        client_critics=result.client_critics,
        aggregated_critic=result.critic.path if result.critic is not None else None,
        update_stats=result.update_stats,
        aggregated_sha256=result.actor.sha256 if result.actor is not None else None,
        aggregated_critic_sha256=result.critic.sha256 if result.critic is not None else None,
    )
    if result.actor is None:
        stop_if_all_failed_alike(f"round {server_round}", list(selected),
                                 {c: r for c, r in rejected.items() if c not in absent})


def evaluate_round(strategy: FedAvgFSDP, recorder: RunRecorder, server_round: int, sent: Sequence[int],
                   replies: Sequence[Message]) -> None:
    """Have the strategy aggregate one evaluation's ``replies`` and record it; stop the run when every
    evaluating client (``sent``) failed for the same reason.

    Clients that failed, sent a reply the strategy refused (``evaluation_refused``) or did not reply
    are recorded with their reasons: on the evaluation's point
    when the others' episodes made one, else (nothing to average) as an evaluation that recorded
    nothing, so that a round missing from the validation curve says why. The point also records
    each averaged client's share of truncated episodes (a warning for each above 0).
    """
    model = "base" if server_round == 0 else "aggregated"
    strategy.evaluation_refused = {}  # an aggregate_evaluate of its own may not set it
    metrics = strategy.aggregate_evaluate(server_round, replies)
    failed = {}
    for r in replies:
        if r.has_error():
            client, node = strategy.nodes.client_of(r.metadata.src_node_id), r.metadata.src_node_id
            failed[refusal_key(client, node)] = error_reason(client, node, reply_reason(r))
    failed.update(strategy.evaluation_refused)  # replies the strategy refused (malformed), with why
    answered = {strategy.nodes.client_of(r.metadata.src_node_id) for r in replies}
    failed.update({client: NO_REPLY for client in sent if client not in answered})
    why = "; ".join(f"client {c}: {reason}" for c, reason in sorted(failed.items()))
    if metrics is None:
        stop_if_all_failed_alike(f"evaluation of round {server_round}", list(sent), failed)
        if failed:
            log(WARNING, "round %d: the evaluation of the %s model recorded nothing: %s", server_round, model, why)
            recorder.record_eval_failure(server_round=server_round, model=model, failed=failed)
        return
    log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
    if failed:
        log(WARNING, "round %d: the evaluation of the %s model lacks the episodes of %s", server_round, model, why)
    used = [r for r in replies if not r.has_error()
            and refusal_key(strategy.nodes.client_of(r.metadata.src_node_id), r.metadata.src_node_id) not in failed]
    recorder.record_eval(server_round=server_round, model=model, metrics=dict(metrics), failed=failed,
                         truncated=truncated_shares(used, strategy.nodes.client_of))


class RoundLoop:
    """Runs (or resumes) the rounds of one run with ``strategy`` and records them.

    ``last_completed`` is the last round an earlier attempt committed (None: not even round 0);
    ``before_commit(round)`` runs just before each round's commit, ``after_commit(round)`` after
    it (:mod:`.retention` notes there what the commit lets go, so the commit's write records it,
    and removes it here);
    ``run_root`` is where the clients' progress files are (None: no step lines are relayed);
    ``max_empty_rounds``: rounds in a row that aggregate nothing before the run stops (0: never;
    by default the run config's default, :data:`MAX_EMPTY_ROUNDS`).
    """

    def __init__(self, strategy: FedAvgFSDP, grid: Grid, recorder: RunRecorder, *, timeout: float,
                 last_completed: int | None = None, after_commit: Callable[[int], Any] | None = None,
                 run_root: Path | None = None, max_empty_rounds: int = MAX_EMPTY_ROUNDS,
                 before_commit: Callable[[int], Any] | None = None) -> None:
        self.run_root = run_root
        self.max_empty_rounds = max_empty_rounds
        self.strategy = strategy
        self.grid = grid
        self.recorder = recorder
        self.timeout = timeout
        self.done = -1 if last_completed is None else last_completed
        self.before_commit = before_commit
        self.after_commit = after_commit

    def run(self, num_rounds: int, evaluate_base: bool = True) -> None:
        """Round 0 (the base model's evaluation) unless committed, then rounds 1..``num_rounds``."""
        log(INFO, "Starting %s strategy:", type(self.strategy).__name__)
        self.strategy.summary()
        if self.done >= num_rounds:
            return
        # Before the first round: wait until every partition the run trains is served.
        self.strategy.nodes.discover(self.grid, self.strategy.required_clients(num_rounds), wait=True)
        if self.done < 0:
            if evaluate_base:
                self.evaluate(0)
            self.recorder.complete_round(0)
        took: list[float] = []
        for server_round in range(1, num_rounds + 1):
            if server_round <= self.done:
                log(INFO, "round %d was completed by an earlier attempt at this run; skipped", server_round)
                continue
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
            started = time.monotonic()
            self.train(server_round)
            # before the evaluation: an unchanged model is not worth evaluating again
            stop_after_empty_rounds(self.recorder.summary["rounds"], self.max_empty_rounds)
            self.evaluate(server_round)
            if self.before_commit is not None:
                self.before_commit(server_round)
            self.recorder.complete_round(server_round)
            if self.after_commit is not None:
                self.after_commit(server_round)
            took.append(time.monotonic() - started)
            left = num_rounds - server_round
            log(INFO, "round %d/%d done in %.0f s%s", server_round, num_rounds, took[-1],
                f"; about {left * sum(took) / len(took) / 60:.1f} min left for {left} round(s) "
                f"(the mean of this attempt's {len(took)})" if left else "")

    def _send(self, messages: list[Message], server_round: int, what: str) -> list[Message]:
        """Send ``messages`` and wait for the replies, saying every minute whom the round waits on
        and, while they train, relaying the clients' step lines."""
        if not messages:
            return []
        clients = _clients(self.strategy, messages)
        done = threading.Event()
        relay = (ProgressRelay(self.run_root, server_round, clients)
                 if self.run_root is not None and what == "training" else None)
        interval = min(PROGRESS_POLL_S, WAITING_LINE_EVERY_S) if relay is not None else WAITING_LINE_EVERY_S

        def remind() -> None:
            started = time.monotonic()
            next_line = started + WAITING_LINE_EVERY_S
            while not done.wait(interval):
                if relay is not None:
                    relay.poll()
                if time.monotonic() >= next_line:
                    next_line += WAITING_LINE_EVERY_S
                    log(INFO, "round %d: %s: waiting on clients %s, %.0f min so far (round timeout %.0f min)",
                        server_round, what, clients, (time.monotonic() - started) / 60, self.timeout / 60)

        reminder = threading.Thread(target=remind, name=f"waiting-round-{server_round}", daemon=True)
        reminder.start()
        try:
            return send_and_receive(self.grid, messages, self.timeout)
        finally:
            done.set()
            reminder.join()
            if relay is not None:
                relay.poll()  # what came since the last poll (a short round may see no poll at all)

    def train(self, server_round: int) -> None:
        """One training step: configure, send, aggregate, record."""
        messages = list(self.strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), self.grid))
        replies = self._send(messages, server_round, "training")
        aggregate_round(self.strategy, self.recorder, server_round, _clients(self.strategy, messages), replies)

    def evaluate(self, server_round: int) -> None:
        """One evaluation of the global model: configure, send, aggregate, record."""
        self.strategy.evaluation_skipped = ""  # only this round's configure_evaluate may say it could not send
        messages = list(self.strategy.configure_evaluate(server_round, ArrayRecord(), ConfigRecord(), self.grid))
        skipped = self.strategy.evaluation_skipped
        if not messages and skipped:  # it should have evaluated and could not: the curve lacks this round
            model = "base" if server_round == 0 else "aggregated"
            log(WARNING, "round %d: the evaluation of the %s model was skipped: %s", server_round, model, skipped)
            self.recorder.record_eval_failure(server_round=server_round, model=model, failed={}, reason=skipped)
            return
        if server_round == 0:
            if not messages:
                return
            log(INFO, "")
            log(INFO, "[ROUND 0]")
        replies = self._send(messages, server_round, "evaluation")
        evaluate_round(self.strategy, self.recorder, server_round, _clients(self.strategy, messages), replies)
