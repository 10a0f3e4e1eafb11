"""A replica pulling its vbuckets from their active node: Kafka's follower fetch, over DCP.

One `ReplicaFeed` per active node this node replicates from: one DCP connection (role REPLICA,
``consumer_name`` = this node), one stream per replica vbucket, each requested from the
vbucket's own state — its high seqno, the snapshot it is in and its failover log. Steady
state and catch-up after downtime are the same request: the active streams from memory when
it still holds the range and backfills from disk when it does not.

Rules (seed follower-catch-up.md, dcp-rollback.md, replication-anchors.md §1.3):
- ROLLBACK(S) truncates the vbucket *before* anything past S is taken (KAFKA-14704), then the
  stream is requested again from where the vbucket really ends (the store may have had to go
  back to 0: Store.rollback) — never from the seqno the active named, which would leave a gap.
- A successful stream request hands over the active's failover log: the replica's history is
  its active's, so that after a promotion consumers roll back exactly where history diverged.
- Items keep the active's seqno and CAS (`VBucket.queue_replicated`) inside the snapshot the
  marker announced; the flusher persists the snapshot ranges, so after a crash the replica
  asks for the rest of a snapshot it held only partly.
- Received and persisted seqnos are acknowledged (DCP_SEQNO_ACKNOWLEDGED) every
  `ack_interval_s` while they move; the active decides the in-sync set from them.
- SyncWrites: DCP_PREPARE, DCP_COMMIT and DCP_ABORT are taken in wire order like any item
  (the vbucket keeps prepares pending; a commit makes the pending prepare's document the
  committed one); a disk backfill sends a commit as the document itself. A batch that held a
  prepare is acknowledged at once, not at the next tick: the active's durable writes wait on
  these acknowledgements.
- When checkpoint memory is full, the rest of a batch waits and the socket stops being read:
  the active's flow-control window fills and it stops sending (bounded memory both sides).

The feed runs until cancelled, reconnecting with backoff when the connection drops; a refused
stream (the active has not applied the new map yet) is requested again after a pause.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import itertools
import logging
from collections import deque
from typing import Final

import numpy as np

from changefeed.checkpoint import CheckpointMemoryFullError, Item, SyncItem
from changefeed.consumer.connection import Connection, ConnectionClosedError
from changefeed.consumer.handshake import connect
from changefeed.protocol.batch import Batch, ChangeColumns
from changefeed.protocol.dcp import (
    DcpControl,
    DcpOpen,
    OpenFlag,
    SeqnoAcknowledged,
    StreamFlag,
    StreamRequest,
    StreamRole,
    decode_failover_log,
    decode_rollback_seqno,
    decode_stream_end,
    encode_buffer_ack,
    encode_dcp_control,
    encode_dcp_open,
    encode_seqno_acknowledged,
    encode_stream_request,
)
from changefeed.protocol.dcp_items import (
    MUTATION_EXTRAS,
    Commit,
    Prepare,
    decode_abort,
    decode_commit,
    decode_prepare,
)
from changefeed.protocol.errors import ProtocolError, StatusError, error_for_status
from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.opcode import Feature, Magic, Opcode
from changefeed.protocol.snapshot_marker import MarkerFlag, decode_snapshot_marker
from changefeed.protocol.status import Status
from changefeed.server.bucket import Bucket
from changefeed.storage import Op
from changefeed.vbmap import NodeAddress

log = logging.getLogger("changefeed.replication")

SEQNO_FOREVER: Final = 0xFFFF_FFFF_FFFF_FFFF
_MUTATION: Final = Op.MUTATION
_OPCODE_MUTATION: Final = int(Opcode.DCP_MUTATION)
_MUTATION_BODY_EXTRAS: Final = MUTATION_EXTRAS.size  # a DCP_MUTATION body's extras
_OP_OF_OPCODE: Final = {
    Opcode.DCP_MUTATION: Op.MUTATION,
    Opcode.DCP_DELETION: Op.DELETION,
    Opcode.DCP_EXPIRATION: Op.EXPIRATION,
}


@dataclasses.dataclass(frozen=True, slots=True)
class FeedOptions:
    """How a replica connects to its active.

    Attributes:
        node_name: this node's name (the active tracks the replica by it).
        bucket: the bucket to select.
        user, password: credentials every node of the cluster accepts.
        buffer_bytes: the DCP flow-control window.
        noop_interval_s: the active's noop interval (a dead replica is noticed this way).
        ack_interval_s: how often received/persisted seqnos are acknowledged while they move.
        retry_s: pause before requesting a refused or ended stream again.
        reconnect_backoff_s: pauses between reconnect attempts (the last one repeats).
    """

    node_name: str
    bucket: str = "default"
    user: str = "Administrator"
    password: str = "password"
    buffer_bytes: int = 8 * 1024 * 1024
    noop_interval_s: float = 5.0
    ack_interval_s: float = 0.05
    retry_s: float = 0.25
    reconnect_backoff_s: tuple[float, ...] = (0.1, 0.2, 0.5, 1.0, 2.0)


@dataclasses.dataclass(slots=True)
class FeedStats:
    """What one feed has done (cluster status, /metrics, tests)."""

    connects: int = 0
    items: int = 0
    bytes: int = 0
    rollbacks: int = 0
    full_rebuilds: int = 0  # rollbacks the store could only do to 0
    refusals: int = 0


class ReplicaFeed:
    """Feeds this node's replica vbuckets `vbuckets` from their active `source`.

    Args:
        bucket: this node's bucket (the replica vbuckets live there).
        source: the active node.
        vbuckets: the replica vbuckets whose active `source` is.
        options: connection settings.
    """

    def __init__(
        self, bucket: Bucket, source: NodeAddress, vbuckets: set[int], options: FeedOptions
    ) -> None:
        assert vbuckets, source
        self.bucket = bucket
        self.source = source
        self.vbuckets = frozenset(vbuckets)
        self.options = options
        self.stats = FeedStats()
        self._conn: Connection | None = None
        self._opaque_vb: dict[int, int] = {}
        self._streaming: set[int] = set()
        self._retry_at: dict[int, float] = {}
        self._acked: dict[int, tuple[int, int]] = {}
        self._unacked_bytes = 0
        # (vbucket, item) waiting for checkpoint memory, in wire order (a run may hold
        # several vbuckets: each item keeps its own).
        self._backlog: deque[tuple[int, Item | Commit]] = deque()
        self._failure: BaseException | None = None
        self._prepared = False  # the batch being taken held a prepare: acknowledge at once

    @property
    def name(self) -> str:
        """The DCP connection name (unique per replica/active pair)."""
        return f"replication:{self.source.name}->{self.options.node_name}:{self.options.bucket}"

    async def run(self) -> None:
        """Stream until cancelled; reconnect with backoff when the connection drops."""
        backoff = self.options.reconnect_backoff_s
        attempt = 0
        while True:  # the feed's life; ended by cancellation
            try:
                await self._session()
                attempt = 0
            except (OSError, TimeoutError, ConnectionClosedError, ProtocolError) as error:
                log.info("replica feed %s: %s; reconnecting", self.name, error)
            except StatusError as error:
                log.warning("replica feed %s refused: %s; retrying", self.name, error)
            finally:
                await self._close()
            await asyncio.sleep(backoff[min(attempt, len(backoff) - 1)])
            attempt += 1

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        self._streaming.clear()
        self._opaque_vb.clear()
        self._backlog.clear()
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _session(self) -> None:
        opts = self.options
        conn = await connect(
            self.source.host, self.source.port, agent=self.name, user=opts.user,
            password=opts.password, bucket=opts.bucket,
            features=[Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON],
        )  # fmt: skip
        self._conn = conn
        self._failure = None
        self.stats.connects += 1
        opaque = conn.next_opaque()
        flags = OpenFlag.PRODUCER | OpenFlag.INCLUDE_DELETE_TIMES
        message = DcpOpen(opaque, self.name, flags, opts.node_name, StreamRole.REPLICA)
        await _expect_ok(conn, encode_dcp_open(message), opaque)
        for key, value in (
            ("enable_noop", "true"),
            ("set_noop_interval", f"{opts.noop_interval_s:g}"),
            ("connection_buffer_size", str(opts.buffer_bytes)),
            ("enable_expiry_opcode", "true"),
        ):
            opaque = conn.next_opaque()
            await _expect_ok(conn, encode_dcp_control(DcpControl(opaque, key, value)), opaque)
        self._unacked_bytes = 0
        conn.on_push = self._on_push
        closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_close(error: ConnectionClosedError) -> None:
            if not closed.done():
                closed.set_exception(error)
                # Retrieved here: the loop below raises it with closed.result(), unless the
                # session is cancelled first (the node stops), when nobody else would.
                closed.exception()

        conn.on_close = on_close
        for vb in sorted(self.vbuckets):
            self._request(vb)
        while not closed.done():  # ticks: acks, retries, backlog; ends with the connection
            await asyncio.wait([closed], timeout=opts.ack_interval_s)
            if self._failure is not None:
                raise self._failure
            self._drain_backlog()
            self._send_acks()
            self._retry_due()
        closed.result()

    # -- requests -------------------------------------------------------------------------------

    def _request(self, vb: int) -> None:
        """Ask for everything after what the vbucket holds, presenting the snapshot it is in
        and its history (the active answers with a stream or a rollback point)."""
        conn = self._conn
        assert conn is not None
        vbucket = self.bucket.vbucket(vb)
        start, snap_start, snap_end = vbucket.replica_request_range()
        opaque = conn.next_opaque()
        self._opaque_vb[opaque] = vb
        self._retry_at.pop(vb, None)
        # ACTIVE_VB_ONLY: a node that is no longer the vbucket's active refuses, and the
        # replica asks where the map points next, instead of copying a copy.
        flags = StreamFlag.ACTIVE_VB_ONLY
        request = StreamRequest(
            vb, opaque, flags, start, SEQNO_FOREVER, vbucket.vb_uuid, snap_start, snap_end, {}
        )
        if vbucket.purge_seqno:
            request = dataclasses.replace(request, value={"purge_seqno": str(vbucket.purge_seqno)})
        conn.send(encode_stream_request(request))

    def _retry_later(self, vb: int) -> None:
        self._streaming.discard(vb)
        self._retry_at[vb] = asyncio.get_running_loop().time() + self.options.retry_s

    def _retry_due(self) -> None:
        now = asyncio.get_running_loop().time()
        for vb, due in list(self._retry_at.items()):
            if due <= now and self._conn is not None:
                self._request(vb)

    # -- the reader task's side -----------------------------------------------------------------

    def _on_push(self, batch: Batch) -> None:
        """In wire order: data runs between control frames (markers, stream responses)."""
        try:
            changes = batch.changes
            done = 0
            view = _BatchView(changes) if len(changes) else None
            for position, frame in batch.controls:
                if position > done:
                    assert view is not None, position
                    self._apply(view, done, position)
                    done = position
                self._on_control(frame)
            if len(changes) > done:
                assert view is not None, done
                self._apply(view, done, len(changes))
            self._ack_bytes(batch.item_bytes)
            if self._prepared:
                self._prepared = False
                self._send_acks()
        except (StatusError, ProtocolError, ValueError) as error:
            # Bad data from the active: stop this connection (the next one starts from what
            # the vbuckets really hold) rather than take anything doubtful.
            self._fail(error)
        except Exception as error:  # a bug here must not leave the feed silently stuck
            log.exception("replica feed %s failed on a batch", self.name)
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        if self._conn is not None:
            self._conn.pause_reading()

    def _apply(self, view: _BatchView, start: int, stop: int) -> None:
        """Queue received changes `start`..`stop` of the batch per vbucket run. A mutation's
        frame body is the stored body (extras | key | value, the layout the store keeps), so
        its item takes that slice as is; tombstones are rare and encoded again."""
        columns = view.columns
        data = columns.data
        opcodes, seqnos, keys = columns.opcode, columns.seqno, columns.key
        key_start, value_end = view.key_start, view.value_end
        cas, flags, expiry = columns.cas, columns.flags, columns.expiry
        datatype, rev, delete_time = columns.datatype, columns.rev_seqno, columns.delete_time
        of_body, mutation, extras = Item.of_body, _OPCODE_MUTATION, _MUTATION_BODY_EXTRAS
        vbs = columns.vbucket
        for first, last in itertools.pairwise(view.runs(start, stop)):  # one vbucket's run each
            items = [
                of_body(
                    seqnos[i], keys[i], _MUTATION, data[key_start[i] - extras : value_end[i]],
                    cas[i], flags[i], expiry[i], datatype[i], rev[i], 0,
                )
                if opcodes[i] == mutation
                else Item(
                    seqnos[i], keys[i], _OP_OF_OPCODE[Opcode(opcodes[i])], columns.value[i],
                    cas[i], flags[i], expiry[i], datatype[i], rev[i], delete_time[i],
                )
                for i in range(first, last)
            ]  # fmt: skip
            self._queue_run(vbs[first], items)
        self.stats.items += stop - start

    def _queue_run(self, vb: int, items: list[Item]) -> None:
        if not self._backlog:
            try:
                taken = self.bucket.vbucket(vb).queue_replicated_run(items)
            except CheckpointMemoryFullError:
                taken = 0
            if taken == len(items):
                return
            items = items[taken:]
            if self._conn is not None:  # wait for the flusher to free memory
                self._conn.pause_reading()
        self._backlog.extend((vb, item) for item in items)

    def _queue(self, vb: int, item: Item | Commit) -> None:
        if self._backlog:
            self._backlog.append((vb, item))
            return
        try:
            self._take(vb, item)
        except CheckpointMemoryFullError:
            # Wait for the flusher to free memory; stop reading until the backlog is in.
            self._backlog.append((vb, item))
            if self._conn is not None:
                self._conn.pause_reading()

    def _drain_backlog(self) -> None:
        while self._backlog:
            vb, item = self._backlog[0]
            try:
                self._take(vb, item)
            except CheckpointMemoryFullError:
                return
            self._backlog.popleft()
        if self._conn is not None:
            self._conn.resume_reading()

    def _take(self, vb: int, item: Item | Commit) -> None:
        vbucket = self.bucket.vbucket(vb)
        if isinstance(item, Commit):
            vbucket.replica_commit(item.key, item.prepared_seqno, item.commit_seqno)
        else:
            vbucket.queue_replicated(item)

    def _on_control(self, frame: Frame) -> None:
        opcode = frame.opcode
        if frame.magic in (Magic.RESPONSE, Magic.ALT_RESPONSE):
            if opcode == Opcode.DCP_STREAM_REQ:
                self._on_stream_response(frame)
            return
        if opcode == Opcode.DCP_NOOP:
            self._send(encode_response(frame))
            return
        self._ack_bytes(frame.wire_size)
        if opcode == Opcode.DCP_SNAPSHOT_MARKER:
            marker = decode_snapshot_marker(frame)
            self._settle_backlog()
            self.bucket.vbucket(frame.vbucket).replica_snapshot(marker.snap_start, marker.snap_end)
            if marker.flags & MarkerFlag.ACK:
                self._send(encode_response(frame))
        elif opcode == Opcode.DCP_STREAM_END:
            reason = decode_stream_end(frame).reason
            log.info(
                "replica stream vb %d from %s ended: %s",
                frame.vbucket,
                self.source.name,
                reason.name,
            )
            self._retry_later(frame.vbucket)
        elif opcode == Opcode.DCP_SET_VBUCKET_STATE:
            self._send(encode_response(frame))
        elif opcode == Opcode.DCP_PREPARE:
            self._queue(frame.vbucket, _prepare_item(decode_prepare(frame)))
            self._prepared = True
            self.stats.items += 1
        elif opcode == Opcode.DCP_COMMIT:
            self._queue(frame.vbucket, decode_commit(frame))
            self.stats.items += 1
        elif opcode == Opcode.DCP_ABORT:
            abort = decode_abort(frame)
            item = SyncItem(
                abort.abort_seqno, abort.key, Op.ABORT, Op.DELETION, b"", 1,
                prepared_seqno=abort.prepared_seqno,
            )  # fmt: skip
            self._queue(frame.vbucket, item)
            self.stats.items += 1

    def _settle_backlog(self) -> None:
        """A marker must not overtake items still waiting for memory: take them first."""
        if self._backlog:
            self._drain_backlog()
        if self._backlog:
            raise ProtocolError(
                "checkpoint memory full across a snapshot boundary", Status.ETMPFAIL
            )

    def _on_stream_response(self, frame: Frame) -> None:
        vb = self._opaque_vb.pop(frame.opaque, None)
        if vb is None or vb not in self.vbuckets:
            return
        vbucket = self.bucket.vbucket(vb)
        if frame.status == Status.SUCCESS:
            vbucket.adopt_failover_log(decode_failover_log(frame.value))
            self._streaming.add(vb)
        elif frame.status == Status.ROLLBACK:
            seqno = decode_rollback_seqno(frame.value)
            self._settle_backlog()
            point = vbucket.rollback(seqno)
            self.stats.rollbacks += 1
            if point < seqno:
                self.stats.full_rebuilds += 1
            log.warning(
                "replica vb %d rolled back to %d (active %s asked for %d)",
                vb, point, self.source.name, seqno,
            )  # fmt: skip
            self._acked.pop(vb, None)
            self._request(vb)
        else:
            self.stats.refusals += 1
            log.info(
                "replica stream vb %d refused by %s: %s %s", vb, self.source.name,
                _status_name(frame.status),
                frame.value[:200].decode(errors="replace"),
            )  # fmt: skip
            self._retry_later(vb)

    def _send_acks(self) -> None:
        if self._conn is None:
            return
        for vb in self._streaming:
            vbucket = self.bucket.vbucket(vb)
            now = (vbucket.high_seqno, vbucket.persisted_seqno)
            if self._acked.get(vb) != now:
                ack = SeqnoAcknowledged(vb, 0, now[0], now[1])
                self._send(encode_seqno_acknowledged(ack))
                self._acked[vb] = now

    def _ack_bytes(self, nbytes: int) -> None:
        self.stats.bytes += nbytes
        self._unacked_bytes += nbytes
        if self._unacked_bytes >= self.options.buffer_bytes // 5:
            self._send(encode_buffer_ack(self._unacked_bytes))
            self._unacked_bytes = 0

    def _send(self, data: bytes) -> None:
        if self._conn is not None:
            with contextlib.suppress(ConnectionClosedError):
                self._conn.send(data)


def _prepare_item(p: Prepare) -> SyncItem:
    return SyncItem(
        p.seqno, p.key, Op.PREPARE, Op.DELETION if p.deleted else Op.MUTATION, p.value, p.cas,
        p.flags, p.expiry, p.datatype, p.rev_seqno, p.delete_time, level=p.level,
    )  # fmt: skip


async def _expect_ok(conn: Connection, data: bytes, opaque: int) -> Frame:
    response = await conn.request(data, opaque)
    if response.status != Status.SUCCESS:
        raise error_for_status(response.status, response.value.decode(errors="replace"))
    return response


__all__ = ["FeedOptions", "FeedStats", "ReplicaFeed"]


def _status_name(status: int) -> str:
    try:
        return Status(status).name
    except ValueError:
        return f"0x{status:x}"


class _BatchView:
    """What `_apply` reads of one received batch, converted once per batch: the batch's
    columns as lists (ChangeColumns keeps them) and where the vbucket changes. A batch is
    cut at every control frame (a marker per vbucket run in steady state); slicing the
    columns per cut cost ~10 us each, this costs a bisect."""

    __slots__ = ("_cuts", "columns", "key_start", "value_end")

    def __init__(self, columns: ChangeColumns) -> None:
        self.columns = columns
        self.key_start: list[int] = columns.array("key_start").tolist()
        self.value_end: list[int] = columns.array("value_end").tolist()
        vbs = columns.array("vbucket")
        self._cuts: list[int] = (np.flatnonzero(vbs[1:] != vbs[:-1]) + 1).tolist()

    def runs(self, start: int, stop: int) -> list[int]:
        """The bounds of the single-vbucket runs of changes `start`..`stop`."""
        cuts = self._cuts
        inside = cuts[bisect.bisect_right(cuts, start) : bisect.bisect_left(cuts, stop)]
        return [start, *inside, stop]
