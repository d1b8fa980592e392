"""Why a run stops, and client failures as one readable line.

Flower reports a failed ClientApp as an error reply whose reason is Flower's (and, in simulation,
Ray's) wrapping of the ClientApp's own exception; :func:`readable_reason` gets that exception's line
back. When every client of a round failed for the same reason (:func:`reason_key` blanks out what
differs between clients), the next rounds would fail the same way and the run stops
(:func:`stop_if_all_failed_alike`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from flwr.app import Message


class RunFailedError(RuntimeError):
    """The run cannot go on; the message is the one line the log and the summary carry."""


class RoundFailedError(RunFailedError):
    """Every client of a round failed for the same reason: the next rounds would fail the same way."""


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


def reason_key(reason: str) -> str:
    """``reason`` with what differs between clients failing the same way blanked out: the leading
    ``client <c> round <r>:`` label, client/round/node numbers and process ids (in paths and text)."""
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
    raise RoundFailedError(
        f"{what}: every client ({len(clients)}) failed the same way, so the run stops: {reasons[first]}"
    )
