"""Why a run stops, and client failures as one readable line.

Flower reports a failed ClientApp as an error reply whose reason is Flower's (and, in simulation,
Ray's) wrapping of the ClientApp's own exception; :func:`readable_reason` gets that exception's line
back. When every client of a round failed for the same reason (:func:`reason_key` blanks out what
differs between clients, and takes a GPU-memory shortage in any of its wordings as one reason), the
next rounds would fail the same way and the run stops (:func:`stop_if_all_failed_alike`). Rounds
that aggregate nothing for different reasons stop the run too once ``max_empty_rounds`` of them
come in a row (:func:`stop_after_empty_rounds`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from flwr.app import Message

from fedagent_flwr import gpu_memory
from fedagent_flwr.losses import evaluation_losses, round_losses


class RunFailedError(RuntimeError):
    """The run cannot go on; the message is the one line the log and the summary carry."""


class RoundFailedError(RunFailedError):
    """Every client of a round failed for the same reason: the next rounds would fail the same way."""


class EmptyRoundsError(RunFailedError):
    """``max_empty_rounds`` rounds in a row aggregated no client update: the run trains nothing."""


def reply_reason(reply: Message) -> str:
    """The readable reason of an error reply."""
    return readable_reason(str(reply.error.reason))


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
# A GPU without the memory a client needs, in every wording that reaches the server (torch's,
# vLLM's at engine start and KV-cache sizing, the verl trainer's own): clients sharing one GPU meet
# the shortage at different places, so their reasons differ in words but not in cause.
_GPU_MEMORY = (gpu_memory.TORCH_OOM, gpu_memory.VLLM_KV_CACHE, gpu_memory.VLLM_STARTUP,
               re.compile(re.escape(gpu_memory.RAN_OUT)))
#: :func:`reason_key` of every GPU-memory shortage.
OUT_OF_GPU_MEMORY = "out of GPU memory"
#: What to do about it, for the line that stops the run.
GPU_MEMORY_HINT = ("the GPU has too little free memory for the clients' trainers: run fewer verl sessions "
                   "on the GPU at once (other runs on it count; tools/gpu/arms.py --max-sessions) or lower "
                   "trainer.gpu_memory_utilization (vLLM's share of the GPU), with a new run_name once a "
                   "round has been committed")


#: :func:`reason_key` of Ray's memory monitor killing workers: the machine's memory, not the GPU's.
OUT_OF_HOST_MEMORY = "out of host memory"
HOST_MEMORY_HINT = ("the machine's memory (RAM) ran low and Ray's memory monitor killed workers: run fewer "
                    "verl sessions on the machine at once (other runs on it count; tools/gpu/arms.py "
                    "--max-sessions), with a new run_name once a round has been committed")


def is_gpu_memory_shortage(reason: str) -> bool:
    """Whether ``reason`` says a GPU had too little free memory (any of the wordings above), and not
    the machine's memory (Ray's error of that kind is also called ``OutOfMemoryError``)."""
    if gpu_memory.is_host_memory_shortage(reason):
        return False
    return any(pattern.search(reason) for pattern in _GPU_MEMORY)


def reason_key(reason: str) -> str:
    """``reason`` with what differs between clients failing the same way blanked out: the leading
    ``client <c> round <r>:`` label, client/round/node numbers and process ids (in paths and text).
    A GPU-memory shortage is one reason however it is worded (:data:`OUT_OF_GPU_MEMORY`), and so is
    a kill for the machine's own memory (:data:`OUT_OF_HOST_MEMORY`: Ray's memory monitor)."""
    if gpu_memory.is_host_memory_shortage(reason):
        return OUT_OF_HOST_MEMORY
    if is_gpu_memory_shortage(reason):
        return OUT_OF_GPU_MEMORY
    text = _CLIENT_LABEL.sub("", reason, count=1) if _CLIENT_LABEL.match(reason) else reason
    return _VARYING.sub(lambda m: f"{m.group(1)}{m.group(2)}#", text)


def stop_if_all_failed_alike(what: str, clients: Sequence[int], reasons: dict[int, str]) -> None:
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
    if reason_key(reasons[first]) == OUT_OF_GPU_MEMORY:
        raise RoundFailedError(f"{what}: every client ({len(clients)}) ran out of GPU memory, so the run stops; "
                               f"{GPU_MEMORY_HINT}: {reasons[first]}")
    if reason_key(reasons[first]) == OUT_OF_HOST_MEMORY:
        raise RoundFailedError(f"{what}: every client ({len(clients)}) was stopped because the machine ran low on "
                               f"memory, so the run stops; {HOST_MEMORY_HINT}: {reasons[first]}")
    raise RoundFailedError(
        f"{what}: every client ({len(clients)}) failed the same way, so the run stops: {reasons[first]}"
    )


def round_reasons(entry: Mapping[str, Any]) -> str:
    """Why the clients of a recorded round (a summary's ``rounds`` entry) were left out, one line:
    ``client <c>: <reason>; ...``, followed by :data:`GPU_MEMORY_HINT` when one ran out of GPU memory."""
    rejected = entry.get("rejected") or {}
    text = "; ".join(f"client {c}: {reason}" for c, reason in rejected.items())
    if any(is_gpu_memory_shortage(str(reason)) for reason in rejected.values()):
        text += f" ({GPU_MEMORY_HINT})"
    if any(gpu_memory.is_host_memory_shortage(str(reason)) for reason in rejected.values()):
        text += f" ({HOST_MEMORY_HINT})"
    return text


def empty_streak(rounds: Sequence[Mapping[str, Any]]) -> list[int]:
    """The rounds at the end of ``rounds`` (a summary's ``rounds`` entries, in order) that
    aggregated no client update, in a row."""
    streak: list[int] = []
    for entry in reversed(rounds):
        if entry.get("aggregated_actor") is not None:
            break
        streak.insert(0, int(entry["round"]))
    return streak


def stop_after_empty_rounds(rounds: Sequence[Mapping[str, Any]], limit: int) -> None:
    """Raise :class:`EmptyRoundsError` when the last ``limit`` recorded rounds all aggregated nothing
    (``limit`` 0: never).

    Clients failing for different reasons (one out of memory, another timed out) do not stop a round
    by themselves (:func:`stop_if_all_failed_alike`), yet a run whose rounds keep aggregating nothing
    trains nothing and only holds the GPU.
    """
    streak = empty_streak(rounds)
    if limit <= 0 or len(streak) < limit:
        return
    why = round_reasons(rounds[-1])
    raise EmptyRoundsError(
        f"round(s) {streak} aggregated no client update, {len(streak)} in a row (max_empty_rounds={limit}), "
        f"so the run stops instead of training nothing" + (f"; round {streak[-1]}: {why}" if why else "")
    )


def partial_rounds_reason(rounds: Sequence[Mapping[str, Any]]) -> str:
    """Why a run whose rounds all aggregated something still lacks clients, or ``""``.

    A round that aggregated some clients but not every client it selected (one failed, timed out,
    was refused by the strategy, or had no SuperNode) trained a model on part of the federation:
    the run's result is not the one it asked for, so its status must say so (``degraded``) and not
    only ``rounds[].rejected``. Which clients count: :func:`fedagent_flwr.losses.round_losses`; a PPO
    client whose actor was averaged but whose critic was refused lost the round's critic only, and
    is named as such.
    """
    losses = [(int(entry["round"]), round_losses(entry)) for entry in rounds]
    reasons = []
    for kind, what in ((0, "aggregated without client(s) {clients} that they selected, so the final model was "
                           "trained on part of the federation"),
                       (1, "averaged the actors of client(s) {clients} but not their critics")):
        partial = [(r, lost[kind]) for r, lost in losses if lost[kind]]
        if partial:
            first_round, first_lost = partial[0]
            clients = sorted({int(c) for _, lost in partial for c in lost})
            reasons.append(f"round(s) {[r for r, _ in partial]} " + what.format(clients=clients)
                           + f" (round {first_round}: " + round_reasons({"rejected": first_lost}) + ")")
    return "; and ".join(reasons)


def partial_evaluations_reason(val_curve: Sequence[Mapping[str, Any]]) -> str:
    """Why a run's validation curve has points that lack some evaluating clients, or ``""``.

    Each evaluating client plays its own slice of the validation episodes, so a point that lost one
    (``val_curve[].failed``) is on other episodes than the rest of the curve, and its comparisons
    with the base model are not like for like. A failed reply from a node no client is on (its
    negative key) lost no client's slice and does not count.
    """
    partial = [(point, evaluation_losses(point)) for point in val_curve]
    partial = [(point, lost) for point, lost in partial if lost]
    if not partial:
        return ""
    first, lost = partial[0]
    return (
        f"the evaluation of round(s) {[point['round'] for point, _ in partial]} lacks some clients' validation "
        f"episodes, so those points are on other episodes than the rest of the curve (round {first['round']}: "
        + round_reasons({"rejected": lost}) + ")"
    )
