"""Episodes cut short by the context budget: a warning per round and the summary's ``truncation`` note.

An episode whose next turn would not fit the token budget (its prompt plus ``max_new_tokens`` over
the trainer's episode budget, :mod:`fedagent_flwr.rollout.episode`) stops there, ``truncated``. A
rollout in which no episode could play a single turn is refused by the trainer
(``trainers.common.checks.check_turns_fit``), but when only some are cut short they count as played
episodes with the reward they had by then (0 for TinyGuess and most tasks): the training reward and
the validation success rate read low because of a budget setting, not because of the model.

Every client reports the share of its episodes that were truncated (``truncated-rate``) with its
training metrics, its validation reply and its per-client validation; the recorder keeps each share
on its curve point (``client_curve``, ``val_curve``: the evaluating clients' episode-weighted share
and, where some were cut short, each client's, ``client_val_curve``; where an older evaluating client
reported none, the share covers the reporting clients' episodes only, and ``truncated_n`` says how
many of the point's ``n`` those are), logs a warning for every
client and round with a share above 0, and derives the summary's top-level ``truncation`` entry
(:func:`truncation_record`) from those points, so a resumed run's earlier rounds count too.

A truncated share does not change how the run ends: the rounds aggregated and were evaluated as
configured, and the share says how far the numbers are the budget's. The budget is a setting, so
the note names the keys that set it for the run's trainer backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: A curve point's key for the share of its episodes that were truncated.
TRUNCATED_SHARE = "truncated_rate"
#: A validation point's key for each evaluating client's share, where some client's was above 0.
TRUNCATED_BY_CLIENT = "truncated"
#: A validation point's key for the episodes its share covers, where fewer than its ``n`` (an older
#: evaluating client reports no share, so the share is the reporting clients' only).
TRUNCATED_EPISODES = "truncated_n"

#: What to change, per trainer backend (the keys of ``fedagent_flwr/schema/trainer.py``).
BUDGET_ADVICE = {
    "reference": "raise trainer.max_model_len or lower trainer.max_new_tokens",
    "verl": ("raise trainer.max_response_length (all turns after the first prompt) or trainer.max_prompt_length "
             "(the first prompt; in rollout.mode=windowed every turn's prompt; validation has the same two "
             "bounds), or lower trainer.max_new_tokens"),
}
#: What each phase's truncated episodes do to the run's numbers, for the warning.
CONSEQUENCE = {
    "training": ("the client's training reward and success rate read low, and its update learned from episodes "
                 "the budget cut short"),
    "validation": "the global model's validation success rate reads low",
    "per-client validation": "the client's own validation success rate reads low",
}


def budget_advice(backend: str) -> str:
    """The keys to change for ``backend``'s episode budget (a backend of one's own: both backends')."""
    return BUDGET_ADVICE.get(backend) or "; or ".join(f"{name}: {advice}" for name, advice in BUDGET_ADVICE.items())


def percent(share: float) -> str:
    """``share`` as a percentage, with a decimal within 1% of either end (a few episodes in a
    thousand are not 0%, and all but a few are not 100%)."""
    return f"{share:.1%}" if 0 < share < 0.01 or 0.99 < share < 1 else f"{share:.0%}"


def warning_line(server_round: int, client: int, phase: str, share: float, episodes: int, backend: str) -> str:
    """The log line for client ``client``'s ``phase`` episodes of ``server_round`` that ``share`` of
    (of ``episodes``) were truncated."""
    count = f" ({round(share * episodes)} of {episodes})" if episodes > 0 else ""
    return (f"round {server_round}: {percent(share)} of client {client}'s {phase} episodes{count} were truncated: they "
            f"ran out of the context budget before they ended and count as played, with the reward they had: "
            f"{CONSEQUENCE.get(phase, 'their numbers read low')}; {budget_advice(backend)}")


def truncated_share(point: Mapping[str, Any]) -> float:
    """A curve point's truncated share (0 when it has none: nothing truncated, or an older client)."""
    value = point.get(TRUNCATED_SHARE)
    return float(value) if isinstance(value, (int, float)) else 0.0


def truncation_record(client_curve: Sequence[Mapping[str, Any]], val_curve: Sequence[Mapping[str, Any]],
                      client_val_curve: Sequence[Mapping[str, Any]], backend: str) -> dict[str, Any] | None:
    """The summary's ``truncation`` entry, or None when no reported episode was truncated.

    ``training`` / ``per_client_validation``: each client and round with a truncated share above 0;
    ``validation``: each evaluation (``model``: base or aggregated) with its episode-weighted share and
    the clients' own (and, where the share covers fewer episodes than the point's ``n``, both counts);
    ``max_share``: the largest share of any of them, an evaluating client's own included (the note
    says "at most that of a client's or an evaluation's episodes"); ``note``: what it means, which
    validation shares cover only some of their episodes, and the keys to change.
    """
    training, per_client = _client_entries(client_curve), _client_entries(client_val_curve)
    validation = [{"round": p["round"], "model": p.get("model"), TRUNCATED_SHARE: truncated_share(p),
                   "clients": dict(p.get(TRUNCATED_BY_CLIENT) or {}),
                   **({"n": p.get("n"), TRUNCATED_EPISODES: p[TRUNCATED_EPISODES]} if TRUNCATED_EPISODES in p else {})}
                  for p in val_curve if truncated_share(p) > 0]
    if not (training or validation or per_client):
        return None
    shares = [entry[TRUNCATED_SHARE] for entry in (*training, *validation, *per_client)]
    shares += [float(share) for entry in validation for share in entry["clients"].values()]
    partial = [f"round {entry['round']}: {entry[TRUNCATED_EPISODES]} of {entry['n']}"
               for entry in validation if TRUNCATED_EPISODES in entry]
    covers = (f"; a validation share covers only the episodes of the clients that reported one ("
              f"{', '.join(partial)}: older clients report none)" if partial else "")
    where = [f"{name} in round(s) {sorted({entry['round'] for entry in entries})}"
             for name, entries in (("training", training), ("validation", validation),
                                   ("per-client validation", per_client)) if entries]
    record: dict[str, Any] = {
        "max_share": max(shares),
        "note": (f"some episodes were truncated ({'; '.join(where)}; at most {percent(max(shares))} of a client's "
                 "or an evaluation's episodes): they ran out of the context budget before they ended and count as "
                 "played, with the reward they had, so the success rates and rewards recorded there read low "
                 f"by a budget setting, not only by the model{covers}; {budget_advice(backend)}"),
    }
    for name, entries in (("training", training), ("validation", validation), ("per_client_validation", per_client)):
        if entries:
            record[name] = entries
    return record


def _client_entries(curve: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The points of a per-client curve with a truncated share above 0: round, client and share."""
    return [{"round": p["round"], "client": p["client"], TRUNCATED_SHARE: truncated_share(p)}
            for p in curve if truncated_share(p) > 0]
