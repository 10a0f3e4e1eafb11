"""``decode_batch`` / ``FrameReader.read_batch``: the columnar hot path must equal the per-frame
path (``FrameReader.next_frame`` + per-message decoders) on every input — the same rows and
control frames in the same order on good input, and a ``ProtocolError`` with the same status on
bad input."""

from __future__ import annotations

import itertools
import random
import struct
import tracemalloc
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.protocol.batch import (
    FIELD_DTYPES,
    VECTORISE_FRAMES_MIN,
    Batch,
    ChangeColumns,
    Column,
    decode_batch,
)
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


def batch_path(
    wire: bytes, chunks: list[int], items_max: int = 1 << 20, vectorise: bool | None = None
) -> Outcome:
    """FrameReader.read_batch after every chunk; control positions shifted to stream order."""
    out = Outcome([], [])
    reader = FrameReader()
    try:
        for piece in _pieces(wire, chunks):
            reader.feed(piece)
            while True:  # bounded: each round consumes bytes or stops
                batch = reader.read_batch(items_max, vectorise=vectorise)
                batch.changes._check_invariants()
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


VECTORISE_MODES = (None, True, False)  # by size, numpy, per frame


def assert_paths_equal(wire: bytes, chunks: list[int]) -> Outcome:
    expected = per_frame_path(wire, [len(wire) or 1])
    for vectorise in VECTORISE_MODES:
        got = batch_path(wire, chunks, vectorise=vectorise)
        assert got.error == expected.error, vectorise
        if expected.error is None:
            assert got.rows == expected.rows, vectorise
            assert got.controls == expected.controls, vectorise
        # decode_batch on the whole buffer agrees too.
        try:
            batch = decode_batch(wire, vectorise=vectorise)
        except ProtocolError as error:
            assert error.status == expected.error, vectorise
        else:
            if expected.error is None:
                assert batch.consumed == len(wire)
                assert rows_of(batch.changes) == expected.rows
                assert batch.controls == expected.controls
            else:
                # decode_batch has no EOF: the only error it cannot see is a frame cut at EOF.
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
    for vectorise in VECTORISE_MODES:
        limited = batch_path(wire, [len(wire)], items_max=items_max, vectorise=vectorise)
        assert limited == whole
        batch = decode_batch(wire, items_max=items_max, vectorise=vectorise)
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


@pytest.mark.parametrize("vectorise", VECTORISE_MODES)
def test_columns_for_each_item_kind(vectorise: bool | None) -> None:
    m = Mutation(3, 4, 10, b"km", b"vm", cas=5, rev_seqno=6, flags=7, expiry=8, datatype=1)
    d1 = Deletion(3, 4, 11, b"kd1", cas=9, rev_seqno=2, delete_time=None)
    d2 = Deletion(3, 4, 12, b"kd2", cas=9, rev_seqno=2, delete_time=77, value=b"x", datatype=4)
    e = Expiration(3, 4, 13, b"ke", cas=1, rev_seqno=3, delete_time=88)
    wire = encode_mutation(m) + encode_deletion(d1) + encode_deletion(d2) + encode_expiration(e)
    batch = decode_batch(wire, vectorise=vectorise)
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
    for vectorise in VECTORISE_MODES:
        expect_error(lambda: decode_batch(wire, vectorise=vectorise))  # noqa: B023
    expect_error(lambda: decode_message(decode_single(wire)))
    outcome = assert_paths_equal(wire, [3])
    assert outcome.error == Status.EINVAL


# -- numpy == per frame: the two decoders of decode_batch -----------------------------------------


def _batches_by_both_decoders(
    wire: bytes, cuts: list[int], items_max: int
) -> tuple[list[Batch] | Status, list[Batch] | Status, str, str]:
    """Feed ``wire`` cut at ``cuts`` to two readers, one decoding with numpy and one per frame;
    every ``read_batch`` of each, or the status it failed with (and the error messages)."""
    outcomes: list[list[Batch] | Status] = []
    messages: list[str] = []
    for vectorise in (True, False):
        reader = FrameReader()
        batches: list[Batch] = []
        message = ""
        try:
            for piece in _pieces_at(wire, cuts):
                reader.feed(piece)
                while True:  # bounded: each round consumes bytes or stops
                    batch = reader.read_batch(items_max, vectorise=vectorise)
                    batch.changes._check_invariants()
                    batches.append(batch)
                    if batch.consumed == 0:
                        break
            outcomes.append(batches)
        except ProtocolError as error:
            outcomes.append(error.status)
            message = str(error)
        messages.append(message)
    return outcomes[0], outcomes[1], messages[0], messages[1]


def _pieces_at(wire: bytes, cuts: list[int]) -> list[bytes]:
    """``wire`` split at the given offsets (taken modulo its length), then b"" for EOF."""
    points = sorted({0, len(wire), *(cut % (len(wire) + 1) for cut in cuts)})
    return [*(wire[a:b] for a, b in itertools.pairwise(points)), b""]


def _assert_same_batches(numpy: list[Batch] | Status, per_frame: list[Batch] | Status) -> None:
    if isinstance(numpy, Status) or isinstance(per_frame, Status):
        assert numpy == per_frame
        return
    assert len(numpy) == len(per_frame)
    for got, expected in zip(numpy, per_frame, strict=True):
        assert got.changes == expected.changes
        for name, dtype in FIELD_DTYPES.items():
            assert got.changes.array(name).dtype == dtype, name
            assert np.array_equal(got.changes.array(name), expected.changes.array(name)), name
        assert got.controls == expected.controls
        assert (got.consumed, got.item_bytes) == (expected.consumed, expected.item_bytes)


@SETTINGS
@given(
    st.lists(dcp_stream_messages(), max_size=40),
    st.lists(st.integers(0, 1 << 16), max_size=6),
    st.sampled_from([1, 2, 7, 1 << 20]),
)
def test_numpy_decoder_equals_per_frame_decoder(
    messages: list[object], cuts: list[int], items_max: int
) -> None:
    # Mutations, deletions V1/V2, expirations, markers, stream ends, noops, with and without
    # stream-ids, cut anywhere: the same batches, call by call, array by array.
    wire = b"".join(encode_message(m) for m in messages)
    numpy, per_frame, _, _ = _batches_by_both_decoders(wire, cuts, items_max)
    assert not isinstance(per_frame, Status), per_frame
    _assert_same_batches(numpy, per_frame)


@SETTINGS
@given(corruptions(), st.lists(st.integers(0, 1 << 12), max_size=4))
def test_numpy_decoder_fails_like_per_frame_decoder(
    case: tuple[bytes, list[int]], cuts: list[int]
) -> None:
    wire, _ = case
    numpy, per_frame, numpy_error, per_frame_error = _batches_by_both_decoders(wire, cuts, 1 << 20)
    _assert_same_batches(numpy, per_frame)
    assert numpy_error == per_frame_error, "the numpy decoder raises the per-frame error"


def _random_stream(rng: random.Random, count: int) -> bytes:
    """``count`` stream messages of every kind (long runs of items, some controls)."""
    out = []
    for seqno in range(1, count + 1):
        vb, sid = rng.randrange(1024), rng.choice([None] * 9 + [rng.randint(1, 0xFFFF)])
        key = rng.randbytes(rng.choice([1, 16, rng.randint(1, 250)]))
        kind = rng.random()
        if kind < 0.6:
            value = rng.randbytes(rng.choice([0, 100, rng.randint(0, 3000)]))
            out.append(encode_mutation(Mutation(vb, 7, seqno, key, value, rng.getrandbits(64),
                                                rng.getrandbits(64), rng.getrandbits(32),
                                                rng.getrandbits(32), rng.getrandbits(32),
                                                rng.randint(0, 7), sid)))  # fmt: skip
        elif kind < 0.8:
            delete_time = rng.choice([None, rng.getrandbits(32)])
            out.append(encode_deletion(Deletion(vb, 7, seqno, key, rng.getrandbits(64), 1,
                                                delete_time, stream_id=sid)))  # fmt: skip
        elif kind < 0.9:
            out.append(encode_expiration(Expiration(vb, 7, seqno, key, 5, 1, rng.getrandbits(32),
                                                    stream_id=sid)))  # fmt: skip
        elif kind < 0.95:
            out.append(encode_snapshot_marker(SnapshotMarker(vb, 7, seqno, seqno + 10, 1)))
        else:
            out.append(encode_dcp_noop(seqno))
    return b"".join(out)


def test_long_runs_equal_in_both_decoders_and_by_size() -> None:
    seed = random.SystemRandom().randrange(2**32)
    print(f"test_long_runs_equal_in_both_decoders_and_by_size: seed {seed}")
    rng = random.Random(seed)
    wire = _random_stream(rng, 3000)
    cuts = [rng.randrange(len(wire)) for _ in range(rng.randint(1, 40))]
    numpy, per_frame, _, _ = _batches_by_both_decoders(wire, cuts, 1 << 20)
    _assert_same_batches(numpy, per_frame)
    assert isinstance(per_frame, list)
    assert max(len(b.changes) for b in per_frame) >= VECTORISE_FRAMES_MIN, "runs long enough"
    # decode_batch picking by size agrees with both, on the whole buffer.
    whole = decode_batch(wire)
    assert whole == decode_batch(wire, vectorise=False)
    assert whole.consumed == len(wire)
    assert whole.changes == decode_batch(wire, vectorise=True).changes


# -- ChangeColumns --------------------------------------------------------------------------------


def test_columns_are_read_only_arrays_and_lists_on_demand() -> None:
    frames = [
        encode_mutation(Mutation(vb, 1, seqno, b"k%d" % seqno, b"v" * seqno, cas=2**64 - seqno))
        for vb, seqno in ((1, 5), (2, 6), (1, 7))
    ]
    wire = b"".join(frames)
    changes = decode_batch(wire, vectorise=True).changes
    changes._check_invariants()
    assert changes.array("cas").dtype == np.uint64
    assert changes.cas == [2**64 - 5, 2**64 - 6, 2**64 - 7], "u64 kept exact as Python ints"
    assert all(type(v) is int for v in changes.seqno)
    with pytest.raises(ValueError, match="read-only"):
        changes.array("seqno")[0] = 9
    assert changes.key is changes.key, "built once"
    assert changes.value == [b"v" * 5, b"v" * 6, b"v" * 7]
    middle = changes.slice(1, 3)
    assert middle.data is changes.data, "a slice shares the bytes"
    assert (middle.seqno, middle.key, len(middle)) == ([6, 7], [b"k6", b"k7"], 2)
    assert changes.slice(0, 3) is changes
    assert len(changes.slice(2, 2)) == 0
    assert middle != changes
    assert middle == decode_batch(b"".join(frames[1:]), vectorise=False).changes


def test_columns_from_lists_or_arrays_and_invariants() -> None:
    fields: dict[str, Column] = {name: [1, 2] for name in FIELD_DTYPES} | {"opcode": [0x57, 0x58]}
    offsets = {"key_start": [1, 5], "key_end": [2, 6], "value_end": [4, 7]}
    listed = ChangeColumns(fields | offsets, b"xkvvykw")
    listed._check_invariants()
    assert (listed.key, listed.value, listed.opcode) == ([b"k", b"k"], [b"vv", b"w"], [87, 88])
    arrays = {name: np.array(c, np.int64) for name, c in offsets.items()}
    from_arrays = ChangeColumns(fields | arrays, b"xkvvykw")
    assert from_arrays == listed
    assert listed.array("seqno").dtype == np.uint64, "an array view built on demand"
    assert from_arrays.key_start.tolist() == [1, 5]
    listed._check_invariants()
    assert listed.slice(1, 2).value == [b"w"]
    overlapping = ChangeColumns(
        fields | offsets | {"key_start": [1, 3], "key_end": [2, 4]}, b"x" * 7
    )
    with pytest.raises(AssertionError, match="overlap"):
        overlapping._check_invariants()
    with pytest.raises(AssertionError):
        ChangeColumns(fields | offsets, b"xkv")  # past the data


def test_an_unfinished_frame_is_neither_copied_nor_decoded() -> None:
    # A large value arriving in small chunks: each read_batch costs what it reads (one header),
    # not what is buffered (the old decoder copied the unread bytes on every call).
    frame = encode_mutation(Mutation(0, 1, 1, b"k", bytes(4 << 20)))
    reader = FrameReader()
    reader.feed(frame[:-1])
    tracemalloc.start()
    try:
        batch = reader.read_batch()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (batch.consumed, len(batch.changes)) == (0, 0)
    assert peak < 64 * 1024, peak
    reader.feed(frame[-1:])
    assert reader.read_batch().changes.value == [bytes(4 << 20)]


def test_short_frames_at_the_end_of_the_buffer_in_the_numpy_decoder() -> None:
    # A V1 deletion with a 1-byte key is 43 bytes, shorter than the 55-byte prefix the numpy
    # decoder reads per frame: at the buffer's end its prefix is filled up, never read past.
    short = [encode_deletion(Deletion(2, 1, seqno, b"k", delete_time=None)) for seqno in (1, 2)]
    assert len(short[0]) == 43
    long_run = b"".join(encode_mutation(Mutation(2, 1, seqno, b"m", b"v")) for seqno in range(3, 9))
    cases = [
        (short[0], [1]),
        (short[0] + short[1], [1, 2]),
        (long_run + short[0] + short[1], [3, 4, 5, 6, 7, 8, 1, 2]),
    ]
    for wire, seqnos in cases:
        for extra in (b"", b"\x80"):  # and with the first byte of a frame still to come
            got = decode_batch(wire + extra, vectorise=True)
            assert got == decode_batch(wire + extra, vectorise=False)
            assert got.consumed == len(wire)
            assert got.changes.seqno == seqnos
            assert got.changes.key[-1] == b"k"
