"""DCP_SNAPSHOT_MARKER (0x56): the seed's byte vectors, every flag bit, every version, and the
sizes and versions a decoder must refuse (dcp-wire.md §7.2, seeds/snapshot-marker.md)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given

from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.snapshot_marker import (
    MARKER_FLAGS_MASK,
    MarkerFlag,
    MarkerVersion,
    SnapshotMarker,
    decode_snapshot_marker,
    encode_snapshot_marker,
)
from changefeed.protocol.status import Status

from .helpers import (
    SETTINGS,
    decode_single,
    expect_error,
    feed_three_ways,
    raw_frame,
    snapshot_markers,
    stream_ids,
)

# The seed's V1 example, byte for byte. Errata (dcp-wire.md §14): the seed labels the snapshot
# type 0x00000001 "disk"; 0x01 is Memory (0x02 is Disk).
V1_SEED = bytes.fromhex(
    "80 56 0000 14 00 0000 00000014 deadbeef 0000000000000000"  # header, extras 20
    "0000000000000000"  # snap_start 0
    "0000000000000008"  # snap_end 8
    "00000001"  # flags: Memory
)
V1_MARKER = SnapshotMarker(
    vbucket=0, opaque=0xDEADBEEF, snap_start=0, snap_end=8, flags=MarkerFlag.MEMORY
)

# The seed's V2.0 example written as the REAL encoding. Errata (dcp-wire.md §14): the seed's byte
# diagram looks little-endian (and its header rows say extras 0x14, bodylen 0); the server encodes
# every field big-endian, extras = 1 version byte, bodylen = 1 + 36 = 0x25. The field values are
# the ones the seed's field table lists: start 1, end 8, Disk, MVS 8, HCS 7.
V2_0_SEED = bytes.fromhex(
    "80 56 0000 01 00 0000 00000025 deadbeef 0000000000000000"  # header, extras 1
    "00"  # version 0 = V2.0
    "0000000000000001"  # snap_start 1
    "0000000000000008"  # snap_end 8
    "00000002"  # flags: Disk
    "0000000000000008"  # max_visible_seqno 8
    "0000000000000007"  # high_completed_seqno 7
)
V2_0_MARKER = SnapshotMarker(
    vbucket=0,
    opaque=0xDEADBEEF,
    snap_start=1,
    snap_end=8,
    flags=MarkerFlag.DISK,
    max_visible_seqno=8,
    high_completed_seqno=7,
    version=MarkerVersion.V2_0,
)

# V2.2, built from the reference layout (dcp-wire.md §7.2): version byte 2, then a 52-byte value:
# the V2.0 fields, purge_seqno at 36 and high_prepared_seqno at 44, all big-endian.
V2_2_VECTOR = bytes.fromhex(
    "80 56 0000 01 00 0003 00000035 0000abcd 0000000000000000"  # vb 3, bodylen 1 + 52 = 0x35
    "02"  # version 2 = V2.2
    "0000000000000010"  # snap_start 16
    "0000000000000020"  # snap_end 32
    "00000006"  # flags: Disk | Checkpoint
    "000000000000001f"  # max_visible_seqno 31
    "000000000000001e"  # high_completed_seqno 30
    "0000000000000009"  # purge_seqno 9
    "0000000000000020"  # high_prepared_seqno 32
)
V2_2_MARKER = SnapshotMarker(
    vbucket=3,
    opaque=0xABCD,
    snap_start=16,
    snap_end=32,
    flags=MarkerFlag.DISK | MarkerFlag.CHECKPOINT,
    max_visible_seqno=31,
    high_completed_seqno=30,
    purge_seqno=9,
    high_prepared_seqno=32,
    version=MarkerVersion.V2_2,
)

VECTORS = [
    pytest.param(V1_SEED, V1_MARKER, id="v1-seed"),
    pytest.param(V2_0_SEED, V2_0_MARKER, id="v2.0-seed"),
    pytest.param(V2_2_VECTOR, V2_2_MARKER, id="v2.2"),
]


def test_vector_sizes_match_flow_control_constants() -> None:
    # dcp-wire.md §8.1: a marker is accounted as 44 / 61 / 77 bytes (V1 / V2.0 / V2.2).
    assert (len(V1_SEED), len(V2_0_SEED), len(V2_2_VECTOR)) == (44, 61, 77)


@pytest.mark.parametrize(("wire", "marker"), VECTORS)
def test_vector_decodes(wire: bytes, marker: SnapshotMarker) -> None:
    feed_three_ways(wire, [marker], decode=decode_snapshot_marker)


@pytest.mark.parametrize(("wire", "marker"), VECTORS)
def test_vector_encodes(wire: bytes, marker: SnapshotMarker) -> None:
    assert encode_snapshot_marker(marker) == wire


def test_v1_seed_is_memory_not_disk() -> None:
    marker = decode_snapshot_marker(decode_single(V1_SEED))
    assert marker.flags == MarkerFlag.MEMORY
    assert not marker.is_disk
    assert decode_snapshot_marker(decode_single(V2_0_SEED)).is_disk


def test_v2_0_is_big_endian() -> None:
    # The little-endian reading of the seed's diagram would give start = 1 << 56.
    marker = decode_snapshot_marker(decode_single(V2_0_SEED))
    assert marker.snap_start == 1
    assert marker.high_completed_seqno == 7
    little = struct.pack("<QQIQQ", 1, 8, 2, 8, 7)
    assert V2_0_SEED[25:] != little
    assert V2_0_SEED[25:] == struct.pack(">QQIQQ", 1, 8, 2, 8, 7)


@pytest.mark.parametrize("flag", list(MarkerFlag))
@pytest.mark.parametrize("version", list(MarkerVersion))
def test_every_flag_bit(flag: MarkerFlag, version: MarkerVersion) -> None:
    marker = SnapshotMarker(1, 2, 3, 4, int(flag), version=version)
    wire = encode_snapshot_marker(marker)
    decoded = decode_snapshot_marker(decode_single(wire))
    assert decoded == marker
    assert decoded.flags == flag
    assert decoded.is_disk == (flag is MarkerFlag.DISK)


def test_flag_values() -> None:
    assert [int(f) for f in MarkerFlag] == [0x01, 0x02, 0x04, 0x08, 0x10, 0x20]
    assert MARKER_FLAGS_MASK == 0x3F


@pytest.mark.parametrize("bad_flags", [0x40, 0x80, 0x100, 0x8000_0000, 0xFFFF_FFFF, 0x41])
@pytest.mark.parametrize("version_byte", [None, 0, 2])
def test_unknown_flag_bits_rejected(bad_flags: int, version_byte: int | None) -> None:
    if version_byte is None:
        frame = Frame(0x80, Opcode.DCP_SNAPSHOT_MARKER, extras=struct.pack(">QQI", 1, 2, bad_flags))
    elif version_byte == 0:
        value = struct.pack(">QQIQQ", 1, 2, bad_flags, 0, 0)
        frame = Frame(0x80, Opcode.DCP_SNAPSHOT_MARKER, extras=b"\x00", value=value)
    else:
        value = struct.pack(">QQIQQQQ", 1, 2, bad_flags, 0, 0, 0, 0)
        frame = Frame(0x80, Opcode.DCP_SNAPSHOT_MARKER, extras=b"\x02", value=value)
    expect_error(lambda: decode_snapshot_marker(frame))


def test_encoder_refuses_unknown_flags_and_reversed_range() -> None:
    with pytest.raises(ValueError):
        encode_snapshot_marker(SnapshotMarker(0, 0, 1, 2, 0x40))
    with pytest.raises(ValueError):
        encode_snapshot_marker(SnapshotMarker(0, 0, 3, 2, 0))


@pytest.mark.parametrize(
    ("version_byte", "value_size"),
    [(1, 36), (1, 44), (1, 52), (1, 0), (3, 52), (0xFF, 36)],
)
def test_v2_1_and_unknown_versions_rejected(version_byte: int, value_size: int) -> None:
    # V2.1 (version byte 1) was removed from the spec and is never accepted.
    wire = raw_frame(
        Opcode.DCP_SNAPSHOT_MARKER, extras=bytes((version_byte,)), value=bytes(value_size)
    )
    frame = decode_single(wire)
    expect_error(lambda: decode_snapshot_marker(frame))


@pytest.mark.parametrize(
    ("extras", "value"),
    [
        pytest.param(bytes(19), b"", id="v1-extras-19"),
        pytest.param(bytes(21), b"", id="v1-extras-21"),
        pytest.param(bytes(20), b"x", id="v1-with-value"),
        pytest.param(b"", b"", id="no-extras"),
        pytest.param(b"", bytes(36), id="no-extras-v2-value"),
        pytest.param(b"\x00\x00", bytes(36), id="extras-2"),
        pytest.param(b"\x00", bytes(35), id="v2.0-value-35"),
        pytest.param(b"\x00", bytes(37), id="v2.0-value-37"),
        pytest.param(b"\x00", bytes(52), id="v2.0-with-v2.2-size"),
        pytest.param(b"\x00", b"", id="v2.0-no-value"),
        pytest.param(b"\x02", bytes(36), id="v2.2-with-v2.0-size"),
        pytest.param(b"\x02", bytes(51), id="v2.2-value-51"),
        pytest.param(b"\x02", bytes(53), id="v2.2-value-53"),
    ],
)
def test_wrong_sizes_rejected(extras: bytes, value: bytes) -> None:
    frame = decode_single(raw_frame(Opcode.DCP_SNAPSHOT_MARKER, extras=extras, value=value))
    expect_error(lambda: decode_snapshot_marker(frame))


@pytest.mark.parametrize("wire", [V1_SEED, V2_0_SEED, V2_2_VECTOR])
def test_key_rejected(wire: bytes) -> None:
    frame = decode_single(wire)
    keyed = Frame(frame.magic, frame.opcode, extras=frame.extras, key=b"k", value=frame.value)
    expect_error(lambda: decode_snapshot_marker(keyed))


@pytest.mark.parametrize("version", list(MarkerVersion))
def test_start_after_end_rejected(version: MarkerVersion) -> None:
    good = encode_snapshot_marker(SnapshotMarker(0, 0, 5, 5, 1, version=version))
    frame = decode_single(good)
    if version is MarkerVersion.V1:
        bad = Frame(0x80, frame.opcode, extras=struct.pack(">QQI", 6, 5, 1))
    else:
        value = struct.pack(">QQ", 6, 5) + frame.value[16:]
        bad = Frame(0x80, frame.opcode, extras=frame.extras, value=value)
    assert decode_snapshot_marker(frame).snap_start == 5
    expect_error(lambda: decode_snapshot_marker(bad))


def test_stream_id_marker_uses_alt_magic() -> None:
    wire = encode_snapshot_marker(SnapshotMarker(7, 9, 1, 2, 1, stream_id=0x1234))
    assert wire[0] == Magic.ALT_REQUEST
    assert wire[2] == 3  # framing extras length
    assert wire[24:27] == b"\x22\x12\x34"
    assert decode_snapshot_marker(decode_single(wire)).stream_id == 0x1234


def test_bad_stream_id_frame_is_stream_id_invalid() -> None:
    wire = raw_frame(
        Opcode.DCP_SNAPSHOT_MARKER,
        magic=Magic.ALT_REQUEST,
        framing=b"\x21\x05",  # stream-id frame info of 1 byte
        extras=struct.pack(">QQI", 1, 2, 1),
    )
    frame = decode_single(wire)
    expect_error(lambda: decode_snapshot_marker(frame), Status.DCP_STREAM_ID_INVALID)


@SETTINGS
@given(snapshot_markers(stream_ids))
def test_round_trip(marker: SnapshotMarker) -> None:
    wire = encode_snapshot_marker(marker)
    feed_three_ways(wire, [marker], decode=decode_snapshot_marker)
