"""Compaction of a node's active vbuckets: on a schedule, and now when a client asks (COMPACT_DB).

Contract:
- Every `interval_s` seconds (`compaction_interval_s`; 0 turns the schedule off) every active
  vbucket loses the tombstones deleted at least `purge_age_s` ago (`tombstone_purge_age_s`,
  Couchbase's metadata purge interval) on the bucket's clock, and its purge seqno rises to the
  highest seqno purged (dcp-wire.md §9.1 rule 2: a consumer resuming below it rolls back to 0).
  `compact_vbucket` does one vbucket now, for COMPACT_DB; it is answered when done.
- What a reader may still need is never purged: only tombstones at or below the vbucket's
  persisted seqno (a checkpoint's unflushed items are not on disk yet) and below the first seqno
  its checkpoints still hold in memory, so every purged tombstone is at or below the position of
  every reader in memory (a cursor pins its checkpoint), and one whose cursor memory recovery
  drops later backfills from a position nothing above was purged at that time. (A reader kept
  on disk longer than the purge age can still miss purges made meanwhile; kv_engine ends such a
  backfill with a rollback, checkpoint/reader.py does not yet.) An idle vbucket's open
  checkpoint is closed first (when everything in it is persisted), so it can be freed.
- Writers are serialized by the event loop, not by a lock: the store takes one write
  transaction at a time (LMDB has one writer; `Store` refuses a second), and every writer of this
  node (the flusher, vbucket metadata, and each compaction chunk) runs synchronously on the loop
  thread, so their transactions never overlap. A chunk looks at no more than
  `limits.COMPACTION_CHUNK_RECORDS_MAX` records and the compactor yields to the loop after
  every chunk, so neither the flusher nor clients wait longer than one chunk (a few ms).
- One vbucket is compacted at a time (an asyncio lock): a COMPACT_DB waits for the chunk loop of
  the scheduled run's current vbucket, not for the whole run.

Not here: the purge itself (storage/compaction.py), the rollback decision (failover.py),
expiry (expiry_pager.py). Replica vbuckets are not compacted here: their active decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import ClassVar

from changefeed import limits
from changefeed.protocol.errors import NotMyVbucketError, StatusError, TemporaryFailureError
from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import (
    CompactDb,
    CompactionSummary,
    decode_compact_db,
    encode_compaction_summary,
)
from changefeed.protocol.status import Status
from changefeed.server.bucket import Bucket
from changefeed.storage import StorageError
from changefeed.vbucket import VBucket

log = logging.getLogger("changefeed.compactor")


@dataclasses.dataclass(frozen=True, slots=True)
class VbucketCompaction:
    """What compacting one vbucket did.

    Attributes:
        vb: the vbucket.
        purged: tombstones removed.
        visited: records looked at.
        purge_seqno: the vbucket's purge seqno afterwards.
        chunks: write transactions used.
    """

    vb: int
    purged: int
    visited: int
    purge_seqno: int
    chunks: int


class Compactor:
    """Purges old tombstones of one bucket's active vbuckets, in chunks on the event loop.

    Args:
        bucket: the node's bucket (its `vbuckets` and `store`).
        clock: the bucket's wall clock (delete times were taken on it).
        interval_s: seconds between scheduled runs; 0 runs only on request.
        purge_age_s: a tombstone is purged once it is this many seconds old.
        chunk_records: records per write transaction (tests pass a small one).
        monotonic: seconds for durations.
    """

    COUNTER_HELP: ClassVar[dict[str, str]] = {
        "runs": "Scheduled compaction runs completed.",
        "requests": "COMPACT_DB requests completed.",
        "vbuckets": "Vbucket compactions completed (scheduled and requested).",
        "tombstones_purged": "Tombstones purged by compaction.",
        "dropped_collection_records_purged": "Records of dropped collections purged.",
        "records_visited": "Records compaction looked at.",
        "failures": "Vbucket compactions that failed with a storage error.",
    }

    def __init__(
        self,
        bucket: Bucket,
        *,
        clock: Callable[[], float],
        interval_s: float,
        purge_age_s: float,
        chunk_records: int = limits.COMPACTION_CHUNK_RECORDS_MAX,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        assert interval_s >= 0, interval_s
        assert purge_age_s >= 0, purge_age_s
        assert 0 < chunk_records <= limits.COMPACTION_CHUNK_RECORDS_MAX, chunk_records
        self._bucket = bucket
        self._clock = clock
        self._interval_s = interval_s
        self.purge_age_s = purge_age_s
        self._chunk_records = chunk_records
        self._monotonic = monotonic
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._requests: set[asyncio.Task[VbucketCompaction]] = set()
        self.counters = dict.fromkeys(self.COUNTER_HELP, 0)
        self.last_run_s = 0.0  # duration of the last scheduled run
        # Which collection ids were dropped (server/manifest.py); their records go with the
        # tombstones, a chunk at a time (storage/compaction.py). None: none are purged.
        self.dropped_collections: Callable[[int], bool] | None = None
        self.started = False

    def start(self) -> None:
        """Start the schedule (unless interval_s is 0); requests work once started."""
        assert self._task is None, self
        self.started = True
        if self._interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._schedule())
            self._task.add_done_callback(_log_failure)

    async def stop(self) -> None:
        """Cancel the schedule and pending requests; call before the store is closed."""
        self.started = False
        tasks = [*self._requests, *([self._task] if self._task is not None else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, StorageError, NotMyVbucketError):
                await task
        self._task = None

    # -- compaction -----------------------------------------------------------------------------

    def cutoff(self, purge_age_s: float | None = None) -> float:
        """The delete time at or below which a tombstone is purged now (bucket clock)."""
        age_s = self.purge_age_s if purge_age_s is None else purge_age_s
        assert age_s >= 0, age_s
        return self._clock() - age_s

    def request(
        self, vb: int, *, delete_time_max: float, seqno_max: int = limits.SEQNO_MAX
    ) -> asyncio.Task[VbucketCompaction]:
        """Start compacting `vb` now (COMPACT_DB); the task's result answers the request.

        Raises:
            NotMyVbucketError: `vb` does not exist or is not active (at once, not in the task).
        """
        self._active(vb)
        task = asyncio.get_running_loop().create_task(
            self.compact_vbucket(vb, delete_time_max=delete_time_max, seqno_max=seqno_max)
        )
        self._requests.add(task)
        task.add_done_callback(self._request_done)
        return task

    def _request_done(self, task: asyncio.Task[VbucketCompaction]) -> None:
        self._requests.discard(task)
        if not task.cancelled() and task.exception() is None:
            self.counters["requests"] += 1

    async def compact_all(self, *, delete_time_max: float) -> list[VbucketCompaction]:
        """Compact every active vbucket, one after the other; a vbucket that fails is logged
        and skipped (the next run tries again)."""
        done = []
        for vb, vbucket in sorted(self._bucket.vbuckets.items()):
            if not vbucket.state.is_active:
                continue
            try:
                done.append(await self.compact_vbucket(vb, delete_time_max=delete_time_max))
            except NotMyVbucketError:
                continue  # it stopped being active meanwhile
            except StorageError as error:
                log.warning("compaction of vb %d failed, retried next run: %s", vb, error)
        return done

    async def compact_vbucket(
        self, vb: int, *, delete_time_max: float, seqno_max: int = limits.SEQNO_MAX
    ) -> VbucketCompaction:
        """Purge `vb`'s tombstones with delete_time <= `delete_time_max` (and seqno <=
        `seqno_max`), chunk by chunk, yielding to the loop between chunks.

        Raises:
            NotMyVbucketError: `vb` does not exist or is not active.
            StorageError: a chunk failed; chunks committed before it stay purged.
        """
        assert not math.isnan(delete_time_max), delete_time_max
        async with self._lock:
            vbucket = self._active(vb)
            try:
                result = await self._purge(vbucket, delete_time_max, seqno_max)
            except StorageError:
                self.counters["failures"] += 1
                raise
        self.counters["vbuckets"] += 1
        self.counters["tombstones_purged"] += result.purged
        self.counters["records_visited"] += result.visited
        return result

    async def _purge(
        self, vbucket: VBucket, delete_time_max: float, seqno_max: int
    ) -> VbucketCompaction:
        store = self._bucket.store
        vb = vbucket.vb
        self._release_idle_checkpoint(vbucket)
        start_seqno = 0
        purged = visited = chunks = 0
        while vbucket.state.is_active:  # bounded: each chunk moves start_seqno on
            ceiling = min(seqno_max, self._purge_ceiling(vbucket))
            if start_seqno > ceiling:
                break
            chunk = store.compact_chunk(
                vb,
                delete_time_max=delete_time_max,
                start_seqno=start_seqno,
                seqno_max=ceiling,
                records_max=self._chunk_records,
                dropped=self.dropped_collections,
            )
            self.counters["dropped_collection_records_purged"] += chunk.dropped
            chunks += 1
            purged += chunk.purged
            visited += chunk.visited
            await asyncio.sleep(0)  # the flusher and clients run after every chunk
            if chunk.next_seqno is None:
                break
            assert chunk.next_seqno > start_seqno, (chunk, start_seqno)
            start_seqno = chunk.next_seqno
        purge_seqno = store.purge_seqno(vb)
        assert purge_seqno <= vbucket.persisted_seqno, (purge_seqno, vbucket)
        return VbucketCompaction(vb, purged, visited, purge_seqno, chunks)

    @staticmethod
    def _purge_ceiling(vbucket: VBucket) -> int:
        """Highest seqno compaction may purge: on disk, no longer in checkpoint memory, and
        below the stored high seqno. The record at the high seqno is kept, as kv_engine keeps
        it: a disk snapshot ends at the high seqno, and a reader — a replica, a consumer — that
        never received an item there would hold that snapshot as partial for ever."""
        return min(vbucket.persisted_seqno - 1, vbucket.manager.first_memory_seqno - 1)

    @staticmethod
    def _release_idle_checkpoint(vbucket: VBucket) -> None:
        """Close the open checkpoint of a vbucket whose every write is persisted, so memory
        can free it once its readers have left (what the next write would do anyway)."""
        if vbucket.persisted_seqno == vbucket.high_seqno and not vbucket.flusher.pending:
            vbucket.manager.close_open_checkpoint()

    def _active(self, vb: int) -> VBucket:
        vbucket = self._bucket.vbuckets.get(vb)
        if vbucket is None or not vbucket.state.is_active:
            state = "missing" if vbucket is None else vbucket.state.value
            raise NotMyVbucketError(f"vb {vb} is {state}: only active vbuckets are compacted")
        return vbucket

    # -- schedule -------------------------------------------------------------------------------

    async def _schedule(self) -> None:
        while True:  # the node's compaction schedule; cancelled by stop()
            await asyncio.sleep(self._interval_s)
            await self.run_once()

    async def run_once(self) -> list[VbucketCompaction]:
        """One scheduled run over every active vbucket, logged with its counts."""
        started = self._monotonic()
        done = await self.compact_all(delete_time_max=self.cutoff())
        self.last_run_s = self._monotonic() - started
        self.counters["runs"] += 1
        purged = sum(result.purged for result in done)
        visited = sum(result.visited for result in done)
        level = logging.INFO if purged else logging.DEBUG
        log.log(
            level,
            "compaction: purged %d tombstones older than %.0f s in %d vbuckets "
            "(%d records looked at) in %.3f s",
            purged,
            self.purge_age_s,
            len(done),
            visited,
            self.last_run_s,
        )
        return done

    def stats(self) -> Iterator[tuple[str, str]]:
        """STAT lines (general group)."""
        for name, value in self.counters.items():
            yield f"compaction_{name}", str(value)
        yield "compaction_last_run_s", f"{self.last_run_s:.6f}"
        yield "compaction_tombstone_purge_age_s", f"{self.purge_age_s:g}"


# -- COMPACT_DB ----------------------------------------------------------------------------------

Reply = Callable[[int, bytes, int], None]  # status, value, datatype


def answer_compact_db(compactor: Compactor | None, frame: Frame, reply: Reply) -> None:
    """COMPACT_DB (connection.py's handler): start compacting; `reply` once it is done.

    kv_engine's fields: purge tombstones deleted before `purge_before_ts` (0: the node's own
    `tombstone_purge_age_s`), at or below `purge_before_seq` (0: any), or all of them with
    `drop_deletes`. The success value is a JSON `CompactionSummary`.

    Raises:
        ProtocolError: a malformed request (EINVAL).
        NotMyVbucketError: the vbucket does not exist or is not active.
        TemporaryFailureError: no compactor runs (the node is starting or stopping).
    """
    request = decode_compact_db(frame)
    if compactor is None or not compactor.started:
        raise TemporaryFailureError("compaction is not running on this node")
    if request.drop_deletes:
        delete_time_max = math.inf
    elif request.purge_before_ts:
        delete_time_max = request.purge_before_ts - 1  # kv_engine: deleted strictly before
    else:
        delete_time_max = compactor.cutoff()
    seqno_max = request.purge_before_seq or limits.SEQNO_MAX
    task = compactor.request(request.vbucket, delete_time_max=delete_time_max, seqno_max=seqno_max)
    task.add_done_callback(functools.partial(_answer, request, reply))


def _answer(request: CompactDb, reply: Reply, task: asyncio.Task[VbucketCompaction]) -> None:
    if task.cancelled():
        reply(Status.ETMPFAIL, b"compaction cancelled: the node is stopping", 0)
        return
    error = task.exception()
    if isinstance(error, StatusError):
        reply(error.code, str(error).encode(), 0)
    elif isinstance(error, StorageError):
        log.warning("COMPACT_DB of vb %d failed: %s", request.vbucket, error)
        reply(Status.EINTERNAL, f"compaction failed: {error}".encode(), 0)
    elif error is not None:  # a bug: say so, and let the client know it failed
        log.error("COMPACT_DB of vb %d failed", request.vbucket, exc_info=error)
        reply(Status.EINTERNAL, b"compaction failed (see the node log)", 0)
    else:
        result = task.result()
        log.info(
            "COMPACT_DB vb %d: purged %d tombstones (%d records looked at), purge seqno %d",
            result.vb,
            result.purged,
            result.visited,
            result.purge_seqno,
        )
        summary = CompactionSummary(result.vb, result.purged, result.purge_seqno, result.visited)
        reply(Status.SUCCESS, encode_compaction_summary(summary), 1)  # datatype JSON


def _log_failure(task: asyncio.Task[None]) -> None:
    """A schedule that died of a bug says so at once (stop() re-raises it at shutdown)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the compaction schedule stopped", exc_info=task.exception())
