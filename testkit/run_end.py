"""How a test run that ran every round must end: ``completed``, or ``degraded`` for the one reason a
machinery test's tiny model gives (no round had a learning signal); and, judged independently of the
code under test, the end a run with lost clients or evaluations must have (``degraded``).

The suite's simulations use tiny models that rarely or never win an episode, so every GRPO group of
theirs may score alike; such a run learned nothing and says so (``serverapp.learning``). Whether a
given tiny run has a signal can differ with the platform's floating point, so a test that checks
the machinery accepts either end, but only the one the run's recorded per-round shares call for,
and only when the run's own ``learning`` record agrees (its rules:
``tests/serverapp/test_learning.py``).
"""

from __future__ import annotations

from typing import Any

NO_SIGNAL = "no round had a learning signal"


def _no_signal(summary: dict[str, Any]) -> bool:
    """Whether no aggregated round had a learning signal, judged from the rounds' recorded shares."""
    rounds = [entry for entry in summary.get("rounds", []) if entry.get("aggregated_actor") is not None]
    shares = [entry.get("zero_variance_group_share") or {} for entry in rounds]
    flat = bool(rounds) and all(s and min(s.values()) >= 1.0 - 1e-9 for s in shares)
    return summary.get("adv_estimator", "grpo") == "grpo" and flat


def _lost_clients(summary: dict[str, Any]) -> bool:
    """Whether some round aggregated a model but recorded a selected client as rejected."""
    return any(entry.get("aggregated_actor") is not None
               and {str(c) for c in entry.get("clients", [])} & set(entry.get("rejected", {}))
               for entry in summary.get("rounds", []))


def _partial_eval(summary: dict[str, Any]) -> bool:
    """Whether some validation point lacks a client's episodes (a failed client, not an unknown node)."""
    return any(str(c).isdigit() for point in summary.get("val_curve", []) for c in point.get("failed", {}))


def expected_end(summary: dict[str, Any]) -> tuple[str, int]:
    """The status and exit status a run that ran every round must have, judged here from its rounds'
    recorded shares, lost clients, and lost or partial evaluations (not from the ``learning`` record
    the code under test wrote, which must agree)."""
    if _no_signal(summary) or summary.get("eval_failures") or _lost_clients(summary) or _partial_eval(summary):
        return "degraded", 3
    return "completed", 0


def ran_every_round(summary: dict[str, Any]) -> bool:
    """True when the run ended as a run whose every round aggregated and evaluated must: ``completed``,
    or ``degraded`` with the no-signal reason alone when its record says no round had a signal. A
    lost or partial evaluation, or a round without a selected client, is never fine in a machinery
    test, whatever the status says or in which order the warning names the reasons."""
    status, _ = expected_end(summary)
    if summary.get("eval_failures") or _lost_clients(summary) or _partial_eval(summary):
        return False
    if summary.get("status") != status:
        return False
    if summary.get("learning", {}).get("no_signal_run") != _no_signal(summary):
        return False
    return status == "completed" or str(summary.get("warning", "")).startswith(NO_SIGNAL)
