"""SEQNO_PERSISTENCE (0xb6): answer once a vbucket's persisted seqno reaches a seqno.

The memcached protocol's way to wait for persistence without polling (kv_engine's
SeqnoPersistenceCommandContext: the request's 8 bytes of extras are the seqno, the vbucket is
in the header, success when persisted, TMPFAIL when it is not in time). A writer that waits
for its window to be on disk sends one per vbucket it wrote and gets the answer as soon as the
flush round that persisted it ends: no poll interval, no second round trip. A waiter hurries
the flusher past its gathering gap, as an OBSERVE_SEQNO below the high seqno does.

Each wait is a future resolved by the bucket's persisted listener; at most
`limits.PERSISTENCE_WAITS_MAX` wait at once on a node (more get TMPFAIL), so memory stays
bounded whatever clients send. A wait past its time, or one the store cannot meet (it is
failing to write), gets TemporaryFailureError.

Not here: which seqno a client should wait for (its write's mutation token), and whether the
history it wrote is still the vbucket's (OBSERVE_SEQNO's vb_uuid tells that).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from changefeed import limits
from changefeed.protocol.errors import NotMyVbucketError, TemporaryFailureError

# A vbucket's persisted seqno, None when the node has no such vbucket.
PersistedSeqno = Callable[[int], int | None]


class PersistenceWaits:
    """The SEQNO_PERSISTENCE waits of one bucket, per vbucket in seqno order.

    Args:
        persisted_seqno: a vbucket's persisted seqno, None if the node has no such vbucket.
        check_writable: raises TemporaryFailureError (naming the error) while the store fails.
        hurry_flush: starts the next flush round without its gathering gap.
        timeout_s: how long a wait may take before it gets TMPFAIL.
    """

    def __init__(
        self,
        persisted_seqno: PersistedSeqno,
        check_writable: Callable[[], None],
        hurry_flush: Callable[[], None],
        *,
        timeout_s: float = limits.PERSISTENCE_WAIT_S,
    ) -> None:
        self._persisted_seqno = persisted_seqno
        self._check_writable = check_writable
        self._hurry_flush = hurry_flush
        self._timeout_s = timeout_s
        # vb -> heap of (seqno, tie-break, future): the lowest seqno is answered first.
        self._waiting: dict[int, list[tuple[int, int, asyncio.Future[None]]]] = {}
        self._order = itertools.count()
        self.count = 0  # waits not answered yet

    def wait(self, vb: int, seqno: int) -> asyncio.Future[None]:
        """A future done once `vb` has persisted `seqno` (at once if it has).

        Raises:
            NotMyVbucketError: the node has no such vbucket.
            TemporaryFailureError: the store is failing to write, or too many waits are
                pending on this node.
        """
        persisted = self._persisted_seqno(vb)
        if persisted is None:
            raise NotMyVbucketError(f"vbucket {vb} does not exist")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if persisted >= seqno:
            future.set_result(None)
            return future
        self._check_writable()
        if self.count >= limits.PERSISTENCE_WAITS_MAX:
            raise TemporaryFailureError(
                f"{self.count} persistence waits pending on this node (at most "
                f"{limits.PERSISTENCE_WAITS_MAX}): retry"
            )
        heapq.heappush(self._waiting.setdefault(vb, []), (seqno, next(self._order), future))
        self.count += 1
        timer = loop.call_later(self._timeout_s, self._expire, vb, seqno, future)
        future.add_done_callback(lambda _: timer.cancel())
        self._hurry_flush()
        return future

    def on_persisted(self, vbs: list[int]) -> None:
        """The flusher persisted more of `vbs` (the bucket's persisted listener)."""
        for vb in vbs:
            heap = self._waiting.get(vb)
            if not heap:
                continue
            persisted = self._persisted_seqno(vb)
            while heap and persisted is not None and heap[0][0] <= persisted:
                _, _, future = heapq.heappop(heap)
                self.count -= 1
                if not future.done():
                    future.set_result(None)
            if not heap:
                del self._waiting[vb]

    def _expire(self, vb: int, seqno: int, future: asyncio.Future[None]) -> None:
        if future.done():
            return
        heap = self._waiting.get(vb, [])
        heap[:] = [entry for entry in heap if entry[2] is not future]
        heapq.heapify(heap)
        if not heap:
            self._waiting.pop(vb, None)
        self.count -= 1
        future.set_exception(
            TemporaryFailureError(
                f"vb {vb}: seqno {seqno} not persisted within {self._timeout_s:g} s"
            )
        )

    def fail_all(self, reason: str) -> None:
        """Every wait ends now with TemporaryFailureError(`reason`): a commit failed or the
        bucket closes; a writer learns why instead of waiting out its time."""
        waiting, self._waiting, self.count = self._waiting, {}, 0
        for heap in waiting.values():
            for _, _, future in heap:
                if not future.done():
                    future.set_exception(TemporaryFailureError(reason))
