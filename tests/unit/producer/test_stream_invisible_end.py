"""A stream whose end seqno is reached only by items an application stream does not send (a
SyncWrite PREPARE or ABORT) still ends, from memory and from disk, on an active and on a
replica, after a restart too — the bug multi-host partition tests found: a `to_latest` copy read
("vbuckets [5] not read in 60 s: ... last seqnos {5: 16}") never ended while the copy's high
seqno was a prepare or an abort, which no disk snapshot holds (the store keeps prepares out of
`by_seqno`) and a restarted vbucket holds in no checkpoint either.

Each stream runs through a real `DcpProducer` over real `VBucket`s and store, its bytes are
decoded and fed to a consumer's `VbSession`: the stream must end with STREAM_END(OK), the
producer's position must reach the end seqno, and the consumer must hold a whole snapshot at the
end (its seqno equal to its last marker's end: kv_engine ends an application stream's snapshot
at the max visible seqno). Replica streams still receive the prepares memory holds."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from changefeed.checkpoint import (
    MARKER_FLAG_DISK,
    MARKER_FLAG_MEMORY,
    CursorKind,
    Item,
    SnapshotStart,
    StreamReader,
    SyncItem,
)
from changefeed.consumer.session import VbSession
from changefeed.producer.producer import DcpProducer
from changefeed.producer.stream_machine import StreamMachine, StreamState
from changefeed.producer.stream_request import Accepted, VbucketView
from changefeed.protocol.dcp import (
    OpenFlag,
    StreamEndReason,
    StreamRequest,
    StreamRole,
    decode_stream_end,
)
from changefeed.protocol.dcp_items import decode_prepare
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.reader import NEED_DATA, FrameReader
from changefeed.protocol.snapshot_marker import decode_snapshot_marker
from changefeed.storage import Op, Store
from changefeed.vbucket import VBucket, VBucketState

VB = 5
MAJORITY = 1
FOREVER = 2**64 - 1
PUMPS_MAX = 200  # a handful of items: far more pumps than any stream here needs
ITEM_OPCODES = (Opcode.DCP_MUTATION, Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION)


class Source:
    """The producer's `VbucketSource` over one vbucket."""

    def __init__(self, vbucket: VBucket) -> None:
        self.vbucket = vbucket

    def vbucket_view(self, vb: int) -> VbucketView | None:
        v = self.vbucket
        if vb != v.vb:
            return None
        return VbucketView(v.state, v.high_seqno, v.persisted_seqno, v.purge_seqno, v.failover_log)

    def open_reader(
        self,
        vb: int,
        name: str,
        start_seqno: int,
        *,
        kind: CursorKind,
        droppable: bool,
        end_seqno: int,
    ) -> StreamReader:
        assert vb == self.vbucket.vb, vb
        return self.vbucket.stream(
            name, start_seqno, kind=kind, droppable=droppable, end_seqno=end_seqno
        )


@dataclass
class Streamed:
    """What one stream sent, as a consumer saw it."""

    session: VbSession
    markers: list[tuple[int, int]] = field(default_factory=list)
    seqnos: list[int] = field(default_factory=list)
    prepares: list[int] = field(default_factory=list)
    end: StreamEndReason | None = None
    position: int = 0  # the producer's position when the pumping stopped


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(tmp_path, map_size_bytes=64 * 1024 * 1024, durable=False)
    yield opened
    opened.close()


def make(store: Store, state: VBucketState = VBucketState.ACTIVE) -> VBucket:
    return VBucket(store, VB, state=state, rng=random.Random(7))


def stream(
    vbucket: VBucket,
    start: int = 0,
    end: int | None = None,
    role: StreamRole = StreamRole.APPLICATION,
) -> Streamed:
    """Stream `vbucket` from `start` to `end` (its high seqno: `to_latest`) and decode it."""
    end = vbucket.high_seqno if end is None else end
    session = VbSession(VB, start, start, start)
    producer = DcpProducer(
        "test", OpenFlag.PRODUCER | OpenFlag.INCLUDE_DELETE_TIMES, source=Source(vbucket), role=role
    )
    assert producer.control("connection_buffer_size", str(2**31))[0] == 0
    request = StreamRequest(VB, 9, 0, start, end, vbucket.vb_uuid, start, start)
    assert isinstance(producer.stream_request(request), Accepted)
    opened = producer.streams[VB]
    out: list[bytes] = []
    for _ in range(PUMPS_MAX):  # bounded: a stream that never ends stops here
        if not producer.ready:
            break
        producer.pump(out, 1 << 20)
    streamed = Streamed(session, position=opened.last_sent_seqno)
    reader = FrameReader(1 << 24)
    reader.feed(b"".join(out))
    while (frame := reader.next_frame()) is not NEED_DATA:
        assert streamed.end is None, "nothing follows STREAM_END"
        if frame.opcode == Opcode.DCP_SNAPSHOT_MARKER:  # type: ignore[union-attr]
            marker = decode_snapshot_marker(frame)  # type: ignore[arg-type]
            streamed.markers.append((marker.snap_start, marker.snap_end))
            session.on_marker(marker.snap_start, marker.snap_end)
        elif frame.opcode in ITEM_OPCODES:  # type: ignore[union-attr]
            seqno = int.from_bytes(frame.extras[:8], "big")  # type: ignore[union-attr]
            streamed.seqnos.append(seqno)
            session.on_item(seqno)
        elif frame.opcode == Opcode.DCP_PREPARE:  # type: ignore[union-attr]
            seqno = decode_prepare(frame).seqno  # type: ignore[arg-type]
            streamed.prepares.append(seqno)
            session.on_item(seqno)
        elif frame.opcode == Opcode.DCP_STREAM_END:  # type: ignore[union-attr]
            streamed.end = decode_stream_end(frame).reason  # type: ignore[arg-type]
    return streamed


def assert_ended_whole(streamed: Streamed, end: int) -> None:
    """STREAM_END(OK), the producer at the end seqno, the consumer at a snapshot's end."""
    assert streamed.end is StreamEndReason.OK, streamed
    assert streamed.position == end, streamed
    session = streamed.session
    assert session.seqno == session.snap_end, streamed  # a whole snapshot, not inside one
    if streamed.markers:
        assert streamed.markers[-1][1] <= end, streamed


def replica_with_pending_prepare(store: Store) -> VBucket:
    """A replica holding 1, 2 and a pending prepare at 3 (its high seqno), flushed."""
    replica = make(store, VBucketState.REPLICA)
    replica.replica_snapshot(1, 3)
    replica.queue_replicated(Item(1, b"a", Op.MUTATION, b"one", 11))
    replica.queue_replicated(Item(2, b"b", Op.MUTATION, b"two", 12))
    replica.queue_replicated(SyncItem(3, b"a", Op.PREPARE, Op.MUTATION, b"p", 13, level=1))
    replica.flush()
    assert replica.high_seqno == 3
    return replica


def test_a_restarted_replica_with_a_pending_prepare_at_its_high_seqno_streams_to_the_end(
    store: Store,
) -> None:
    replica_with_pending_prepare(store).release()
    again = make(store, VBucketState.REPLICA)  # the prepare: pending, in no checkpoint
    assert [p.seqno for p in again.pending_prepares] == [3]
    assert again.high_seqno == 3
    streamed = stream(again)
    assert streamed.seqnos == [1, 2]
    assert_ended_whole(streamed, 3)
    later = stream(again, start=2)  # a consumer that holds everything it can see
    assert (later.seqnos, later.markers) == ([], [])
    assert_ended_whole(later, 3)
    replica = stream(again, role=StreamRole.REPLICA)
    assert replica.end is StreamEndReason.OK and replica.position == 3, replica
    assert replica.seqnos == [1, 2]


def test_a_replica_with_a_pending_prepare_in_memory_streams_to_the_end(store: Store) -> None:
    replica = replica_with_pending_prepare(store)
    streamed = stream(replica)
    assert streamed.seqnos == [1, 2]
    assert_ended_whole(streamed, 3)
    to_replica = stream(replica, role=StreamRole.REPLICA)
    assert (to_replica.seqnos, to_replica.prepares) == ([1, 2], [3])  # still sent the prepare
    assert_ended_whole(to_replica, 3)


def active_ending_in_an_abort(store: Store) -> VBucket:
    vb = make(store)
    vb.set(b"a", b"1")  # 1
    vb.set(b"b", b"2")  # 2
    vb.set(b"p", b"3", level=MAJORITY)  # 3: the durable write
    assert vb.abort(b"p") == 4  # timed out: the last item is the abort
    return vb


def test_an_active_whose_last_item_is_an_abort_streams_to_the_end_from_memory(
    store: Store,
) -> None:
    vb = active_ending_in_an_abort(store)
    streamed = stream(vb)
    assert streamed.seqnos == [1, 2]
    assert_ended_whole(streamed, 4)
    to_replica = stream(vb, role=StreamRole.REPLICA)
    assert (to_replica.seqnos, to_replica.prepares) == ([1, 2], [3])
    assert to_replica.end is StreamEndReason.OK and to_replica.position == 4


def test_an_active_whose_last_item_is_an_abort_streams_to_the_end_from_disk(
    store: Store,
) -> None:
    vb = active_ending_in_an_abort(store)
    vb.flush()
    vb.manager.close_open_checkpoint()  # cursorless once flushed: freed, the rest is on disk
    assert vb.manager.first_memory_seqno > 4
    streamed = stream(vb)
    assert streamed.seqnos == [1, 2]
    assert_ended_whole(streamed, 4)
    middle = stream(vb, start=2)  # only the prepare and the abort lie ahead
    assert (middle.seqnos, middle.markers) == ([], [])
    assert_ended_whole(middle, 4)
    to_replica = stream(vb, role=StreamRole.REPLICA)
    assert to_replica.end is StreamEndReason.OK and to_replica.position == 4, to_replica


def test_an_active_restarted_after_an_abort_streams_to_the_end(store: Store) -> None:
    vb = active_ending_in_an_abort(store)
    vb.close()
    again = make(store)
    assert again.high_seqno == 4
    streamed = stream(again)
    assert streamed.seqnos == [1, 2]
    assert_ended_whole(streamed, 4)


def test_a_stream_ending_inside_a_snapshot_with_an_invisible_tail_ends_after_it(
    store: Store,
) -> None:
    vb = make(store)
    vb.set(b"a", b"1")  # 1
    vb.set(b"p", b"2", level=MAJORITY)  # 2: pending, never completes here
    streamed = stream(vb, end=1)
    assert streamed.seqnos == [1]
    assert streamed.end is StreamEndReason.OK
    assert streamed.session.seqno == streamed.session.snap_end == 1
    whole = stream(vb)
    assert whole.seqnos == [1]
    assert_ended_whole(whole, 2)


def test_a_replica_holding_part_of_a_snapshot_streams_to_its_high_seqno(store: Store) -> None:
    replica = make(store, VBucketState.REPLICA)
    replica.replica_snapshot(1, 10)  # the active's snapshot; 4 of its items arrived
    for seqno in range(1, 5):
        replica.queue_replicated(Item(seqno, b"k%d" % seqno, Op.MUTATION, b"v", 10 + seqno))
    assert replica.high_seqno == 4
    streamed = stream(replica)
    assert streamed.seqnos == [1, 2, 3, 4]
    assert streamed.end is StreamEndReason.OK and streamed.position == 4, streamed
    to_replica = stream(replica, role=StreamRole.REPLICA)
    assert to_replica.seqnos == [1, 2, 3, 4]
    assert to_replica.end is StreamEndReason.OK and to_replica.position == 4, to_replica


# -- the machine alone -------------------------------------------------------------------------


def test_a_visible_only_marker_ends_at_the_max_visible_seqno() -> None:
    machine = StreamMachine(0, 9, visible_only=True)
    marker = machine.marker(SnapshotStart(1, 9, MARKER_FLAG_MEMORY, 7))
    assert marker == SnapshotStart(0, 7, MARKER_FLAG_MEMORY)
    machine.items(1, 9)  # 8 and 9 are read (framed as nothing), so the stream is at its end
    assert machine.state is StreamState.ENDING and machine.last_sent_seqno == 9
    replica = StreamMachine(0, 9)  # a replica stream announces the snapshot whole
    assert replica.marker(SnapshotStart(1, 9, MARKER_FLAG_MEMORY, 7)) == SnapshotStart(
        0, 9, MARKER_FLAG_MEMORY
    )


def test_a_snapshot_of_nothing_visible_sends_no_marker_but_is_read() -> None:
    machine = StreamMachine(4, 20, visible_only=True)
    assert machine.marker(SnapshotStart(5, 6, MARKER_FLAG_MEMORY, 4)) is None
    assert machine.live
    machine.items(5, 6)
    assert machine.state is StreamState.SNAPSHOT_PENDING and machine.last_sent_seqno == 6
    marker = machine.marker(SnapshotStart(7, 8, MARKER_FLAG_MEMORY, 8))
    assert marker == SnapshotStart(4, 8, MARKER_FLAG_MEMORY)  # the stream's first marker


def test_caught_up_at_a_disk_snapshot_end_past_its_last_record_ends_the_stream() -> None:
    machine = StreamMachine(0, 4, visible_only=True)
    assert machine.marker(SnapshotStart(1, 4, MARKER_FLAG_DISK, 2)) == SnapshotStart(
        0, 2, MARKER_FLAG_DISK
    )
    machine.items(1, 2)
    assert machine.live  # 3 and 4 (a prepare, its abort) are on no disk
    machine.caught_up(2)
    assert machine.live
    machine.caught_up(4)
    assert machine.end_reason is StreamEndReason.OK and machine.last_sent_seqno == 4


def test_caught_up_inside_a_snapshot_ends_only_at_the_end_seqno() -> None:
    machine = StreamMachine(0, FOREVER)
    machine.marker(SnapshotStart(1, 10, MARKER_FLAG_MEMORY, 4))  # a replica's partial snapshot
    machine.items(1, 4)
    machine.caught_up(4)
    assert machine.state is StreamState.IN_MEMORY_SNAPSHOT  # the rest may come
    bounded = StreamMachine(0, 4)
    bounded.marker(SnapshotStart(1, 10, MARKER_FLAG_MEMORY, 4))
    bounded.items(1, 4)
    assert bounded.live
    bounded.caught_up(4)
    assert bounded.end_reason is StreamEndReason.OK
