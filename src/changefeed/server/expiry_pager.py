"""The expiry pager: turns expired documents into DCP expirations without anyone reading them.

Contract:
- Every `interval_s` seconds (`expiry_pager_interval_s`; 0 turns it off) a pass looks at up to
  `limits.EXPIRY_PAGER_RECORDS_PER_PASS_MAX` stored records of the active vbuckets and queues an
  EXPIRATION for every live document whose expiry has passed on the bucket's clock
  (`VBucket.expire_if_due`, the very path of lazy expiry on access, so a document rewritten or
  deleted meanwhile is left alone). DCP streams, and the mirror after them, see the expiration
  like any other change.
- Bounded: a pass reads the store in chunks of `limits.EXPIRY_PAGER_CHUNK_RECORDS_MAX` records,
  one read snapshot each, and yields to the event loop after each chunk. Each vbucket keeps a
  resume seqno, and passes continue from the vbucket where the last one stopped, so successive
  passes sweep every vbucket from seqno 0 to its end and start again: a document is found at
  most one sweep after it expired (`records / RECORDS_PER_PASS_MAX` passes; one pass when the
  bucket holds fewer records than that).
- Documents still only in memory (not yet flushed) are found once flushed, the next pass.
- While the store cannot persist (`bucket.persistence.failing`, a full disk) no pass runs: the
  node refuses writes then, and expirations are writes.

Not here: the expiry rule itself (vbucket.py), the scan (storage/expiry.py), reads that expire
lazily on access (still done: the pager only shortens how long an expired document waits).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import ClassVar

from changefeed import limits
from changefeed.server.bucket import Bucket
from changefeed.storage import StorageError

log = logging.getLogger("changefeed.expiry_pager")


@dataclasses.dataclass(frozen=True, slots=True)
class PagerPass:
    """What one pass did.

    Attributes:
        visited: records looked at.
        expired: expirations queued.
        vbuckets: vbuckets the pass looked into.
        duration_s: how long the pass took (yields included).
    """

    visited: int
    expired: int
    vbuckets: int
    duration_s: float


class ExpiryPager:
    """Expires documents of one bucket's active vbuckets in the background.

    Args:
        bucket: the node's bucket (its `vbuckets` and `store`).
        clock: the bucket's wall clock (expiry times are on it).
        interval_s: seconds between passes; 0 never runs a pass by itself.
        records_per_pass: records a pass looks at, at most.
        chunk_records: records per read snapshot (then the pager yields the loop).
        monotonic: seconds for durations.
    """

    COUNTER_HELP: ClassVar[dict[str, str]] = {
        "runs": "Expiry pager passes completed.",
        "expired": "Expirations the expiry pager queued.",
        "records_visited": "Records the expiry pager looked at.",
        "failures": "Expiry pager passes that failed with a storage error.",
    }

    def __init__(
        self,
        bucket: Bucket,
        *,
        clock: Callable[[], float],
        interval_s: float,
        records_per_pass: int = limits.EXPIRY_PAGER_RECORDS_PER_PASS_MAX,
        chunk_records: int = limits.EXPIRY_PAGER_CHUNK_RECORDS_MAX,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        assert interval_s >= 0, interval_s
        assert 0 < chunk_records <= records_per_pass, (chunk_records, records_per_pass)
        assert records_per_pass <= limits.EXPIRY_PAGER_RECORDS_PER_PASS_MAX, records_per_pass
        self._bucket = bucket
        self._clock = clock
        self._interval_s = interval_s
        self._records_per_pass = records_per_pass
        self._chunk_records = chunk_records
        self._monotonic = monotonic
        self._resume: dict[int, int] = {}  # vb -> seqno the next chunk of that vb starts at
        self._next_vb = 0  # the vbucket the next pass starts with
        self._task: asyncio.Task[None] | None = None
        self.counters = dict.fromkeys(self.COUNTER_HELP, 0)
        self.last_run_s = 0.0

    def start(self) -> None:
        """Start the passes (unless interval_s is 0)."""
        assert self._task is None, self
        if self._interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._schedule())
            self._task.add_done_callback(_log_failure)

    async def stop(self) -> None:
        """Cancel the passes; call before the store is closed."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _schedule(self) -> None:
        while True:  # the node's expiry pager; cancelled by stop()
            await asyncio.sleep(self._interval_s)
            if self._bucket.persistence.failing:
                continue  # writes are refused while the store cannot persist: so are these
            try:
                await self.run_pass()
            except StorageError as error:
                self.counters["failures"] += 1
                log.warning("expiry pager pass failed, retried next interval: %s", error)

    async def run_pass(self) -> PagerPass:
        """One bounded pass (see the module docstring), logged with its counts."""
        started = self._monotonic()
        active = [
            vb for vb, vbucket in sorted(self._bucket.vbuckets.items()) if vbucket.state.is_active
        ]
        later = [vb for vb in active if vb >= self._next_vb]
        order = later + [vb for vb in active if vb < self._next_vb]
        budget = self._records_per_pass
        visited = expired = vbuckets = 0
        for vb in order:  # bounded: each vbucket once, each chunk spends budget
            if budget <= 0:
                self._next_vb = vb
                break
            vbuckets += 1
            vb_visited, vb_expired = await self._page(vb, budget)
            budget -= vb_visited
            visited += vb_visited
            expired += vb_expired
            if vb in self._resume:  # stopped inside this vbucket: the next pass goes on here
                self._next_vb = vb
                break
        else:
            self._next_vb = 0  # every vbucket had its turn: the next pass starts at the first
        duration_s = self._monotonic() - started
        self.last_run_s = duration_s
        self.counters["runs"] += 1
        self.counters["expired"] += expired
        self.counters["records_visited"] += visited
        log.log(
            logging.INFO if expired else logging.DEBUG,
            "expiry pager: expired %d documents (%d records looked at in %d vbuckets) in %.3f s",
            expired,
            visited,
            vbuckets,
            duration_s,
        )
        assert visited <= self._records_per_pass, (visited, self._records_per_pass)
        return PagerPass(visited, expired, vbuckets, duration_s)

    async def _page(self, vb: int, budget: int) -> tuple[int, int]:
        """Scan `vb` from its resume seqno until its end or until `budget` records were seen;
        returns (records looked at, expirations queued)."""
        visited = expired = 0
        while visited < budget:  # bounded by budget: every chunk looks at >= 1 record or ends
            vbucket = self._bucket.vbuckets[vb]
            if not vbucket.state.is_active:
                break
            scan = self._bucket.store.find_expired(
                vb,
                start_seqno=self._resume.get(vb, 0),
                records_max=min(self._chunk_records, budget - visited),
                expiry_max=int(self._clock()),
            )
            visited += scan.visited
            for key in scan.keys:
                expired += vbucket.expire_if_due(key)
            if scan.next_seqno is None:
                self._resume.pop(vb, None)  # swept to the end: the next sweep starts at 0
            else:
                self._resume[vb] = scan.next_seqno
            await asyncio.sleep(0)  # the flusher and clients run after every chunk
            if scan.next_seqno is None:
                break
        return visited, expired

    def stats(self) -> Iterator[tuple[str, str]]:
        """STAT lines (general group)."""
        for name, value in self.counters.items():
            yield f"expiry_pager_{name}", str(value)
        yield "expiry_pager_last_run_s", f"{self.last_run_s:.6f}"


def _log_failure(task: asyncio.Task[None]) -> None:
    """A pager that died of a bug says so at once (its passes stop)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the expiry pager stopped", exc_info=task.exception())
