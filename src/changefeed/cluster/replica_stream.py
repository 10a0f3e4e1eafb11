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

Nodes with a cluster CA (`FeedOptions.tls`) dial the active's TLS port and authenticate by this
node's certificate, with no SASL; otherwise the plain port and the shared password
(docs/operations.md, "Nodes authenticate to each other by certificate").
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import itertools
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Final, Protocol

import numpy as np

from changefeed.checkpoint import CheckpointMemoryFullError, Item, SyncItem
from changefeed.consumer.connection import Connection, ConnectionClosedError
from changefeed.consumer.dcp_node_stream import open_session
from changefeed.consumer.dcp_session import (
    DcpSession,
    MarkerReceived,
    Run,
    StreamAnswered,
    StreamEnded,
    SyncFrame,
    SyncRun,
)
from changefeed.consumer.handshake import connect
from changefeed.protocol.batch import Batch, ChangeColumns
from changefeed.protocol.dcp import (
    SeqnoAcknowledged,
    StreamFlag,
    StreamRequest,
    StreamRole,
    decode_failover_log,
    decode_rollback_seqno,
    encode_seqno_acknowledged,
)
from changefeed.protocol.dcp_items import (
    MUTATION_EXTRAS,
    Commit,
    Prepare,
    decode_abort,
    decode_commit,
    decode_prepare,
)
from changefeed.protocol.errors import ProtocolError, StatusError
from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.protocol.snapshot_marker import SnapshotMarker
from changefeed.protocol.status import Status
from changefeed.protocol.sync_columns import OP_PREPARE, SyncColumns
from changefeed.storage import Op
from changefeed.vbmap import NodeAddress
from changefeed.vbucket import ReplicatedColumns

log = logging.getLogger("changefeed.replication")

SEQNO_FOREVER: Final = 0xFFFF_FFFF_FFFF_FFFF
_MUTATION: Final = Op.MUTATION
_OPCODE_MUTATION: Final = int(Opcode.DCP_MUTATION)
_MUTATION_BODY_EXTRAS: Final = MUTATION_EXTRAS.size  # a DCP_MUTATION body's extras
_SYNC_RUN_OPCODES: Final = frozenset((int(Opcode.DCP_PREPARE), int(Opcode.DCP_COMMIT)))
_OP_OF_OPCODE: Final = {
    Opcode.DCP_MUTATION: Op.MUTATION,
    Opcode.DCP_DELETION: Op.DELETION,
    Opcode.DCP_EXPIRATION: Op.EXPIRATION,
}


class ReplicaVBucket(Protocol):
    """What a feed needs of one replica vbucket (the replica role of `vbucket.VBucket`)."""

    @property
    def vb_uuid(self) -> int: ...

    @property
    def purge_seqno(self) -> int: ...

    @property
    def high_seqno(self) -> int: ...

    @property
    def persisted_seqno(self) -> int: ...

    def replica_request_range(self) -> tuple[int, int, int]: ...

    def adopt_failover_log(self, entries: list[tuple[int, int]]) -> None: ...

    def rollback(self, seqno: int) -> int: ...

    def replica_snapshot(self, snap_start: int, snap_end: int) -> None: ...

    def queue_replicated(self, item: Item) -> None: ...

    def queue_replicated_run(self, items: Sequence[Item]) -> int: ...

    def queue_replicated_columns(self, run: ReplicatedColumns) -> int: ...

    def replica_commit(self, key: bytes, prepared_seqno: int, commit_seqno: int) -> None: ...

    def queue_replicated_prepares(self, prepares: Sequence[SyncItem]) -> int: ...

    def replica_commit_many(self, commits: Sequence[tuple[bytes, int, int]]) -> int: ...


class FeedLink(Protocol):
    """What a feed needs of its connection (`consumer.connection.Connection` has it; the
    cluster simulator gives a simulated one)."""

    def next_opaque(self) -> int: ...

    def send(self, data: bytes) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class ReplicaVBuckets(Protocol):
    """Where a feed finds its vbuckets and hears of persistence (the node's bucket)."""

    @property
    def persisted_listeners(self) -> list[Callable[[list[int]], None]]: ...

    def vbucket(self, vb: int) -> ReplicaVBucket: ...


@dataclasses.dataclass(frozen=True, slots=True)
class FeedOptions:
    """How a replica connects to its active.

    Attributes:
        node_name: this node's name (the active tracks the replica by it).
        bucket: the bucket to select.
        user, password: credentials every node of the cluster accepts.
        buffer_bytes: the DCP flow-control window.
        noop_interval_s: the active's noop interval (a dead replica is noticed this way).
        silence_max_s: a link that brought nothing — no data, no noop — for this long is
            dropped and dialled again (a partition's silent drops leave a TCP connection
            that looks open on both ends; the active's noops make silence impossible on a
            live one). 0: three noop intervals.
        ack_interval_s: how often received/persisted seqnos are acknowledged while they move.
        retry_s: pause before requesting a refused or ended stream again.
        reconnect_backoff_s: pauses between reconnect attempts (the last one repeats).
        tls: the TLS settings to dial with (the cluster CA trusted, this node's certificate
            presented: `server.node.NodeTls.client`), asked at every connect so that a
            rotated certificate is used from the next connection on. With it, an active whose
            map entry has a TLS port (`NodeAddress.tls_port`) is dialled there and the
            certificate authenticates this node (no SASL); one without a TLS port is dialled
            on its plain port with `user`/`password`. None: plain TCP and the password.
    """

    node_name: str
    bucket: str = "default"
    user: str = "Administrator"
    password: str = "password"
    buffer_bytes: int = 8 * 1024 * 1024
    noop_interval_s: float = 5.0
    silence_max_s: float = 0.0
    ack_interval_s: float = 0.05
    retry_s: float = 0.25
    reconnect_backoff_s: tuple[float, ...] = (0.1, 0.2, 0.5, 1.0, 2.0)
    tls: Callable[[], ssl.SSLContext] | None = None


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
        bucket: where the replica vbuckets live (the node's bucket, through a narrow port).
        source: the active node.
        vbuckets: the replica vbuckets whose active `source` is.
        options: connection settings.
        clock: monotonic seconds (retries of refused streams); inject for simulation.

    The feed is a sans-IO core — `attach` a link, `request_all`, `on_push` what it received,
    `tick` now and then, `detach` when the link is gone — and an asyncio shell, `run`, that
    drives it over a real connection. The cluster simulator drives the same core.
    """

    def __init__(
        self,
        bucket: ReplicaVBuckets,
        source: NodeAddress,
        vbuckets: set[int],
        options: FeedOptions,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert vbuckets, source
        self.bucket = bucket
        self.source = source
        self.vbuckets = frozenset(vbuckets)
        self.options = options
        self.stats = FeedStats()
        self._clock = clock
        self._conn: FeedLink | None = None
        self._connection: Connection | None = None  # the shell's real connection
        self._session = DcpSession(buffer_bytes=options.buffer_bytes)
        self._retry_at: dict[int, float] = {}
        self._acked: dict[int, tuple[int, int]] = {}
        # (vbucket, item) waiting for checkpoint memory, in wire order (a run may hold
        # several vbuckets: each item keeps its own).
        self._backlog: deque[tuple[int, Item | Commit]] = deque()
        self._failure: BaseException | None = None
        self._heard_at = 0.0  # when the link last brought anything (clock)
        self._prepared = False  # the batch being taken held a prepare: acknowledge at once
        self._warned_plain = False  # logged that the active has no TLS port
        self._last_tls_error: str | None = None  # the TLS refusal logged last (shell)

    @property
    def name(self) -> str:
        """The DCP connection name (unique per replica/active pair)."""
        return f"replication:{self.source.name}->{self.options.node_name}:{self.options.bucket}"

    # -- the sans-IO core -------------------------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """Why the current link must be dropped (bad data, a bug), if it must."""
        return self._failure

    @property
    def retries_pending(self) -> bool:
        """Whether a refused or ended stream waits to be requested again (`tick` does it)."""
        return bool(self._retry_at)

    def control_messages(self) -> list[tuple[str, str]]:
        """The DCP controls a replica connection sets after DCP_OPEN."""
        opts = self.options
        return [
            ("enable_noop", "true"),
            ("set_noop_interval", f"{opts.noop_interval_s:g}"),
            ("connection_buffer_size", str(opts.buffer_bytes)),
            ("enable_expiry_opcode", "true"),
        ]

    @property
    def session(self) -> DcpSession:
        """The consumer protocol of the current link (its handshake is sent through it)."""
        return self._session

    def attach(self, link: FeedLink) -> None:
        """A new link to the active (not yet opened: send `session.open_messages` first)."""
        self._conn = link
        self._failure = None
        self._heard_at = self._clock()
        self.stats.connects += 1
        self._session.forget()
        self._backlog.clear()
        self._acked.clear()  # its active may know nothing of what the last link was told

    def detach(self) -> None:
        """The link is gone: nothing is requested or owed on it any more."""
        self._conn = None
        self._session.forget()
        self._backlog.clear()

    def request_all(self) -> None:
        """Request every vbucket of the feed from what it holds (after the handshake)."""
        for vb in sorted(self.vbuckets):
            self._request(vb)

    def on_push(self, batch: Batch) -> None:
        """What the link received, decoded (`protocol.batch.decode_batch`)."""
        self._heard_at = self._clock()
        self._on_push(batch)

    def on_persisted(self, vbs: list[int]) -> None:
        """The flusher persisted more of `vbs`: acknowledge now, not at the next tick."""
        if self._conn is not None and any(
            vb in self.vbuckets and self._session.status(vb) is not None for vb in vbs
        ):
            self._send_acks()

    def tick(self) -> None:
        """Take what waited for memory, acknowledge what moved, request what is due; give up
        on a link that has been silent too long (`FeedOptions.silence_max_s`)."""
        opts = self.options
        silence_max = opts.silence_max_s or 3 * opts.noop_interval_s
        silent = self._clock() - self._heard_at
        if self._conn is not None and self._failure is None and silent > silence_max:
            log.warning(
                "replica feed %s: nothing from %s for %.1f s; connecting again",
                self.name, self.source.name, silent,
            )  # fmt: skip
            self._fail(TimeoutError(f"the active sent nothing for {silent:.1f} s"))
            return
        self._drain_backlog()
        self._send_acks()
        self._retry_due()

    # -- the asyncio shell ----------------------------------------------------------------------

    async def run(self) -> None:
        """Stream until cancelled; reconnect with backoff when the connection drops."""
        backoff = self.options.reconnect_backoff_s
        attempt = 0
        listeners = self.bucket.persisted_listeners
        listeners.append(self.on_persisted)  # persisted acks go out as the flusher commits
        try:
            while True:  # the feed's life; ended by cancellation
                try:
                    await self._connected()
                    attempt = 0
                except (OSError, TimeoutError, ConnectionClosedError, ProtocolError) as error:
                    text = str(error)
                    if "TLS:" in text and text != self._last_tls_error:
                        # A refused certificate (either side's) repeats at every attempt:
                        # one line per distinct reason, not one per reconnect.
                        log.warning("replica feed %s: %s; reconnecting", self.name, text)
                    else:
                        log.info("replica feed %s: %s; reconnecting", self.name, text)
                    self._last_tls_error = text if "TLS:" in text else None
                except StatusError as error:
                    log.warning("replica feed %s refused: %s; retrying", self.name, error)
                finally:
                    await self._close()
                await asyncio.sleep(backoff[min(attempt, len(backoff) - 1)])
                attempt += 1
        finally:
            listeners.remove(self.on_persisted)

    async def _close(self) -> None:
        conn = self._connection
        self._connection = None
        self.detach()
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _connected(self) -> None:
        """One connection's life: open it, request every vbucket, then tick (acks, retries,
        the backlog) until it ends."""
        opts = self.options
        host, port, tls = self.dial()
        conn = await connect(
            host, port, agent=self.name, user=None if tls is not None else opts.user,
            password=opts.password, bucket=opts.bucket,
            features=[Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON], tls=tls,
        )  # fmt: skip
        self._connection = conn
        self.attach(conn)
        await open_session(
            conn, self._session, name=self.name, role=StreamRole.REPLICA,
            controls=self.control_messages(), consumer_name=opts.node_name,
        )  # fmt: skip
        conn.on_push = self.on_push
        closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_close(error: ConnectionClosedError) -> None:
            if not closed.done():
                closed.set_exception(error)
                # Retrieved here: the loop below raises it with closed.result(), unless the
                # session is cancelled first (the node stops), when nobody else would.
                closed.exception()

        conn.on_close = on_close
        self.request_all()
        while not closed.done():  # ticks: acks, retries, backlog; ends with the connection
            await asyncio.wait([closed], timeout=opts.ack_interval_s)
            if self._failure is not None:
                raise self._failure
            self.tick()
        closed.result()

    def dial(self) -> tuple[str, int, ssl.SSLContext | None]:
        """Where and how the next connection goes: the active's TLS port with this node's
        certificate when both sides have TLS, else its plain port (authenticated by password)."""
        source, tls = self.source, self.options.tls
        if tls is not None and source.tls_port:
            return source.host, source.tls_port, tls()
        if tls is not None and not self._warned_plain:
            self._warned_plain = True
            log.warning(
                "replica feed %s: %s advertises no TLS port; replicating over plain TCP "
                "with the password", self.name, source.name,
            )  # fmt: skip
        return source.host, source.port, None

    # -- requests -------------------------------------------------------------------------------

    def _request(self, vb: int) -> None:
        """Ask for everything after what the vbucket holds, presenting the snapshot it is in
        and its history (the active answers with a stream or a rollback point)."""
        conn = self._conn
        assert conn is not None
        vbucket = self.bucket.vbucket(vb)
        start, snap_start, snap_end = vbucket.replica_request_range()
        opaque = conn.next_opaque()
        self._retry_at.pop(vb, None)
        # ACTIVE_VB_ONLY: a node that is no longer the vbucket's active refuses, and the
        # replica asks where the map points next, instead of copying a copy.
        flags = StreamFlag.ACTIVE_VB_ONLY
        request = StreamRequest(
            vb, opaque, flags, start, SEQNO_FOREVER, vbucket.vb_uuid, snap_start, snap_end, {}
        )
        if vbucket.purge_seqno:
            request = dataclasses.replace(request, value={"purge_seqno": str(vbucket.purge_seqno)})
        conn.send(self._session.request(request))

    def _retry_later(self, vb: int) -> None:
        self._retry_at[vb] = self._clock() + self.options.retry_s

    def _retry_due(self) -> None:
        now = self._clock()
        for vb, due in list(self._retry_at.items()):
            if due <= now and self._conn is not None:
                self._request(vb)

    # -- the reader task's side -----------------------------------------------------------------

    def _on_push(self, batch: Batch) -> None:
        """The session's events in wire order: data runs between control frames."""
        try:
            view = _BatchView(batch.changes) if len(batch.changes) else None
            # By type, not `match` (which tries every pattern in turn). A durable write's
            # prepare and commit come as SyncRuns (columns, protocol/sync_columns.py); what
            # stays a SyncFrame (a DCP_ABORT, a frame the columns left to its decoder, every
            # sync frame with sync_columns=False) gathers into runs of one vbucket and opcode,
            # which any other event ends.
            sync_run: list[Frame] = []
            sync_vb = sync_opcode = -1
            for event in self._session.receive(batch):
                kind = type(event)
                if kind is SyncFrame:
                    frame: Frame = event.frame  # type: ignore[union-attr]
                    vb: int = event.vb  # type: ignore[union-attr]
                    if sync_run and (vb != sync_vb or frame.opcode != sync_opcode):
                        self._on_sync_run(sync_vb, sync_run)
                        sync_run = []
                    sync_run.append(frame)
                    sync_vb, sync_opcode = vb, frame.opcode
                    continue
                if sync_run:
                    self._on_sync_run(sync_vb, sync_run)
                    sync_run = []
                if kind is Run:
                    assert view is not None and isinstance(event, Run), event
                    self._apply(view, event.start, event.stop)
                elif kind is SyncRun:
                    assert isinstance(event, SyncRun), event
                    self._on_sync_columns(batch.syncs, event.start, event.stop)
                elif kind is MarkerReceived:
                    assert isinstance(event, MarkerReceived), event
                    self._on_marker(event.vb, event.marker)
                elif kind is StreamAnswered:
                    assert isinstance(event, StreamAnswered), event
                    self._on_stream_response(event.frame, event.vb)
                elif kind is StreamEnded:
                    assert isinstance(event, StreamEnded), event
                    log.info(
                        "replica stream vb %d from %s ended: %s",
                        event.vb, self.source.name, event.reason.name,
                    )  # fmt: skip
                    self._retry_later(event.vb)
            if sync_run:
                self._on_sync_run(sync_vb, sync_run)
            self.stats.bytes = self._session.received_bytes
            self._flush_owed()
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
        """Queue received changes `start`..`stop` of the batch per vbucket run. A run of only
        mutations (the usual case) goes to the replica role as column slices
        (`VBucket.queue_replicated_columns`): a mutation's frame body is the stored body
        (extras | key | value, the layout the store keeps), taken as is. A run holding
        tombstones (rare; their wire extras are not the stored ones) goes as items."""
        vbucket_of = self.bucket.vbucket
        seqnos, keys, bodies, cas = view.seqno, view.key, view.bodies, view.cas
        flags, expiry, datatype, rev = view.flags, view.expiry, view.datatype, view.rev_seqno
        vbs, opcodes, plain = view.vbucket, view.opcode, view.all_mutations
        for first, last in itertools.pairwise(view.runs(start, stop)):  # one vbucket's run each
            vb = vbs[first]
            if self._backlog or not (
                plain or opcodes[first:last].count(_OPCODE_MUTATION) == last - first
            ):
                self._queue_run(vb, _items_of(view, first, last))
                continue
            run = ReplicatedColumns(
                seqnos[first:last], keys[first:last], bodies[first:last], cas[first:last],
                flags[first:last], expiry[first:last], datatype[first:last], rev[first:last],
            )  # fmt: skip
            try:
                taken = vbucket_of(vb).queue_replicated_columns(run)
            except CheckpointMemoryFullError:
                taken = 0
            if taken < last - first:  # memory ran out: the rest wait as items
                self._hold_back(vb, _items_of(view, first + taken, last))
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
        self._hold_back(vb, items)

    def _hold_back(self, vb: int, items: Sequence[Item | Commit]) -> None:
        """Keep `items` for when the flusher has freed memory; stop reading meanwhile."""
        if not self._backlog and self._conn is not None:
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

    def _on_marker(self, vb: int, marker: SnapshotMarker) -> None:
        self._settle_backlog()
        self.bucket.vbucket(vb).replica_snapshot(marker.snap_start, marker.snap_end)

    def _on_sync_run(self, vb: int, frames: list[Frame]) -> None:
        """Consecutive DCP_PREPAREs (or DCP_COMMITs) of `vb`: decoded, then queued as one run
        (`queue_replicated_prepares`, `replica_commit_many`). A frame that does not decode
        raises after the ones before it are queued, as one at a time would."""
        opcode = frames[0].opcode
        if len(frames) == 1 or opcode not in _SYNC_RUN_OPCODES:
            for frame in frames:
                self._on_sync(vb, frame)
            return
        error: ProtocolError | None = None
        if opcode == Opcode.DCP_PREPARE:
            prepares: list[SyncItem] = []
            try:
                for frame in frames:  # bounded by the run
                    prepares.append(_prepare_item(decode_prepare(frame)))
            except ProtocolError as bad:
                error = bad
            if prepares:
                self._prepared = True
                self._queue_prepares(vb, prepares)
            self.stats.items += len(prepares)
        else:
            commits: list[Commit] = []
            try:
                for frame in frames:  # bounded by the run
                    commits.append(decode_commit(frame))
            except ProtocolError as bad:
                error = bad
            if commits:
                self._queue_commits(vb, commits)
            self.stats.items += len(commits)
        if error is not None:
            raise error

    def _on_sync_columns(self, syncs: SyncColumns, start: int, stop: int) -> None:
        """DCP_PREPAREs (or DCP_COMMITs) `start`..`stop` of the batch's sync columns, one
        vbucket's, consecutive on the wire and checked as their decoders check them
        (protocol/sync_columns.py): queued as `_on_sync_run` queues the frames it decodes —
        a run as one run, a single one alone — with no `Frame`, `Prepare` or `Commit` built."""
        vb = syncs.vbucket[start]
        count = stop - start
        if syncs.opcode[start] == OP_PREPARE:
            prepares = _prepares_of(syncs, start, stop)
            if count == 1:
                self._queue(vb, prepares[0])
            else:
                self._queue_prepares(vb, prepares)
            self._prepared = True
            self.stats.items += count
            return
        keys, prepared = syncs.key[start:stop], syncs.prepared_seqno[start:stop]
        commits = list(zip(keys, prepared, syncs.seqno[start:stop], strict=True))
        if count == 1:
            self._queue(vb, Commit(vb, syncs.opaque[start], *commits[0]))
        else:
            self._queue_commit_runs(vb, commits, syncs.opaque[start])
        self.stats.items += count

    def _queue_prepares(self, vb: int, prepares: list[SyncItem]) -> None:
        taken = 0
        if not self._backlog:
            vbucket = self.bucket.vbucket(vb)
            before = vbucket.high_seqno
            try:
                taken = vbucket.queue_replicated_prepares(prepares)
            except CheckpointMemoryFullError:
                taken = 0
            except StatusError:
                self._count_taken(vbucket, before, [p.seqno for p in prepares])
                raise
        if taken < len(prepares):  # memory ran out (or a backlog waits): the rest wait
            self._hold_back(vb, prepares[taken:])

    def _queue_commits(self, vb: int, commits: list[Commit]) -> None:
        runs = [(c.key, c.prepared_seqno, c.commit_seqno) for c in commits]
        self._queue_commit_runs(vb, runs, commits[0].opaque)

    def _queue_commit_runs(
        self, vb: int, commits: list[tuple[bytes, int, int]], opaque: int
    ) -> None:
        """Queue (key, prepared seqno, commit seqno) triples as one run; what memory refuses
        (or a backlog holds up) waits as `Commit`s, built only for those."""
        taken = 0
        if not self._backlog:
            vbucket = self.bucket.vbucket(vb)
            before = vbucket.high_seqno
            try:
                taken = vbucket.replica_commit_many(commits)
            except CheckpointMemoryFullError:
                taken = 0
            except StatusError:
                self._count_taken(vbucket, before, [seqno for _, _, seqno in commits])
                raise
        if taken < len(commits):
            self._hold_back(vb, [Commit(vb, opaque, *commit) for commit in commits[taken:]])

    def _count_taken(self, vbucket: ReplicaVBucket, before: int, seqnos: list[int]) -> None:
        """A run refused a bad item after queueing the ones before it (the vbucket's runs do):
        count those, as one call each would have. Its caller counts a run only when it
        returns, and where runs split (a noop ends a run of columns, not one of frames) must
        not change the count."""
        after = vbucket.high_seqno
        self.stats.items += sum(before < seqno <= after for seqno in seqnos)

    def _on_sync(self, vb: int, frame: Frame) -> None:
        opcode = frame.opcode
        if opcode == Opcode.DCP_PREPARE:
            self._queue(vb, _prepare_item(decode_prepare(frame)))
            self._prepared = True
        elif opcode == Opcode.DCP_COMMIT:
            self._queue(vb, decode_commit(frame))
        else:
            abort = decode_abort(frame)
            item = SyncItem(
                abort.abort_seqno, abort.key, Op.ABORT, Op.DELETION, b"", 1,
                prepared_seqno=abort.prepared_seqno,
            )  # fmt: skip
            self._queue(vb, item)
        self.stats.items += 1

    def _settle_backlog(self) -> None:
        """A marker must not overtake items still waiting for memory: take them first."""
        if self._backlog:
            self._drain_backlog()
        if self._backlog:
            raise ProtocolError(
                "checkpoint memory full across a snapshot boundary", Status.ETMPFAIL
            )

    def _on_stream_response(self, frame: Frame, vb: int) -> None:
        if vb not in self.vbuckets:
            return
        vbucket = self.bucket.vbucket(vb)
        if frame.status == Status.SUCCESS:
            vbucket.adopt_failover_log(decode_failover_log(frame.value))
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
        """Acknowledge every streaming vbucket whose seqnos moved, in one write: a flush
        round persists many vbuckets at once, and a write each cost a send call apiece."""
        if self._conn is None:
            return
        acks: list[bytes] = []
        acked, vbucket_of = self._acked, self.bucket.vbucket
        for vb in self._session.streaming():
            vbucket = vbucket_of(vb)
            now = (vbucket.high_seqno, vbucket.persisted_seqno)
            if acked.get(vb) != now:
                acks.append(encode_seqno_acknowledged(SeqnoAcknowledged(vb, 0, *now)))
                acked[vb] = now
        if acks:
            self._send(b"".join(acks))

    def _flush_owed(self) -> None:
        owed = self._session.data_to_send()
        if owed:
            self._send(owed)

    def _send(self, data: bytes) -> None:
        if self._conn is not None:
            with contextlib.suppress(ConnectionClosedError):
                self._conn.send(data)


def _prepares_of(syncs: SyncColumns, start: int, stop: int) -> list[SyncItem]:
    """Prepares `start`..`stop` of the sync columns as items."""
    return _prepare_items(
        syncs.seqno, syncs.key, syncs.value, syncs.cas, syncs.flags, syncs.expiry,
        syncs.datatype, syncs.rev_seqno, syncs.delete_time, syncs.deleted, syncs.level,
        start, stop,
    )  # fmt: skip


def _prepare_item(p: Prepare) -> SyncItem:
    """A decoded DCP_PREPARE as an item: a run of one, its fields as columns."""
    return _prepare_items(
        (p.seqno,), (p.key,), (p.value,), (p.cas,), (p.flags,), (p.expiry,), (p.datatype,),
        (p.rev_seqno,), (p.delete_time,), (p.deleted,), (p.level,), 0, 1,
    )[0]  # fmt: skip


def _prepare_items(
    seqnos: Sequence[int], keys: Sequence[bytes], values: Sequence[bytes],
    cases: Sequence[int], flags: Sequence[int], expiries: Sequence[int],
    datatypes: Sequence[int], revs: Sequence[int], delete_times: Sequence[int],
    deleted: Sequence[bool], levels: Sequence[int], start: int, stop: int,
) -> list[SyncItem]:  # fmt: skip
    """Prepares `start`..`stop` of per-field columns as the items the replica role keeps:
    the one place a prepare's fields become a `SyncItem`. Inline, not a helper per item: a
    call per prepare measured ~20% more CPU for the run (0.88 -> 1.07 us per item)."""
    prepare, mutation, deletion = Op.PREPARE, Op.MUTATION, Op.DELETION
    return [
        SyncItem(
            seqnos[i], keys[i], prepare, deletion if deleted[i] else mutation, values[i],
            cases[i], flags[i], expiries[i], datatypes[i], revs[i], delete_times[i],
            level=levels[i],
        )
        for i in range(start, stop)
    ]  # fmt: skip


__all__ = [
    "FeedLink",
    "FeedOptions",
    "FeedStats",
    "ReplicaFeed",
    "ReplicaVBucket",
    "ReplicaVBuckets",
]


def _status_name(status: int) -> str:
    try:
        return Status(status).name
    except ValueError:
        return f"0x{status:x}"


def _items_of(view: _BatchView, first: int, last: int) -> list[Item]:
    """Changes `first`..`last` of a batch as items: a mutation takes its frame body as is
    (`Item.of_body`), a tombstone is encoded again."""
    columns = view.columns
    data, opcodes, seqnos, keys = columns.data, columns.opcode, columns.seqno, columns.key
    body_start, value_end = view.body_start, view.value_end
    cas, flags, expiry = columns.cas, columns.flags, columns.expiry
    datatype, rev, delete_time = columns.datatype, columns.rev_seqno, columns.delete_time
    of_body, mutation = Item.of_body, _OPCODE_MUTATION
    return [
        of_body(
            seqnos[i], keys[i], _MUTATION, data[body_start[i] : value_end[i]],
            cas[i], flags[i], expiry[i], datatype[i], rev[i], 0,
        )
        if opcodes[i] == mutation
        else Item(
            seqnos[i], keys[i], _OP_OF_OPCODE[Opcode(opcodes[i])], columns.value[i],
            cas[i], flags[i], expiry[i], datatype[i], rev[i], delete_time[i],
        )
        for i in range(first, last)
    ]  # fmt: skip


class _BatchView:
    """What `_apply` reads of one received batch, converted once per batch: the batch's
    columns as lists (ChangeColumns keeps them), every change's frame body, whether every
    change is a mutation, and where the vbucket changes. A batch is cut at every control
    frame (a marker per vbucket run in steady state; in a catch-up a replica reads 256 KiB,
    ~1,600 items, per batch with a few markers). Slicing the columns per cut cost ~10 us
    each, this costs a bisect; the bodies are one pass over the batch, not one `map` per run
    (the feed's own CPU 0.20 -> 0.16 us/item on long runs, 0.65 -> 0.48 on runs of 17)."""

    __slots__ = (
        "_cuts", "all_mutations", "bodies", "body_start", "cas", "columns", "datatype",
        "expiry", "flags", "key", "opcode", "rev_seqno", "seqno", "value_end", "vbucket",
    )  # fmt: skip

    def __init__(self, columns: ChangeColumns) -> None:
        self.columns = columns
        # Where a mutation's frame body starts: its extras, before the key.
        self.body_start: list[int] = (
            columns.array("key_start").astype(np.int64) - _MUTATION_BODY_EXTRAS
        ).tolist()
        self.value_end: list[int] = columns.array("value_end").tolist()
        vbs = columns.array("vbucket")
        self._cuts: list[int] = (np.flatnonzero(vbs[1:] != vbs[:-1]) + 1).tolist()
        opcodes = columns.array("opcode")
        self.all_mutations = bool((opcodes == _OPCODE_MUTATION).all())
        data = columns.data
        # A tombstone's slice is not its stored body: `_apply` takes bodies of mutation runs only.
        self.bodies = [data[a:b] for a, b in zip(self.body_start, self.value_end, strict=True)]
        self.opcode, self.vbucket, self.seqno = columns.opcode, columns.vbucket, columns.seqno
        self.key, self.cas, self.flags = columns.key, columns.cas, columns.flags
        self.expiry, self.datatype = columns.expiry, columns.datatype
        self.rev_seqno = columns.rev_seqno

    def runs(self, start: int, stop: int) -> list[int]:
        """The bounds of the single-vbucket runs of changes `start`..`stop`."""
        cuts = self._cuts
        inside = cuts[bisect.bisect_right(cuts, start) : bisect.bisect_left(cuts, stop)]
        return [start, *inside, stop]
