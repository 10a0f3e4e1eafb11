"""The consumer side of one DCP connection, sans-IO: frames in, typed events and bytes out.

Written once and used by both shells that read DCP: the application client
(`dcp_node_stream.NodeStream` under `DcpClient`) and the replica feed
(`cluster.replica_stream.ReplicaFeed`). It owns what the wire asks of any consumer
(dcp-wire.md §4, §8): the DCP_OPEN and control messages, the opaque → vbucket map of stream
requests, each stream's status, NOOP replies, snapshot-marker acks, DCP_SET_VBUCKET_STATE
replies and flow-control buffer acks (every `limits.DCP_BUFFER_ACK_FRACTION` of the window). It
splits a received batch into events *in wire order*: runs of changes between control frames,
and one event per control frame that means something to the shell. What to do with them —
queue rows for an application, apply items to a replica vbucket, roll back, re-request — is the
shell's.

No socket, no clock, no asyncio: the shell feeds `receive` with what its connection decoded
and sends `data_to_send()` (acks are owed bytes, not calls), so the whole consumer protocol is
unit-tested without a node and driven by the cluster simulator.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator

from changefeed import limits
from changefeed.protocol.batch import Batch
from changefeed.protocol.collections import SystemEventMessage, decode_system_event
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
from changefeed.protocol.dcp_items import decode_seqno_advanced
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.quick_init import quick_init
from changefeed.protocol.snapshot_marker import MarkerFlag, SnapshotMarker, decode_snapshot_marker
from changefeed.protocol.sync_columns import SyncColumns


class StreamStatus(enum.Enum):
    """Where one vbucket's stream on this connection is."""

    REQUESTED = "requested"  # a stream request is out, unanswered
    STREAMING = "streaming"  # accepted; changes may arrive
    ENDED = "ended"  # refused, rolled back, or ended by the producer: request again to go on


@quick_init  # built per item: see protocol/quick_init.py
@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """Changes ``start``..``stop`` of the batch (its ``changes`` columns), with no control frame
    between them; they may span vbuckets."""

    start: int
    stop: int


@dataclasses.dataclass(frozen=True, slots=True)
class StreamAnswered:
    """The producer answered the stream request for ``vb`` (``frame.status``: success, rollback,
    or a refusal); the stream is STREAMING on success, else ENDED."""

    vb: int
    frame: Frame


@dataclasses.dataclass(frozen=True, slots=True)
class StreamEnded:
    """DCP_STREAM_END for ``vb``."""

    vb: int
    reason: StreamEndReason


@quick_init  # built per item: see protocol/quick_init.py
@dataclasses.dataclass(frozen=True, slots=True)
class MarkerReceived:
    """A snapshot marker for ``vb`` (already acked on the wire when it asked for an ack)."""

    vb: int
    marker: SnapshotMarker


@quick_init  # built per item: see protocol/quick_init.py
@dataclasses.dataclass(frozen=True, slots=True)
class SyncFrame:
    """DCP_PREPARE, DCP_COMMIT or DCP_ABORT (only replica streams carry them); the shell
    decodes what it needs."""

    vb: int
    frame: Frame


@quick_init  # built per run of sync frames: see protocol/quick_init.py
@dataclasses.dataclass(frozen=True, slots=True)
class SyncRun:
    """Entries ``start``..``stop`` of the batch's ``syncs`` columns (protocol/sync_columns.py):
    DCP_PREPAREs or DCP_COMMITs of one vbucket, consecutive on the wire (only replica streams
    carry them). A sync frame its decoder would refuse, and DCP_ABORT, come as `SyncFrame`."""

    start: int
    stop: int


@dataclasses.dataclass(frozen=True, slots=True)
class PositionMoved:
    """A DCP_SYSTEM_EVENT (``event`` set) or DCP_SEQNO_ADVANCED for ``vb`` at ``seqno``."""

    vb: int
    seqno: int
    event: SystemEventMessage | None = None


Event = Run | StreamAnswered | StreamEnded | MarkerReceived | SyncFrame | SyncRun | PositionMoved

_SYNC_OPCODES = frozenset(map(int, (Opcode.DCP_PREPARE, Opcode.DCP_COMMIT, Opcode.DCP_ABORT)))
_RESPONSE_MAGICS = frozenset((int(Magic.RESPONSE), int(Magic.ALT_RESPONSE)))
_OP_STREAM_REQ = int(Opcode.DCP_STREAM_REQ)
_OP_NOOP = int(Opcode.DCP_NOOP)
_OP_SNAPSHOT_MARKER = int(Opcode.DCP_SNAPSHOT_MARKER)
_OP_STREAM_END = int(Opcode.DCP_STREAM_END)
_OP_SET_VBUCKET_STATE = int(Opcode.DCP_SET_VBUCKET_STATE)
_OP_SYSTEM_EVENT = int(Opcode.DCP_SYSTEM_EVENT)
_OP_SEQNO_ADVANCED = int(Opcode.DCP_SEQNO_ADVANCED)


class DcpSession:
    """The consumer protocol of one DCP connection.

    Args:
        buffer_bytes: the flow-control window announced (``connection_buffer_size``); 0 = no
            flow control (no buffer acks are owed).
    """

    def __init__(self, *, buffer_bytes: int) -> None:
        assert buffer_bytes >= 0, buffer_bytes
        self.buffer_bytes = buffer_bytes
        self._unacked_bytes = 0
        self._opaque_vb: dict[int, int] = {}
        self._status: dict[int, StreamStatus] = {}
        self._outbox: list[bytes] = []
        self.received_bytes = 0  # wire bytes of data and control messages taken

    # -- what the shell sends -------------------------------------------------------------------

    def open_messages(
        self,
        opaques: Iterator[int],
        *,
        name: str,
        role: StreamRole,
        consumer_name: str = "",
        controls: list[tuple[str, str]],
    ) -> list[tuple[int, bytes]]:
        """DCP_OPEN (as a producer's consumer, with delete times) and then each control, as
        ``(opaque, request)``: the shell sends each and expects SUCCESS before the next."""
        flags = OpenFlag.PRODUCER | OpenFlag.INCLUDE_DELETE_TIMES
        opaque = next(opaques)
        messages = [(opaque, encode_dcp_open(DcpOpen(opaque, name, flags, consumer_name, role)))]
        for key, value in controls:
            opaque = next(opaques)
            messages.append((opaque, encode_dcp_control(DcpControl(opaque, key, value))))
        return messages

    def request(self, request: StreamRequest) -> bytes:
        """The stream request to send for ``request.vbucket``; its answer comes back as
        `StreamAnswered`. A vbucket has at most one request out."""
        vb = request.vbucket
        self.require(vb, None, StreamStatus.ENDED)
        self._opaque_vb[request.opaque] = vb
        self._status[vb] = StreamStatus.REQUESTED
        return encode_stream_request(request)

    def data_to_send(self) -> bytes:
        """The replies and acks owed since the last call (send them in this order)."""
        owed, self._outbox = self._outbox, []
        return b"".join(owed)

    # -- what the shell receives ----------------------------------------------------------------

    def receive(self, batch: Batch) -> list[Event]:
        """Events of one decoded batch, in wire order.

        Raises:
            ProtocolError: a stream answer for an opaque this session never sent.
        """
        events: list[Event] = []
        done = 0
        syncs = batch.syncs
        taken = 0  # sync frames given as events so far
        for index, (position, frame) in enumerate(batch.controls):
            if taken < len(syncs) and syncs.control[taken] == index:
                done, taken = self._sync_runs(events, syncs, taken, index, done)
            if position > done:
                events.append(Run(done, position))
                done = position
            event = self._control(frame)
            if event is not None:
                events.append(event)
        if taken < len(syncs):
            done, taken = self._sync_runs(events, syncs, taken, len(batch.controls), done)
        assert taken == len(syncs), (taken, len(syncs))
        if len(batch.changes) > done:
            events.append(Run(done, len(batch.changes)))
        self._consumed(batch.item_bytes)
        return events

    def status(self, vb: int) -> StreamStatus | None:
        """The stream's status, or None if this session never requested ``vb``."""
        return self._status.get(vb)

    def require(self, vb: int, *expected: StreamStatus | None) -> None:
        """Assert ``vb``'s stream is in one of ``expected`` (a bug in the shell otherwise)."""
        status = self._status.get(vb)
        assert status in expected, (vb, status, expected)

    def streaming(self) -> list[int]:
        """The vbuckets whose streams are open now."""
        return [vb for vb, s in self._status.items() if s is StreamStatus.STREAMING]

    def forget(self) -> None:
        """The connection is gone: no request is out, no stream open, no ack owed."""
        self._opaque_vb.clear()
        self._status.clear()
        self._outbox.clear()
        self._unacked_bytes = 0

    # -- inside ---------------------------------------------------------------------------------

    def _sync_runs(
        self, events: list[Event], syncs: SyncColumns, taken: int, control: int, done: int
    ) -> tuple[int, int]:
        """The sync frames from ``taken`` that precede control frame ``control``, as runs
        (`SyncRun`) between the changes around them. Returns (changes given, syncs given)."""
        count = len(syncs)
        positions, controls, sizes = syncs.position, syncs.control, syncs.wire_size
        while taken < count and controls[taken] == control:  # bounded by the sync frames
            position = positions[taken]
            assert position >= done, (position, done)
            if position > done:
                events.append(Run(done, position))
                done = position
            stop = syncs.run_end(taken)
            self._consumed_each(sizes[taken:stop])
            events.append(SyncRun(taken, stop))
            taken = stop
        return done, taken

    def _consumed_each(self, sizes: list[int]) -> None:
        """`_consumed` of each size in turn (a buffer ack goes out where one call per frame
        would send it), in one step while no ack is due, the usual case."""
        total = sum(sizes)
        if not self.buffer_bytes or (
            self._unacked_bytes + total < self.buffer_bytes * limits.DCP_BUFFER_ACK_FRACTION
        ):
            self.received_bytes += total
            self._unacked_bytes += total if self.buffer_bytes else 0
            return
        for size in sizes:  # an ack falls inside: frame by frame
            self._consumed(size)

    def _control(self, frame: Frame) -> Event | None:
        # Plain ints (_RESPONSE_MAGICS, _OP_*): an Enum member's lookup costs ~0.25 us on
        # 3.11 and this runs per control frame (twice per durable write on a replica).
        opcode = frame.opcode
        if frame.magic in _RESPONSE_MAGICS:
            if opcode != _OP_STREAM_REQ:
                return None  # other responses (controls after open) are the shell's
            vb = self._opaque_vb.pop(frame.opaque, None)
            if vb is None:
                raise ProtocolError(f"stream response for unknown opaque {frame.opaque}")
            self.require(vb, StreamStatus.REQUESTED)
            ok = frame.status == 0
            self._status[vb] = StreamStatus.STREAMING if ok else StreamStatus.ENDED
            return StreamAnswered(vb, frame)
        if opcode == _OP_NOOP:
            self._outbox.append(encode_response(frame))  # not counted by flow control
            return None
        self._consumed(frame.wire_size)
        vb = frame.vbucket
        if opcode in _SYNC_OPCODES:
            return SyncFrame(vb, frame)
        if opcode == _OP_SNAPSHOT_MARKER:
            marker = decode_snapshot_marker(frame)
            if marker.flags & MarkerFlag.ACK:
                self._outbox.append(encode_response(frame))
            return MarkerReceived(vb, marker)
        if opcode == _OP_STREAM_END:
            if self._status.get(vb) is StreamStatus.STREAMING:
                self._status[vb] = StreamStatus.ENDED
            return StreamEnded(vb, decode_stream_end(frame).reason)
        if opcode == _OP_SET_VBUCKET_STATE:
            self._outbox.append(encode_response(frame))
            return None
        if opcode == _OP_SYSTEM_EVENT:
            message = decode_system_event(frame)
            return PositionMoved(vb, message.seqno, message)
        if opcode == _OP_SEQNO_ADVANCED:
            return PositionMoved(vb, decode_seqno_advanced(frame).seqno)
        return None  # what a consumer may ignore (OSO markers, ...)

    def _consumed(self, nbytes: int) -> None:
        self.received_bytes += nbytes
        if not self.buffer_bytes:
            return
        self._unacked_bytes += nbytes
        if self._unacked_bytes >= self.buffer_bytes * limits.DCP_BUFFER_ACK_FRACTION:
            self._outbox.append(encode_buffer_ack(self._unacked_bytes))
            self._unacked_bytes = 0
