"""Shared test helpers for ``changefeed.protocol``: the feed-three-ways harness (h11's habit,
STYLE.md §1), raw frame builders that bypass the encoders' checks, message strategies for
hypothesis and a table of every decoder for the fuzz tests.

Nothing here asserts anything about a particular message; the tests do.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from changefeed import limits
from changefeed.protocol import (
    collections,
    dcp,
    dcp_items,
    error_map,
    kv,
    kv_ops,
    sasl,
    scram,
    subdoc,
)
from changefeed.protocol.batch import ChangeColumns, decode_batch
from changefeed.protocol.dcp import StreamEnd, StreamEndReason
from changefeed.protocol.dcp_items import Deletion, Expiration, Mutation, SeqnoAdvanced
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame
from changefeed.protocol.frame_info import decode_frame_infos, stream_id_of
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.reader import CLOSED, NEED_DATA, FrameReader
from changefeed.protocol.snapshot_marker import (
    MARKER_FLAGS_MASK,
    MarkerVersion,
    SnapshotMarker,
    decode_snapshot_marker,
    encode_snapshot_marker,
)
from changefeed.protocol.status import Status

# No deadline: the suite runs on loaded CI machines; example counts stay at hypothesis' default.
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

HEADER = struct.Struct(">BBHBBHIIQ")
ALT_HEADER = struct.Struct(">BBBBBBHIIQ")
ITEM_OPCODES = frozenset((Opcode.DCP_MUTATION, Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION))


# -- feeding --------------------------------------------------------------------------------------


def frame_ends(data: bytes) -> list[int]:
    """Offsets just past each frame in ``data``, read from the headers (bodylen at offset 8).

    An independent oracle for where the reader may cut: it must return frame ``i`` exactly when
    byte ``ends[i] - 1`` has arrived, not before and not later.
    """
    ends = []
    pos = 0
    while pos + limits.HEADER_SIZE <= len(data):
        (bodylen,) = struct.unpack_from(">I", data, pos + 8)
        pos += limits.HEADER_SIZE + bodylen
        if pos > len(data):
            break
        ends.append(pos)
    return ends


def drain(reader: FrameReader) -> list[Frame]:
    """Every frame the reader can give now; stops at NEED_DATA (CLOSED is an error here)."""
    out: list[Frame] = []
    while True:  # bounded: each frame consumes >= 24 buffered bytes
        frame = reader.next_frame()
        if frame is NEED_DATA:
            return out
        assert frame is not CLOSED, "CLOSED before EOF"
        assert isinstance(frame, Frame), frame
        out.append(frame)


def _finish(reader: FrameReader, way: str) -> None:
    assert reader.buffered_bytes == 0, (way, reader.buffered_bytes)
    assert reader.next_frame() is NEED_DATA, way
    reader.feed(b"")
    assert reader.next_frame() is CLOSED, way
    assert reader.next_frame() is CLOSED, way  # CLOSED is sticky


def feed_three_ways(
    data: bytes,
    expected: Sequence[object] | object,
    *,
    decode: Callable[[Frame], object] | None = None,
    frame_size_max: int = limits.FRAME_SIZE_MAX,
    seed: int = 0,
    check_batch: bool = True,
) -> list[Frame]:
    """Feed ``data`` to fresh ``FrameReader``s whole, one byte at a time and in random chunks;
    each way must produce exactly ``expected`` (after ``decode`` if given) and leave nothing
    behind: no buffered bytes, ``NEED_DATA``, then ``CLOSED`` after EOF.

    A fourth way appends a trailing partial header: the frames still come out, the tail stays
    buffered unconsumed, and EOF inside it raises ``ProtocolError``.

    Returns:
        The frames of the whole-feed way, for further checks.
    """
    if not isinstance(expected, list | tuple):
        expected = [expected]
    expected = list(expected)

    def conv(frames: list[Frame]) -> list[object]:
        return [decode(f) if decode else f for f in frames]

    ends = frame_ends(data)
    assert len(ends) == len(expected), ("test data holds", len(ends), "frames")
    assert not ends or ends[-1] == len(data), "test data must be whole frames"

    # 1. whole
    reader = FrameReader(frame_size_max)
    reader.feed(data)
    whole = drain(reader)
    assert conv(whole) == expected, "whole"
    _finish(reader, "whole")

    # 2. one byte at a time: frame i appears exactly when its last byte arrives.
    reader = FrameReader(frame_size_max)
    got: list[Frame] = []
    for index in range(len(data)):
        reader.feed(data[index : index + 1])
        got += drain(reader)
        arrived = index + 1
        complete = sum(1 for end in ends if end <= arrived)
        assert len(got) == complete, ("bytewise", arrived, len(got), complete)
        last_end = max([0, *(end for end in ends if end <= arrived)])
        assert reader.buffered_bytes == arrived - last_end, ("bytewise", arrived)
    assert conv(got) == expected, "bytewise"
    _finish(reader, "bytewise")

    # 3. random chunks, seeded so a failure replays.
    rng = random.Random(seed ^ len(data))
    reader = FrameReader(frame_size_max)
    got = []
    pos = 0
    while pos < len(data):  # bounded: every step feeds at least one byte
        size = rng.randint(1, max(1, len(data) // 3 + 1))
        reader.feed(data[pos : pos + size])
        pos += size
        got += drain(reader)
    assert conv(got) == expected, ("chunks", seed)
    _finish(reader, "chunks")

    # 4. trailing bytes: a partial header after the frames is kept, not consumed, not parsed.
    tail = bytes((Magic.REQUEST, Opcode.DCP_NOOP)) + bytes(rng.randint(0, 21))
    reader = FrameReader(frame_size_max)
    reader.feed(data + tail)
    assert conv(drain(reader)) == expected, "trailing"
    assert reader.buffered_bytes == len(tail), "trailing"
    reader.feed(b"")
    with pytest.raises(ProtocolError) as info:
        reader.next_frame()
    assert info.value.status == Status.EINVAL

    if check_batch:
        batch = decode_batch(data, frame_size_max=frame_size_max)
        assert batch.consumed == len(data)
        assert len(batch.changes) + len(batch.controls) == len(expected)
        for vectorise in (True, False):  # decode_batch's two decoders agree (test_batch.py)
            again = decode_batch(data, frame_size_max=frame_size_max, vectorise=vectorise)
            assert again == batch, vectorise
    return whole


def decode_single(data: bytes, frame_size_max: int = limits.FRAME_SIZE_MAX) -> Frame:
    """The one frame in ``data``, which must be exactly one whole frame."""
    reader = FrameReader(frame_size_max)
    reader.feed(data)
    frame = reader.next_frame()
    assert isinstance(frame, Frame), frame
    assert reader.buffered_bytes == 0
    return frame


def expect_error(call: Callable[[], object], status: Status = Status.EINVAL) -> ProtocolError:
    """``call()`` must raise ``ProtocolError`` with ``status`` (any other exception fails)."""
    with pytest.raises(ProtocolError) as info:
        call()
    assert info.value.status == status, (Status.name_of(info.value.status), str(info.value))
    return info.value


# -- raw frames: headers that the encoders would refuse to build -----------------------------


def raw_frame(
    opcode: int,
    *,
    magic: int = Magic.REQUEST,
    datatype: int = 0,
    vbucket: int = 0,
    opaque: int = 0,
    cas: int = 0,
    framing: bytes = b"",
    extras: bytes = b"",
    key: bytes = b"",
    value: bytes = b"",
    keylen: int | None = None,
    extlen: int | None = None,
    framelen: int | None = None,
    bodylen: int | None = None,
) -> bytes:
    """Header + body with every length overridable, for hostile-input tests."""
    body = framing + extras + key + value
    keylen = len(key) if keylen is None else keylen
    extlen = len(extras) if extlen is None else extlen
    framelen = len(framing) if framelen is None else framelen
    bodylen = len(body) if bodylen is None else bodylen
    if magic in (Magic.ALT_REQUEST, Magic.ALT_RESPONSE):
        header = ALT_HEADER.pack(
            magic, opcode, framelen, keylen, extlen, datatype, vbucket, bodylen, opaque, cas
        )
    else:
        assert framelen == 0
        header = HEADER.pack(magic, opcode, keylen, extlen, datatype, vbucket, bodylen, opaque, cas)
    return header + body


def header_only(bodylen: int, *, magic: int = Magic.REQUEST, opcode: int = 0x57) -> bytes:
    """Just the 24 header bytes of a frame that declares ``bodylen``."""
    return HEADER.pack(magic, opcode, 0, 0, 0, 0, bodylen, 0, 0)


# -- hypothesis strategies --------------------------------------------------------------------

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFF_FFFF)
u64 = st.integers(0, 0xFFFF_FFFF_FFFF_FFFF)
seqnos = st.integers(1, 0xFFFF_FFFF_FFFF_FFFF)
datatypes = st.integers(0, 7)
keys = st.binary(min_size=1, max_size=250)  # alt framing caps keys at 255 bytes
values = st.binary(max_size=160)
stream_ids = st.none() | st.integers(1, 0xFFFF)


@st.composite
def mutations(draw: st.DrawFn, stream_id: st.SearchStrategy[int | None] = stream_ids) -> Mutation:
    return Mutation(
        vbucket=draw(u16),
        opaque=draw(u32),
        seqno=draw(seqnos),
        key=draw(keys),
        value=draw(values),
        cas=draw(u64),
        rev_seqno=draw(u64),
        flags=draw(u32),
        expiry=draw(u32),
        lock_time=draw(u32),
        datatype=draw(datatypes),
        stream_id=draw(stream_id),
    )


@st.composite
def deletions(draw: st.DrawFn, stream_id: st.SearchStrategy[int | None] = stream_ids) -> Deletion:
    return Deletion(
        vbucket=draw(u16),
        opaque=draw(u32),
        seqno=draw(seqnos),
        key=draw(keys),
        cas=draw(u64),
        rev_seqno=draw(u64),
        delete_time=draw(st.none() | u32),  # None = V1 (18-byte extras), else V2 (21)
        value=draw(st.binary(max_size=40)),
        datatype=draw(datatypes),
        stream_id=draw(stream_id),
    )


@st.composite
def expirations(
    draw: st.DrawFn, stream_id: st.SearchStrategy[int | None] = stream_ids
) -> Expiration:
    return Expiration(
        vbucket=draw(u16),
        opaque=draw(u32),
        seqno=draw(seqnos),
        key=draw(keys),
        cas=draw(u64),
        rev_seqno=draw(u64),
        delete_time=draw(u32),
        value=draw(st.binary(max_size=40)),
        datatype=draw(datatypes),
        stream_id=draw(stream_id),
    )


@st.composite
def seqno_advances(
    draw: st.DrawFn, stream_id: st.SearchStrategy[int | None] = stream_ids
) -> SeqnoAdvanced:
    return SeqnoAdvanced(draw(u16), draw(u32), draw(u64), draw(stream_id))


@st.composite
def snapshot_markers(
    draw: st.DrawFn, stream_id: st.SearchStrategy[int | None] = stream_ids
) -> SnapshotMarker:
    version = draw(st.sampled_from(list(MarkerVersion)))
    a, b = sorted((draw(u64), draw(u64)))
    v2 = version is not MarkerVersion.V1
    v22 = version is MarkerVersion.V2_2
    return SnapshotMarker(
        vbucket=draw(u16),
        opaque=draw(u32),
        snap_start=a,
        snap_end=b,
        flags=draw(st.integers(0, MARKER_FLAGS_MASK)),
        max_visible_seqno=draw(u64) if v2 else 0,
        high_completed_seqno=draw(u64) if v2 else 0,
        purge_seqno=draw(u64) if v22 else 0,
        high_prepared_seqno=draw(u64) if v22 else 0,
        version=version,
        stream_id=draw(stream_id),
    )


@st.composite
def stream_ends(
    draw: st.DrawFn, stream_id: st.SearchStrategy[int | None] = stream_ids
) -> StreamEnd:
    return StreamEnd(
        draw(u16), draw(u32), draw(st.sampled_from(list(StreamEndReason))), draw(stream_id)
    )


class Noop:
    """A DCP_NOOP in a generated stream (there is no message class for it)."""

    def __init__(self, opaque: int) -> None:
        self.opaque = opaque

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Noop) and other.opaque == self.opaque

    def __repr__(self) -> str:
        return f"Noop({self.opaque})"


def noops() -> st.SearchStrategy[Noop]:
    return st.builds(Noop, u32)


def dcp_stream_messages(stream_id: st.SearchStrategy[int | None] = stream_ids) -> Any:
    """One of the messages a producer pushes on a stream."""
    return st.one_of(
        mutations(stream_id),
        deletions(stream_id),
        expirations(stream_id),
        snapshot_markers(stream_id),
        stream_ends(stream_id),
        noops(),
    )


def encode_message(message: object) -> bytes:
    """Encode any stream message generated above."""
    if isinstance(message, Mutation):
        return dcp_items.encode_mutation(message)
    if isinstance(message, Deletion):
        return dcp_items.encode_deletion(message)
    if isinstance(message, Expiration):
        return dcp_items.encode_expiration(message)
    if isinstance(message, SeqnoAdvanced):
        return dcp_items.encode_seqno_advanced(message)
    if isinstance(message, SnapshotMarker):
        return encode_snapshot_marker(message)
    if isinstance(message, StreamEnd):
        return dcp.encode_stream_end(message)
    if isinstance(message, Noop):
        return dcp.encode_dcp_noop(message.opaque)
    raise AssertionError(f"no encoder for {message!r}")


def decode_message(frame: Frame) -> object:
    """Decode a stream frame by its opcode with the per-message decoders."""
    decoder = STREAM_DECODERS.get(frame.opcode)
    if decoder is None:
        return frame
    return decoder(frame)


def _decode_noop(frame: Frame) -> Noop:
    return Noop(frame.opaque)


STREAM_DECODERS: dict[int, Callable[[Frame], object]] = {
    Opcode.DCP_MUTATION: dcp_items.decode_mutation,
    Opcode.DCP_DELETION: dcp_items.decode_deletion,
    Opcode.DCP_EXPIRATION: dcp_items.decode_expiration,
    Opcode.DCP_SEQNO_ADVANCED: dcp_items.decode_seqno_advanced,
    Opcode.DCP_SNAPSHOT_MARKER: decode_snapshot_marker,
    Opcode.DCP_STREAM_END: dcp.decode_stream_end,
    Opcode.DCP_NOOP: _decode_noop,
}


# -- batch oracle -------------------------------------------------------------------------------

Row = tuple[int, int, int, int, int, int, int, int, int, int, bytes, bytes]


def row_of(item: Mutation | Deletion | Expiration) -> Row:
    """The ``ChangeColumns`` row the batch path must produce for a per-frame decoded item."""
    if isinstance(item, Mutation):
        opcode, flags, expiry, delete_time = Opcode.DCP_MUTATION, item.flags, item.expiry, 0
    elif isinstance(item, Deletion):
        opcode, flags, expiry = Opcode.DCP_DELETION, 0, 0
        delete_time = 0 if item.delete_time is None else item.delete_time
    else:
        opcode, flags, expiry, delete_time = Opcode.DCP_EXPIRATION, 0, 0, item.delete_time
    return (
        int(opcode),
        item.vbucket,
        item.opaque,
        item.seqno,
        item.rev_seqno,
        item.cas,
        flags,
        expiry,
        delete_time,
        item.datatype,
        item.key,
        item.value,
    )


def rows_of(columns: ChangeColumns) -> list[Row]:
    c = columns
    lengths = {
        len(c.opcode),
        len(c.vbucket),
        len(c.opaque),
        len(c.seqno),
        len(c.rev_seqno),
        len(c.cas),
        len(c.flags),
        len(c.expiry),
        len(c.delete_time),
        len(c.datatype),
        len(c.key),
        len(c.value),
    }
    assert len(lengths) == 1, lengths  # every column has one entry per change
    return list(
        zip(
            c.opcode,
            c.vbucket,
            c.opaque,
            c.seqno,
            c.rev_seqno,
            c.cas,
            c.flags,
            c.expiry,
            c.delete_time,
            c.datatype,
            c.key,
            c.value,
            strict=True,
        )
    )


def is_batch_item(frame: Frame) -> bool:
    """Frames ``decode_batch`` turns into column rows: classic-magic DCP item requests.

    Items with a stream-id (alt magic) stay control frames: columns have no stream-id.
    """
    return frame.magic == Magic.REQUEST and frame.opcode in ITEM_OPCODES


# -- every decoder, for fuzzing -----------------------------------------------------------------


def _touch(value: object) -> object:
    """Evaluate the computed properties of a decoded value (they parse peer bytes too)."""
    if isinstance(value, dcp.StreamRequest):
        return (value.stream_id, value.client_purge_seqno)
    if isinstance(value, SnapshotMarker):
        return value.is_disk
    return value


FRAME_DECODERS: list[tuple[str, Callable[[Frame], object]]] = [
    ("dcp_open", dcp.decode_dcp_open),
    ("dcp_control", dcp.decode_dcp_control),
    ("stream_request", dcp.decode_stream_request),
    ("stream_end", dcp.decode_stream_end),
    ("buffer_ack", dcp.decode_buffer_ack),
    ("seqno_acknowledged", dcp.decode_seqno_acknowledged),
    ("set_vbucket_state", dcp.decode_set_vbucket_state),
    ("mutation", dcp_items.decode_mutation),
    ("deletion", dcp_items.decode_deletion),
    ("expiration", dcp_items.decode_expiration),
    ("seqno_advanced", dcp_items.decode_seqno_advanced),
    ("snapshot_marker", decode_snapshot_marker),
    ("hello", kv.decode_hello),
    ("store", kv.decode_store),
    ("key_only", kv.decode_key_only),
    ("vb_state_filter", kv.decode_vb_state_filter),
    ("observe_seqno_request", kv.decode_observe_seqno_request),
    ("seqno_persistence", kv.decode_seqno_persistence),
    ("stream_id", lambda f: f.stream_id),
    # The Couchbase SDK's commands (tests/fuzz/test_fuzz_subdoc.py fuzzes them on their own).
    ("get_meta", kv_ops.decode_get_meta),
    ("touch", kv_ops.decode_touch),
    ("get_locked", kv_ops.decode_get_locked),
    ("unlock", kv_ops.decode_unlock),
    ("arithmetic", kv_ops.decode_arithmetic),
    ("concat", kv_ops.decode_concat),
    ("clustermap_notification", kv_ops.decode_clustermap_notification),
    ("multi_lookup", subdoc.decode_multi_lookup),
    ("multi_mutation", subdoc.decode_multi_mutation),
    ("get_error_map", error_map.decode_get_error_map),
    ("system_event", collections.decode_system_event),
]

BYTES_DECODERS: list[tuple[str, Callable[[bytes], object]]] = [
    ("failover_log", dcp.decode_failover_log),
    ("rollback_seqno", dcp.decode_rollback_seqno),
    ("json_object", lambda b: dcp.decode_json_object(b, "fuzz")),
    ("mutation_token", kv.decode_mutation_token),
    ("get_response_flags", kv.decode_get_response_flags),
    ("vb_seqnos", kv.decode_vb_seqnos),
    ("observe_seqno_result", kv.decode_observe_seqno_result),
    ("plain", sasl.decode_plain),
    ("mechanisms", sasl.decode_mechanisms),
    ("frame_infos", decode_frame_infos),
    ("stream_id_of", stream_id_of),
    ("get_meta_extras", kv_ops.decode_get_meta_extras),
    ("arithmetic_value", kv_ops.decode_arithmetic_value),
    ("lookup_results", subdoc.decode_lookup_results),
    ("mutation_results", subdoc.decode_mutation_results),
    ("error_map", error_map.decode_error_map),
    ("scram_client_first", scram.parse_client_first),
    ("scram_client_final", scram.parse_client_final),
    ("collection_key", collections.split_key),
    ("collection_id_extras", collections.decode_id_extras),
    ("stream_filter", collections.decode_stream_filter),
]


def reencode(value: object) -> bytes | None:
    """Encode a decoded message again, when it has an encoder that accepts every decoded value."""
    if isinstance(value, Mutation | Deletion | Expiration | SeqnoAdvanced | SnapshotMarker):
        return encode_message(value)
    if isinstance(value, StreamEnd):
        return dcp.encode_stream_end(value)
    if isinstance(value, dcp.DcpOpen):
        return dcp.encode_dcp_open(value)
    if isinstance(value, dcp.DcpControl):
        return dcp.encode_dcp_control(value)
    if isinstance(value, dcp.SeqnoAcknowledged):
        return dcp.encode_seqno_acknowledged(value)
    if isinstance(value, dcp.StreamRequest):
        return dcp.encode_stream_request(value)
    if isinstance(value, kv.StoreCommand) and value.opcode in kv.STORE_OPCODES:
        return kv.encode_store(value)
    if isinstance(value, collections.SystemEventMessage):
        return collections.encode_system_event(value)
    return None


def apply_every_decoder(frame: Frame) -> list[tuple[str, object]]:
    """Run every decoder on ``frame`` (and on its parts); the only allowed outcomes are a value
    or ``ProtocolError``. A decoded value must survive encode → decode → encode unchanged
    (compared as bytes, so a JSON ``NaN`` in a stream-request value compares equal)."""
    outcomes: list[tuple[str, object]] = []
    for name, decoder in FRAME_DECODERS:
        try:
            value = decoder(frame)
            _touch(value)
        except ProtocolError as error:
            assert isinstance(error.status, int), (name, error)
            outcomes.append((name, error))
            continue
        outcomes.append((name, value))
        again = reencode(value)
        if again is not None:
            assert reencode(decoder(decode_single(again))) == again, (name, value)
    for part in (frame.extras, frame.key, frame.value, frame.framing_extras):
        for name, bytes_decoder in BYTES_DECODERS:
            try:
                outcomes.append((name, bytes_decoder(part)))
            except ProtocolError as error:
                outcomes.append((name, error))
    return outcomes
