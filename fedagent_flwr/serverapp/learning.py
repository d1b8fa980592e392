"""Whether a run could learn and whether it did: the summary's ``learning`` record.

Two questions a user asks of every run, answered from what the run already records:

* **Was there anything to learn from?** GRPO's advantage is an episode's reward minus its group's
  mean, so a round in which every group of every reporting client scored alike
  (``zero-variance-group-share`` 1.0 from each) carried no information to learn from: whatever
  moved the weights (the KL and entropy terms, which Adam rescales to full step size, or before
  ``trainers.verl.flat_groups`` verl's float32 rounding, which gave every flat episode the same
  non-zero advantage) was drift, not learning. A GRPO run in which *every* aggregated round was
  like that learned nothing by construction; the recorder marks it ``degraded`` (exit status 3)
  with this reason, and each such round gets a warning in the log. Only for ``grpo``: PPO's
  advantages come from its critic, not from the group mean. A client whose every group was flat in
  a round where another client's were not is named too (``clients_without_signal``, and a line in
  the log except under PPO's critic): its update is drift of the same kind, and the mean takes it
  at its full weight beside the others' (a WebShop run on 2026-12-06 moved such a client's model
  0.075 against 0.26 for its peer), diluting the round's signal without making the round flat.
* **Did the global model get better?** The last evaluated model's validation success against the
  base model's (round 0), each with its 95% Wilson interval. The verdict follows the criterion of
  ``docs/results.md``: ``above`` when the final interval lies wholly above the base interval,
  ``below`` when wholly below, ``overlapping`` otherwise (no clear change at this sample size).
  This is reported, not turned into an exit status: a short run that moves within the noise has
  not failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fedagent_flwr.intervals import wilson_interval
from fedagent_flwr.protocol import ZERO_VARIANCE_GROUP_SHARE

#: A client's share at or above this is "every group flat" (the share is a mean of ratios).
FLAT_SHARE = 1.0 - 1e-9
#: A round entry's key for its clients' shares (``{client id: share}``).
ROUND_SHARES = "zero_variance_group_share"
#: The estimators whose advantages come from the group mean alone (the summary's ``adv_estimator``).
GRPO = "grpo"
GROUP_MEAN_ESTIMATORS = frozenset({GRPO, "grpo_vectorized"})
#: The estimators whose advantages come from a critic (PPO's GAE): a flat group still has a signal there,
#: so the log does not call its update drift (every other estimator keeps the warnings).
CRITIC_ESTIMATORS = frozenset({"gae"})


def round_shares(client_metrics: Mapping[int, Mapping[str, Any]]) -> dict[str, float]:
    """Each client's ``zero-variance-group-share`` of one round, keyed by client id (as a string,
    the summary's JSON keys); clients that did not report it are left out."""
    return {str(client): float(metrics[ZERO_VARIANCE_GROUP_SHARE])
            for client, metrics in sorted(client_metrics.items()) if ZERO_VARIANCE_GROUP_SHARE in metrics}


def flat_clients(shares: Mapping[str, float]) -> list[str]:
    """The clients (ids as the summary's keys) whose every group of the round scored alike."""
    return [client for client, share in shares.items() if share >= FLAT_SHARE]


def learning_record(rounds: Sequence[Mapping[str, Any]], val_curve: Sequence[Mapping[str, Any]],
                    adv_estimator: str = GRPO) -> dict[str, Any]:
    """The summary's ``learning`` entry from its ``rounds``, ``val_curve`` and advantage estimator.

    ``rounds_measured``: the aggregated rounds whose clients reported their zero-variance share;
    ``rounds_without_signal``: those in which every reporting client's share was 1.0;
    ``clients_without_signal``: per measured round with at least one such client, but not all, which
    ones (``[{"round": r, "clients": ["0"]}, ...]``: their updates were drift averaged in beside the others');
    ``no_signal_run`` (GRPO only; so far, while the run goes on): every aggregated round was
    measured and flat, so nothing could be learned;
    ``final_vs_base``: the base and last validation points with their intervals and the verdict.
    """
    trained = [entry for entry in rounds if entry.get("aggregated_actor") is not None]
    measured = [entry for entry in trained if entry.get(ROUND_SHARES)]
    flat: list[int] = []  # rounds in which every reporting client was flat
    partly: list[dict[str, Any]] = []  # rounds in which some were: which
    for entry in measured:
        clients = flat_clients(entry[ROUND_SHARES])
        if len(clients) == len(entry[ROUND_SHARES]):
            flat.append(entry["round"])
        elif clients:
            partly.append({"round": entry["round"], "clients": clients})
    record: dict[str, Any] = {
        "rounds_measured": [entry["round"] for entry in measured],
        "rounds_without_signal": flat,
        "clients_without_signal": partly,
        "no_signal_run": (adv_estimator in GROUP_MEAN_ESTIMATORS and bool(trained) and len(measured) == len(trained)
                          and len(flat) == len(trained)),
    }
    comparison = final_vs_base(val_curve)
    if comparison is not None:
        record["final_vs_base"] = comparison
    return record


def final_vs_base(val_curve: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The base model's validation point against the last later one, or None before there are both."""
    base = next((point for point in val_curve if point.get("model") == "base"), None)
    later = [point for point in val_curve if point.get("model") != "base"]
    if base is None or not later:
        return None
    base_point, final_point = _with_interval(base), _with_interval(later[-1])
    base_low, base_high = base_point["success_ci95"]
    low, high = final_point["success_ci95"]
    verdict = "above" if low > base_high else "below" if high < base_low else "overlapping"
    return {"base": base_point, "final": final_point, "verdict": verdict}


def _with_interval(point: Mapping[str, Any]) -> dict[str, Any]:
    """A validation point's round, n, rate and 95% interval; summaries written before the
    interval was recorded (a resumed run's earlier points) get it computed from rate and n."""
    n, rate = int(point.get("n", 0)), float(point.get("success_rate", 0.0))
    interval = point.get("success_ci95")
    if interval is None:
        low, high = wilson_interval(rate * n, n)
        interval = [round(low, 4), round(high, 4)]
    kept = {"round": point.get("round"), "n": n, "success_rate": rate, "success_ci95": list(interval)}
    if point.get("failed"):  # the point lacks these clients' slices of the validation episodes
        kept["failed"] = dict(point["failed"])
    return kept


def describe(comparison: Mapping[str, Any]) -> str:
    """One line for the log: base -> final validation success with intervals, and the verdict."""
    base, final = comparison["base"], comparison["final"]
    meaning = {"above": "the final model's 95% interval lies above the base model's",
               "below": "the final model's 95% interval lies below the base model's: it got worse",
               "overlapping": "the intervals overlap: no clear change at this sample size"}[comparison["verdict"]]
    lacking = sorted({client for point in (base, final) for client in point.get("failed", {})})
    # each evaluating client plays its own slice of the episodes, so a point without some is on other episodes
    caveat = (f" (not on the same episodes: clients {', '.join(lacking)} failed to evaluate; "
              "see val_curve[].failed)") if lacking else ""
    return (f"validation success {base['success_rate']:.3f} {_interval(base)} (round {base['round']}, n={base['n']}) "
            f"-> {final['success_rate']:.3f} {_interval(final)} (round {final['round']}, n={final['n']}): "
            f"{meaning}{caveat}")


def no_signal_reason(record: Mapping[str, Any]) -> str:
    """Why a run whose every round was flat learned nothing, and what to change."""
    return (f"no round had a learning signal (rounds {record['rounds_without_signal']}): in each, every group "
            "of every reporting client's episodes scored alike (zero-variance-group-share 1.0), so GRPO had "
            "nothing to learn from and the updates were drift; make rewards differ within a group (an "
            "easier task split, more turns, a larger trainer.rollout_n, or a stronger base model)")


def _interval(point: Mapping[str, Any]) -> str:
    low, high = point["success_ci95"]
    return f"[{low:.3f}, {high:.3f}]"
