"""The run's written record: ``federated_summary.json``, ``metrics.jsonl`` and a learning curve.

The summary follows FedAgent's schema (reference/fedagent.md §1.7) so existing analysis scripts
read it, plus a few fields of ours (strategy, status, rejected clients, timings, resumes).
Everything is rewritten atomically after every round and evaluation, so a crash leaves the last
complete state; ``last_completed_round`` says how far a re-run may skip (``serverapp.resume``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.common import log

from fedagent_flwr.atomic import atomic_path, json_text, write_text_atomic
from fedagent_flwr.checkpoint.content_hash import CONTENT_HASH_VERSION
from fedagent_flwr.intervals import wilson_interval
from fedagent_flwr.protocol import (
    CLIENT_VAL_PREFIX,
    NUM_EXAMPLES,
    REWARD_MEAN,
    SCORE_MEAN,
    SUCCESS_RATE,
    TRUNCATED_RATE,
    EvalReply,
    ProtocolError,
)
from fedagent_flwr.serverapp.crashpoint import crash_point
from fedagent_flwr.serverapp.failures import partial_evaluations_reason, partial_rounds_reason, round_reasons
from fedagent_flwr.serverapp.learning import (
    CRITIC_ESTIMATORS,
    GRPO,
    ROUND_SHARES,
    flat_clients,
    learning_record,
    no_signal_reason,
    round_shares,
)
from fedagent_flwr.serverapp.tracking import Sink, open_sinks, scalars_of
from fedagent_flwr.serverapp.truncation import (
    TRUNCATED_BY_CLIENT,
    TRUNCATED_EPISODES,
    TRUNCATED_SHARE,
    truncated_share,
    truncation_record,
    warning_line,
)

if TYPE_CHECKING:
    from fedagent_flwr.serverapp.resume import PreviousRun

SUMMARY_FILE = "federated_summary.json"
METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "learning_curve.png"


class RunRecorder:
    """Collects provenance and curves of one run and writes them after every update.

    With ``previous`` (a re-run of the same run) it continues that run's record: the completed
    rounds' entries, curve points and metrics lines are kept, and the resume is noted.
    """

    def __init__(self, run_dir: str | os.PathLike[str], header: dict[str, Any],
                 previous: PreviousRun | None = None, tracking: Sequence[str] = ()) -> None:
        self.run_dir = Path(run_dir)
        # sinks besides metrics.jsonl (config key ``tracking``); a resumed run's earlier events are
        # already in them, so only new events go there
        self.sinks: list[Sink] = open_sinks(tracking, self.run_dir)
        self.summary: dict[str, Any] = {
            **header,
            # how this record's sha256s were computed (resume and verify compare like with like)
            "content_hash": header.get("content_hash", CONTENT_HASH_VERSION),
            "status": "running",
            "final_model": header.get("base_model"),
            "last_completed_round": None,
            "resumed": [],
            "val_curve": [],
            "client_curve": [],
            "client_val_curve": [],
            "eval_failures": [],  # evaluations that recorded nothing, with each client's reason
            "rounds": [],
        }
        self.events: list[dict[str, Any]] = []
        self._earlier_seconds = 0.0
        if previous is not None:
            self.summary.update(
                last_completed_round=previous.last_completed_round,
                # earlier_run_id: the attempt resumed (its run id is about to be overwritten by the header's)
                resumed=[*previous.resumed, {"run_id": header.get("run_id"),
                                             "after_round": previous.last_completed_round,
                                             "earlier_run_id": previous.run_id}],
                val_curve=list(previous.val_curve),
                client_curve=list(previous.client_curve),
                client_val_curve=list(previous.client_val_curve),
                eval_failures=list(previous.eval_failures),
                rounds=list(previous.rounds),
            )
            if previous.last_aggregate is not None:
                self.summary["final_model"] = previous.last_aggregate["aggregated_actor"]
            # written once (round 0's commit) or after a commit that freed something: a re-run may do neither
            for key in ("initial_eval_seconds", "disk_freed_bytes", "store_freed_bytes", "store_freed_objects"):
                if getattr(previous, key) is not None:
                    self.summary[key] = getattr(previous, key)
            self.events = list(previous.events)
            self._earlier_seconds = previous.wall_seconds
        self._started = time.time()
        self._last_commit = self._started
        self.write()

    @property
    def summary_path(self) -> Path:
        return self.run_dir / SUMMARY_FILE

    def _event(self, event: dict[str, Any]) -> None:
        """Add one ``metrics.jsonl`` event and hand its scalars to the tracking sinks."""
        self.events.append(event)
        self._track(event)

    def _track(self, event: dict[str, Any]) -> None:
        scalars = scalars_of(event)
        if not scalars:
            return
        for sink in list(self.sinks):
            try:
                sink.log(scalars, int(event["round"]))
            except Exception as exc:  # noqa: BLE001 - tracking must never stop a run
                log(WARNING, "[fedagent] tracking sink %s failed (%s: %s); it is dropped, "
                    "metrics.jsonl keeps every event", type(sink).__name__, type(exc).__name__, exc)
                self.sinks.remove(sink)

    def record_round(
        self,
        *,
        server_round: int,
        clients: list[int],
        started_from: str,
        client_actors: dict[int, str],
        aggregated: str | None,
        rejected: dict[int, str],
        client_metrics: dict[int, dict[str, Any]],
        client_critics: dict[int, str] | None = None,
        aggregated_critic: str | None = None,
        update_stats: dict[str, Any] | None = None,
        aggregated_sha256: str | None = None,
        aggregated_critic_sha256: str | None = None,
    ) -> None:
        """Provenance of one round: started_from -> client checkpoints -> aggregated model
        (and, for PPO, the clients' critics -> the aggregated critic), with the statistics of
        the clients' updates when the aggregation measured them (``checkpoint.update_stats``).
        The content hashes of the aggregates are what a re-run checks the files against before
        it resumes from them."""
        # FedAvgFSDP records a round right after renaming its new global model into place.
        crash_point(f"aggregated@{server_round}")
        entry = {
            "round": server_round,
            "clients": clients,
            "started_from": started_from,
            "client_actors": [client_actors[c] for c in sorted(client_actors)],
            "client_actor_ids": sorted(client_actors),
            "aggregated_actor": aggregated,
            "aggregated_hf": aggregated,
            "rejected": {str(c): reason for c, reason in sorted(rejected.items())},
        }
        if aggregated_sha256:
            entry["aggregated_sha256"] = aggregated_sha256
        if client_critics:
            entry["client_critics"] = [client_critics[c] for c in sorted(client_critics)]
            entry["aggregated_critic"] = aggregated_critic
            if aggregated_critic_sha256:
                entry["aggregated_critic_sha256"] = aggregated_critic_sha256
        if update_stats is not None:
            entry["update_stats"] = update_stats
        shares = round_shares(client_metrics)
        if shares:
            entry[ROUND_SHARES] = shares
            # Not where a critic gives the advantage (PPO's GAE): there a flat group still has a signal.
            flat = flat_clients(shares)
            critic = self.summary.get("adv_estimator", GRPO) in CRITIC_ESTIMATORS
            if aggregated is None or not flat or critic:
                pass  # nothing flat was averaged in, or the flat groups had a critic's signal
            elif len(flat) == len(shares):
                log(WARNING, "[fedagent] round %d had no learning signal: every group of every reporting client's "
                    "episodes scored alike (zero-variance-group-share 1.0 from clients %s), so the update is "
                    "drift, not learning", server_round, ", ".join(shares))
            else:
                log(INFO, "[fedagent] round %d: client(s) %s had no learning signal (every group of their episodes "
                    "scored alike), so their update is drift, averaged in beside the others' at its full weight",
                    server_round, ", ".join(flat))
        self.summary["rounds"].append(entry)
        if aggregated is not None:
            self.summary["final_model"] = aggregated
        for client, reply_metrics in sorted(client_metrics.items()):
            # per-client validation rides in the train reply; it is recorded apart from training
            metrics = {k: v for k, v in reply_metrics.items() if not k.startswith(CLIENT_VAL_PREFIX)}
            point = _curve_point(server_round, "client", client, metrics)
            self.summary["client_curve"].append(point)
            self._warn_truncated(server_round, client, "training", truncated_share(point), point["n"])
            self._event({"event": "train", **point, "metrics": metrics})
            if len(metrics) < len(reply_metrics):
                self._record_client_val(server_round, client, reply_metrics)
        self._event({"event": "aggregate",
                     **{k: entry[k] for k in ("round", "clients", "aggregated_actor", "rejected")},
                     "update_stats": update_stats})
        self.write()

    def _record_client_val(self, server_round: int, client: int, reply_metrics: dict[str, Any]) -> None:
        """One point of ``client_val_curve``: client ``client``'s own trained model on the
        validation episodes (FedAgent's client_end_eval, its ``client_curve``)."""
        try:
            val = EvalReply.from_metrics(reply_metrics, CLIENT_VAL_PREFIX)
        except ProtocolError as exc:
            log(WARNING, "[fedagent] round %d: client %d's per-client validation is not recorded: %s",
                server_round, client, exc)
            return
        point = _curve_point(server_round, "client", client, val.metrics())
        self.summary["client_val_curve"].append(point)
        self._warn_truncated(server_round, client, "per-client validation", truncated_share(point), point["n"])
        self._event({"event": "client_val", **point, "client_val/success_rate": point["success_rate"]})

    def record_eval(self, *, server_round: int, model: str, metrics: dict[str, Any],
                    failed: dict[int, str] | None = None,
                    truncated: Mapping[int, tuple[float, int]] | None = None) -> None:
        """One point of the validation curve (round 0 is the base model); ``failed``: the evaluating
        clients whose episodes it lacks, with why; ``truncated``: each evaluating client's share of
        truncated episodes and its episode count, as it reported them (a warning for each above 0; an
        older client reports none, and the point's share then covers ``truncated_n`` of its ``n`` episodes)."""
        point = _curve_point(server_round, "model", model, metrics)
        if truncated:
            covered = sum(n for _, n in truncated.values())
            if TRUNCATED_SHARE not in point and covered > 0:
                # an aggregate without the share (an older client reported none, or a strategy's own):
                # the episode-weighted mean of the reporting clients', over their episodes only
                point[TRUNCATED_SHARE] = sum(share * n for share, n in truncated.values()) / covered
                if covered != point["n"]:
                    point[TRUNCATED_EPISODES] = covered
            cut = {c: (share, n) for c, (share, n) in sorted(truncated.items()) if share > 0}
            if cut:
                point[TRUNCATED_BY_CLIENT] = {str(c): share for c, (share, _) in cut.items()}
            for client, (share, n) in cut.items():
                self._warn_truncated(server_round, client, "validation", share, n)
        if failed:
            point["failed"] = {str(c): reason for c, reason in sorted(failed.items())}
        self.summary["val_curve"].append(point)
        # verl's own name for the validation rate, so tools reading verl's logs find it here too.
        self._event({"event": "evaluate", **point, "val/success_rate": point["success_rate"]})
        self.write()

    def _warn_truncated(self, server_round: int, client: int, phase: str, share: float, episodes: int) -> None:
        """Warn that ``share`` of client ``client``'s ``phase`` episodes of ``server_round`` were truncated."""
        if share > 0:
            log(WARNING, "[fedagent] %s", warning_line(server_round, client, phase, share, episodes,
                                                      str(self.summary.get("trainer_backend", ""))))

    def record_eval_failure(self, *, server_round: int, model: str, failed: dict[int, str], reason: str = "") -> None:
        """An evaluation that recorded nothing (every evaluating client failed, for different reasons,
        or, ``reason``, none could be asked): its round has no validation point, and ``eval_failures``
        says why."""
        entry: dict[str, Any] = {"round": server_round, "model": model,
                                 "failed": {str(c): why for c, why in sorted(failed.items())}}
        if reason:
            entry["reason"] = reason
        self.summary["eval_failures"].append(entry)
        self._event({"event": "evaluate_failed", **entry})
        self.write()

    def complete_round(self, server_round: int) -> None:
        """Commit ``server_round``: its global model is in place, its results are recorded.

        The one atomic replace of the summary that writes ``last_completed_round`` is the round's
        commit point; a re-run skips every round up to it (``serverapp.resume``).
        """
        # Wall clock of the round (selection, training, aggregation, evaluation): from the last
        # commit, or from the start of this (re-)run, to this one. The first commit of a round
        # counts (round 0 is committed again after the initial evaluation).
        now = time.time()
        seconds = round(now - self._last_commit, 3)
        self._last_commit = now
        if server_round == 0:
            self.summary.setdefault("initial_eval_seconds", seconds)
        for entry in self.summary["rounds"]:
            if entry["round"] == server_round:
                entry.setdefault("wall_seconds", seconds)
        if server_round > 0:
            self._track({"event": "round_time", "round": server_round, "wall_seconds": seconds})
        self.summary["last_completed_round"] = server_round
        self.write(commit_round=server_round)

    def _learning(self) -> dict[str, Any]:
        return learning_record(self.summary["rounds"], self.summary["val_curve"],
                               str(self.summary.get("adv_estimator", GRPO)))

    def outcome(self) -> tuple[str, str]:
        """The status of a run whose rounds all ran, and why when it is not ``completed``.

        ``degraded``: some round aggregated no client checkpoint (the previous global model went on
        to the next round), so the final model had fewer rounds of training than the run asked for;
        or some round aggregated without a client it selected (``failures.partial_rounds_reason``),
        so the final model was trained on part of the federation; or no round had a learning signal
        (``serverapp.learning``: every group of every client scored alike), so the run learned nothing;
        or an evaluation recorded nothing (``eval_failures``), so the validation curve lacks that round
        and its comparisons with the base model are not the run's; or an evaluation lacks some
        clients' episodes (``val_curve[].failed``), so its point is on other episodes.
        ``failed``: no round aggregated anything, so the run trained nothing at all (its final model
        is the one it started from); the reason names the last round's client failures.
        """
        rounds = self.summary["rounds"]
        empty = [entry for entry in rounds if entry.get("aggregated_actor") is None]
        learning = self._learning()
        lost = self.summary.get("eval_failures") or []
        unvalidated = (
            f"the evaluation of round(s) {[entry['round'] for entry in lost]} recorded nothing (round "
            f"{lost[0]['round']}: " + "; ".join([f"client {c}: {why}" for c, why in lost[0]["failed"].items()]
                                                + ([lost[0]["reason"]] if lost[0].get("reason") else [])) + ")"
        ) if lost else ""
        if empty and len(empty) == len(rounds):
            last = empty[-1]
            why = round_reasons(last)
            return "failed", (
                f"no round aggregated any client update (round(s) {[entry['round'] for entry in empty]}): the run "
                f"trained nothing and its final model is the one it started from"
                + (f" (last round, {last['round']}: {why})" if why else "")
            )
        reasons: list[str] = []
        if empty:
            first = empty[0]
            refused = "; ".join(f"client {c}: {reason}" for c, reason in (first.get("rejected") or {}).items())
            reasons.append(
                f"round(s) {[entry['round'] for entry in empty]} aggregated no client checkpoint and kept the "
                f"previous global model" + (f" (round {first['round']}: {refused})" if refused else ""))
        partial = partial_rounds_reason(rounds)
        reasons += [partial] if partial else []
        reasons += [no_signal_reason(learning)] if learning["no_signal_run"] else []
        reasons += [unvalidated] if unvalidated else []
        partial_eval = partial_evaluations_reason(self.summary["val_curve"])
        reasons += [partial_eval] if partial_eval else []
        return ("degraded", "; and ".join(reasons)) if reasons else ("completed", "")

    def finish(self, status: str = "completed", error: str = "") -> None:
        """Mark the run ``completed``, ``degraded`` or ``failed`` and write everything once more.

        ``error`` is why: the summary's ``error`` for a failed run, its ``warning`` for a degraded one.
        """
        self.summary["status"] = status
        if error:
            self.summary["warning" if status == "degraded" else "error"] = error
        self.write()
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def write(self, commit_round: int | None = None) -> None:
        """Rewrite metrics, summary and plot atomically, in that order.

        The metrics lines go first so that the summary, whose rename commits a round, is never
        ahead of them: a re-run keeps the metrics lines of the rounds the summary committed.
        """
        self.summary["wall_seconds"] = round(self._earlier_seconds + time.time() - self._started, 3)
        self.summary["learning"] = self._learning()
        truncation = truncation_record(self.summary["client_curve"], self.summary["val_curve"],
                                       self.summary["client_val_curve"], str(self.summary.get("trainer_backend", "")))
        if truncation is None:
            self.summary.pop("truncation", None)
        else:
            self.summary["truncation"] = truncation
        lines = "".join(_json_line(event) for event in self.events)
        write_text_atomic(self.run_dir / METRICS_FILE, lines)
        with atomic_path(self.summary_path) as tmp:
            tmp.write_text(json_text(self.summary))
            if commit_round is not None:
                crash_point(f"commit@{commit_round}")
        if self.summary["val_curve"] or self.summary["client_curve"]:
            try:
                plot_learning_curve(self.summary, self.run_dir / CURVE_FILE)
            except Exception as exc:  # a plot is a convenience; it must never stop a run
                log(WARNING, "[fedagent] learning curve not drawn: %s", exc)


def _curve_point(server_round: int, label: str, value: Any, metrics: dict[str, Any]) -> dict[str, Any]:
    """One point of FedAgent's val_curve / client_curve from a Flower MetricRecord's values,
    with the 95% Wilson interval of its success rate over its ``n`` episodes."""
    n = int(metrics.get(NUM_EXAMPLES, 0))
    rate = float(metrics.get(SUCCESS_RATE, 0.0))
    low, high = wilson_interval(rate * n, n)
    point = {
        "round": server_round,
        label: value,
        "n": n,
        "success_rate": rate,
        "success_ci95": [round(low, 4), round(high, 4)],
        "reward_mean": float(metrics.get(REWARD_MEAN, 0.0)),
    }
    if SCORE_MEAN in metrics:  # envs that score episodes (WebShop): the validation score
        point["score_mean"] = float(metrics[SCORE_MEAN])
    if TRUNCATED_RATE in metrics:  # episodes cut short by the context budget (serverapp.truncation)
        point[TRUNCATED_SHARE] = float(metrics[TRUNCATED_RATE])
    return point


def _json_line(event: dict[str, Any]) -> str:
    return json.dumps(event, sort_keys=True) + "\n"


def plot_learning_curve(summary: dict[str, Any], path: Path) -> None:
    """Validation success rate of the global model and the clients' training reward per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    val = summary["val_curve"]
    if val:
        rounds = [p["round"] for p in val]
        rates = [p["success_rate"] for p in val]
        # 95% Wilson intervals (older summaries may lack them: recomputed from n).
        bounds = [p.get("success_ci95") or wilson_interval(p["success_rate"] * p["n"], p["n"]) for p in val]
        errors = [[max(r - b[0], 0.0) for r, b in zip(rates, bounds)],
                  [max(b[1] - r, 0.0) for r, b in zip(rates, bounds)]]
        left.errorbar(rounds, rates, yerr=errors, fmt="o-", capsize=3, label="success, global model (95% CI)")
        scored = [p for p in val if "score_mean" in p]
        if scored:
            left.plot([p["round"] for p in scored], [p["score_mean"] for p in scored], "s--", label="mean score")
        clients = summary.get("client_val_curve") or []
        if clients:  # FedAgent's circles: each trained client's own model
            left.plot([p["round"] for p in clients], [p["success_rate"] for p in clients], "o", fillstyle="none",
                      alpha=0.7, label="success, each trained client")
        left.legend(fontsize=8)
    left.set_title("Validation success rate" + (" and score" if any("score_mean" in p for p in val) else ""))
    left.set_xlabel("round")
    left.set_ylim(-0.02, 1.02)
    left.grid(alpha=0.3)
    for client in sorted({p["client"] for p in summary["client_curve"]}):
        points = [p for p in summary["client_curve"] if p["client"] == client]
        right.plot([p["round"] for p in points], [p["reward_mean"] for p in points], "o-", label=f"client {client}")
    right.set_title("Training reward (mean per episode)")
    right.set_xlabel("round")
    right.grid(alpha=0.3)
    if summary["client_curve"]:
        right.legend(fontsize=8)
    from matplotlib.ticker import MaxNLocator

    for axis in (left, right):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    fig.suptitle(f"{summary.get('env_kind', '')} · {summary.get('mode', '')} · {summary.get('strategy', '')}")
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
