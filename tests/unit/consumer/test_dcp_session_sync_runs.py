"""``DcpSession.receive`` with sync frames as columns (``SyncRun`` events) against the same
session given them as frames (``SyncFrame`` events, ``decode_batch(sync_columns=False)``):
the same changes, sync frames and control events in the same wire order, and the same bytes
owed (noop replies, marker acks, buffer acks at the same points). Hypothesis streams."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.consumer.dcp_session import (
    DcpSession,
    MarkerReceived,
    Run,
    SyncFrame,
    SyncRun,
)
from changefeed.protocol.batch import Batch, decode_batch
from changefeed.protocol.dcp_items import (
    ABORT_EXTRAS,
    Abort,
    Commit,
    Mutation,
    Prepare,
    decode_commit,
    decode_prepare,
    encode_abort,
    encode_commit,
    encode_mutation,
    encode_prepare,
)
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import encode_frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.snapshot_marker import MarkerFlag, SnapshotMarker, encode_snapshot_marker


@st.composite
def streams(draw: st.DrawFn) -> list[bytes]:
    out: list[bytes] = []
    steps: list[tuple[int, str]] = []
    for _ in range(draw(st.integers(0, 25))):  # a kind repeated: runs of one vbucket and kind
        vb = draw(st.integers(0, 2))
        kind = draw(
            st.sampled_from(["prepare", "commit", "abort", "mutation", "marker", "noop", "bad"])
        )
        steps += [(vb, kind)] * draw(st.integers(1, 5))
    for n, (vb, kind) in enumerate(steps):
        seqno = n + 1
        key = b"k%d" % draw(st.integers(0, 3))
        if kind == "prepare":
            prepare = Prepare(vb, n, seqno, key, b"v%d" % n, 5 + n, 1, 2, 3, n % 2 == 0, 1 + n % 3)
            out.append(encode_prepare(prepare))
        elif kind == "commit":
            out.append(encode_commit(Commit(vb, n, key, seqno, seqno + 1)))
        elif kind == "abort":
            out.append(encode_abort(Abort(vb, n, key, seqno, seqno + 1)))
        elif kind == "mutation":
            out.append(encode_mutation(Mutation(vb, 1, seqno, key, b"v", 5, 1, 2, 3)))
        elif kind == "marker":
            flags = MarkerFlag.MEMORY | (MarkerFlag.ACK if n % 3 == 0 else 0)
            out.append(encode_snapshot_marker(SnapshotMarker(vb, n, seqno, seqno + 5, flags)))
        elif kind == "noop":
            out.append(encode_frame(Magic.REQUEST, Opcode.DCP_NOOP, opaque=n))
        else:  # a commit its decoder refuses: stays a SyncFrame either way
            extras = ABORT_EXTRAS.pack(seqno, seqno)
            out.append(encode_frame(Magic.REQUEST, Opcode.DCP_COMMIT, vbucket=vb, extras=extras))
    return out


def wire_order(session: DcpSession, batch: Batch) -> list[object]:
    """The session's events, each change and each sync frame on its own, in order."""
    out: list[object] = []
    syncs = batch.syncs
    for event in session.receive(batch):
        if isinstance(event, Run):
            out += [("change", i) for i in range(event.start, event.stop)]
        elif isinstance(event, SyncRun):
            assert len(set(syncs.vbucket[event.start : event.stop])) == 1
            assert len(set(syncs.opcode[event.start : event.stop])) == 1
            for i in range(event.start, event.stop):
                out.append(
                    ("sync", syncs.vbucket[i], syncs.opcode[i], syncs.seqno[i], syncs.key[i])
                )
        elif isinstance(event, SyncFrame):
            frame = event.frame
            try:
                if frame.opcode == Opcode.DCP_PREPARE:
                    seqno, key = decode_prepare(frame).seqno, frame.key
                elif frame.opcode == Opcode.DCP_COMMIT:
                    seqno, key = decode_commit(frame).commit_seqno, frame.key
                else:
                    out.append(("abort", event.vb, frame.key))
                    continue
            except ProtocolError:
                out.append(("refused", event.vb, bytes(frame.extras)))
                continue
            out.append(("sync", event.vb, frame.opcode, seqno, key))
        elif isinstance(event, MarkerReceived):
            out.append(("marker", event.vb, event.marker))
        else:
            out.append(event)
    return out


@settings(max_examples=100, deadline=None)
@given(streams(), st.lists(st.integers(1, 8), max_size=6), st.sampled_from([0, 200, 1000]))
def test_sync_runs_keep_wire_order_and_acks(
    stream: list[bytes], cuts: list[int], window: int
) -> None:
    columns, frames = DcpSession(buffer_bytes=window), DcpSession(buffer_bytes=window)
    position = 0
    for count in [*cuts, len(stream)]:  # received buffers cut between frames
        data = b"".join(stream[position : position + count])
        position += count
        by_columns = wire_order(columns, decode_batch(data))
        by_frames = wire_order(frames, decode_batch(data, sync_columns=False))
        assert by_columns == by_frames
        assert columns.data_to_send() == frames.data_to_send()
        assert columns.received_bytes == frames.received_bytes
