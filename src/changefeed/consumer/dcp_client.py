"""``DcpClient``: stream any set of vbuckets from a node, with rollback, flow control and noops.

Two views of each vbucket's session are kept on purpose:

* the *request* session, owned by the reader task, says what to ask for next — it is rolled back
  and re-requested the moment a ROLLBACK answer arrives, with no round trip through the app;
* the *application* session (``client.session``) moves only as the application takes events
  from ``events()``, so saving it after handling an event never claims data the application has
  not seen (exactly-once resume).

Events wait in a bounded queue; when it is full the reader task stops reading the socket and the
producer's flow-control window fills, so a slow application never grows our memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from changefeed import limits
from changefeed.consumer.connection import CloseReason, Connection, ConnectionClosedError
from changefeed.consumer.events import (
    Changes,
    Disconnected,
    Event,
    Rollback,
    Snapshot,
    StreamEnded,
    StreamOpened,
    StreamRefused,
)
from changefeed.consumer.handshake import call, connect
from changefeed.consumer.session import SessionState, VbSession
from changefeed.failover import FailoverLog
from changefeed.protocol.batch import Batch
from changefeed.protocol.dcp import (
    DcpControl,
    DcpOpen,
    OpenFlag,
    StreamFlag,
    StreamRequest,
    StreamRole,
    decode_failover_log,
    decode_rollback_seqno,
    decode_stream_end,
    encode_buffer_ack,
    encode_dcp_control,
    encode_dcp_open,
    encode_stream_request,
)
from changefeed.protocol.errors import ProtocolError, error_for_status
from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.opcode import Feature, Magic, Opcode
from changefeed.protocol.snapshot_marker import MarkerFlag, decode_snapshot_marker
from changefeed.protocol.status import Status

SEQNO_FOREVER = 0xFFFF_FFFF_FFFF_FFFF
RECONNECT_ATTEMPTS_MAX = 60  # with the backoff capped at 5 s: about 5 minutes
Start = Literal["beginning", "now"] | SessionState


@dataclass(frozen=True, slots=True)
class ClientConfig:
    host: str = "127.0.0.1"
    port: int = 11210
    bucket: str = "default"
    user: str = "Administrator"
    password: str = "password"
    name: str = ""  # DCP connection name; default "changefeed:consumer:<random>" (a reused
    # name makes the node close the older connection, dcp-wire.md §4)
    buffer_bytes: int = 8 * 1024 * 1024  # flow-control window; acked at 20% (dcp-wire.md §8.1)
    noop_interval_s: float = 10.0
    end_seqno: int = SEQNO_FOREVER  # or stream only up to a seqno, then STREAM_END(Ok)
    to_latest: bool = False  # end each stream at the high seqno at request time
    reconnect_backoff_s: tuple[float, ...] = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
    # Roll back to the newest whole snapshot at or below the node's rollback seqno (safe for
    # any consumer). False: to the node's seqno exactly, for sinks that re-read the keys they
    # hold above it from the node (the Spark mirror does).
    rollback_to_snapshot: bool = True
    # Who reads (DCP_OPEN): application streams may fall back to disk under memory pressure;
    # REPLICA is for a cluster's replica vbuckets pulling from their active.
    role: StreamRole = StreamRole.APPLICATION


class DcpClient:
    """Async DCP consumer. ``async with DcpClient(config) as c: await c.stream(...)``."""

    def __init__(self, config: ClientConfig, *, rng: random.Random | None = None) -> None:
        if not config.name:
            config = dataclasses.replace(
                config, name=f"changefeed:consumer:{uuid.uuid4().hex[:12]}"
            )
        self.config = config
        self.session = SessionState()
        self._requests: dict[int, VbSession] = {}
        self._opaque_vb: dict[int, int] = {}
        self._vbuckets: list[int] = []
        # Bounded by pausing the socket at limits.EVENT_QUEUE_MAX (plus the events of one read).
        self._events: deque[Event] = deque()
        self._event_ready = asyncio.Event()
        self._conn: Connection | None = None
        self._unacked_bytes = 0
        self._rng = rng or random.Random()
        self._end_seqnos: dict[int, int] = {}

    async def __aenter__(self) -> DcpClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the connection, negotiate, authenticate, select the bucket, DCP_OPEN."""
        cfg = self.config
        conn = await connect(
            cfg.host, cfg.port, agent=cfg.name, user=cfg.user, password=cfg.password,
            bucket=cfg.bucket, features=[Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON],
        )  # fmt: skip
        try:
            opaque = conn.next_opaque()
            flags = OpenFlag.PRODUCER | OpenFlag.INCLUDE_DELETE_TIMES
            await _expect_ok(
                conn, encode_dcp_open(DcpOpen(opaque, cfg.name, flags, role=cfg.role)), opaque
            )
            for key, value in self._controls():
                opaque = conn.next_opaque()
                await _expect_ok(conn, encode_dcp_control(DcpControl(opaque, key, value)), opaque)
        except BaseException:
            await conn.close()
            raise
        conn.on_push = self._on_push
        conn.on_close = lambda error: self._put(Disconnected(str(error)))
        self._conn = conn
        self._unacked_bytes = 0

    def _controls(self) -> list[tuple[str, str]]:
        return [
            ("enable_noop", "true"),
            ("set_noop_interval", f"{self.config.noop_interval_s:g}"),
            ("connection_buffer_size", str(self.config.buffer_bytes)),
            ("enable_expiry_opcode", "true"),
            ("send_stream_end_on_client_close_stream", "true"),
        ]

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def stream(
        self,
        vbuckets: list[int],
        start: Start = "beginning",
        *,
        end_seqnos: dict[int, int] | None = None,
    ) -> None:
        """Request streams for ``vbuckets`` from the beginning, from now, or from saved state.

        Args:
            end_seqnos: per-vbucket end seqno (the stream ends after the snapshot holding it);
                vbuckets not listed use ``config.end_seqno``.
        """
        if end_seqnos:
            self._end_seqnos.update(end_seqnos)
        if isinstance(start, SessionState):
            for vb in vbuckets:
                self.session.vbuckets[vb] = start.get(vb).copy()
        for vb in vbuckets:
            session = self.session.get(vb)
            self._requests[vb] = session.copy()
            self._vbuckets.append(vb)
            self._send_stream_request(vb, from_latest=start == "now")

    def _send_stream_request(self, vb: int, *, from_latest: bool = False) -> None:
        assert self._conn is not None
        request_session = self._requests[vb]
        start, snap_start, snap_end = request_session.request_range()
        flags = StreamFlag.FROM_LATEST if from_latest else 0
        if self.config.to_latest:
            flags |= StreamFlag.TO_LATEST
        opaque = self._conn.next_opaque()
        self._opaque_vb[opaque] = vb
        value = {}
        if request_session.purge_seqno:
            value["purge_seqno"] = str(request_session.purge_seqno)
        request = StreamRequest(
            vb,
            opaque,
            flags,
            start,
            self._end_seqnos.get(vb, self.config.end_seqno),
            request_session.vb_uuid,
            snap_start,
            snap_end,
            value,
        )
        self._conn.send(encode_stream_request(request))

    async def events(self) -> AsyncIterator[Event]:
        """Yield events in order, advancing ``self.session`` as each is taken.

        On a dropped connection yields ``Disconnected``, reconnects with backoff and resumes
        every stream from the session state.
        """
        while True:  # the application's loop; ends when the caller stops iterating
            while not self._events:
                self._event_ready.clear()
                await self._event_ready.wait()
            event = self._events.popleft()
            if len(self._events) <= limits.EVENT_QUEUE_MAX // 2 and self._conn is not None:
                self._conn.resume_reading()
            self._apply(event)
            yield event
            if isinstance(event, Disconnected):
                await self._reconnect()

    def _apply(self, event: Event) -> None:
        if isinstance(event, Changes):
            # Per run and vbucket, not per item: the columns' arrays (session.py).
            cols = event.columns
            self.session.on_items(cols.array("vbucket"), cols.array("seqno"))
        elif isinstance(event, Snapshot):
            session = self.session.get(event.vbucket)
            session.on_marker(event.snap_start, event.snap_end)
            session.purge_seqno = max(session.purge_seqno, event.purge_seqno)
        elif isinstance(event, Rollback):
            self.session.get(event.vbucket).rollback_to(event.seqno)
        elif isinstance(event, StreamOpened):
            self.session.get(event.vbucket).failover_log = FailoverLog(event.failover_log)

    async def _reconnect(self) -> None:
        """Reconnect with jittered backoff, then resume every stream from ``self.session``.

        Raises:
            ConnectionClosedError: after ``RECONNECT_ATTEMPTS_MAX`` failed attempts.
        """
        await self.close()
        backoff = self.config.reconnect_backoff_s
        last_error: Exception | None = None
        for attempt in range(RECONNECT_ATTEMPTS_MAX):
            delay = backoff[min(attempt, len(backoff) - 1)]
            await asyncio.sleep(delay * (0.5 + self._rng.random()))
            try:
                await self.connect()
            except (OSError, ConnectionClosedError, TimeoutError) as error:
                last_error = error
                continue
            vbuckets, self._vbuckets = self._vbuckets, []
            self._events.clear()
            await self.stream(vbuckets, start=self.session)
            return
        raise ConnectionClosedError(CloseReason.IO_ERROR, f"reconnect failed: {last_error}")

    # -- reader task side ---------------------------------------------------------------------

    def _on_push(self, batch: Batch) -> None:
        """Runs in the connection's reader task: split the batch into events, in order."""
        assert self._conn is not None
        changes = batch.changes
        done = 0
        for position, frame in batch.controls:
            if position > done:
                self._put(Changes(changes.slice(done, position)))
                done = position
            self._on_control(frame)
        if len(changes) > done:
            self._put(Changes(changes.slice(done, len(changes))))
        self._ack(batch.item_bytes)

    def _on_control(self, frame: Frame) -> None:
        opcode = frame.opcode
        if frame.magic in (Magic.RESPONSE, Magic.ALT_RESPONSE):
            if opcode == Opcode.DCP_STREAM_REQ:
                self._on_stream_response(frame)
            return
        if opcode == Opcode.DCP_NOOP:
            self._send(encode_response(frame))
            return
        self._ack(frame.wire_size)
        if opcode == Opcode.DCP_SNAPSHOT_MARKER:
            marker = decode_snapshot_marker(frame)
            self._put(
                Snapshot(
                    frame.vbucket,
                    marker.snap_start,
                    marker.snap_end,
                    marker.flags,
                    marker.purge_seqno,
                )
            )
            if marker.flags & MarkerFlag.ACK:
                self._send(encode_response(frame))
        elif opcode == Opcode.DCP_STREAM_END:
            self._put(StreamEnded(frame.vbucket, decode_stream_end(frame).reason))
        elif opcode == Opcode.DCP_SET_VBUCKET_STATE:
            self._send(encode_response(frame))

    def _on_stream_response(self, frame: Frame) -> None:
        vb = self._opaque_vb.pop(frame.opaque, None)
        if vb is None:
            raise ProtocolError(f"stream response for unknown opaque {frame.opaque}")
        if frame.status == Status.SUCCESS:
            log = decode_failover_log(frame.value)
            self._requests[vb].failover_log = FailoverLog(log)
            self._put(StreamOpened(vb, log))
        elif frame.status == Status.ROLLBACK:
            server_seqno = decode_rollback_seqno(frame.value)
            request_session = self._requests[vb]
            seqno = server_seqno
            if self.config.rollback_to_snapshot:
                seqno = request_session.consistent_point_at_or_below(server_seqno)
            request_session.rollback_to(seqno)
            self._put(Rollback(vb, seqno, server_seqno))
            self._send_stream_request(vb)
        else:
            self._put(StreamRefused(vb, frame.status, frame.value.decode(errors="replace")))

    def _put(self, event: Event) -> None:
        self._events.append(event)
        self._event_ready.set()
        if len(self._events) >= limits.EVENT_QUEUE_MAX and self._conn is not None:
            self._conn.pause_reading()  # resumed by events() once the app catches up

    def _send(self, data: bytes) -> None:
        assert self._conn is not None
        self._conn.send(data)

    def _ack(self, nbytes: int) -> None:
        self._unacked_bytes += nbytes
        if self._unacked_bytes >= self.config.buffer_bytes // 5:
            self._send(encode_buffer_ack(self._unacked_bytes))
            self._unacked_bytes = 0


async def _expect_ok(conn: Connection, data: bytes, opaque: int) -> Frame:
    response = await conn.request(data, opaque)
    if response.status != Status.SUCCESS:
        raise error_for_status(response.status, response.value.decode(errors="replace"))
    return response


__all__ = ["ClientConfig", "DcpClient", "call"]
