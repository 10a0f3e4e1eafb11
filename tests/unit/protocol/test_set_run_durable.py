"""`take_set_run` of durable SETs against the per-frame decoder as its model, and fuzzed.

The model: decode frames one by one with `check_header`/`decode_frame`; a run starting with a
durable SET (flexible magic, framing extras exactly one durability frame info with a known
level, `durability_of` reads it) is the longest prefix of durable SETs with the same framing
extras, each otherwise as plain as `test_set_run.plain` asks; a run never mixes kinds.
"""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed import limits
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, check_header, decode_frame, encode_frame
from changefeed.protocol.frame_info import durability_of
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.set_run import durability_framing, run_frames, take_set_run

FRAME_MAX = 4096
STORE_EXTRAS = struct.Struct(">II")


def one_durability_info(framing: bytes) -> bool:
    """The model of `durability_framing`: one frame info, id 1, a level the decoder knows."""
    if len(framing) not in (2, 4) or framing[0] >> 4 != 1 or framing[0] & 0x0F != len(framing) - 1:
        return False
    try:
        return durability_of(framing) is not None
    except ProtocolError:
        return False


def settable(frame: Frame) -> bool:
    return (
        frame.opcode == Opcode.SET
        and len(frame.extras) == 8
        and frame.cas == 0
        and 0 < len(frame.key) <= limits.KEY_SIZE_MAX
        and frame.key[:1] != b"\xff"
    )


def model(buffer: bytes, items_max: int) -> tuple[list[Frame], int, bytes]:
    taken: list[Frame] = []
    pos = 0
    framing: bytes | None = None
    while len(taken) < items_max and len(buffer) - pos >= limits.HEADER_SIZE:
        try:
            total = limits.HEADER_SIZE + check_header(buffer, pos, FRAME_MAX)
        except ProtocolError:
            break
        if len(buffer) - pos < total:
            break
        frame = decode_frame(buffer, pos, total)
        if not settable(frame):
            break
        if frame.magic == Magic.REQUEST:
            kind = b""
        elif frame.magic == Magic.ALT_REQUEST and one_durability_info(frame.framing_extras):
            kind = frame.framing_extras
        else:
            break
        if framing is None:
            framing = kind
        elif kind != framing:
            break
        taken.append(frame)
        pos += total
    return taken, pos, framing or b""


KNOWN = [b"\x11\x01", b"\x11\x02", b"\x11\x03", b"\x13\x01\x00\x10", b"\x13\x03\xff\xff"]
OTHERS = [b"\x11\x04", b"\x11\x00", b"\x12\x01\x00", b"\x11\x01\x00", b"\x21\x01", b"\x50"]
framings = st.sampled_from([*KNOWN, *OTHERS, b"\x11\x01\x50", b"\x00\x11\x01", b""])
durable_frames = st.builds(
    lambda vb, opaque, key, value, flags, expiry, datatype, cas, framing, magic: encode_frame(
        magic if framing else Magic.REQUEST,
        Opcode.SET,
        vbucket=vb,
        opaque=opaque,
        cas=cas,
        key=key,
        value=value,
        datatype=datatype,
        extras=STORE_EXTRAS.pack(flags, expiry),
        framing_extras=framing,
    ),
    st.integers(0, 0xFFFF),
    st.integers(0, 0xFFFF_FFFF),
    st.binary(min_size=1, max_size=255) | st.just(b"\xffk"),
    st.binary(max_size=300),
    st.integers(0, 0xFFFF_FFFF),
    st.integers(0, 0xFFFF_FFFF),
    st.integers(0, 7),
    st.sampled_from([0, 0, 0, 0, 1]),
    framings,
    st.sampled_from([Magic.ALT_REQUEST] * 5 + [Magic.ALT_RESPONSE]),
)


@settings(max_examples=200)
@given(
    st.lists(durable_frames, max_size=12),
    st.integers(0, 40),
    st.integers(1, 20),
    st.integers(0, 30),
)
def test_a_run_is_the_prefix_of_one_kind(
    frames: list[bytes], cut: int, items_max: int, pad: int
) -> None:
    data = b"".join(frames)
    data = data[: max(0, len(data) - cut)]
    buffer = bytearray(b"\xee" * pad + data)
    expected, span, framing = model(data, items_max)
    run = take_set_run(buffer, pad, FRAME_MAX, items_max)
    assert run.consumed == span
    assert run.framing_extras == framing
    assert run.opaques == [f.opaque for f in expected]
    assert run.vbuckets == [f.vbucket for f in expected]
    assert run.keys == [f.key for f in expected]
    assert run.values == [f.value for f in expected]
    assert run.datatypes == [f.datatype for f in expected]
    assert list(zip(run.flags, run.expiries, strict=True)) == [
        STORE_EXTRAS.unpack(f.extras) for f in expected
    ]
    # What the per-frame path gets of a run it serves frame by frame: the frames as decoded.
    assert run_frames(run) == expected


@given(st.binary(min_size=0, max_size=6))
def test_durability_framing_is_one_known_durability_info(framing: bytes) -> None:
    assert durability_framing(framing) == one_durability_info(framing)


@settings(max_examples=400)
@given(st.binary(max_size=400), st.integers(0, 10))
def test_fuzz_alt_magic_never_raises_and_stays_in_bounds(data: bytes, start: int) -> None:
    data = b"\x08" + data  # an alt request first: the durable path
    start = min(start, len(data))
    run = take_set_run(bytearray(data), start, FRAME_MAX, 64)
    assert 0 <= run.consumed <= len(data) - start
    assert len(run) * (limits.HEADER_SIZE + 2 + 8 + 1) <= run.consumed
    assert bool(run.framing_extras) == (len(run) > 0 and data[start] == 0x08)
