"""The node's side of changefeed.ipc: each stream group's changes published into its service.

With ``shm_groups = N`` the bucket's vbuckets are split into N contiguous groups and each group
gets a service ``<bucket>-<port>-g<i>`` (docs/ipc.md). A group is fed the way a DCP stream is:
an in-process `DcpProducer` (sans-IO) holds one stream per vbucket, each reading the checkpoint
manager through a cursor (a `StreamReader`: memory, or disk after its cursor was dropped); its
streams' encoder is a `RowEncoder` (server/shm_rows.py), which builds change rows straight from
the items (no DCP frame is encoded or decoded), once per batch for every reader, so the rows
equal what a DCP reader of the same vbuckets gets.

Published rows are persisted rows (``shm_persisted_only``, the default): a row is held until the
flusher has written its seqno, so a node killed with -9 never takes back what readers saw, and
after a restart the publisher continues the ring exactly where it stopped — the positions
stored with the newest batch are its stream-request positions (vb_uuid, seqno, snapshot). If
the node cannot continue one (its history diverged), a rollback row goes out first.

Batches hold at most ``limits.SHM_ROWS_PER_BATCH_MAX`` rows and must fit a slot; a batch too
large is split, and a single row larger than a slot goes out as a gap (readers fetch it over
DCP). The task of a group never waits for a reader (ipc/provider.py: slow readers lose data),
and it reclaims a dead reader's slots and budget itself (``Provider.maintain``, each round of
its loop, which wakes at least every TICK_S).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.typing import NDArray
from prometheus_client.core import GaugeMetricFamily

from changefeed import limits
from changefeed.consumer.change_rows import OP_ROLLBACK, ChangeRows
from changefeed.ipc.layout import POSITION_FIELDS, Geometry
from changefeed.ipc.provider import Provider
from changefeed.producer.backfill_slots import BackfillSlots
from changefeed.producer.producer import DcpProducer
from changefeed.producer.stream_request import Accepted, Refused, RollbackTo
from changefeed.protocol.dcp import OpenFlag, StreamRequest
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.shm_rows import RowCollector

log = logging.getLogger("changefeed.shm")

SEQNO_FOREVER: Final = 0xFFFF_FFFF_FFFF_FFFF
TICK_S: Final = 0.1  # an idle group looks for refused streams and persistence this often
# Free when unused: with no reader subscribed for IDLE_AFTER_S a group stops publishing (its
# streams and checkpoint cursors closed, no wakeup per change) and only moves the ring's head
# positions on to what is persisted, every REFRESH_S, with a gap batch (readers fetch those rows
# over DCP). The first subscriber restarts the streams from the head positions: no row is
# skipped, and the catch-up from memory or disk covers at most REFRESH_S of changes.
IDLE_AFTER_S: Final = 1.0
REFRESH_S: Final = 1.0
RETRY_S: Final = 1.0  # a refused (not active) vbucket is asked for again after this long
# Rows wait up to COALESCE_S to go out together (unless a batch's worth is ready): under a
# steady writer a flush round persists a few dozen rows every few ms, and each batch costs
# every reader a wakeup, a reference, an Arrow read and a position check whatever its size.
COALESCE_S: Final = 0.005
UUID, SEQNO, SNAP_START, SNAP_END, BEFORE = range(POSITION_FIELDS)


def groups_of(vbuckets: int, groups: int) -> list[tuple[int, ...]]:
    """`vbuckets` split into `groups` contiguous groups, as even as possible."""
    assert 1 <= groups <= vbuckets, (groups, vbuckets)
    bounds = [vbuckets * i // groups for i in range(groups + 1)]
    return [tuple(range(bounds[i], bounds[i + 1])) for i in range(groups)]


def service_name(bucket: str, port: int, index: int) -> str:
    """The service of group `index` of a node: ``<bucket>-<port>-g<index>``."""
    return f"{bucket}-{port}-g{index}"


class GroupPublisher:
    """One group: its provider, its in-process DCP producer and the task between them."""

    def __init__(
        self,
        bucket: Bucket,
        provider: Provider,
        *,
        persisted_only: bool,
        backfill_slots: BackfillSlots,
        rows_per_batch: int = limits.SHM_ROWS_PER_BATCH_MAX,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.bucket = bucket
        self.provider = provider
        self.group = provider.geometry.group
        self.persisted_only = persisted_only
        self.rows_per_batch = rows_per_batch
        self._loop_time = clock or asyncio.get_running_loop().time
        self._backfill_slots = backfill_slots
        self.producer = self._new_producer()
        self._index = np.full(limits.VBUCKETS_MAX, -1, np.int64)
        self._index[list(self.group)] = np.arange(len(self.group))
        self._positions = self._start_positions()
        self._streaming: set[int] = set()
        self._retry_at: dict[int, float] = {}
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._pending_since = 0.0  # when the oldest pending row came (COALESCE_S)
        self._rollback_queued = False  # a rollback row is pending
        # Persisted seqnos at the last look at the pending rows (None: pending rows came since):
        # while neither changes, the look is skipped (it polls every SHM_PERSIST_POLL_S).
        self._checked: NDArray[np.int64] | None = None
        self._work = asyncio.Event()
        for vb in self.group:
            bucket.wakeup(vb).add_callback(self._work.set)
        self._task: asyncio.Task[None] | None = None
        self.paused = False  # no reader: streams closed, nothing published per change
        self._unread_since: float | None = None  # when the last reader left (None: one is in)
        self._refreshed_at = 0.0
        self.stats = {
            "rows": 0,
            "batches": 0,
            "rollbacks": 0,
            "gaps": 0,
            "refused": 0,
            "pauses": 0,
            "resumes": 0,
            "refreshes": 0,
        }

    def _new_producer(self) -> DcpProducer:
        self._rows = RowCollector()
        return DcpProducer(
            f"shm:{self.provider.service}",
            OpenFlag.PRODUCER | OpenFlag.INCLUDE_DELETE_TIMES,
            source=self.bucket,
            backfill_slots=self._backfill_slots,
            encoder_factory=self._rows.encoder,
        )

    def _start_positions(self) -> NDArray[np.uint64]:
        """Where the ring ends (a reused ring), else each vbucket's high seqno now."""
        resumed = self.provider.resume_positions()
        if resumed is not None:
            log.info(
                "%s: resuming the ring after batch %d",
                self.provider.service,
                self.provider.head_seq,
            )
            return resumed.copy()
        positions = np.zeros((len(self.group), POSITION_FIELDS), np.uint64)
        for i, vb in enumerate(self.group):
            view = self.bucket.vbucket_view(vb)
            if view is not None:
                high = view.high_seqno
                positions[i] = (view.failover_log.latest[0], high, high, high, high)
        return positions

    def start(self) -> None:
        if self.provider.head_seq == 0:
            # A fresh ring starts with an empty batch that carries the start positions, so a
            # reader knows where the ring begins before any row is published.
            self.provider.publish(ChangeRows().to_batch(), self._positions)
        loop = asyncio.get_running_loop()
        loop.add_reader(self.provider.control_fileno(), self.provider.handle_control)
        self._task = loop.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self.provider.control_fileno())
        if not self.paused:
            for vb in self.group:
                with contextlib.suppress(ValueError):
                    self.bucket.wakeup(vb).remove_callback(self._work.set)
            # What is persisted by now goes out; the rest is read again after a restart.
            with contextlib.suppress(Exception):
                self._publish_ready(now=True)
        self.producer.close()
        self.provider.stop_offer()

    async def _run(self) -> None:
        try:
            while True:  # the group's publishing loop; cancelled by stop()
                self._work.clear()
                self.provider.maintain()  # dead readers reclaimed (every RECLAIM_INTERVAL_S)
                if self._idle():
                    await asyncio.sleep(TICK_S)  # nothing per change: a look every tick
                    continue
                self._request_streams()
                produced = self._pump() if self._pending_rows < limits.SHM_PENDING_ROWS_MAX else 0
                published = self._publish_ready()
                if produced >= limits.PUMP_BYTES_MAX or published >= self.rows_per_batch:
                    await asyncio.sleep(0)  # more is waiting: no pause
                    continue
                if self._pending_rows:
                    # Rows are gathering: the next round comes when they may go out (COALESCE_S)
                    # or may be persisted, not per change (a round costs ~100 us whatever it
                    # takes, and a steady writer would wake it per write).
                    age = self._loop_time() - self._pending_since
                    await asyncio.sleep(max(COALESCE_S - age, limits.SHM_PERSIST_POLL_S))
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._work.wait(), TICK_S)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("shm publisher of %s failed", self.provider.service)

    # -- free when unused -----------------------------------------------------------------------

    def _idle(self) -> bool:
        """Pause, resume or refresh by the subscriber count; True while paused."""
        now = self._loop_time()
        readers = self.provider.subscription()[0]
        if readers:
            self._unread_since = None
            if self.paused:
                self._resume()
            return False
        if self._unread_since is None:
            self._unread_since = now
        if not self.paused and now - self._unread_since >= IDLE_AFTER_S:
            self._pause()
        if self.paused and now - self._refreshed_at >= REFRESH_S:
            self._refreshed_at = now
            self._refresh()
        return self.paused

    def _pause(self) -> None:
        """No reader: publish what is ready, close the streams (their cursors go), stop being
        woken per change. The ring ends at the positions of its newest batch."""
        with contextlib.suppress(Exception):
            self._publish_ready(now=True)
        for vb in self.group:
            with contextlib.suppress(ValueError):
                self.bucket.wakeup(vb).remove_callback(self._work.set)
        self.producer.close()
        self.producer = self._new_producer()
        self._streaming.clear()
        self._retry_at.clear()
        self._pending = []
        self._pending_rows = 0
        self.paused = True
        self.stats["pauses"] += 1
        log.info("%s: no reader; publishing paused", self.provider.service)

    def _resume(self) -> None:
        """A reader subscribed: stream again from the ring's head positions."""
        assert self.paused
        for vb in self.group:
            self.bucket.wakeup(vb).add_callback(self._work.set)
        self.paused = False
        self.stats["resumes"] += 1
        self._work.set()
        log.info("%s: a reader subscribed; publishing resumed", self.provider.service)

    def _refresh(self) -> None:
        """While paused: move the head positions on to what each active vbucket persisted (the
        high seqno without persisted-only), as a gap batch: a reader that wants those rows
        fetches them over DCP (`LostDataError`; `LocalStream` does it), and a reader from "now"
        starts at most REFRESH_S behind. A vbucket whose branch changed, or that went back, is
        left for the resumed stream request to settle (a rollback row)."""
        positions = self._positions.copy()
        moved = False
        for i, vb in enumerate(self.group):
            view = self.bucket.vbucket_view(vb)
            if view is None or not view.state.is_active:
                continue
            target = view.persisted_seqno if self.persisted_only else view.high_seqno
            if view.failover_log.latest[0] != int(positions[i, UUID]):
                continue
            if target > int(positions[i, SEQNO]):
                positions[i, BEFORE] = positions[i, SEQNO]
                positions[i, SEQNO:BEFORE] = target
                moved = True
        if not moved:
            return
        unmoved = positions[:, SEQNO] == self._positions[:, SEQNO]
        positions[unmoved, BEFORE] = positions[unmoved, SEQNO]
        self._positions = positions
        self.provider.publish_gap(positions)
        self.stats["refreshes"] += 1

    # -- streams --------------------------------------------------------------------------------

    def _request_streams(self) -> None:
        now = self._loop_time()
        for i, vb in enumerate(self.group):
            if vb in self._streaming or self._retry_at.get(vb, 0.0) > now:
                continue
            uuid, seqno, snap_start, snap_end, _ = (int(v) for v in self._positions[i])
            if not snap_start <= seqno <= snap_end:
                snap_start = snap_end = seqno
            request = StreamRequest(vb, vb, 0, seqno, SEQNO_FOREVER, uuid, snap_start, snap_end)
            outcome = self.producer.stream_request(request)
            if isinstance(outcome, Accepted):
                self._streaming.add(vb)
                self._positions[i, UUID] = outcome.vb_uuid
                self._work.set()
            elif isinstance(outcome, RollbackTo):
                self._roll_back(i, vb, outcome.seqno)
            else:
                assert isinstance(outcome, Refused), outcome
                self.stats["refused"] += 1
                self._retry_at[vb] = now + RETRY_S
                log.debug("%s vb %d: %s", self.provider.service, vb, outcome.message)

    def _roll_back(self, index: int, vb: int, seqno: int) -> None:
        """The node cannot continue vb from our position: void our rows after a consistent
        point at or below `seqno` (a snapshot end we published whole), then ask again there."""
        _, at, snap_start, snap_end, _ = (int(v) for v in self._positions[index])
        point = at if at == snap_end else max(snap_start - 1, 0)
        if point > seqno:
            point = 0  # no whole snapshot of ours is known at or below it
        log.warning("%s vb %d: rolling back from %d to %d", self.provider.service, vb, at, point)
        self._drop_pending(vb, point)
        rows = ChangeRows()
        rows.append_rollback(vb, point)
        self._pending.append(rows.to_batch())
        self._pending_rows += 1
        self._rollback_queued = True
        self._checked = None
        # Asked again from `point` on the same branch: common history up to there.
        self._positions[index, SEQNO:BEFORE] = point
        self.stats["rollbacks"] += 1

    def _drop_pending(self, vb: int, seqno: int) -> None:
        kept = []
        for batch in self._pending:
            vbs = batch.column("vbucket").to_numpy()
            seqnos = batch.column("seqno").to_numpy()
            keep = (vbs != vb) | (seqnos <= seqno)
            kept.append(batch if keep.all() else batch.filter(pa.array(keep)))
        self._pending = [b for b in kept if b.num_rows]
        self._pending_rows = sum(b.num_rows for b in self._pending)

    # -- items -> rows --------------------------------------------------------------------------

    def _pump(self) -> int:
        """Take what the streams have as pending rows (`RowCollector`: built straight from the
        items, once for every reader); returns the producer's units (0: nothing)."""
        written = self.producer.pump([], limits.PUMP_BYTES_MAX)
        collector = self._rows
        for vb, reason in collector.ended:
            log.info("%s vb %d: stream ended (%s); asking again", self.provider.service, vb, reason)
            self._streaming.discard(vb)
            self._retry_at[vb] = self._loop_time() + RETRY_S
        collector.ended.clear()
        batch = collector.take()
        if batch is not None:
            if not self._pending:
                self._pending_since = self._loop_time()
            self._pending.append(batch)
            self._pending_rows += batch.num_rows
            self._checked = None
        return written

    # -- rows -> batches -------------------------------------------------------------------------

    def _publish_ready(self, *, now: bool = False) -> int:
        """Publish the pending rows that may go (persisted ones, or all) once a batch's worth is
        pending or the oldest waited COALESCE_S (`now`: at once); returns rows sent."""
        if not self._pending:
            return 0
        if (
            not now
            and self._pending_rows < self.rows_per_batch
            and self._loop_time() - self._pending_since < COALESCE_S
        ):
            return 0
        persisted = None
        if self.persisted_only:
            persisted = np.array([self.bucket.vbucket(vb).persisted_seqno for vb in self.group])
            if self._checked is not None and np.array_equal(persisted, self._checked):
                return 0  # nothing persisted and nothing pending since the last look
            self._checked = persisted
        # Rows go out in the order they were read, up to the first one not persisted yet (per
        # vbucket persistence is in seqno order, so that holds back only a flush round's worth
        # of other vbuckets' rows): slices, no Arrow filter and no copy of what stays.
        ready_parts: list[pa.RecordBatch] = []
        kept: list[pa.RecordBatch] = []
        for batch in self._pending:
            if kept or persisted is None:
                (kept if kept else ready_parts).append(batch)
                continue
            vbs = batch.column("vbucket").to_numpy()
            ready = batch.column("seqno").to_numpy() <= persisted[self._index[vbs]]
            if self._rollback_queued:  # a rollback row goes at once (it is no change)
                ready |= pc.equal(batch.column("op"), OP_ROLLBACK).to_numpy(zero_copy_only=False)
            first = int(np.argmin(ready)) if not ready.all() else batch.num_rows
            if first:
                ready_parts.append(batch.slice(0, first))
            if first < batch.num_rows:
                kept.append(batch.slice(first))
        self._pending = kept
        self._pending_rows = sum(b.num_rows for b in kept)
        if not kept:
            self._rollback_queued = False
        self._pending_since = self._loop_time()  # what stays waits for persistence, not this
        if not ready_parts:
            return 0
        batch = ready_parts[0] if len(ready_parts) == 1 else pa.concat_batches(ready_parts)
        rows = int(batch.num_rows)
        for start in range(0, rows, self.rows_per_batch):
            self._publish(batch.slice(start, self.rows_per_batch))
        self.stats["rows"] += rows
        return rows

    def _publish(self, batch: pa.RecordBatch) -> None:
        """One batch into one slot: split while too large; a row too large is a gap."""
        if pa.ipc.get_record_batch_size(batch) > self.provider.payload_bytes:
            if batch.num_rows > 1:
                half = batch.num_rows // 2
                self._publish(batch.slice(0, half))
                self._publish(batch.slice(half))
                return
            self._advance(batch)
            self.provider.publish_gap(self._positions)
            self.stats["gaps"] += 1
            return
        self._advance(batch)
        self.provider.publish(batch, self._positions)
        self.stats["batches"] += 1

    def _advance(self, batch: pa.RecordBatch) -> None:
        """Positions after `batch`: each vbucket's last row (seqno and snapshot)."""
        positions = self._positions
        positions[:, BEFORE] = positions[:, SEQNO]
        index = self._index[batch.column("vbucket").to_numpy()]
        _, from_end = np.unique(index[::-1], return_index=True)
        last = len(index) - 1 - from_end
        rows = index[last]
        positions[rows, SEQNO] = batch.column("seqno").to_numpy()[last]
        positions[rows, SNAP_START] = batch.column("snap_start").to_numpy()[last]
        positions[rows, SNAP_END] = batch.column("snap_end").to_numpy()[last]


class ShmPublisher:
    """Every group of the node's bucket, published while the node runs.

    Args:
        bucket: the node's bucket.
        config: ``shm_*`` settings.
        port: the node's bound port (it names the services).
        backfill_slots: the node's bound on disk backfills.
    """

    def __init__(
        self, bucket: Bucket, config: NodeConfig, *, port: int, backfill_slots: BackfillSlots
    ) -> None:
        self.bucket = bucket
        self.config = config
        self.port = port
        self.backfill_slots = backfill_slots
        self.groups: list[GroupPublisher] = []

    def start(self) -> None:
        """Offer every group's service and start publishing.

        Raises:
            changefeed.ipc.ProviderExistsError: another live node offers one of them.
        """
        config = self.config
        for index, group in enumerate(groups_of(len(self.bucket.vbuckets), config.shm_groups)):
            geometry = Geometry(
                config.shm_slots, config.shm_slot_bytes, config.shm_max_subscribers, group
            )
            provider = Provider.offer(
                service_name(self.bucket.name, self.port, index),
                geometry,
                directory=config.shm_dir,
                bucket=self.bucket.name,
                node_port=self.port,
            )
            publisher = GroupPublisher(
                self.bucket,
                provider,
                persisted_only=config.shm_persisted_only,
                backfill_slots=self.backfill_slots,
            )
            publisher.start()
            self.groups.append(publisher)

    async def stop(self) -> None:
        for publisher in self.groups:
            await publisher.stop()
        self.groups.clear()

    def register_stats(
        self, stat_providers: dict[str, Callable[[], Iterable[tuple[str, str]]]]
    ) -> None:
        """Serve STAT ``shm`` from `stat_providers` (the node's ``context.stat_providers``)."""
        stat_providers["shm"] = self.stat_lines

    def stat_lines(self) -> Iterator[tuple[str, str]]:
        """STAT ``shm``: per service ``<service>:<figure>`` (`changefeed.ipc.stats`: slots by
        state, readers attached/stalled/behind/dead/reclaimed, batches and rows published, the
        oldest unread batch's age, bytes mapped), then ``<service>:publisher_<counter>``."""
        for publisher in self.groups:
            service = publisher.provider.service
            for name, value in publisher.provider.service_stats().items():
                yield f"{service}:{name}", _stat_value(value)
            for counter, count in publisher.stats.items():
                yield f"{service}:publisher_{counter}", str(count)

    def metric_families(self) -> Iterator[GaugeMetricFamily]:
        """The same figures for ``/metrics``: ``changefeed_shm_<figure>{service=...}``."""
        figures = [(p.provider.service, p.provider.service_stats()) for p in self.groups]
        if not figures:
            return
        for name in figures[0][1]:
            family = GaugeMetricFamily(
                f"changefeed_shm_{name}", _METRIC_HELP.get(name, name), labels=["service"]
            )
            for service, values in figures:
                family.add_metric([service], values[name])
            yield family

    def stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for publisher in self.groups:
            for key, value in publisher.stats.items():
                total[key] = total.get(key, 0) + value
            total["subscribers"] = (
                total.get("subscribers", 0) + publisher.provider.subscription()[0]
            )
        return total


def _stat_value(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3f}"


_METRIC_HELP = {
    "slots_empty": "Ring slots holding no batch.",
    "slots_in_writing": "Ring slots the provider is writing.",
    "slots_ready": "Ring slots holding a batch no reader references.",
    "slots_referenced": "Ring slots holding a batch readers reference.",
    "readers_attached": "Local readers subscribed.",
    "readers_stalled": "Readers whose next batch has waited in the ring over 1 s.",
    "readers_behind": "Readers whose next batch left the ring (they catch up over DCP).",
    "readers_dead": "Logs of dead reader processes not reclaimed yet.",
    "logs_quarantined": "Transaction logs quarantined (a reader died mid-transaction).",
    "readers_lost_total": "Times the attached readers fell behind the ring.",
    "oldest_unread_age_s": "Age of the oldest batch a reader has yet to take, in seconds.",
    "head_seq": "Seq of the newest batch in the ring.",
    "bytes_mapped": "Bytes of the service's shared-memory segments.",
    "batches_published_total": "Batches published since the node started.",
    "rows_published_total": "Change rows published since the node started.",
    "gaps_total": "Gap batches published (rows larger than a slot).",
    "readers_reclaimed_total": "Dead readers whose logs the node rolled back.",
    "slots_reclaimed_total": "Slot references given back by reclaiming dead readers.",
}
