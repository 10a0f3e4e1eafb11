"""The control-segment decoder against corrupted bytes: a clear ControlSegmentError, no crash.

A proxy maps a segment another process wrote (and a crashed provider may have left half
written); a restarted provider decodes it before reusing it. Whatever the bytes, decoding must
either succeed or raise `ControlSegmentError` naming what is wrong — never IndexError,
struct.error, UnicodeDecodeError, a huge allocation or a hang.
"""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.ipc import ControlSegmentError
from changefeed.ipc.layout import (
    CRC_AT,
    SLOT_HEADER,
    ControlLayout,
    Geometry,
    check_control,
    decode_control,
    decode_slot_header,
    encode_header,
)

GEOMETRY = Geometry(
    slot_count=6, slot_bytes=32 * 1024, max_subscribers=3, group=(2, 5, 9), pid_map_entries=4
)


def valid_segment() -> bytearray:
    layout = ControlLayout.of(GEOMETRY)
    buf = bytearray(layout.control_bytes)
    encode_header(memoryview(buf), GEOMETRY, segment_id=99, node_port=11210, bucket="default")
    for index in range(GEOMETRY.max_subscribers):
        struct.pack_into("<I", buf, layout.node(index), 0xFFFF_FFFF)
    return buf


def test_a_valid_segment_decodes() -> None:
    header = check_control(valid_segment())
    assert header.geometry == GEOMETRY
    assert (header.segment_id, header.node_port, header.bucket) == (99, 11210, "default")


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (0, b"X", "bad magic"),
        (8, b"\x02", "layout version 2"),
        (16, b"\x01", "bad geometry"),  # slot_count 1
        (20, b"\x07", "slot_bytes 32775"),
        (64, b"\x01", "checksum mismatch"),  # the node port: no other check covers it
        (32, b"\xff\xff", "group size"),
        (CRC_AT, b"\x00\x00\x00\x00", "checksum mismatch"),
    ],
)
def test_corrupted_header_fields_are_named(offset: int, value: bytes, message: str) -> None:
    buf = valid_segment()
    buf[offset : offset + len(value)] = value
    with pytest.raises(ControlSegmentError, match=message):
        check_control(buf)


def test_live_words_out_of_range_are_named() -> None:
    layout = ControlLayout.of(GEOMETRY)
    buf = valid_segment()
    struct.pack_into("<Q", buf, layout.slot_state(3), 7 << 16 | 9)  # 9 refs, 3 subscribers max
    with pytest.raises(ControlSegmentError, match="slot 3: refcount 9"):
        check_control(buf)
    buf = valid_segment()
    buf[layout.node_slot(1, 2)] = 7
    with pytest.raises(ControlSegmentError, match="transaction log 1: slot flags"):
        check_control(buf)
    buf = valid_segment()
    struct.pack_into("<I", buf, 132, 5 << 16)
    with pytest.raises(ControlSegmentError, match="5 subscribers"):
        check_control(buf)


def test_a_truncated_segment_is_refused() -> None:
    buf = valid_segment()
    for size in (0, 10, 191, 200, len(buf) - 1):
        with pytest.raises(ControlSegmentError):
            check_control(bytes(buf[:size]))


@settings(max_examples=500, deadline=None)
@given(
    edits=st.lists(
        st.tuples(
            st.integers(0, ControlLayout.of(GEOMETRY).control_bytes - 1),
            st.binary(min_size=1, max_size=8),
        ),
        min_size=1,
        max_size=8,
    ),
    cut=st.none() | st.integers(0, ControlLayout.of(GEOMETRY).control_bytes),
)
def test_corrupted_bytes_decode_or_raise_a_clear_error(
    edits: list[tuple[int, bytes]], cut: int | None
) -> None:
    buf = valid_segment()
    for offset, value in edits:
        buf[offset : offset + len(value)] = value[: len(buf) - offset]
    data = bytes(buf if cut is None else buf[:cut])
    try:
        header = check_control(data)
    except ControlSegmentError as error:
        assert str(error)
        return
    assert header.layout.control_bytes <= len(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=4096))
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    for decode in (decode_control, check_control):
        with contextlib.suppress(ControlSegmentError):
            decode(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=SLOT_HEADER.size, max_size=SLOT_HEADER.size))
def test_slot_headers_decode_or_raise_a_clear_error(data: bytes) -> None:
    try:
        header = decode_slot_header(memoryview(data), GEOMETRY)
    except ControlSegmentError:
        return
    assert header.seq > 0 and header.ipc_bytes <= GEOMETRY.slot_payload_bytes
