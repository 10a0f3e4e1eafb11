"""One DCP connection of a ``DcpClient``: the streams it holds on one node.

A ``DcpClient`` opens one ``NodeStream`` per node that holds active copies of the vbuckets it
streams. The node stream owns the wire side of that connection: DCP_OPEN and the controls,
stream requests, noop replies, snapshot-marker acks and flow-control buffer acks (per
connection, dcp-wire.md §8.1). It turns what the reader task receives into events, in wire
order, and hands everything that needs a decision — a stream request's answer, a stream's end,
the loss of the connection — to its ``StreamOwner`` (the client), which knows the sessions and
the cluster map. It keeps no per-vbucket state beyond which opaque asked for which vbucket.
"""

from __future__ import annotations

from typing import Protocol

from changefeed.consumer.connection import Connection, ConnectionClosedError
from changefeed.consumer.events import Changes, Event, Snapshot
from changefeed.consumer.session import VbSession
from changefeed.protocol.batch import Batch
from changefeed.protocol.dcp import (
    DcpControl,
    DcpOpen,
    OpenFlag,
    StreamEndReason,
    StreamRequest,
    StreamRole,
    decode_stream_end,
    encode_buffer_ack,
    encode_dcp_control,
    encode_dcp_open,
    encode_stream_request,
)
from changefeed.protocol.errors import ProtocolError, error_for_status
from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.snapshot_marker import MarkerFlag, decode_snapshot_marker
from changefeed.protocol.status import Status


class StreamOwner(Protocol):
    """What a ``NodeStream`` reports to (all called in the connection's reader task)."""

    def put(self, event: Event) -> None:
        """Queue a data event (``Changes``, ``Snapshot``) for the application."""

    def stream_answered(self, node: NodeStream, vb: int, frame: Frame) -> None:
        """The node answered a stream request for ``vb`` (any status)."""

    def stream_ended(self, node: NodeStream, vb: int, reason: StreamEndReason) -> None:
        """The node ended ``vb``'s stream (DCP_STREAM_END)."""

    def disconnected(self, node: NodeStream, error: ConnectionClosedError) -> None:
        """The connection dropped (not called for a local close)."""


class NodeStream:
    """The DCP connection to one node (``server`` = ``host:port``). Build with ``open``."""

    def __init__(
        self, server: str, conn: Connection, owner: StreamOwner, *, buffer_bytes: int
    ) -> None:
        self.server = server
        self._conn = conn
        self._owner = owner
        self._buffer_bytes = buffer_bytes
        self._unacked_bytes = 0
        self._opaque_vb: dict[int, int] = {}

    @classmethod
    async def open(
        cls,
        server: str,
        conn: Connection,
        owner: StreamOwner,
        *,
        name: str,
        role: StreamRole,
        controls: list[tuple[str, str]],
        buffer_bytes: int,
    ) -> NodeStream:
        """DCP_OPEN (as a producer's consumer, with delete times) and ``controls`` on ``conn``,
        an authenticated connection with the bucket selected; ``conn`` is closed on failure.

        Raises:
            StatusError: the node refused DCP_OPEN or a control.
            ConnectionClosedError, TimeoutError: the connection failed meanwhile.
        """
        try:
            opaque = conn.next_opaque()
            flags = OpenFlag.PRODUCER | OpenFlag.INCLUDE_DELETE_TIMES
            await _expect_ok(conn, encode_dcp_open(DcpOpen(opaque, name, flags, role=role)), opaque)
            for key, value in controls:
                opaque = conn.next_opaque()
                await _expect_ok(conn, encode_dcp_control(DcpControl(opaque, key, value)), opaque)
        except BaseException:
            await conn.close()
            raise
        node = cls(server, conn, owner, buffer_bytes=buffer_bytes)
        conn.on_push = node._on_push
        conn.on_close = lambda error: owner.disconnected(node, error)
        return node

    @property
    def closed(self) -> bool:
        return self._conn.closed is not None

    def request(self, session: VbSession, *, flags: int, end_seqno: int) -> None:
        """Ask for ``session.vbucket`` from where ``session`` is (its failover log's newest
        uuid, its snapshot range); the answer comes to ``StreamOwner.stream_answered``.

        Raises:
            ConnectionClosedError: the connection is gone.
        """
        start, snap_start, snap_end = session.request_range()
        opaque = self._conn.next_opaque()
        value = {"purge_seqno": str(session.purge_seqno)} if session.purge_seqno else {}
        request = StreamRequest(
            session.vbucket, opaque, flags, start, end_seqno, session.vb_uuid,
            snap_start, snap_end, value,
        )  # fmt: skip
        self._conn.send(encode_stream_request(request))
        self._opaque_vb[opaque] = session.vbucket

    def pause_reading(self) -> None:
        self._conn.pause_reading()

    def resume_reading(self) -> None:
        self._conn.resume_reading()

    async def close(self) -> None:
        await self._conn.close()

    # -- reader task side ---------------------------------------------------------------------

    def _on_push(self, batch: Batch) -> None:
        """Split the batch into events, in wire order: data runs between control frames."""
        changes = batch.changes
        done = 0
        for position, frame in batch.controls:
            if position > done:
                self._owner.put(Changes(changes.slice(done, position)))
                done = position
            self._on_control(frame)
        if len(changes) > done:
            self._owner.put(Changes(changes.slice(done, len(changes))))
        self._ack(batch.item_bytes)

    def _on_control(self, frame: Frame) -> None:
        opcode = frame.opcode
        if frame.magic in (Magic.RESPONSE, Magic.ALT_RESPONSE):
            if opcode == Opcode.DCP_STREAM_REQ:
                vb = self._opaque_vb.pop(frame.opaque, None)
                if vb is None:
                    raise ProtocolError(f"stream response for unknown opaque {frame.opaque}")
                self._owner.stream_answered(self, vb, frame)
            return
        if opcode == Opcode.DCP_NOOP:
            self._conn.send(encode_response(frame))
            return
        self._ack(frame.wire_size)
        if opcode == Opcode.DCP_SNAPSHOT_MARKER:
            marker = decode_snapshot_marker(frame)
            self._owner.put(
                Snapshot(
                    frame.vbucket,
                    marker.snap_start,
                    marker.snap_end,
                    marker.flags,
                    marker.purge_seqno,
                )
            )
            if marker.flags & MarkerFlag.ACK:
                self._conn.send(encode_response(frame))
        elif opcode == Opcode.DCP_STREAM_END:
            self._owner.stream_ended(self, frame.vbucket, decode_stream_end(frame).reason)
        elif opcode == Opcode.DCP_SET_VBUCKET_STATE:
            self._conn.send(encode_response(frame))

    def _ack(self, nbytes: int) -> None:
        self._unacked_bytes += nbytes
        if self._unacked_bytes >= self._buffer_bytes // 5:
            self._conn.send(encode_buffer_ack(self._unacked_bytes))
            self._unacked_bytes = 0


async def _expect_ok(conn: Connection, data: bytes, opaque: int) -> Frame:
    response = await conn.request(data, opaque)
    if response.status != Status.SUCCESS:
        raise error_for_status(response.status, response.value.decode(errors="replace"))
    return response
