"""`take_set_run` against the per-frame decoder as its model, and fuzzed.

The model: decode frames one by one with `check_header`/`decode_frame`; the run must be exactly
the longest prefix of plain SETs (classic magic, 8 bytes of extras, no CAS, key and value within
`decode_store`'s limits), each with the fields the frame decoder gives.
"""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed import limits
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import HEADER, Frame, check_header, decode_frame, encode_frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.set_run import (
    pack_set_success,
    pack_set_success_with_token,
    pack_set_successes,
    take_set_run,
)

FRAME_MAX = 4096
STORE_EXTRAS = struct.Struct(">II")


def plain(frame: Frame) -> bool:
    return (
        frame.magic == Magic.REQUEST
        and frame.opcode == Opcode.SET
        and len(frame.extras) == 8
        and frame.cas == 0
        and 0 < len(frame.key) <= limits.KEY_SIZE_MAX
        and frame.key[:1] != b"\xff"  # the per-frame path escapes it (collection_commands.py)
    )


def model(buffer: bytes, items_max: int) -> tuple[list[Frame], int]:
    """The plain-SET prefix by the per-frame decoder, and the bytes it spans."""
    taken: list[Frame] = []
    pos = 0
    while len(taken) < items_max and len(buffer) - pos >= limits.HEADER_SIZE:
        try:
            total = limits.HEADER_SIZE + check_header(buffer, pos, FRAME_MAX)
        except ProtocolError:
            break
        if len(buffer) - pos < total:
            break
        frame = decode_frame(buffer, pos, total)
        if not plain(frame):
            break
        taken.append(frame)
        pos += total
    return taken, pos


keys = st.binary(min_size=0, max_size=260)
set_frames = st.builds(
    lambda vb, opaque, key, value, flags, expiry, datatype, cas, extras: encode_frame(
        Magic.REQUEST,
        Opcode.SET,
        vbucket=vb,
        opaque=opaque,
        cas=cas,
        key=key,
        value=value,
        datatype=datatype,
        extras=extras if extras is not None else STORE_EXTRAS.pack(flags, expiry),
    ),
    st.integers(0, 0xFFFF),
    st.integers(0, 0xFFFF_FFFF),
    keys.filter(lambda k: len(k) > 0) | st.just(b""),
    st.binary(max_size=300),
    st.integers(0, 0xFFFF_FFFF),
    st.integers(0, 0xFFFF_FFFF),
    st.integers(0, 7),
    st.sampled_from([0, 0, 0, 0, 1, 0xFFFF_FFFF_FFFF]),
    st.sampled_from([None, None, None, None, b"", b"\0" * 4]),
)
other_frames = st.builds(
    lambda magic, opcode, key: encode_frame(magic, opcode, key=key),
    st.sampled_from([Magic.REQUEST, Magic.ALT_REQUEST, Magic.RESPONSE]),
    st.sampled_from([Opcode.SET, Opcode.GET, Opcode.NOOP, Opcode.DELETE]),
    st.binary(min_size=1, max_size=10),
)


@settings(max_examples=400)
@given(
    st.lists(set_frames | other_frames, max_size=12),
    st.integers(0, 40),
    st.integers(1, 20),
    st.integers(0, 30),
)
def test_run_is_the_plain_set_prefix(
    frames: list[bytes], cut: int, items_max: int, pad: int
) -> None:
    data = b"".join(frames)
    data = data[: max(0, len(data) - cut)]  # maybe a partial frame at the end
    buffer = bytearray(b"\xee" * pad + data)  # the run starts at an offset
    expected, span = model(data, items_max)
    run = take_set_run(buffer, pad, FRAME_MAX, items_max)
    assert run.consumed == span
    assert len(run) == len(expected)
    assert run.vbuckets == [f.vbucket for f in expected]
    assert run.opaques == [f.opaque for f in expected]
    assert run.keys == [f.key for f in expected]
    assert run.values == [f.value for f in expected]
    assert [(fl, ex) for fl, ex in zip(run.flags, run.expiries, strict=True)] == [
        STORE_EXTRAS.unpack(f.extras) for f in expected
    ]
    assert run.datatypes == [f.datatype for f in expected]
    assert all(
        type(k) is bytes and type(v) is bytes for k, v in zip(run.keys, run.values, strict=True)
    )


def test_frame_over_the_reader_limit_ends_the_run() -> None:
    small = encode_frame(Magic.REQUEST, Opcode.SET, key=b"k", value=b"v", extras=bytes(8))
    big = encode_frame(Magic.REQUEST, Opcode.SET, key=b"k", value=b"v" * 200, extras=bytes(8))
    run = take_set_run(bytearray(small + big + small), 0, 100, 10)
    assert len(run) == 1 and run.consumed == len(small)


@settings(max_examples=1000)
@given(st.binary(max_size=400), st.integers(0, 10))
def test_fuzz_never_raises_and_stays_in_bounds(data: bytes, start: int) -> None:
    start = min(start, len(data))
    run = take_set_run(bytearray(data), start, FRAME_MAX, 64)
    assert 0 <= run.consumed <= len(data) - start
    assert len(run) * (limits.HEADER_SIZE + 8 + 1) <= run.consumed


@given(st.integers(0, 0xFFFF_FFFF), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_success_replies_decode_as_the_frame_codec_encodes(opaque: int, cas: int, n: int) -> None:
    request = Frame(Magic.REQUEST, Opcode.SET, opaque=opaque)
    plain_reply = pack_set_success(opaque, cas)
    assert plain_reply == encode_frame(Magic.RESPONSE, Opcode.SET, opaque=opaque, cas=cas)
    with_token = pack_set_success_with_token(opaque, cas, n, n >> 1)
    assert with_token == encode_frame(
        Magic.RESPONSE, Opcode.SET, opaque=request.opaque, cas=cas,
        extras=struct.pack(">QQ", n, n >> 1),
    )  # fmt: skip
    assert HEADER.unpack_from(with_token)[6] == 16


U32, U64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)


@given(st.lists(st.tuples(U32, U64, U64, U64), max_size=40))
def test_a_run_of_replies_packs_as_one_reply_at_a_time(
    replies: list[tuple[int, int, int, int]],
) -> None:
    """`pack_set_successes` (numpy, column by column) against the per-reply struct packs,
    with and without the mutation token, over the whole range of every field."""
    opaques = [reply[0] for reply in replies]
    cases = [reply[1] for reply in replies]
    uuids = [reply[2] for reply in replies]
    seqnos = [reply[3] for reply in replies]
    plain_replies = b"".join(map(pack_set_success, opaques, cases))
    assert pack_set_successes(opaques, cases) == plain_replies
    with_token = b"".join(map(pack_set_success_with_token, opaques, cases, uuids, seqnos))
    assert pack_set_successes(opaques, cases, uuids, seqnos) == with_token
