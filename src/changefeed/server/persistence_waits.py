"""SEQNO_PERSISTENCE (0xb6): answer once a vbucket's persisted seqno reaches a seqno.

The memcached protocol's way to wait for persistence without polling (kv_engine's
SeqnoPersistenceCommandContext: the request's 8 bytes of extras are the seqno, the vbucket is
in the header, success when persisted, TMPFAIL when it is not in time). A writer that waits
for its window to be on disk sends one per vbucket it wrote and gets the answer as soon as the
flush round that persisted it ends: no poll interval, no second round trip. A wait hurries
the flusher past its gathering gap, as an OBSERVE_SEQNO below the high seqno does.

A wait is answered success only on the history it began on: if the vbucket changed state or
history (a failover, a rollback) meanwhile, whether the seqno the writer meant is persisted is
not known here, and it gets TMPFAIL saying so (the writer's OBSERVE_SEQNO with its vb_uuid
tells). Memory stays bounded whatever clients send: at most `limits.PERSISTENCE_WAITS_MAX`
waits per node (more get TMPFAIL), a connection's waits are cancelled when it closes (the
caller does that), and a wait that ends early (timed out, cancelled) is dropped from its
vbucket's heap lazily, in amortised O(log n).

Not here: which seqno a client should wait for (its write's mutation token).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from changefeed import limits
from changefeed.protocol.errors import NotMyVbucketError, TemporaryFailureError
from changefeed.vbucket_state import VBucketState


@dataclass(frozen=True, slots=True)
class VbucketMark:
    """What a wait must still find when its seqno is persisted: the vbucket's persisted
    seqno now, and its state and history (vb_uuid) when the wait began."""

    persisted_seqno: int
    state: VBucketState
    vb_uuid: int


# A vbucket's mark, None when the node has no such vbucket.
MarkOf = Callable[[int], VbucketMark | None]


@dataclass(order=True)
class _Wait:
    seqno: int
    order: int
    future: asyncio.Future[None] = field(compare=False)
    mark: VbucketMark = field(compare=False)
    queued: bool = field(default=True, compare=False)  # its entry is in its vbucket's heap


class PersistenceWaits:
    """The SEQNO_PERSISTENCE waits of one bucket, per vbucket in seqno order.

    Args:
        mark_of: a vbucket's persisted seqno, state and vb_uuid, None if the node has no
            such vbucket.
        check_writable: raises TemporaryFailureError (naming the error) while the store fails.
        hurry_flush: starts the next flush round without its gathering gap.
        timeout_s: how long a wait may take before it gets TMPFAIL.
    """

    def __init__(
        self,
        mark_of: MarkOf,
        check_writable: Callable[[], None],
        hurry_flush: Callable[[], None],
        *,
        timeout_s: float = limits.PERSISTENCE_WAIT_S,
    ) -> None:
        self._mark_of = mark_of
        self._check_writable = check_writable
        self._hurry_flush = hurry_flush
        self._timeout_s = timeout_s
        # vb -> heap of waits, lowest seqno first; entries of waits that ended early stay
        # until popped or the heap is rebuilt (`_ended` of them).
        self._waiting: dict[int, list[_Wait]] = {}
        self._ended: dict[int, int] = {}
        self._order = itertools.count()
        self.count = 0  # waits not answered yet
        self.answered_total = 0  # waits answered success after waiting (not at once)
        self.requested_total = 0  # every wait asked for, those answered at once included

    @property
    def heap_entries(self) -> int:
        """Entries in the vbuckets' heaps: the waits pending plus ended ones not dropped yet
        (at most about as many again: a heap is rebuilt once they are half of it)."""
        return sum(map(len, self._waiting.values()))

    def wait(self, vb: int, seqno: int) -> asyncio.Future[None]:
        """A future done once `vb` has persisted `seqno` (at once if it has). Cancelling it
        (its connection closed) ends the wait.

        Raises:
            NotMyVbucketError: the node has no such vbucket.
            TemporaryFailureError: the store is failing to write, or too many waits are
                pending on this node.
        """
        mark = self._mark_of(vb)
        if mark is None:
            raise NotMyVbucketError(f"vbucket {vb} does not exist")
        self.requested_total += 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if mark.persisted_seqno >= seqno:
            future.set_result(None)
            return future
        self._check_writable()
        if self.count >= limits.PERSISTENCE_WAITS_MAX:
            raise TemporaryFailureError(
                f"{self.count} persistence waits pending on this node (at most "
                f"{limits.PERSISTENCE_WAITS_MAX}): retry"
            )
        wait = _Wait(seqno, next(self._order), future, mark)
        heapq.heappush(self._waiting.setdefault(vb, []), wait)
        self.count += 1
        timer = loop.call_later(self._timeout_s, self._expire, wait)
        future.add_done_callback(lambda _: self._done(vb, wait, timer))
        self._hurry_flush()
        return future

    def on_persisted(self, vbs: list[int]) -> None:
        """The flusher persisted more of `vbs` (the bucket's persisted listener)."""
        for vb in vbs:
            heap = self._waiting.get(vb)
            if not heap:
                continue
            mark = self._mark_of(vb)
            while heap and (mark is None or heap[0].seqno <= mark.persisted_seqno):
                wait = heapq.heappop(heap)
                wait.queued = False
                if wait.future.done():
                    self._ended[vb] -= 1  # ended early: its entry is gone now
                    continue
                if mark is None or (mark.state, mark.vb_uuid) != (
                    wait.mark.state,
                    wait.mark.vb_uuid,
                ):
                    wait.future.set_exception(_changed(vb, wait.seqno))
                    continue
                self.answered_total += 1
                wait.future.set_result(None)
            if not heap:
                del self._waiting[vb]
                self._ended.pop(vb, None)

    def fail_all(self, reason: str) -> None:
        """Every wait ends now with TemporaryFailureError(`reason`): a commit failed or the
        bucket closes; a writer learns why instead of waiting out its time."""
        waiting, self._waiting, self._ended = self._waiting, {}, {}
        for heap in waiting.values():
            for wait in heap:
                wait.queued = False
                if not wait.future.done():
                    wait.future.set_exception(TemporaryFailureError(reason))

    def _expire(self, wait: _Wait) -> None:
        """The wait's time ran out: TMPFAIL (its heap entry goes lazily)."""
        if not wait.future.done():
            wait.future.set_exception(
                TemporaryFailureError(
                    f"seqno {wait.seqno} not persisted within {self._timeout_s:g} s"
                )
            )

    def _done(self, vb: int, wait: _Wait, timer: asyncio.TimerHandle) -> None:
        """A wait's future is done, however: it is counted out once, and if its entry is
        still in the heap (it timed out, was cancelled or failed before its seqno was
        persisted), the heap is rebuilt once such stale entries are half of it."""
        timer.cancel()
        self.count -= 1
        if not wait.queued:
            return  # answered from the heap, or the heap was dropped
        heap = self._waiting[vb]
        ended = self._ended[vb] = self._ended.get(vb, 0) + 1
        if ended * 2 > len(heap) + 16:
            for entry in heap:
                entry.queued = not entry.future.done()
            heap[:] = [entry for entry in heap if entry.queued]
            heapq.heapify(heap)
            self._ended[vb] = 0
            if not heap:
                del self._waiting[vb]
                del self._ended[vb]


def _changed(vb: int, seqno: int) -> TemporaryFailureError:
    return TemporaryFailureError(
        f"vb {vb} changed state or history while seqno {seqno} was waited for: whether it "
        "is persisted here on the writer's history is not known (ask OBSERVE_SEQNO)"
    )
