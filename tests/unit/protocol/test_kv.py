"""KV commands (dcp-wire.md §1.6, §2.2, §7.16): HELLO, SET/ADD/REPLACE, GET/DELETE, mutation
tokens, GET response flags, GET_ALL_VB_SEQNOS, OBSERVE_SEQNO. Round trips and hostile input."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed import limits
from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.kv import (
    Hello,
    ObserveSeqnoResult,
    StoreCommand,
    decode_get_response_flags,
    decode_hello,
    decode_key_only,
    decode_mutation_token,
    decode_observe_seqno_request,
    decode_observe_seqno_result,
    decode_store,
    decode_vb_seqnos,
    decode_vb_state_filter,
    encode_hello,
    encode_hello_features,
    encode_mutation_token,
    encode_observe_seqno_result,
    encode_request,
    encode_store,
    encode_vb_seqnos,
)
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.protocol.status import Status

from .helpers import (
    SETTINGS,
    datatypes,
    decode_single,
    expect_error,
    feed_three_ways,
    u16,
    u32,
    u64,
)

kv_keys = st.binary(min_size=1, max_size=limits.KEY_SIZE_MAX)


# -- HELLO --------------------------------------------------------------------------------------


def test_hello_layout() -> None:
    wire = encode_hello(5, "cf", [Feature.XERROR, Feature.COLLECTIONS])
    assert wire == (
        bytes.fromhex("80 1f 0002 00 00 0000 00000006 00000005 0000000000000000")
        + b"cf"
        + b"\x00\x07\x00\x12"
    )


@SETTINGS
@given(u32, st.text(max_size=30), st.lists(u16, max_size=20))
def test_hello_round_trip(opaque: int, agent: str, features: list[int]) -> None:
    wire = encode_hello(opaque, agent, features)
    feed_three_ways(wire, [Hello(agent, tuple(features))], decode=decode_hello)
    # The response carries the enabled subset as the value.
    request = decode_single(wire)
    reply = decode_single(encode_response(request, value=encode_hello_features(features[:2])))
    assert decode_hello(reply).features == tuple(features[:2])


def test_hello_hostile() -> None:
    expect_error(lambda: decode_hello(Frame(0x80, 0x1F, extras=b"\x00", value=b"\x00\x01")))
    expect_error(lambda: decode_hello(Frame(0x80, 0x1F, value=b"\x00\x01\x02")))
    # A non-UTF-8 agent name is a log string only: replaced, not refused.
    assert decode_hello(Frame(0x80, 0x1F, key=b"\xff", value=b"")).agent == "\ufffd"


# -- store commands -----------------------------------------------------------------------------


@st.composite
def store_commands(draw: st.DrawFn) -> StoreCommand:
    return StoreCommand(
        opcode=draw(st.sampled_from([Opcode.SET, Opcode.ADD, Opcode.REPLACE])),
        vbucket=draw(u16),
        opaque=draw(u32),
        key=draw(kv_keys),
        value=draw(st.binary(max_size=200)),
        flags=draw(u32),
        expiry=draw(u32),
        cas=draw(u64),
        datatype=draw(datatypes),
    )


@SETTINGS
@given(store_commands())
def test_store_round_trip(command: StoreCommand) -> None:
    feed_three_ways(encode_store(command), [command], decode=decode_store)


def test_store_layout() -> None:
    wire = encode_store(StoreCommand(Opcode.SET, 1, 2, b"k", b"v", flags=3, expiry=4, cas=5))
    assert wire == (
        bytes.fromhex("80 01 0001 08 00 0001 0000000a 00000002 0000000000000005")
        + struct.pack(">II", 3, 4)
        + b"kv"
    )


def test_store_encoder_misuse() -> None:
    with pytest.raises(ValueError):
        encode_store(StoreCommand(Opcode.GET, 0, 0, b"k", b""))


@pytest.mark.parametrize(
    ("frame", "status"),
    [
        pytest.param(Frame(0x80, 0x01, extras=bytes(4), key=b"k"), Status.EINVAL, id="extras-4"),
        pytest.param(Frame(0x80, 0x01, extras=bytes(9), key=b"k"), Status.EINVAL, id="extras-9"),
        pytest.param(Frame(0x80, 0x01, extras=bytes(8)), Status.EINVAL, id="no-key"),
        pytest.param(
            Frame(0x80, 0x01, extras=bytes(8), key=bytes(limits.KEY_SIZE_MAX + 1)),
            Status.EINVAL,
            id="key-too-long",
        ),
        pytest.param(
            Frame(0x80, 0x01, extras=bytes(8), key=b"k", value=bytes(limits.VALUE_SIZE_MAX + 1)),
            Status.E2BIG,
            id="value-too-big",
        ),
    ],
)
def test_store_hostile(frame: Frame, status: Status) -> None:
    expect_error(lambda: decode_store(frame), status)


def test_store_limits_accepted() -> None:
    frame = Frame(
        0x80,
        0x01,
        extras=bytes(8),
        key=bytes(limits.KEY_SIZE_MAX),
        value=bytes(limits.VALUE_SIZE_MAX),
    )
    assert len(decode_store(frame).value) == limits.VALUE_SIZE_MAX


# -- GET / DELETE ---------------------------------------------------------------------------------


@SETTINGS
@given(st.sampled_from([Opcode.GET, Opcode.DELETE]), u16, u32, kv_keys, u64)
def test_key_only_round_trip(
    opcode: Opcode, vbucket: int, opaque: int, key: bytes, cas: int
) -> None:
    wire = encode_request(opcode, vbucket=vbucket, opaque=opaque, key=key, cas=cas)
    [frame] = feed_three_ways(wire, [key], decode=decode_key_only)
    assert (frame.opcode, frame.vbucket, frame.opaque, frame.cas) == (opcode, vbucket, opaque, cas)


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(Frame(0x80, 0x00, extras=b"\x00", key=b"k"), id="extras"),
        pytest.param(Frame(0x80, 0x00, key=b"k", value=b"v"), id="value"),
        pytest.param(Frame(0x80, 0x00), id="no-key"),
        pytest.param(Frame(0x80, 0x00, key=bytes(251)), id="key-too-long"),
    ],
)
def test_key_only_hostile_einval(frame: Frame) -> None:
    expect_error(lambda: decode_key_only(frame))


# -- responses: mutation token, GET flags -------------------------------------------------------


@SETTINGS
@given(u64, u64, u32)
def test_mutation_token_round_trip(uuid: int, seqno: int, opaque: int) -> None:
    request = Frame(0x80, Opcode.SET, opaque=opaque)
    wire = encode_response(request, extras=encode_mutation_token(uuid, seqno), cas=7)
    feed_three_ways(wire, [(uuid, seqno)], decode=lambda f: decode_mutation_token(f.extras))


def test_mutation_token_absent_and_hostile() -> None:
    assert decode_mutation_token(b"") is None
    for size in (1, 8, 15, 17, 32):
        expect_error(lambda size=size: decode_mutation_token(bytes(size)))


@SETTINGS
@given(u32, st.binary(max_size=50))
def test_get_response_round_trip(flags: int, value: bytes) -> None:
    request = Frame(0x80, Opcode.GET, opaque=1)
    wire = encode_response(request, extras=struct.pack(">I", flags), value=value, cas=9)
    feed_three_ways(
        wire, [(flags, value)], decode=lambda f: (decode_get_response_flags(f.extras), f.value)
    )


@pytest.mark.parametrize("size", [0, 3, 5, 8])
def test_get_response_flags_hostile(size: int) -> None:
    expect_error(lambda: decode_get_response_flags(bytes(size)))


# -- GET_ALL_VB_SEQNOS ----------------------------------------------------------------------------


@SETTINGS
@given(st.lists(st.tuples(u16, u64), max_size=40))
def test_vb_seqnos_round_trip(pairs: list[tuple[int, int]]) -> None:
    request = Frame(0x80, Opcode.GET_ALL_VB_SEQNOS, opaque=1)
    wire = encode_response(request, value=encode_vb_seqnos(pairs))
    feed_three_ways(wire, [pairs], decode=lambda f: decode_vb_seqnos(f.value))


def test_vb_seqnos_layout() -> None:
    assert encode_vb_seqnos([(1, 2)]) == bytes.fromhex("0001 0000000000000002")


@pytest.mark.parametrize("size", [1, 9, 11, 21])
def test_vb_seqnos_hostile(size: int) -> None:
    expect_error(lambda: decode_vb_seqnos(bytes(size)))


@pytest.mark.parametrize(
    ("extras", "state"),
    [(b"", 0), (struct.pack(">I", 0), 0), (struct.pack(">I", 1), 1), (struct.pack(">II", 4, 8), 4)],
)
def test_vb_state_filter(extras: bytes, state: int) -> None:
    wire = encode_request(Opcode.GET_ALL_VB_SEQNOS, extras=extras)
    feed_three_ways(wire, [state], decode=decode_vb_state_filter)


@pytest.mark.parametrize(
    "extras", [b"\x00", bytes(3), bytes(5), bytes(12), struct.pack(">I", 5), b"\xff" * 4]
)
def test_vb_state_filter_hostile(extras: bytes) -> None:
    expect_error(lambda: decode_vb_state_filter(Frame(0x80, 0x48, extras=extras)))


# -- OBSERVE_SEQNO --------------------------------------------------------------------------------


@st.composite
def observe_results(draw: st.DrawFn) -> ObserveSeqnoResult:
    old = draw(st.none() | st.tuples(u64, u64))
    return ObserveSeqnoResult(
        draw(u16), draw(u64), draw(u64), draw(u64), *(old if old else (None, None))
    )


@SETTINGS
@given(observe_results())
def test_observe_seqno_result_round_trip(result: ObserveSeqnoResult) -> None:
    request = Frame(0x80, Opcode.OBSERVE_SEQNO, vbucket=result.vbucket, opaque=3)
    wire = encode_response(request, value=encode_observe_seqno_result(result))
    feed_three_ways(wire, [result], decode=lambda f: decode_observe_seqno_result(f.value))


def test_observe_seqno_layouts() -> None:
    plain = encode_observe_seqno_result(ObserveSeqnoResult(1, 2, 3, 4))
    assert plain == bytes.fromhex("00 0001") + struct.pack(">QQQ", 2, 3, 4)
    failover = encode_observe_seqno_result(ObserveSeqnoResult(1, 2, 3, 4, 5, 6))
    assert failover == bytes.fromhex("01 0001") + struct.pack(">QQQQQ", 2, 3, 4, 5, 6)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(b"", id="empty"),
        pytest.param(bytes(26), id="26"),
        pytest.param(bytes(28), id="28"),
        pytest.param(bytes(43), id="43"),
        pytest.param(bytes(44), id="format-0-with-failover-size"),
        pytest.param(b"\x01" + bytes(26), id="format-1-without-failover"),
        pytest.param(b"\x02" + bytes(26), id="format-2"),
        pytest.param(b"\x02" + bytes(42), id="format-2-long"),
    ],
)
def test_observe_seqno_result_hostile(value: bytes) -> None:
    expect_error(lambda: decode_observe_seqno_result(value))


@SETTINGS
@given(u64, u16)
def test_observe_seqno_request_round_trip(uuid: int, vbucket: int) -> None:
    wire = encode_request(Opcode.OBSERVE_SEQNO, vbucket=vbucket, value=struct.pack(">Q", uuid))
    feed_three_ways(wire, [uuid], decode=decode_observe_seqno_request)


@pytest.mark.parametrize("size", [0, 7, 9])
def test_observe_seqno_request_hostile(size: int) -> None:
    expect_error(lambda: decode_observe_seqno_request(Frame(0x80, 0x91, value=bytes(size))))
