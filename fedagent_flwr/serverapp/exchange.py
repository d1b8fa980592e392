"""Send instructions to SuperNodes and collect their replies, looking for replies twice a second.

Flower's deployment grid (``HttpGrid``: what a ServerApp under ``flower-superlink`` talks through)
sleeps 3 s between two pulls of replies, so each exchange of the run (the partition query, every
round's training and evaluation, the shutdown query) went on 1.5 s on average, and up to 3 s, after
its last reply had reached the SuperLink; a round has two such exchanges. :func:`send_and_receive`
does what ``HttpGrid.send_and_receive`` does (push, then pull the replies still missing until all
came or the timeout passed) with a pull every :data:`REPLY_POLL_S` instead: one small request to the
SuperLink, which a SuperNode's own polling and Flower's newer task grid (every 0.25 s) also make.
Any other grid keeps its own ``send_and_receive``: the simulation's in-memory grid already pulls
every 0.1 s, and a test's stand-in grid may offer nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid

# Seconds between two pulls of the replies still missing (Flower's HttpGrid: 3 s).
REPLY_POLL_S = 0.5


def _polls_slowly(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's deployment grid, whose own send_and_receive pulls every 3 s."""
    from flwr.superlink.grid.http_grid import HttpGrid  # on use: it adds ~1 s to importing the app

    return isinstance(grid, HttpGrid)


def send_and_receive(grid: Grid, messages: Iterable[Message], timeout: float | None) -> list[Message]:
    """Push ``messages`` and return the replies that came within ``timeout`` seconds (``None``: wait
    for all of them), as ``grid.send_and_receive`` would, pulling every :data:`REPLY_POLL_S` on a
    deployment grid."""
    if not _polls_slowly(grid):
        return list(grid.send_and_receive(messages, timeout=timeout))
    missing = set(grid.push_messages(messages))
    end = time.monotonic() + (timeout if timeout is not None else 0.0)
    replies: list[Message] = []
    while timeout is None or time.monotonic() < end:
        pulled = list(grid.pull_messages(missing))
        replies.extend(pulled)
        missing.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
        if not missing:
            break
        time.sleep(REPLY_POLL_S)
    return replies
