"""Bounded read-ahead for the streamed aggregation: disk reads and hashing overlap the arithmetic.

:func:`~fedagent_flwr.checkpoint.aggregate.weighted_mean` consumes every source's full tensor of
every key in a fixed order (key by key, sources in order). Read on the averaging thread, each
read, and the content hash of a source checked while reading, would leave the arithmetic idle,
and the arithmetic would leave the disk idle. :class:`ReadAhead` runs the reads on one
background thread, in that order, into slots of one ring buffer allocated up front; the
averaging thread takes each slot when it needs it (:meth:`ReadAhead.take`) and hands it back
when done (:meth:`Slot.release`). A slot's bytes are reused only once it has been handed back
and its hash has completed: hashing and averaging read a slot at the same time, neither
writes it.

**Memory bound**: the ring, ``capacity`` bytes (:func:`ring_bytes`: twice the largest tensor,
so that one large tensor is read while the previous one is averaged), whatever the number of
sources or keys, plus, per slot in flight, a few bytes of bookkeeping; tensors of no elements
take no ring space. Slots are freed in order, and the consumer holds at most one slot at a time
(what must outlive it is copied out first): once that slot is handed back the reader can always
place the next one, so the two threads cannot wait on each other.

Thread safety: while a :class:`ReadAhead` runs, only its thread may read from the readers it
was given (a rank file is read through one file position); the consumer reads other readers.
"""

from __future__ import annotations

import math
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

import torch

from fedagent_flwr.checkpoint.reader import CheckpointReader

__all__ = ["ReadAhead", "ReadItem", "Slot", "ring_bytes"]

# Slot starts are aligned so that a slot's bytes can be viewed as any dtype (and stay
# cache-line aligned for the arithmetic).
_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def ring_bytes(largest: int) -> int:
    """Ring capacity for tensors of at most ``largest`` bytes: two of them, so the next one can be
    read while the last one is averaged."""
    return 2 * _aligned(max(1, largest))


@dataclass(frozen=True)
class ReadItem:
    """One read of the plan: source ``index``'s full ``key``, converted to ``dtype``."""

    key: str
    index: int
    reader: CheckpointReader
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _nothing() -> None:
    """No hashing left to wait for."""


class Slot:
    """One tensor read ahead: ``tensor`` lives in the ring until :meth:`release`."""

    __slots__ = ("item", "tensor", "begin", "end", "wait_hash", "released", "_owner")

    def __init__(self, owner: ReadAhead, item: ReadItem, tensor: torch.Tensor, begin: int, end: int) -> None:
        self._owner = owner
        self.item = item
        self.tensor = tensor  # read only: its hash may still be running
        self.begin, self.end = begin, end  # byte range in the ring (0, 0 for an empty tensor)
        self.wait_hash: Callable[[], None] = _nothing
        self.released = False

    def release(self) -> None:
        """The consumer is done with ``tensor``; its ring bytes may be reused."""
        self._owner._release(self)


class ReadAhead:
    """Reads ``items`` in order on one background thread into a ring of ``capacity`` bytes.

    Use as a context manager: leaving it normally waits for the thread and every hash in flight
    (raising a hashing error), leaving it with an error stops the thread first.
    """

    def __init__(self, items: Sequence[ReadItem], capacity: int) -> None:
        too_big = [item for item in items if _aligned(item.nbytes) > capacity]
        if too_big:
            raise ValueError(f"'{too_big[0].key}' needs {too_big[0].nbytes} bytes, the ring holds {capacity}")
        self._items = list(items)
        self._ring = torch.empty(capacity, dtype=torch.uint8)
        self._capacity = capacity
        self._head = 0  # where the next slot may start
        self._live: deque[Slot] = deque()  # slots holding ring bytes, oldest first (reader thread only)
        self._ready: queue.SimpleQueue[Slot | BaseException | None] = queue.SimpleQueue()
        self._cond = threading.Condition()  # guards Slot.released and _stopped
        self._stopped = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckpt-read-ahead", daemon=True)
        self._thread.start()

    # -- consumer side ---------------------------------------------------------------------------
    def take(self, key: str, index: int) -> Slot:
        """The next slot, which must be source ``index``'s ``key``; re-raises the reader's error."""
        if self._failure is not None:
            raise self._failure
        got = self._ready.get()
        if isinstance(got, BaseException):
            self._failure = got
            raise got
        if got is None or got.item.key != key or got.item.index != index:
            found = "the end of the plan" if got is None else f"source {got.item.index}'s '{got.item.key}'"
            raise RuntimeError(f"read-ahead out of step: asked for source {index}'s '{key}', next is {found}")
        return got

    def close(self) -> None:
        """After the last :meth:`take`: end the reader thread and wait for every hash in flight,
        raising a hashing error. The thread is told to stop, so a consumer that took less than
        the plan cannot leave it waiting for a release."""
        self._stop()
        while self._live:
            self._live.popleft().wait_hash()

    def abort(self) -> None:
        """Stop reading (on an error): the thread ends after the read it is in; no hash is left
        running once this returns. Errors of the reads and hashes in flight are dropped."""
        self._stop()
        while self._live:  # every slot read and not yet reclaimed, taken or not
            try:
                self._live.popleft().wait_hash()
            except Exception:  # noqa: BLE001 -- an error is already on its way out
                pass

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()

    def _release(self, slot: Slot) -> None:
        with self._cond:
            slot.released = True
            self._cond.notify_all()

    # -- reader thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            for item in self._items:
                if self._stopped:  # told to stop while the ring had room: read no further
                    return
                slot = self._allocate(item)
                if slot is None:  # stopped
                    return
                slot.wait_hash = item.reader.read_into_deferred(item.key, slot.tensor)
                self._ready.put(slot)
            self._ready.put(None)
        except BaseException as exc:  # noqa: BLE001 -- handed to the consumer, raised there
            self._ready.put(exc)

    def _allocate(self, item: ReadItem) -> Slot | None:
        nbytes = item.nbytes
        if nbytes == 0:
            return Slot(self, item, torch.empty(item.shape, dtype=item.dtype), 0, 0)
        need = _aligned(nbytes)
        while (begin := self._fit(need)) is None:
            if not self._reclaim_oldest():
                return None
        tensor = self._ring[begin : begin + nbytes].view(item.dtype).view(item.shape)
        slot = Slot(self, item, tensor, begin, begin + need)
        self._live.append(slot)
        self._head = begin + need
        return slot

    def _fit(self, need: int) -> int | None:
        """Start of a free run of ``need`` bytes after the newest slot, wrapping to the start of
        the ring when the end is too short; None while the live slots are in the way."""
        if not self._live:
            self._head = 0
            return 0
        first = self._live[0].begin
        if first < self._head:  # live bytes in [first, head): free after head and before first
            if self._capacity - self._head >= need:
                return self._head
            return 0 if first >= need else None
        return self._head if first - self._head >= need else None  # wrapped: free in [head, first)

    def _reclaim_oldest(self) -> bool:
        """Free the oldest slot once the consumer has released it and its hash is done; False
        when stopped instead."""
        oldest = self._live[0]
        with self._cond:
            self._cond.wait_for(lambda: oldest.released or self._stopped)
            if self._stopped:
                return False
        oldest.wait_hash()  # a hashing error ends the thread; the consumer raises it
        self._live.popleft()
        return True
