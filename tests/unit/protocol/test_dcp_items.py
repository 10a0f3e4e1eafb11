"""DCP data messages (dcp-wire.md §7.3–7.5, §7.13): mutation, deletion V1/V2, expiration,
seqno-advanced, and ``encode_item_body``. Exact layouts, round trips with and without stream
ids, and hostile extras."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.protocol.dcp_items import (
    DELETION_V1_EXTRAS,
    DELETION_V1_PREFIX,
    DELETION_V2_EXTRAS,
    DELETION_V2_PREFIX,
    EXPIRATION_EXTRAS,
    EXPIRATION_PREFIX,
    MUTATION_EXTRAS,
    MUTATION_PREFIX,
    Deletion,
    Expiration,
    Mutation,
    SeqnoAdvanced,
    decode_deletion,
    decode_expiration,
    decode_mutation,
    decode_seqno_advanced,
    encode_deletion,
    encode_expiration,
    encode_item_body,
    encode_mutation,
    encode_seqno_advanced,
)
from changefeed.protocol.frame import Frame
from changefeed.protocol.frame_info import encode_frame_info, encode_stream_id
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.status import Status

from .helpers import (
    SETTINGS,
    decode_single,
    deletions,
    expect_error,
    expirations,
    feed_three_ways,
    mutations,
    seqno_advances,
    stream_ids,
)


def test_extras_sizes() -> None:
    sizes = (MUTATION_EXTRAS.size, DELETION_V1_EXTRAS.size, DELETION_V2_EXTRAS.size)
    assert sizes == (31, 18, 21)
    assert EXPIRATION_EXTRAS.size == 20


def test_layouts_against_literal_formats() -> None:
    # Independent oracles: the layouts are declared once, field by field, in dcp_items.py; here
    # they are spelled out whole (dcp-wire.md §1.1, §7.3-7.5) and must pack the same bytes.
    header = ">BBHBBHIIQ"
    for declared, extras in (
        (MUTATION_EXTRAS, ">QQIIIHB"),
        (DELETION_V1_EXTRAS, ">QQH"),
        (DELETION_V2_EXTRAS, ">QQIB"),
        (EXPIRATION_EXTRAS, ">QQI"),
    ):
        assert declared.format == extras, declared.format
    for prefix, extras in (
        (MUTATION_PREFIX, "QQIIIHB"),
        (DELETION_V1_PREFIX, "QQH"),
        (DELETION_V2_PREFIX, "QQIB"),
        (EXPIRATION_PREFIX, "QQI"),
    ):
        assert prefix.format == header + extras, prefix.format
    fields = (0x80, 0x57, 3, 31, 1, 2, 36, 7, 9, 5, 1, 0xDEAD, 4, 0, 0, 0)
    assert MUTATION_PREFIX.pack(*fields) == struct.pack(">BBHBBHIIQQQIIIHB", *fields)


def test_mutation_layout() -> None:
    m = Mutation(
        vbucket=0x0203,
        opaque=0x0A0B0C0D,
        seqno=0x11,
        key=b"key",
        value=b"value",
        cas=0xCA5,
        rev_seqno=0x22,
        flags=0x33,
        expiry=0x44,
        lock_time=0x55,
        datatype=1,
    )
    assert encode_mutation(m) == (
        bytes.fromhex("80 57 0003 1f 01 0203 00000027 0a0b0c0d 0000000000000ca5")
        + bytes.fromhex("0000000000000011 0000000000000022 00000033 00000044 00000055 0000 00")
        + b"keyvalue"
    )
    # dcp-wire.md §8.1: a mutation is 55 + key + value bytes on the wire.
    assert len(encode_mutation(m)) == 55 + 3 + 5


def test_deletion_layouts() -> None:
    v1 = encode_deletion(Deletion(1, 2, 3, b"k", cas=4, rev_seqno=5, delete_time=None))
    assert v1 == (
        bytes.fromhex("80 58 0001 12 00 0001 00000013 00000002 0000000000000004")
        + bytes.fromhex("0000000000000003 0000000000000005 0000")
        + b"k"
    )
    v2 = encode_deletion(Deletion(1, 2, 3, b"k", cas=4, rev_seqno=5, delete_time=6))
    assert v2 == (
        bytes.fromhex("80 58 0001 15 00 0001 00000016 00000002 0000000000000004")
        + bytes.fromhex("0000000000000003 0000000000000005 00000006 00")
        + b"k"
    )
    assert (len(v1), len(v2)) == (42 + 1, 45 + 1)  # dcp-wire.md §8.1: 42+… / 45+…


def test_expiration_and_seqno_advanced_layouts() -> None:
    e = encode_expiration(Expiration(1, 2, 3, b"k", cas=4, rev_seqno=5, delete_time=6))
    assert e == (
        bytes.fromhex("80 59 0001 14 00 0001 00000015 00000002 0000000000000004")
        + bytes.fromhex("0000000000000003 0000000000000005 00000006")
        + b"k"
    )
    s = encode_seqno_advanced(SeqnoAdvanced(1, 2, 3))
    assert s == bytes.fromhex("80 64 0000 08 00 0001 00000008 00000002 0000000000000000") + (
        bytes.fromhex("0000000000000003")
    )
    assert (len(e), len(s)) == (44 + 1, 32)


def test_mutation_with_stream_id_layout() -> None:
    wire = encode_mutation(Mutation(1, 2, 3, b"k", b"v", stream_id=0xBEEF))
    assert wire[:4] == bytes((Magic.ALT_REQUEST, Opcode.DCP_MUTATION, 3, 1))
    assert wire[8:12] == (3 + 31 + 1 + 1).to_bytes(4, "big")
    assert wire[24:27] == b"\x22\xbe\xef"


@SETTINGS
@given(mutations(stream_ids))
def test_mutation_round_trip(message: Mutation) -> None:
    feed_three_ways(encode_mutation(message), [message], decode=decode_mutation)


@SETTINGS
@given(deletions(stream_ids))
def test_deletion_round_trip(message: Deletion) -> None:
    [frame] = feed_three_ways(encode_deletion(message), [message], decode=decode_deletion)
    assert len(frame.extras) == (18 if message.delete_time is None else 21)


@SETTINGS
@given(expirations(stream_ids))
def test_expiration_round_trip(message: Expiration) -> None:
    feed_three_ways(encode_expiration(message), [message], decode=decode_expiration)


@SETTINGS
@given(seqno_advances(stream_ids))
def test_seqno_advanced_round_trip(message: SeqnoAdvanced) -> None:
    feed_three_ways(encode_seqno_advanced(message), [message], decode=decode_seqno_advanced)


@SETTINGS
@given(mutations(stream_ids))
def test_encode_item_body_equals_encode_mutation(message: Mutation) -> None:
    whole = encode_mutation(message)
    framing = 0 if message.stream_id is None else 3
    body = memoryview(whole[24 + framing :])  # extras + key + value, as a store would hold it
    pieces = encode_item_body(
        Opcode.DCP_MUTATION,
        vbucket=message.vbucket,
        opaque=message.opaque,
        cas=message.cas,
        datatype=message.datatype,
        extras_len=31,
        key_len=len(message.key),
        body=body,
        stream_id=message.stream_id,
    )
    assert b"".join(pieces) == whole
    assert pieces[-1] is body  # handed through for writelines, not copied


def test_encode_item_body_misuse() -> None:
    with pytest.raises(ValueError):
        encode_item_body(
            Opcode.DCP_MUTATION,
            vbucket=0,
            opaque=0,
            cas=0,
            datatype=0,
            extras_len=31,
            key_len=5,
            body=bytes(35),
        )


def test_encode_mutation_seqno_0_is_our_bug() -> None:
    with pytest.raises(ValueError):
        encode_mutation(Mutation(0, 0, 0, b"k", b""))


def _mutation_extras(seqno: int = 1, nmeta: int = 0) -> bytes:
    return struct.pack(">QQIIIHB", seqno, 1, 0, 0, 0, nmeta, 0)


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(Frame(0x80, 0x57, extras=_mutation_extras()[:30], key=b"k"), id="extras-30"),
        pytest.param(
            Frame(0x80, 0x57, extras=_mutation_extras() + b"\0", key=b"k"), id="extras-32"
        ),
        pytest.param(Frame(0x80, 0x57, extras=b"", key=b"k"), id="no-extras"),
        pytest.param(Frame(0x80, 0x57, extras=_mutation_extras(seqno=0), key=b"k"), id="seqno-0"),
        pytest.param(Frame(0x80, 0x57, extras=_mutation_extras(nmeta=1), key=b"k"), id="nmeta"),
        pytest.param(Frame(0x80, 0x57, extras=_mutation_extras()), id="no-key"),
    ],
)
def test_mutation_hostile_einval(frame: Frame) -> None:
    expect_error(lambda: decode_mutation(frame))


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(Frame(0x80, 0x58, extras=bytes(17), key=b"k"), id="extras-17"),
        pytest.param(Frame(0x80, 0x58, extras=bytes(19), key=b"k"), id="extras-19"),
        pytest.param(Frame(0x80, 0x58, extras=bytes(20), key=b"k"), id="extras-20"),
        pytest.param(Frame(0x80, 0x58, extras=bytes(22), key=b"k"), id="extras-22"),
        pytest.param(Frame(0x80, 0x58, extras=bytes(31), key=b"k"), id="mutation-extras"),
        pytest.param(
            Frame(0x80, 0x58, extras=struct.pack(">QQH", 0, 1, 0), key=b"k"), id="v1-seqno-0"
        ),
        pytest.param(
            Frame(0x80, 0x58, extras=struct.pack(">QQH", 1, 1, 3), key=b"k"), id="v1-nmeta"
        ),
        pytest.param(
            Frame(0x80, 0x58, extras=struct.pack(">QQIB", 0, 1, 1, 0), key=b"k"), id="v2-seqno-0"
        ),
        pytest.param(Frame(0x80, 0x58, extras=struct.pack(">QQIB", 1, 1, 1, 0)), id="v2-no-key"),
    ],
)
def test_deletion_hostile_einval(frame: Frame) -> None:
    expect_error(lambda: decode_deletion(frame))


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(Frame(0x80, 0x59, extras=bytes(19), key=b"k"), id="extras-19"),
        pytest.param(Frame(0x80, 0x59, extras=bytes(21), key=b"k"), id="extras-21"),
        pytest.param(Frame(0x80, 0x59, extras=bytes(20), key=b"k"), id="seqno-0"),
        pytest.param(Frame(0x80, 0x59, extras=struct.pack(">QQI", 1, 1, 1)), id="no-key"),
    ],
)
def test_expiration_hostile_einval(frame: Frame) -> None:
    expect_error(lambda: decode_expiration(frame))


@pytest.mark.parametrize("size", [0, 7, 9, 16])
def test_seqno_advanced_hostile_einval(size: int) -> None:
    expect_error(lambda: decode_seqno_advanced(Frame(0x80, 0x64, extras=bytes(size))))


ITEM_DECODERS = [decode_mutation, decode_deletion, decode_expiration, decode_seqno_advanced]
ITEM_EXTRAS = [
    _mutation_extras(),
    struct.pack(">QQIB", 1, 1, 1, 0),
    struct.pack(">QQI", 1, 1, 1),
    struct.pack(">Q", 1),
]


@pytest.mark.parametrize(
    ("framing", "status"),
    [
        (b"\x21\x00", Status.DCP_STREAM_ID_INVALID),
        (b"\x23\x00\x00\x01", Status.DCP_STREAM_ID_INVALID),
        (b"\x22\x00\x00", Status.DCP_STREAM_ID_INVALID),
        (b"\x2f", Status.EINVAL),
    ],
)
@pytest.mark.parametrize("index", range(4))
def test_bad_stream_id_rejected_by_every_item_decoder(
    framing: bytes, status: Status, index: int
) -> None:
    frame = Frame(0x08, 0x57 + index, extras=ITEM_EXTRAS[index], key=b"k", framing_extras=framing)
    expect_error(lambda: ITEM_DECODERS[index](frame), status)


def test_stream_id_survives_other_frame_infos() -> None:
    wire = encode_mutation(Mutation(1, 2, 3, b"k", b"v", stream_id=9))
    frame = decode_single(wire)
    other = Frame(
        frame.magic,
        frame.opcode,
        extras=frame.extras,
        key=frame.key,
        value=frame.value,
        framing_extras=b"\x00\x50" + frame.framing_extras,  # barrier, preserve-ttl, then the sid
    )
    again = decode_single(other.encode())
    assert decode_mutation(again).stream_id == 9


@SETTINGS
@given(st.lists(st.one_of(mutations(), deletions(), expirations()), min_size=2, max_size=5))
def test_several_items_in_one_buffer(messages: list[object]) -> None:
    encoders = {Mutation: encode_mutation, Deletion: encode_deletion, Expiration: encode_expiration}
    decoders = {0x57: decode_mutation, 0x58: decode_deletion, 0x59: decode_expiration}
    wire = b"".join(encoders[type(m)](m) for m in messages)  # type: ignore[operator]
    feed_three_ways(wire, messages, decode=lambda f: decoders[f.opcode](f))


other_infos = st.lists(
    st.tuples(st.integers(0, 270).filter(lambda i: i != 2), st.binary(max_size=20)), max_size=3
)


@SETTINGS
@given(mutations(st.integers(1, 0xFFFF)), other_infos, st.integers(0, 3))
def test_stream_id_among_escaped_frame_infos(
    message: Mutation, infos: list[tuple[int, bytes]], where: int
) -> None:
    # Frame infos with ids and lengths >= 15 (escaped) around the stream-id must not disturb it.
    plain = decode_single(encode_mutation(message))
    encoded = [encode_frame_info(i, d) for i, d in infos]
    encoded.insert(min(where, len(encoded)), encode_stream_id(message.stream_id or 1))
    frame = Frame(
        Magic.ALT_REQUEST,
        plain.opcode,
        datatype=plain.datatype,
        vbucket=plain.vbucket,
        opaque=plain.opaque,
        cas=plain.cas,
        extras=plain.extras,
        key=plain.key,
        value=plain.value,
        framing_extras=b"".join(encoded),
    )
    feed_three_ways(frame.encode(), [message], decode=decode_mutation)
