"""``FrameReader``: sentinels, incremental splitting, the bound checked from the header alone,
poisoning after an error, EOF handling, and the buffer's memory bound (STYLE.md §1)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed import limits
from changefeed.protocol.dcp import encode_dcp_noop
from changefeed.protocol.dcp_items import Mutation, decode_mutation, encode_mutation
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Magic
from changefeed.protocol.reader import CLOSED, NEED_DATA, FrameReader
from changefeed.protocol.status import Status

from .helpers import (
    SETTINGS,
    Noop,
    dcp_stream_messages,
    decode_message,
    drain,
    encode_message,
    expect_error,
    feed_three_ways,
    header_only,
    raw_frame,
)


def mutation(seqno: int, value_size: int = 10) -> bytes:
    return encode_mutation(Mutation(1, 2, seqno, b"key%d" % seqno, bytes(value_size)))


def test_sentinels_are_distinct_classes_that_print_by_name() -> None:
    assert isinstance(NEED_DATA, type)
    assert isinstance(CLOSED, type)
    assert repr(NEED_DATA) == "NEED_DATA"
    assert repr(CLOSED) == "CLOSED"
    assert NEED_DATA is not CLOSED


def test_empty_reader_needs_data_then_closes() -> None:
    reader = FrameReader()
    assert reader.next_frame() is NEED_DATA
    assert reader.buffered_bytes == 0
    reader.feed(b"")
    assert reader.next_frame() is CLOSED
    assert reader.next_frame() is CLOSED


def test_several_frames_three_ways() -> None:
    wire = mutation(1) + encode_dcp_noop(7) + mutation(2, 300)
    frames = feed_three_ways(
        wire,
        [
            Mutation(1, 2, 1, b"key1", bytes(10)),
            Noop(7),
            Mutation(1, 2, 2, b"key2", bytes(300)),
        ],
        decode=decode_message,
    )
    assert [f.opcode for f in frames] == [0x57, 0x5C, 0x57]


@SETTINGS
@given(st.lists(dcp_stream_messages(), min_size=1, max_size=6), st.integers(0, 2**32))
def test_stream_round_trip(messages: list[object], seed: int) -> None:
    wire = b"".join(encode_message(m) for m in messages)
    feed_three_ways(wire, messages, decode=decode_message, seed=seed)


def test_e2big_from_24_header_bytes_declaring_4_gib() -> None:
    reader = FrameReader()
    reader.feed(header_only(0xFFFF_FFFF))  # 4 GiB - 1; not one body byte has arrived
    assert reader.buffered_bytes == 24
    expect_error(reader.next_frame, Status.E2BIG)


def test_e2big_via_read_batch_from_header_alone() -> None:
    reader = FrameReader()
    reader.feed(mutation(1) + header_only(0xFFFF_FFFF))
    expect_error(reader.read_batch, Status.E2BIG)


def test_e2big_at_custom_limit_and_limit_itself_accepted() -> None:
    reader = FrameReader(frame_size_max=100)
    ok = raw_frame(0x5C, value=bytes(100))
    reader.feed(ok)
    frame = reader.next_frame()
    assert isinstance(frame, Frame)
    assert len(frame.value) == 100
    reader.feed(header_only(101))
    expect_error(reader.next_frame, Status.E2BIG)


def test_frames_before_the_bad_header_are_delivered() -> None:
    reader = FrameReader(frame_size_max=1000)
    reader.feed(mutation(1) + mutation(2) + header_only(5000))
    assert len(drain_until_error(reader)) == 2


def drain_until_error(reader: FrameReader) -> list[Frame]:
    out: list[Frame] = []
    with pytest.raises(ProtocolError):
        while True:  # bounded: the buffer ends in a bad header
            frame = reader.next_frame()
            assert isinstance(frame, Frame)
            out.append(frame)
    return out


@pytest.mark.parametrize(
    ("bad", "status"),
    [
        pytest.param(header_only(0xFFFF_FFFF), Status.E2BIG, id="e2big"),
        pytest.param(b"\x00" * 24, Status.EINVAL, id="bad-magic"),
        pytest.param(raw_frame(0x57, datatype=0x40), Status.EINVAL, id="bad-datatype"),
        pytest.param(raw_frame(0x57, keylen=9, bodylen=3), Status.EINVAL, id="key-over-body"),
        pytest.param(
            raw_frame(0x57, magic=Magic.ALT_REQUEST, framing=b"\xf0"),
            Status.EINVAL,
            id="bad-frame-info",
        ),
    ],
)
def test_poisoned_after_error(bad: bytes, status: Status) -> None:
    reader = FrameReader()
    reader.feed(bad)
    expect_error(reader.next_frame, status)
    # Every later call refuses, with the same status, even once good bytes arrive.
    expect_error(reader.next_frame, status)
    expect_error(lambda: reader.feed(mutation(1)), status)
    expect_error(reader.read_batch, status)
    expect_error(reader.frames, status)
    expect_error(lambda: reader.feed(b""), status)
    expect_error(reader.next_frame, status)


def test_poisoned_after_read_batch_error() -> None:
    reader = FrameReader()
    reader.feed(b"\x00" * 24)
    expect_error(reader.read_batch)
    expect_error(reader.next_frame)


@pytest.mark.parametrize("cut", [1, 10, 23, 24, 25, 40])
def test_eof_mid_frame_raises(cut: int) -> None:
    wire = mutation(1)
    reader = FrameReader()
    reader.feed(wire[:cut])
    assert reader.next_frame() is NEED_DATA
    reader.feed(b"")
    expect_error(reader.next_frame)
    expect_error(reader.next_frame)  # poisoned


@pytest.mark.parametrize("cut", [1, 23, 24, 40])
def test_eof_mid_frame_raises_in_read_batch(cut: int) -> None:
    reader = FrameReader()
    reader.feed(mutation(1) + mutation(2)[:cut])
    reader.feed(b"")
    batch = reader.read_batch()
    assert batch.changes.seqno == [1]
    expect_error(reader.read_batch)


def test_closed_after_eof_once_frames_are_taken() -> None:
    reader = FrameReader()
    reader.feed(mutation(1) + mutation(2))
    reader.feed(b"")
    assert [f.opcode for f in reader.frames()] == [0x57, 0x57]
    assert reader.next_frame() is CLOSED
    assert reader.next_frame() is CLOSED


def test_feed_after_eof_is_our_bug() -> None:
    reader = FrameReader()
    reader.feed(b"")
    with pytest.raises(ValueError):
        reader.feed(b"x")


def test_unfinished_frame_is_never_consumed() -> None:
    wire = mutation(1, 500)
    reader = FrameReader()
    for size in (1, 23, 24, 100, len(wire) - 1):
        reader.feed(wire[reader.buffered_bytes : size])
        assert reader.next_frame() is NEED_DATA
        assert reader.buffered_bytes == size
        batch = reader.read_batch()
        assert batch.consumed == 0
        assert len(batch.changes) == 0
        assert reader.buffered_bytes == size
    reader.feed(wire[-1:])
    frame = reader.next_frame()
    assert isinstance(frame, Frame)
    assert decode_mutation(frame).seqno == 1


def test_accepts_bytearray_and_memoryview() -> None:
    wire = mutation(1) + mutation(2)
    reader = FrameReader()
    reader.feed(bytearray(wire[:30]))
    reader.feed(memoryview(wire)[30:])
    assert [decode_mutation(f).seqno for f in reader.frames()] == [1, 2]


def test_frames_returns_every_complete_frame() -> None:
    reader = FrameReader()
    reader.feed(mutation(1) + mutation(2) + mutation(3)[:5])
    assert len(reader.frames()) == 2
    assert reader.frames() == []
    assert reader.buffered_bytes == 5


def test_read_batch_items_max_and_resume() -> None:
    reader = FrameReader()
    reader.feed(b"".join(mutation(s) for s in range(1, 11)))
    first = reader.read_batch(items_max=3)
    assert first.changes.seqno == [1, 2, 3]
    second = reader.read_batch()
    assert second.changes.seqno == list(range(4, 11))
    assert reader.buffered_bytes == 0


def test_read_batch_then_next_frame_interleave() -> None:
    reader = FrameReader()
    reader.feed(mutation(1) + encode_dcp_noop(5))
    frame = reader.next_frame()
    assert isinstance(frame, Frame)
    batch = reader.read_batch()
    assert len(batch.changes) == 0
    assert [f.opaque for _, f in batch.controls] == [5]


def test_buffer_stays_bounded_and_compacts() -> None:
    # Many frames fed in chunks: what is buffered never exceeds one unfinished frame plus a
    # chunk, and the backing bytearray is compacted instead of growing with the stream.
    rng = random.Random(4)
    wire = b"".join(mutation(s, rng.randint(0, 3000)) for s in range(1, 2001))
    frame_size_max = 4096
    chunk_max = 10_000
    reader = FrameReader(frame_size_max)
    pos = 0
    count = 0
    largest_backing = 0
    while pos < len(wire):  # bounded: each step feeds >= 1 byte
        size = rng.randint(1, chunk_max)
        reader.feed(wire[pos : pos + size])
        pos += size
        assert reader.buffered_bytes <= limits.HEADER_SIZE + frame_size_max + chunk_max
        count += len(drain(reader))
        assert reader.buffered_bytes < limits.HEADER_SIZE + frame_size_max
        largest_backing = max(largest_backing, len(reader._buffer))  # white-box: real memory
    assert count == 2000
    assert largest_backing <= 2 * (limits.HEADER_SIZE + frame_size_max + chunk_max) + 64 * 1024
    assert largest_backing < len(wire) // 4


def test_feed_three_ways_can_fail() -> None:
    # The harness itself must notice a wrong expectation, a missing frame and a leftover byte.
    wire = mutation(1)
    right = Mutation(1, 2, 1, b"key1", bytes(10))
    feed_three_ways(wire, [right], decode=decode_message)
    with pytest.raises(AssertionError):
        feed_three_ways(wire, [Mutation(1, 2, 2, b"key1", bytes(10))], decode=decode_message)
    with pytest.raises(AssertionError):
        feed_three_ways(wire + wire, [right], decode=decode_message)
    with pytest.raises(AssertionError):
        feed_three_ways(wire + b"\x80", [right], decode=decode_message)


def test_skip_oversized_answers_once_and_stays_in_sync() -> None:
    """An oversized request becomes one OversizedFrame; its body is dropped as it arrives
    (never buffered) and the next frame decodes normally, fed whole or byte by byte."""
    from changefeed.protocol.frame import encode_frame
    from changefeed.protocol.opcode import Magic, Opcode
    from changefeed.protocol.reader import OversizedFrame

    big = encode_frame(Magic.REQUEST, Opcode.SET, opaque=0x1234, key=b"k", value=b"v" * 5000)
    after = encode_frame(Magic.REQUEST, Opcode.NOOP, opaque=0x99)
    for step in (len(big) + len(after), 1, 700):
        reader = FrameReader(1024)
        reader.skip_oversized = True
        data = big + after
        seen: list[object] = []
        peak = 0
        for offset in range(0, len(data), step):
            reader.feed(data[offset : offset + step])
            peak = max(peak, reader.buffered_bytes)
            while (frame := reader.next_frame()) is not NEED_DATA:
                seen.append(frame)
        assert seen[0] == OversizedFrame(Magic.REQUEST, Opcode.SET, 0x1234, len(big) - 24)
        assert isinstance(seen[1], Frame)
        assert seen[1].opcode == Opcode.NOOP
        assert seen[1].opaque == 0x99
        assert len(seen) == 2
        assert peak <= step + 24, (step, peak)  # the body was never held


def test_without_skip_oversized_it_is_still_a_poisoning_e2big() -> None:
    from changefeed.protocol.frame import encode_frame
    from changefeed.protocol.opcode import Magic, Opcode

    reader = FrameReader(16)
    reader.feed(encode_frame(Magic.REQUEST, Opcode.SET, key=b"k", value=b"v" * 100))
    with pytest.raises(ProtocolError) as error:
        reader.next_frame()
    assert error.value.status == Status.E2BIG
    with pytest.raises(ProtocolError):
        reader.next_frame()
