"""Frame infos in the flexible framing extras (dcp-wire.md §1.3): nibble encoding, the id and
length escapes (>= 15), the DCP stream-id, and truncated objects."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame_info import (
    FRAME_INFO_DCP_STREAM_ID,
    decode_frame_infos,
    encode_frame_info,
    encode_stream_id,
    stream_id_of,
)
from changefeed.protocol.status import Status

from .helpers import SETTINGS, expect_error

infos = st.tuples(st.integers(0, 270), st.binary(max_size=270))


@pytest.mark.parametrize(
    ("info_id", "data", "wire"),
    [
        (0, b"", b"\x00"),  # barrier
        (1, b"\x02", b"\x11\x02"),  # durability level 2
        (2, b"\x00\x07", b"\x22\x00\x07"),  # stream id 7
        (5, b"", b"\x50"),  # preserve TTL
        (14, bytes(14), b"\xee" + bytes(14)),  # largest unescaped id and length
        (15, b"", b"\xf0\x00"),  # id escape: 15 + 0
        (16, b"a", b"\xf1\x01a"),  # id escape: 15 + 1
        (270, b"", b"\xf0\xff"),  # largest id: 15 + 255
        (3, bytes(15), b"\x3f\x00" + bytes(15)),  # length escape: 15 + 0
        (3, bytes(20), b"\x3f\x05" + bytes(20)),  # length escape: 15 + 5
        (3, bytes(270), b"\x3f\xff" + bytes(270)),  # largest length
        (20, bytes(16), b"\xff\x05\x01" + bytes(16)),  # both escapes: id byte first, then length
    ],
)
def test_vectors(info_id: int, data: bytes, wire: bytes) -> None:
    assert encode_frame_info(info_id, data) == wire
    assert decode_frame_infos(wire) == [(info_id, data)]


def test_stream_id_vector() -> None:
    assert encode_stream_id(1) == b"\x22\x00\x01"
    assert encode_stream_id(0xABCD) == b"\x22\xab\xcd"
    assert encode_stream_id(0xFFFF) == b"\x22\xff\xff"
    assert stream_id_of(b"\x22\xab\xcd") == 0xABCD
    assert FRAME_INFO_DCP_STREAM_ID == 2


@pytest.mark.parametrize("bad", [0, -1, 0x10000])
def test_encode_stream_id_range(bad: int) -> None:
    with pytest.raises(ValueError):
        encode_stream_id(bad)


@pytest.mark.parametrize(("info_id", "size"), [(-1, 0), (271, 0), (0, 271)])
def test_encode_frame_info_range(info_id: int, size: int) -> None:
    with pytest.raises(ValueError):
        encode_frame_info(info_id, bytes(size))


@SETTINGS
@given(st.lists(infos, max_size=5))
def test_round_trip(pairs: list[tuple[int, bytes]]) -> None:
    wire = b"".join(encode_frame_info(i, d) for i, d in pairs)
    assert decode_frame_infos(wire) == pairs


@SETTINGS
@given(st.binary(max_size=64))
def test_decode_is_a_value_or_einval_and_canonical(data: bytes) -> None:
    # The encoder is canonical (it escapes exactly when a nibble would be >= 15), so any bytes
    # that decode re-encode to themselves.
    try:
        pairs = decode_frame_infos(data)
    except ProtocolError as error:
        assert error.status == Status.EINVAL
        return
    assert b"".join(encode_frame_info(i, d) for i, d in pairs) == data


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(b"\xf0", id="id-escape-missing"),
        pytest.param(b"\x2f", id="length-escape-missing"),
        pytest.param(b"\xff\x01", id="length-escape-missing-after-id-escape"),
        pytest.param(b"\x22\x00", id="stream-id-1-of-2-bytes"),
        pytest.param(b"\x3f\x00" + bytes(14), id="escaped-length-short"),
        pytest.param(b"\x00\x25\x00", id="second-object-truncated"),
    ],
)
def test_truncated_objects_einval(wire: bytes) -> None:
    expect_error(lambda: decode_frame_infos(wire))
    expect_error(lambda: stream_id_of(wire))


def test_stream_id_of() -> None:
    assert stream_id_of(b"") is None
    assert stream_id_of(b"\x00") is None  # a barrier only
    assert stream_id_of(b"\x00\x11\x01\x22\x01\x02") == 0x0102  # found after other objects
    assert stream_id_of(encode_frame_info(17, b"xy") + b"\x22\x00\x09") == 9


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(b"\x21\x01", id="1-byte"),
        pytest.param(b"\x23\x00\x00\x01", id="3-bytes"),
        pytest.param(b"\x20", id="empty"),
        pytest.param(b"\x22\x00\x00", id="sid-0"),
    ],
)
def test_bad_stream_id_is_stream_id_invalid(wire: bytes) -> None:
    expect_error(lambda: stream_id_of(wire), Status.DCP_STREAM_ID_INVALID)
