"""`encode_response` packs the classic header itself: for any request and fields it gives the
bytes `encode_frame` gives with the response magic, or the same ValueError."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.protocol.frame import Frame, decode_frame, encode_frame, encode_response
from changefeed.protocol.opcode import Magic
from changefeed.protocol.status import Status

sizes = st.sampled_from([0, 1, 4, 255, 256, 0xFFFF, 0x10000])


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 0xFF),  # opcode
    st.integers(0, 0xFFFF_FFFF),  # opaque
    st.sampled_from([*Status, 0, 0xFFFF]),
    sizes,  # extras
    sizes,  # key
    st.binary(max_size=40),
    st.integers(0, 2**64 - 1),
    st.integers(0, 0xFF),  # datatype, invalid bits included
)
def test_encode_response_is_encode_frame_with_the_response_magic(
    opcode: int,
    opaque: int,
    status: int,
    extras_size: int,
    key_size: int,
    value: bytes,
    cas: int,
    datatype: int,
) -> None:
    request = Frame(Magic.REQUEST, opcode, opaque=opaque)
    fields = {
        "extras": b"e" * extras_size,
        "key": b"k" * key_size,
        "value": value,
        "cas": cas,
        "datatype": datatype,
    }
    try:
        expected: bytes | str = encode_frame(
            Magic.RESPONSE, opcode, vbucket=status, opaque=opaque, **fields
        )
    except ValueError as error:
        expected = str(error)
    try:
        got: bytes | str = encode_response(request, status, **fields)
    except ValueError as error:
        got = str(error)
    assert got == expected
    if isinstance(got, bytes):
        frame = decode_frame(got, 0, len(got))
        assert (frame.magic, frame.opcode, frame.opaque) == (Magic.RESPONSE, opcode, opaque)
        assert (frame.status, frame.cas, frame.value) == (status, cas, value)
