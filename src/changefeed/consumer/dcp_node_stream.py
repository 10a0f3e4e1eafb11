"""One DCP connection of a ``DcpClient``: the streams it holds on one node.

A ``DcpClient`` opens one ``NodeStream`` per node that holds active copies of the vbuckets it
streams. The node stream is the asyncio shell of that connection around the one consumer
protocol (`dcp_session.DcpSession`: DCP_OPEN and controls, stream requests, noop replies,
snapshot-marker acks, buffer acks, the wire-ordered split); it turns the session's events into
the application's (`Changes`, `Snapshot`) and hands everything that needs a decision — a
stream request's answer, a stream's end, the loss of the connection — to its ``StreamOwner``
(the client), which knows the sessions and the cluster map.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from changefeed.consumer.connection import Connection, ConnectionClosedError
from changefeed.consumer.dcp_session import (
    DcpSession,
    MarkerReceived,
    PositionMoved,
    Run,
    StreamAnswered,
    StreamEnded,
)
from changefeed.consumer.events import Changes, CollectionEvent, Event, SeqnoAdvanced, Snapshot
from changefeed.consumer.session import VbSession
from changefeed.protocol.batch import Batch
from changefeed.protocol.collections import StreamFilter
from changefeed.protocol.dcp import StreamEndReason, StreamRequest, StreamRole
from changefeed.protocol.errors import error_for_status
from changefeed.protocol.frame import Frame
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
        self, server: str, conn: Connection, owner: StreamOwner, session: DcpSession
    ) -> None:
        self.server = server
        self._conn = conn
        self._owner = owner
        self.session = session

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
        session = DcpSession(buffer_bytes=buffer_bytes)
        try:
            await open_session(conn, session, name=name, role=role, controls=controls)
        except BaseException:
            await conn.close()
            raise
        node = cls(server, conn, owner, session)
        conn.on_push = node._on_push
        conn.on_close = lambda error: owner.disconnected(node, error)
        return node

    @property
    def closed(self) -> bool:
        return self._conn.closed is not None

    def request(
        self,
        session: VbSession,
        *,
        flags: int,
        end_seqno: int,
        stream_filter: StreamFilter | None = None,
    ) -> None:
        """Ask for ``session.vbucket`` from where ``session`` is (its failover log's newest
        uuid, its snapshot range and, on a collections connection — ``stream_filter`` given —
        the manifest uid it saw); the answer comes to ``StreamOwner.stream_answered``.

        Raises:
            ConnectionClosedError: the connection is gone.
        """
        start, snap_start, snap_end = session.request_range()
        value: dict[str, Any] = {}
        if session.purge_seqno:
            value["purge_seqno"] = str(session.purge_seqno)
        if stream_filter is not None and not stream_filter.everything:
            value.update(json.loads(stream_filter.to_json()))  # dcp-wire.md §6.1
        if stream_filter is not None and session.manifest_uid:
            value["uid"] = f"{session.manifest_uid:x}"  # kv_engine stream-request-value.md
        request = StreamRequest(
            session.vbucket, self._conn.next_opaque(), flags, start, end_seqno,
            session.vb_uuid, snap_start, snap_end, value,
        )  # fmt: skip
        self._conn.send(self.session.request(request))

    def pause_reading(self) -> None:
        self._conn.pause_reading()

    def resume_reading(self) -> None:
        self._conn.resume_reading()

    async def close(self) -> None:
        await self._conn.close()

    # -- reader task side ---------------------------------------------------------------------

    def _on_push(self, batch: Batch) -> None:
        """The session's events, in wire order, as the application's and the owner's."""
        owner, changes = self._owner, batch.changes
        for event in self.session.receive(batch):
            match event:
                case Run(start, stop):
                    owner.put(Changes(changes.slice(start, stop)))
                case MarkerReceived(vb, marker):
                    snapshot = Snapshot(
                        vb, marker.snap_start, marker.snap_end, marker.flags, marker.purge_seqno
                    )
                    owner.put(snapshot)
                case StreamAnswered(vb, frame):
                    owner.stream_answered(self, vb, frame)
                case StreamEnded(vb, reason):
                    owner.stream_ended(self, vb, reason)
                case PositionMoved(vb, seqno, message):
                    owner.put(CollectionEvent(vb, message) if message else SeqnoAdvanced(vb, seqno))
                case _:
                    pass  # SyncFrame, SyncRun: application streams never carry them
        owed = self.session.data_to_send()
        if owed and self._conn.closed is None:
            self._conn.send(owed)


async def open_session(
    conn: Connection,
    session: DcpSession,
    *,
    name: str,
    role: StreamRole,
    controls: list[tuple[str, str]],
    consumer_name: str = "",
) -> None:
    """Send the session's DCP_OPEN and controls on ``conn``, each awaited and checked.

    Raises:
        StatusError: the node refused one.
        ConnectionClosedError, TimeoutError: the connection failed meanwhile.
    """
    messages = session.open_messages(
        iter(conn.next_opaque, None),
        name=name, role=role, consumer_name=consumer_name, controls=controls,
    )  # fmt: skip
    for opaque, message in messages:
        response = await conn.request(message, opaque)
        if response.status != Status.SUCCESS:
            raise error_for_status(response.status, response.value.decode(errors="replace"))
