"""``decode_batch`` / ``FrameReader.read_batch``: the columnar hot path must equal the per-frame
path (``FrameReader.next_frame`` + per-message decoders) on every input — the same rows and
control frames in the same order on good input, and a ``ProtocolError`` with the same status on
bad input."""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.protocol.batch import ChangeColumns, decode_batch
from changefeed.protocol.dcp import encode_dcp_noop
from changefeed.protocol.dcp_items import (
    Deletion,
    Expiration,
    Mutation,
    encode_deletion,
    encode_expiration,
    encode_mutation,
)
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.reader import CLOSED, NEED_DATA, FrameReader
from changefeed.protocol.snapshot_marker import SnapshotMarker, encode_snapshot_marker
from changefeed.protocol.status import Status

from .helpers import (
    SETTINGS,
    Row,
    dcp_stream_messages,
    decode_message,
    decode_single,
    encode_message,
    expect_error,
    is_batch_item,
    raw_frame,
    row_of,
    rows_of,
)

# -- the two paths ------------------------------------------------------------------------------


@dataclass
class Outcome:
    rows: list[Row]
    controls: list[tuple[int, Frame]]
    error: Status | None = None


def per_frame_path(wire: bytes, chunks: list[int]) -> Outcome:
    """FrameReader.next_frame + per-message decoders; items become rows, the rest controls."""
    out = Outcome([], [])
    reader = FrameReader()
    try:
        for piece in _pieces(wire, chunks):
            reader.feed(piece)
            while True:  # bounded by the fed bytes
                frame = reader.next_frame()
                if frame is NEED_DATA or frame is CLOSED:
                    break
                assert isinstance(frame, Frame)
                if is_batch_item(frame):
                    item = decode_message(frame)
                    assert isinstance(item, Mutation | Deletion | Expiration)
                    out.rows.append(row_of(item))
                else:
                    out.controls.append((len(out.rows), frame))
            if not piece:
                assert frame is CLOSED
    except ProtocolError as error:
        out.error = error.status
    return out


def batch_path(wire: bytes, chunks: list[int], items_max: int = 1 << 20) -> Outcome:
    """FrameReader.read_batch after every chunk; control positions shifted to stream order."""
    out = Outcome([], [])
    reader = FrameReader()
    try:
        for piece in _pieces(wire, chunks):
            reader.feed(piece)
            while True:  # bounded: each round consumes bytes or stops
                batch = reader.read_batch(items_max)
                base = len(out.rows)
                out.rows += rows_of(batch.changes)
                out.controls += [(base + at, frame) for at, frame in batch.controls]
                if batch.consumed == 0:
                    break
        assert reader.buffered_bytes == 0
    except ProtocolError as error:
        out.error = error.status
    return out


def _pieces(wire: bytes, chunks: list[int]) -> list[bytes]:
    """``wire`` cut at the given sizes (cycled), then b"" for EOF."""
    pieces = []
    pos = 0
    index = 0
    while pos < len(wire):  # bounded: sizes are >= 1
        size = chunks[index % len(chunks)] if chunks else len(wire)
        pieces.append(wire[pos : pos + size])
        pos += size
        index += 1
    return [*pieces, b""]


def assert_paths_equal(wire: bytes, chunks: list[int]) -> Outcome:
    expected = per_frame_path(wire, [len(wire) or 1])
    got = batch_path(wire, chunks)
    assert got.error == expected.error
    if expected.error is None:
        assert got.rows == expected.rows
        assert got.controls == expected.controls
    # decode_batch on the whole buffer agrees too.
    try:
        batch = decode_batch(wire)
    except ProtocolError as error:
        assert error.status == expected.error
    else:
        if expected.error is None:
            assert batch.consumed == len(wire)
            assert rows_of(batch.changes) == expected.rows
            assert batch.controls == expected.controls
        else:
            # decode_batch has no EOF: the only error it cannot see is a frame cut off at EOF.
            assert batch.consumed < len(wire)
            assert expected.error == Status.EINVAL
    return expected


# -- good input ---------------------------------------------------------------------------------

chunkings = st.lists(st.integers(1, 400), min_size=1, max_size=5)


@SETTINGS
@given(st.lists(dcp_stream_messages(st.none()), max_size=12), chunkings)
def test_mixture_equals_per_frame_path(messages: list[object], chunks: list[int]) -> None:
    wire = b"".join(encode_message(m) for m in messages)
    outcome = assert_paths_equal(wire, chunks)
    assert outcome.error is None
    assert len(outcome.rows) + len(outcome.controls) == len(messages)
    # Rows are the items, in order; controls decode to the other messages, at their positions.
    rows = iter(outcome.rows)
    controls = iter(outcome.controls)
    items_seen = 0
    for message in messages:
        if isinstance(message, Mutation | Deletion | Expiration):
            assert next(rows) == row_of(message)
            items_seen += 1
        else:
            position, frame = next(controls)
            assert position == items_seen
            assert decode_message(frame) == message


@SETTINGS
@given(st.lists(dcp_stream_messages(), max_size=12), chunkings)
def test_mixture_with_stream_ids_equals_per_frame_path(
    messages: list[object], chunks: list[int]
) -> None:
    # Items with a stream-id (alt magic) are handed over as control frames: the columns carry
    # no stream-id. Decoding those controls gives the original messages back.
    wire = b"".join(encode_message(m) for m in messages)
    outcome = assert_paths_equal(wire, chunks)
    assert outcome.error is None
    rows = iter(outcome.rows)
    controls = iter(outcome.controls)
    for message in messages:
        sid = getattr(message, "stream_id", None)
        if isinstance(message, Mutation | Deletion | Expiration) and sid is None:
            assert next(rows) == row_of(message)
        else:
            assert decode_message(next(controls)[1]) == message


@SETTINGS
@given(st.lists(dcp_stream_messages(st.none()), min_size=1, max_size=12), st.integers(1, 5))
def test_items_max_splits_without_losing_order(messages: list[object], items_max: int) -> None:
    wire = b"".join(encode_message(m) for m in messages)
    whole = batch_path(wire, [len(wire)])
    limited = batch_path(wire, [len(wire)], items_max=items_max)
    assert limited == whole
    batch = decode_batch(wire, items_max=items_max)
    assert len(batch.changes) <= items_max


# -- corrupted input ----------------------------------------------------------------------------


@st.composite
def corruptions(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    messages = draw(st.lists(dcp_stream_messages(), min_size=1, max_size=8))
    wire = bytearray(b"".join(encode_message(m) for m in messages))
    kind = draw(st.sampled_from(["flip", "byte", "truncate", "length", "splice", "delete"]))
    at = draw(st.integers(0, len(wire) - 1))
    if kind == "flip":
        wire[at] ^= 1 << draw(st.integers(0, 7))
    elif kind == "byte":
        wire[at] = draw(st.integers(0, 255))
    elif kind == "truncate":
        del wire[at:]
    elif kind == "length":
        # Overwrite one of a header's length fields (first frame's offsets 2..11).
        field = draw(st.sampled_from([(2, ">H"), (4, ">B"), (8, ">I"), (2, ">B"), (3, ">B")]))
        offset, fmt = field
        limit = (1 << (8 * struct.calcsize(fmt))) - 1
        struct.pack_into(fmt, wire, offset, draw(st.integers(0, limit)))
    elif kind == "splice":
        other = draw(st.integers(0, len(wire) - 1))
        wire[at:at] = wire[other : other + draw(st.integers(1, 64))]
    else:
        del wire[at : at + draw(st.integers(1, 32))]
    return bytes(wire), draw(chunkings)


@SETTINGS
@given(corruptions())
def test_corrupted_both_raise_or_both_agree(case: tuple[bytes, list[int]]) -> None:
    wire, chunks = case
    assert_paths_equal(wire, chunks)


def test_random_bytes_after_valid_prefix_both_paths_agree() -> None:
    rng = random.Random(7)
    prefix = encode_mutation(Mutation(1, 1, 1, b"k", b"v"))
    for _ in range(300):
        tail = bytes([0x80, rng.choice([0x57, 0x58, 0x59, 0x56, 0x5C])]) + rng.randbytes(
            rng.randint(0, 80)
        )
        assert_paths_equal(prefix + tail, [rng.randint(1, 50)])


# -- columns, positions, accounting -------------------------------------------------------------


def test_columns_for_each_item_kind() -> None:
    m = Mutation(3, 4, 10, b"km", b"vm", cas=5, rev_seqno=6, flags=7, expiry=8, datatype=1)
    d1 = Deletion(3, 4, 11, b"kd1", cas=9, rev_seqno=2, delete_time=None)
    d2 = Deletion(3, 4, 12, b"kd2", cas=9, rev_seqno=2, delete_time=77, value=b"x", datatype=4)
    e = Expiration(3, 4, 13, b"ke", cas=1, rev_seqno=3, delete_time=88)
    wire = encode_mutation(m) + encode_deletion(d1) + encode_deletion(d2) + encode_expiration(e)
    batch = decode_batch(wire)
    c = batch.changes
    assert c.opcode == [0x57, 0x58, 0x58, 0x59]
    assert c.seqno == [10, 11, 12, 13]
    assert c.rev_seqno == [6, 2, 2, 3]
    assert c.cas == [5, 9, 9, 1]
    assert c.flags == [7, 0, 0, 0]
    assert c.expiry == [8, 0, 0, 0]
    assert c.delete_time == [0, 0, 77, 88]
    assert c.datatype == [1, 0, 4, 0]
    assert c.key == [b"km", b"kd1", b"kd2", b"ke"]
    assert c.value == [b"vm", b"", b"x", b""]
    assert c.vbucket == [3, 3, 3, 3]
    assert c.opaque == [4, 4, 4, 4]
    assert len(c) == 4
    assert batch.consumed == len(wire)
    assert batch.item_bytes == len(wire)
    assert batch.controls == []


def test_controls_carry_positions_and_are_not_item_bytes() -> None:
    marker = encode_snapshot_marker(SnapshotMarker(0, 1, 1, 2, 1))
    noop = encode_dcp_noop(99)
    m1 = encode_mutation(Mutation(0, 1, 1, b"a", b""))
    m2 = encode_mutation(Mutation(0, 1, 2, b"b", b""))
    wire = marker + m1 + noop + m2 + noop
    batch = decode_batch(wire)
    assert [(at, f.opcode) for at, f in batch.controls] == [(0, 0x56), (1, 0x5C), (2, 0x5C)]
    assert batch.item_bytes == len(m1) + len(m2)
    assert batch.consumed == len(wire)


def test_start_offset_and_partial_tail() -> None:
    m1 = encode_mutation(Mutation(0, 1, 1, b"a", b""))
    m2 = encode_mutation(Mutation(0, 1, 2, b"b", b"xyz"))
    buffer = bytearray(b"JUNK" + m1 + m2[:-1])
    batch = decode_batch(buffer, 4)
    assert batch.changes.seqno == [1]
    assert batch.consumed == len(m1)
    batch = decode_batch(memoryview(bytes(buffer)), 4)
    assert batch.consumed == len(m1)


def test_response_and_alt_magic_items_are_controls() -> None:
    response = raw_frame(Opcode.DCP_MUTATION, magic=Magic.RESPONSE)
    alt = encode_mutation(Mutation(0, 1, 1, b"a", b"", stream_id=5))
    batch = decode_batch(response + alt)
    assert len(batch.changes) == 0
    assert [f.magic for _, f in batch.controls] == [Magic.RESPONSE, Magic.ALT_REQUEST]


def test_empty_columns() -> None:
    assert len(ChangeColumns()) == 0
    batch = decode_batch(b"")
    assert (batch.consumed, batch.item_bytes, len(batch.changes)) == (0, 0, 0)


MUT = struct.pack(">QQIIIHB", 1, 1, 0, 0, 0, 0, 0)


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(raw_frame(0x57, extras=MUT[:30], key=b"k"), id="mutation-extras-30"),
        pytest.param(raw_frame(0x57, extras=MUT + b"\x00", key=b"k"), id="mutation-extras-32"),
        pytest.param(raw_frame(0x57, extras=b"", key=b"k"), id="mutation-no-extras"),
        pytest.param(raw_frame(0x58, extras=bytes(20), key=b"k"), id="deletion-extras-20"),
        pytest.param(raw_frame(0x58, extras=bytes(31), key=b"k"), id="deletion-extras-31"),
        pytest.param(raw_frame(0x59, extras=bytes(21), key=b"k"), id="expiration-extras-21"),
        pytest.param(raw_frame(0x59, extras=bytes(18), key=b"k"), id="expiration-extras-18"),
        pytest.param(
            raw_frame(0x57, extras=struct.pack(">QQIIIHB", 0, 1, 0, 0, 0, 0, 0), key=b"k"),
            id="mutation-seqno-0",
        ),
        pytest.param(
            raw_frame(0x57, extras=struct.pack(">QQIIIHB", 1, 1, 0, 0, 0, 2, 0), key=b"k"),
            id="mutation-nmeta",
        ),
        pytest.param(raw_frame(0x57, extras=MUT), id="mutation-no-key"),
        pytest.param(
            raw_frame(0x58, extras=struct.pack(">QQH", 1, 1, 1), key=b"k"), id="deletion-v1-nmeta"
        ),
        pytest.param(
            raw_frame(0x58, extras=struct.pack(">QQIB", 0, 1, 1, 0), key=b"k"),
            id="deletion-v2-seqno-0",
        ),
        pytest.param(raw_frame(0x59, extras=struct.pack(">QQI", 1, 1, 1)), id="expiration-no-key"),
    ],
)
def test_bad_items_einval_in_both_paths(wire: bytes) -> None:
    expect_error(lambda: decode_batch(wire))
    expect_error(lambda: decode_message(decode_single(wire)))
    outcome = assert_paths_equal(wire, [3])
    assert outcome.error == Status.EINVAL
