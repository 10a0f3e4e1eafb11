"""The 24-byte header and ``Frame`` (dcp-wire.md §1.1–1.2): exact layouts, round trips through
the reader for classic and alt magics, header checks done from the header alone."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed import limits
from changefeed.protocol.frame import (
    ALT_HEADER,
    HEADER,
    Frame,
    check_header,
    decode_frame,
    encode_frame,
    encode_response,
)
from changefeed.protocol.frame_info import encode_frame_info
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.status import Status

from .helpers import (
    SETTINGS,
    datatypes,
    decode_single,
    expect_error,
    feed_three_ways,
    header_only,
    raw_frame,
    u8,
    u16,
    u32,
    u64,
)

CLASSIC_MAGICS = [Magic.REQUEST, Magic.RESPONSE, Magic.SERVER_REQUEST, Magic.SERVER_RESPONSE]
ALT_MAGICS = [Magic.ALT_REQUEST, Magic.ALT_RESPONSE]


def test_struct_sizes() -> None:
    assert HEADER.size == 24
    assert ALT_HEADER.size == 24


def test_classic_layout() -> None:
    wire = encode_frame(
        Magic.REQUEST,
        Opcode.SET,
        datatype=1,
        vbucket=0x0102,
        opaque=0x0A0B0C0D,
        cas=0x1122334455667788,
        extras=b"EXTRAS",
        key=b"KEY",
        value=b"VALUE",
    )
    assert wire == (
        bytes.fromhex("80 01 0003 06 01 0102 0000000e 0a0b0c0d 1122334455667788")
        + b"EXTRASKEYVALUE"
    )


def test_alt_layout() -> None:
    wire = encode_frame(
        Magic.ALT_REQUEST,
        Opcode.DCP_MUTATION,
        vbucket=5,
        opaque=6,
        framing_extras=b"\x22\x00\x07",
        extras=b"E",
        key=b"KK",
        value=b"V",
    )
    # byte 2 = framing extras length (u8), byte 3 = key length (u8)
    assert wire == (
        bytes.fromhex("08 57 03 02 01 00 0005 00000007 00000006 0000000000000000")
        + b"\x22\x00\x07EKKV"
    )


def test_response_layout_status_in_vbucket_field() -> None:
    request = Frame(Magic.REQUEST, Opcode.DCP_STREAM_REQ, vbucket=9, opaque=0x55)
    wire = encode_response(request, Status.ROLLBACK, value=b"12345678")
    frame = decode_single(wire)
    assert wire[:8] == bytes.fromhex("81 53 0000 00 00 0023")
    assert frame.magic == Magic.RESPONSE
    assert frame.status == Status.ROLLBACK
    assert frame.opaque == 0x55
    assert frame.value == b"12345678"
    assert not frame.is_request


@st.composite
def frames(draw: st.DrawFn) -> Frame:
    magic = draw(st.sampled_from(CLASSIC_MAGICS + ALT_MAGICS))
    alt = magic in ALT_MAGICS
    framing = b""
    if alt:
        pairs = draw(st.lists(st.tuples(st.integers(0, 270), st.binary(max_size=20)), max_size=3))
        framing = b"".join(encode_frame_info(i, d) for i, d in pairs)  # <= 3 * 23 bytes
    return Frame(
        magic=int(magic),
        opcode=draw(u8),
        datatype=draw(datatypes),
        vbucket=draw(u16),
        opaque=draw(u32),
        cas=draw(u64),
        extras=draw(st.binary(max_size=48)),
        key=draw(st.binary(max_size=255 if alt else 300)),
        value=draw(st.binary(max_size=100)),
        framing_extras=framing,
    )


@SETTINGS
@given(st.lists(frames(), min_size=1, max_size=4))
def test_round_trip(expected: list[Frame]) -> None:
    wire = b"".join(f.encode() for f in expected)
    got = feed_three_ways(wire, expected, check_batch=False)  # arbitrary opcodes and extras
    for frame in got:
        assert frame.wire_size == len(frame.encode())
        assert frame.is_request == (frame.magic in (0x80, 0x08, 0x82))


@SETTINGS
@given(frames())
def test_decode_frame_at_offset(frame: Frame) -> None:
    wire = frame.encode()
    padded = b"junk" + wire + b"more"
    bodylen = check_header(padded, 4, limits.FRAME_SIZE_MAX)
    assert bodylen == len(wire) - 24
    assert decode_frame(padded, 4, len(wire)) == frame
    assert decode_frame(memoryview(padded), 4, len(wire)) == frame


def test_encoder_misuse_is_value_error() -> None:
    with pytest.raises(ValueError):
        encode_frame(Magic.REQUEST, 0, datatype=0x08)
    with pytest.raises(ValueError):
        encode_frame(Magic.REQUEST, 0, framing_extras=b"\x00")
    with pytest.raises(ValueError):
        encode_frame(Magic.ALT_REQUEST, 0, key=bytes(256))
    with pytest.raises(ValueError):
        encode_frame(Magic.ALT_REQUEST, 0, framing_extras=bytes(256))
    with pytest.raises(ValueError):
        encode_frame(Magic.REQUEST, 0, extras=bytes(256))
    with pytest.raises(ValueError):
        encode_frame(Magic.REQUEST, 0, key=bytes(0x10000))


@pytest.mark.parametrize("magic", [0x00, 0x01, 0x7F, 0x84, 0x09, 0x19, 0xFF])
def test_unknown_magic_einval(magic: int) -> None:
    header = bytes((magic,)) + header_only(0)[1:]
    expect_error(lambda: check_header(header, 0, 1024))


@pytest.mark.parametrize("datatype", [0x08, 0x10, 0x80, 0xFF])
@pytest.mark.parametrize("magic", [Magic.REQUEST, Magic.ALT_REQUEST])
def test_bad_datatype_einval(datatype: int, magic: int) -> None:
    wire = raw_frame(0x57, magic=magic, datatype=datatype)
    expect_error(lambda: check_header(wire, 0, 1024))


@pytest.mark.parametrize("magic", [Magic.REQUEST, Magic.ALT_REQUEST, Magic.RESPONSE])
@pytest.mark.parametrize("bodylen", [1025, 0xFFFF_FFFF])
def test_body_over_limit_e2big_from_header_alone(magic: int, bodylen: int) -> None:
    header = raw_frame(0x57, magic=magic, bodylen=bodylen)
    assert len(header) == 24
    expect_error(lambda: check_header(header, 0, 1024), Status.E2BIG)


def test_body_at_limit_accepted() -> None:
    assert check_header(raw_frame(0x57, bodylen=1024), 0, 1024) == 1024


@pytest.mark.parametrize(
    "lengths",
    [
        {"keylen": 5, "bodylen": 4},
        {"extlen": 5, "bodylen": 4},
        {"keylen": 3, "extlen": 3, "bodylen": 5},
        {"framelen": 3, "keylen": 1, "extlen": 1, "bodylen": 4},
        {"framelen": 255, "keylen": 255, "extlen": 255, "bodylen": 764},
    ],
)
def test_sections_longer_than_body_einval(lengths: dict[str, int]) -> None:
    magic = Magic.ALT_REQUEST if "framelen" in lengths else Magic.REQUEST
    header = raw_frame(0x57, magic=magic, **lengths)
    expect_error(lambda: check_header(header, 0, 1 << 20))


def test_bad_frame_infos_rejected_by_decode_frame() -> None:
    wire = raw_frame(0x57, magic=Magic.ALT_REQUEST, framing=b"\x2f")  # length escape missing
    bodylen = check_header(wire, 0, 1024)
    expect_error(lambda: decode_frame(wire, 0, 24 + bodylen))


def test_stream_id_property() -> None:
    assert Frame(0x80, 0x57).stream_id is None
    assert Frame(0x08, 0x57, framing_extras=b"\x22\x01\x00").stream_id == 256
    bad = Frame(0x08, 0x57, framing_extras=b"\x21\x01")
    expect_error(lambda: bad.stream_id, Status.DCP_STREAM_ID_INVALID)


def test_frame_is_frozen() -> None:
    frame = Frame(0x80, 0x57)
    with pytest.raises(AttributeError):
        frame.opcode = 1  # type: ignore[misc]
    assert not hasattr(frame, "__dict__")


def test_header_fields_big_endian() -> None:
    frame = decode_single(raw_frame(0x57, vbucket=0x0102, opaque=0x01020304, cas=1))
    assert (frame.vbucket, frame.opaque, frame.cas) == (0x0102, 0x01020304, 1)
    assert struct.unpack(">Q", frame.encode()[16:24]) == (1,)
