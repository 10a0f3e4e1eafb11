"""``DcpProducer`` with a real bucket: typed stream-request outcomes, roles, the stream limit,
and the frames a pump writes (markers, items in order, STREAM_END) however the bytes are cut."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import CursorKind
from changefeed.producer.backfill_slots import BackfillSlots
from changefeed.producer.producer import DcpProducer
from changefeed.producer.stream_request import Accepted, Refused, RollbackTo
from changefeed.protocol.dcp import (
    OpenFlag,
    StreamEndReason,
    StreamFlag,
    StreamRequest,
    StreamRole,
    decode_stream_end,
)
from changefeed.protocol.dcp_items import decode_deletion, decode_mutation
from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.reader import NEED_DATA, FrameReader
from changefeed.protocol.snapshot_marker import decode_snapshot_marker
from changefeed.protocol.status import Status
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig

SEQNO_FOREVER = 0xFFFF_FFFF_FFFF_FFFF
VB = 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def bucket(tmp_path: Path) -> Iterator[Bucket]:
    config = NodeConfig(data_dir=tmp_path, vbuckets=4, durable=False)
    opened = Bucket.open(config, clock=FakeClock(), rng=random.Random(7))
    yield opened
    for vbucket in opened.vbuckets.values():
        vbucket.close()
    opened.store.close()


def producer(bucket: Bucket, **kwargs: object) -> DcpProducer:
    flags = OpenFlag.PRODUCER | OpenFlag.INCLUDE_DELETE_TIMES
    return DcpProducer("test", flags, source=bucket, clock=FakeClock(), **kwargs)  # type: ignore[arg-type]


def request(
    vb: int = VB,
    start: int = 0,
    end: int = SEQNO_FOREVER,
    *,
    uuid: int = 0,
    flags: int = 0,
    opaque: int = 77,
) -> StreamRequest:
    return StreamRequest(vb, opaque, flags, start, end, uuid, start, start)


def write(bucket: Bucket, count: int, vb: int = VB) -> None:
    vbucket = bucket.vbucket(vb)
    for n in range(count):
        vbucket.set(b"key%d" % (n % 7), b"value%d" % n)
    if count:
        vbucket.delete(b"key0")


def frames(data: bytes) -> list[Frame]:
    reader = FrameReader(64 * 1024 * 1024)
    reader.feed(data)
    out = []
    while (frame := reader.next_frame()) is not NEED_DATA:
        assert isinstance(frame, Frame)
        out.append(frame)
    return out


def describe(frame: Frame) -> tuple[object, ...]:
    """A frame as comparable values: markers, items (seqno, key, value, cas), stream end."""
    if frame.opcode == Opcode.DCP_SNAPSHOT_MARKER:
        marker = decode_snapshot_marker(frame)
        return ("marker", marker.snap_start, marker.snap_end, marker.flags)
    if frame.opcode == Opcode.DCP_MUTATION:
        m = decode_mutation(frame)
        return ("mutation", m.seqno, m.key, m.value, m.cas, m.rev_seqno)
    if frame.opcode == Opcode.DCP_DELETION:
        d = decode_deletion(frame)
        return ("deletion", d.seqno, d.key, d.cas, d.rev_seqno)
    if frame.opcode == Opcode.DCP_STREAM_END:
        return ("end", decode_stream_end(frame).reason)
    raise AssertionError(f"unexpected opcode {frame.opcode:#x}")


def pump_all(p: DcpProducer, budgets: Iterator[int]) -> bytes:
    out: list[bytes] = []
    for budget in budgets:  # bounded by the caller's budgets
        if not p.ready:
            break
        p.pump(out, budget)
    assert not p.ready, "budgets ran out before the streams were drained"
    return b"".join(out)


def test_accepted_carries_the_failover_log_and_the_stream_sends_everything(bucket: Bucket) -> None:
    write(bucket, 20)
    p = producer(bucket)
    outcome = p.stream_request(request(end=bucket.vbucket(VB).high_seqno))
    assert isinstance(outcome, Accepted)
    assert list(outcome.failover_log) == bucket.failover_log(VB)
    assert p.has_stream(VB)
    sent = frames(pump_all(p, iter([1 << 20] * 4)))
    assert {f.opaque for f in sent} == {77}
    assert {f.vbucket for f in sent} == {VB}
    described = [describe(f) for f in sent]
    assert described[0][:2] == ("marker", 0)  # the first marker starts at the start seqno
    snap_end = -1
    for entry in described[:-1]:  # every item lies inside the snapshot announced before it
        if entry[0] == "marker":
            assert isinstance(entry[2], int)
            snap_end = entry[2]
        else:
            assert isinstance(entry[1], int)
            assert entry[1] <= snap_end, (entry, snap_end)
    assert snap_end == 21
    items = [d for d in described if d[0] in ("mutation", "deletion")]
    assert [d[1] for d in items] == sorted(d[1] for d in items)  # seqnos increase
    assert items[-1][:3] == ("deletion", 21, b"key0")
    assert described[-1] == ("end", StreamEndReason.OK)
    assert not p.has_stream(VB)


def test_rollback_and_refusal_are_typed_outcomes(bucket: Bucket) -> None:
    write(bucket, 5)
    p = producer(bucket)
    rollback = p.stream_request(request(start=3, uuid=0xBAD))  # unknown branch: back to 0
    assert isinstance(rollback, RollbackTo)
    assert rollback.seqno == 0
    refused = p.stream_request(request(vb=9))
    assert isinstance(refused, Refused)
    assert refused.status == Status.NOT_MY_VBUCKET
    assert not p.streams


def test_the_connection_stream_limit_is_enforced(bucket: Bucket) -> None:
    p = producer(bucket, streams_max=2)
    assert isinstance(p.stream_request(request(vb=0)), Accepted)
    assert isinstance(p.stream_request(request(vb=1)), Accepted)
    refused = p.stream_request(request(vb=2))
    assert isinstance(refused, Refused)
    assert refused.status == Status.ENOMEM
    assert "streams_max" in refused.message
    existing = p.stream_request(request(vb=1))  # a duplicate is still KEY_EEXISTS, not ENOMEM
    assert isinstance(existing, Refused)
    assert existing.status == Status.KEY_EEXISTS


@pytest.mark.parametrize(
    ("role", "control", "kind", "droppable"),
    [
        (StreamRole.APPLICATION, None, CursorKind.STREAM, True),
        (StreamRole.APPLICATION, "false", CursorKind.STREAM, False),
        (StreamRole.REPLICA, None, CursorKind.REPLICA, False),
        (StreamRole.REPLICA, "true", CursorKind.REPLICA, True),
    ],
)
def test_the_role_decides_the_cursor_kind_not_the_connection_name(
    bucket: Bucket, role: StreamRole, control: str | None, kind: CursorKind, droppable: bool
) -> None:
    flags = OpenFlag.PRODUCER
    # A name with "replication" in it no longer changes anything: the role does.
    p = DcpProducer("replication:looks-like-one", flags, source=bucket, role=role)
    if control is not None:
        assert p.control("supports_cursor_dropping", control)[0] == Status.SUCCESS
    assert isinstance(p.stream_request(request()), Accepted)
    manager = bucket.vbucket(VB).manager
    names = [name for name in manager._cursors if name.startswith("dcp:")]  # test-only peek
    assert len(names) == 1
    cursor = manager.cursor(names[0])
    assert cursor is not None
    assert cursor.kind is kind
    assert cursor.droppable is droppable


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(budgets=st.lists(st.integers(1, 600), min_size=1, max_size=30), count=st.integers(0, 60))
def test_output_is_the_same_however_the_pump_budget_cuts_it(
    tmp_path_factory: pytest.TempPathFactory, budgets: list[int], count: int
) -> None:
    config = NodeConfig(data_dir=tmp_path_factory.mktemp("b"), vbuckets=4, durable=False)
    bucket = Bucket.open(config, clock=FakeClock(), rng=random.Random(3))
    try:
        for vb in (0, 1):
            write(bucket, count, vb)
        expected: list[list[tuple[object, ...]]] = []
        got: list[list[tuple[object, ...]]] = []
        for cut, into in ((iter([1 << 30] * 8), expected), (cycle_forever(budgets), got)):
            p = producer(bucket)
            for vb in (0, 1):
                high = bucket.vbucket(vb).high_seqno
                assert isinstance(p.stream_request(request(vb=vb, end=high, opaque=vb)), Accepted)
            per_vb: dict[int, list[tuple[object, ...]]] = {0: [], 1: []}
            for frame in frames(pump_all(p, cut)):
                per_vb[frame.opaque].append(describe(frame))
            into.extend(per_vb.values())
        assert got == expected
    finally:
        for vbucket in bucket.vbuckets.values():
            vbucket.close()
        bucket.store.close()


def cycle_forever(budgets: list[int]) -> Iterator[int]:
    for _ in range(100_000):  # bounded: enough rounds for any drained test stream
        yield from budgets


def test_from_latest_with_nothing_new_ends_at_once(bucket: Bucket) -> None:
    write(bucket, 3)
    p = producer(bucket)
    high = bucket.vbucket(VB).high_seqno
    outcome = p.stream_request(request(end=high, flags=StreamFlag.FROM_LATEST))
    assert isinstance(outcome, Accepted)
    assert [describe(f) for f in frames(pump_all(p, iter([4096])))] == [("end", StreamEndReason.OK)]


def test_a_flow_controlled_stream_reads_no_further_than_it_sends(bucket: Bucket) -> None:
    """With a 1-byte window the stream sends one message and its cursor stays there, so it
    keeps pinning the checkpoints after it (what a parked reader relies on)."""
    write(bucket, 50)
    p = producer(bucket)
    assert p.control("connection_buffer_size", "1")[0] == Status.SUCCESS
    assert isinstance(p.stream_request(request()), Accepted)
    out: list[bytes] = []
    p.pump(out, 1 << 20)
    assert [describe(f)[0] for f in frames(b"".join(out))] == ["marker"]
    stream = p.streams[VB]
    assert stream.reader.last_seqno == 0  # read the marker only, not a run of items
    assert not p.ready  # the window is full until an ack
    p.on_buffer_ack(len(out[0]))
    p.pump(out, 1 << 20)
    assert stream.last_sent_seqno == stream.reader.last_seqno == 1


def test_v7_status_codes_change_what_closing_a_missing_stream_answers(bucket: Bucket) -> None:
    p = producer(bucket)
    assert p.close_stream(3) == Status.KEY_ENOENT
    assert p.control("v7_dcp_status_codes", "true") == (Status.SUCCESS, "")
    assert p.close_stream(3) == Status.DCP_STREAM_NOT_FOUND
    assert p.control("v7_dcp_status_codes", "false")[0] == Status.EINVAL


def test_backfill_order_is_honest_about_what_it_does(bucket: Bucket) -> None:
    p = producer(bucket)
    assert p.control("backfill_order", "round-robin")[0] == Status.SUCCESS
    assert p.control("backfill_order", "sequential")[0] == Status.NOT_SUPPORTED
    assert p.control("backfill_order", "random")[0] == Status.EINVAL


def test_backfills_wait_for_a_slot_and_all_complete(tmp_path: Path) -> None:
    """With one backfill slot per connection, only one stream reads disk at a time; the
    others wait (not ready, nothing read) and run once the slot is given back."""
    config = NodeConfig(data_dir=tmp_path, vbuckets=4, durable=False)
    first = Bucket.open(config, clock=FakeClock(), rng=random.Random(9))
    for vb in range(3):
        write(first, 30, vb)
    for vbucket in first.vbuckets.values():
        vbucket.close()  # flushed: after reopening, memory holds nothing and streams backfill
    first.store.close()
    bucket = Bucket.open(config, clock=FakeClock(), rng=random.Random(9))
    try:
        slots = BackfillSlots(slots_max=8)
        p = producer(bucket, backfill_slots=slots, backfills_max=1)
        for vb in range(3):
            high = bucket.vbucket(vb).high_seqno
            assert isinstance(p.stream_request(request(vb=vb, end=high, opaque=vb)), Accepted)
        out: list[bytes] = []
        p.pump(out, 300)  # a small budget: the first backfill cannot finish in one pump
        assert slots.in_use == 1
        assert sum(stream.holds_backfill_slot for stream in p.streams.values()) == 1
        waiting = [s for s in p.streams.values() if not s.holds_backfill_slot]
        assert all(s.items_sent == 0 for s in waiting)
        out += [pump_all(p, iter([300] * 10_000))]
        per_vb: dict[int, list[tuple[object, ...]]] = {0: [], 1: [], 2: []}
        for frame in frames(b"".join(out)):
            per_vb[frame.opaque].append(describe(frame))
        for vb in range(3):
            assert per_vb[vb][-1] == ("end", StreamEndReason.OK)
            assert per_vb[vb][-2][:2] == ("deletion", bucket.vbucket(vb).high_seqno)
        assert slots.in_use == 0
    finally:
        for vbucket in bucket.vbuckets.values():
            vbucket.close()
        bucket.store.close()
