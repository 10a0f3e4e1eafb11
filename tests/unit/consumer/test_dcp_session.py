"""The sans-IO consumer side of a DCP connection (`consumer.dcp_session.DcpSession`): what it
owes the producer (noop replies, marker acks, buffer acks at the limits fraction) and the
events it makes of a batch, in wire order, with each stream's status — no socket, no node."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed import limits
from changefeed.consumer.dcp_session import (
    DcpSession,
    MarkerReceived,
    Run,
    StreamAnswered,
    StreamEnded,
    StreamStatus,
    SyncFrame,
)
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp import (
    StreamEnd,
    StreamEndReason,
    StreamRequest,
    StreamRole,
    decode_buffer_ack,
    encode_dcp_noop,
    encode_failover_log,
    encode_stream_end,
)
from changefeed.protocol.dcp_items import Abort, Mutation, encode_abort, encode_mutation
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.reader import FrameReader
from changefeed.protocol.snapshot_marker import MarkerFlag, SnapshotMarker, encode_snapshot_marker
from changefeed.protocol.status import Status


def frames_of(data: bytes) -> list[Frame]:
    reader = FrameReader()
    reader.feed(data)
    frames = []
    while isinstance(frame := reader.next_frame(), Frame):
        frames.append(frame)
    return frames


def request(session: DcpSession, vb: int, opaque: int) -> Frame:
    data = session.request(StreamRequest(vb, opaque, 0, 0, 2**64 - 1, 0, 0, 0, {}))
    return frames_of(data)[0]


def answer(req: Frame, status: int = Status.SUCCESS) -> bytes:
    value = encode_failover_log([(7, 0)]) if status == Status.SUCCESS else b""
    return encode_response(req, status, value=value)


def mutation(vb: int, seqno: int) -> bytes:
    return encode_mutation(Mutation(vb, 1, seqno, b"k%d" % seqno, b"v", cas=seqno))


def marker(vb: int, start: int, end: int, flags: int = MarkerFlag.MEMORY) -> bytes:
    return encode_snapshot_marker(SnapshotMarker(vb, 1, start, end, flags))


def test_events_come_in_wire_order_with_runs_between_control_frames() -> None:
    session = DcpSession(buffer_bytes=0)
    req0, req1 = request(session, 0, 10), request(session, 1, 11)
    assert session.status(0) is StreamStatus.REQUESTED
    wire = b"".join(
        [
            answer(req0),
            marker(0, 1, 2),
            mutation(0, 1),
            mutation(0, 2),
            answer(req1, Status.NOT_MY_VBUCKET),
            encode_stream_end(StreamEnd(0, 10, StreamEndReason.STATE_CHANGED)),
            encode_abort(Abort(0, 10, b"k", 3, 4)),
            mutation(0, 5),
        ]
    )
    events = session.receive(decode_batch(wire))
    kinds = [type(e).__name__ for e in events]
    assert kinds == [
        "StreamAnswered", "MarkerReceived", "Run", "StreamAnswered", "StreamEnded", "SyncFrame",
        "Run",
    ]  # fmt: skip
    assert events[2] == Run(0, 2) and events[6] == Run(2, 3)
    assert isinstance(events[1], MarkerReceived) and events[1].marker.snap_end == 2
    assert isinstance(events[4], StreamEnded) and events[4].reason is StreamEndReason.STATE_CHANGED
    assert isinstance(events[5], SyncFrame) and events[5].frame.opcode == Opcode.DCP_ABORT
    assert isinstance(events[3], StreamAnswered) and events[3].vb == 1
    assert session.status(0) is StreamStatus.ENDED  # ended by the producer
    assert session.status(1) is StreamStatus.ENDED  # refused
    assert session.data_to_send() == b""  # no ack asked for, no flow control


def test_noops_marker_acks_and_vbucket_state_changes_are_answered() -> None:
    session = DcpSession(buffer_bytes=0)
    ack_marker = marker(3, 1, 1, MarkerFlag.MEMORY | MarkerFlag.ACK)
    session.receive(decode_batch(encode_dcp_noop(42) + ack_marker))
    owed = frames_of(session.data_to_send())
    assert [(f.opcode, f.opaque) for f in owed] == [
        (Opcode.DCP_NOOP, 42),
        (Opcode.DCP_SNAPSHOT_MARKER, 1),
    ]
    assert session.data_to_send() == b""  # owed once


def test_an_answer_to_a_request_never_sent_is_a_protocol_error() -> None:
    session = DcpSession(buffer_bytes=0)
    req = request(session, 0, 10)
    session.receive(decode_batch(answer(req)))
    with pytest.raises(ProtocolError, match="unknown opaque 10"):
        session.receive(decode_batch(answer(req)))


def test_a_vbucket_is_requested_again_only_once_its_stream_ended() -> None:
    session = DcpSession(buffer_bytes=0)
    req = request(session, 0, 10)
    with pytest.raises(AssertionError):
        request(session, 0, 11)  # a request is out already
    session.receive(decode_batch(answer(req, Status.ROLLBACK)))
    request(session, 0, 12)  # after a rollback answer: again, from the rollback point
    session.forget()
    assert session.status(0) is None and session.streaming() == []


@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=60), window=st.integers(200, 5000))
def test_buffer_acks_cover_every_byte_at_the_fraction(sizes: list[int], window: int) -> None:
    """Model: acks are owed whenever the unacked bytes reach the fraction of the window;
    together they never exceed what arrived, and what is left unacked is below the fraction."""
    session = DcpSession(buffer_bytes=window)
    received = acked = 0
    seqnos = itertools.count(1)
    for size in sizes:
        wire = b"".join(mutation(0, next(seqnos)) for _ in range(size))
        batch = decode_batch(wire)
        session.receive(batch)
        received += batch.item_bytes
        for frame in frames_of(session.data_to_send()):
            assert frame.opcode == Opcode.DCP_BUFFER_ACKNOWLEDGEMENT
            acked += decode_buffer_ack(frame)
    assert acked <= received
    assert received - acked < window * limits.DCP_BUFFER_ACK_FRACTION


def test_open_messages_are_the_open_then_each_control() -> None:
    session = DcpSession(buffer_bytes=1000)
    messages = session.open_messages(
        itertools.count(5),
        name="n",
        role=StreamRole.REPLICA,
        consumer_name="me",
        controls=[("enable_noop", "true"), ("connection_buffer_size", "1000")],
    )
    opcodes = [(opaque, frames_of(data)[0].opcode) for opaque, data in messages]
    assert opcodes == [
        (5, Opcode.DCP_OPEN),
        (6, Opcode.DCP_CONTROL),
        (7, Opcode.DCP_CONTROL),
    ]
