"""DCP control messages (dcp-wire.md §4–§7): open, control, stream request and its answers
(failover log, rollback seqno), stream end, close stream, noop, buffer ack, set-vbucket-state,
get failover log. Round trips through the reader, exact layouts, and hostile input."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.protocol.dcp import (
    OPEN_FLAGS_VALID,
    STREAM_FLAGS_VALID,
    DcpControl,
    DcpOpen,
    OpenFlag,
    StreamEnd,
    StreamEndReason,
    StreamFlag,
    StreamRequest,
    StreamRole,
    WireVbucketState,
    decode_buffer_ack,
    decode_dcp_control,
    decode_dcp_open,
    decode_failover_log,
    decode_json_object,
    decode_rollback_seqno,
    decode_set_vbucket_state,
    decode_stream_end,
    decode_stream_request,
    encode_buffer_ack,
    encode_close_stream,
    encode_dcp_control,
    encode_dcp_noop,
    encode_dcp_open,
    encode_failover_log,
    encode_get_failover_log,
    encode_rollback_seqno,
    encode_set_vbucket_state,
    encode_stream_end,
    encode_stream_request,
)
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.opcode import Datatype, Magic, Opcode
from changefeed.protocol.status import Status

from .helpers import (
    SETTINGS,
    decode_single,
    expect_error,
    feed_three_ways,
    raw_frame,
    stream_ends,
    stream_ids,
    u16,
    u32,
    u64,
)

text = st.text(min_size=1, max_size=40)
valid_open_flags = st.integers(0, OPEN_FLAGS_VALID).filter(
    lambda f: (
        not f & ~OPEN_FLAGS_VALID
        and f & 0x48 != 0x48
        and (not f & OpenFlag.INCLUDE_DELETED_USER_XATTRS or f & OpenFlag.INCLUDE_XATTRS)
    )
)


# -- DCP_OPEN -----------------------------------------------------------------------------------


def test_open_layout() -> None:
    wire = encode_dcp_open(DcpOpen(0x11, "cf:1", OpenFlag.PRODUCER))
    assert wire == (
        bytes.fromhex("80 50 0004 08 00 0000 0000000c 00000011 0000000000000000")
        + bytes.fromhex("00000000 00000001")
        + b"cf:1"
    )


@SETTINGS
@given(
    st.builds(
        DcpOpen,
        u32,
        text,
        valid_open_flags,
        st.none() | st.text(max_size=20),
        st.sampled_from(list(StreamRole)),
    )
)
def test_open_round_trip(message: DcpOpen) -> None:
    feed_three_ways(encode_dcp_open(message), [message], decode=decode_dcp_open)


def test_open_consumer_name_is_json_value() -> None:
    frame = decode_single(encode_dcp_open(DcpOpen(1, "n", 0, consumer_name="rep")))
    assert frame.datatype == Datatype.JSON
    assert json.loads(frame.value) == {"consumer_name": "rep"}


def test_open_stream_role_is_a_json_key_and_defaults_to_application() -> None:
    frame = decode_single(encode_dcp_open(DcpOpen(1, "n", 1, role=StreamRole.REPLICA)))
    assert json.loads(frame.value) == {"stream_role": "replica"}
    assert decode_dcp_open(frame).role is StreamRole.REPLICA
    plain = decode_single(encode_dcp_open(DcpOpen(1, "replication:x", 1)))
    assert plain.value == b""
    assert decode_dcp_open(plain).role is StreamRole.APPLICATION  # the name does not decide


@pytest.mark.parametrize("role", ['"leader"', "7", "null", '["replica"]'])
def test_open_unknown_stream_role_is_einval_naming_it(role: str) -> None:
    frame = decode_single(encode_dcp_open(DcpOpen(1, "n", 1, role=StreamRole.REPLICA)))
    bad = dataclasses.replace(frame, value=f'{{"stream_role": {role}}}'.encode())
    with pytest.raises(ProtocolError) as error:
        decode_dcp_open(bad)
    assert error.value.status == Status.EINVAL
    assert "stream_role" in str(error.value)


def _open(
    flags: int = 1,
    *,
    extras: bytes | None = None,
    key: bytes = b"name",
    value: bytes = b"",
    datatype: int = 0,
) -> Frame:
    if extras is None:
        extras = struct.pack(">II", 0, flags)
    return Frame(0x80, Opcode.DCP_OPEN, datatype=datatype, extras=extras, key=key, value=value)


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(_open(extras=bytes(4)), id="extras-4"),
        pytest.param(_open(extras=bytes(9)), id="extras-9"),
        pytest.param(_open(extras=b""), id="no-extras"),
        pytest.param(_open(key=b""), id="no-name"),
        pytest.param(_open(0x002), id="ex-notifier-bit"),
        pytest.param(_open(0x010), id="unused-bit-0x10"),
        pytest.param(_open(0x080), id="pitr-bit"),
        pytest.param(_open(0x400), id="bit-0x400"),
        pytest.param(_open(0x8000_0000), id="top-bit"),
        pytest.param(_open(0x008 | 0x040), id="both-novalue"),
        pytest.param(_open(0x100), id="deleted-user-xattrs-without-xattrs"),
        pytest.param(_open(key=b"\xff\xfe"), id="name-not-utf8"),
        pytest.param(_open(value=b'{"consumer_name":"x"}'), id="json-value-raw-datatype"),
        pytest.param(_open(value=b"{nope", datatype=1), id="bad-json"),
        pytest.param(_open(value=b"[1]", datatype=1), id="json-not-object"),
        pytest.param(_open(value=b'{"other":"x"}', datatype=1), id="unknown-key"),
        pytest.param(_open(value=b'{"consumer_name":5}', datatype=1), id="name-not-string"),
        pytest.param(_open(value=b"\xff\xfe\xfd", datatype=1), id="value-not-utf8"),
        pytest.param(_open(value=b"[" * 100_000, datatype=1), id="deeply-nested-json"),
        pytest.param(_open(value=b"1" * 5000, datatype=1), id="huge-integer-json"),
    ],
)
def test_open_hostile_einval(frame: Frame) -> None:
    expect_error(lambda: decode_dcp_open(frame))


def test_open_flags() -> None:
    assert OPEN_FLAGS_VALID == 0x36D
    assert sum(OpenFlag) == OPEN_FLAGS_VALID
    message = decode_dcp_open(_open(0x004 | 0x100 | 0x020 | 0x001 | 0x200))
    assert message.flags == 0x325


def test_open_encoder_needs_a_name() -> None:
    with pytest.raises(ValueError):
        encode_dcp_open(DcpOpen(0, "", 1))


# -- DCP_CONTROL --------------------------------------------------------------------------------


def test_control_layout() -> None:
    # dcp-wire.md §14: the real enable_noop packet has extras 0, key 11, value 4, bodylen 15.
    wire = encode_dcp_control(DcpControl(3, "enable_noop", "true"))
    assert wire[:12] == bytes.fromhex("80 5e 000b 00 00 0000 0000000f")
    assert wire[24:] == b"enable_nooptrue"


@SETTINGS
@given(st.builds(DcpControl, u32, text, text))
def test_control_round_trip(message: DcpControl) -> None:
    feed_three_ways(encode_dcp_control(message), [message], decode=decode_dcp_control)


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(Frame(0x80, 0x5E, extras=b"\x00", key=b"k", value=b"v"), id="extras"),
        pytest.param(Frame(0x80, 0x5E, key=b"", value=b"v"), id="no-key"),
        pytest.param(Frame(0x80, 0x5E, key=b"k", value=b""), id="no-value"),
        pytest.param(Frame(0x80, 0x5E, key=b"\xc3", value=b"v"), id="key-not-utf8"),
        pytest.param(Frame(0x80, 0x5E, key=b"k", value=b"\x80"), id="value-not-utf8"),
    ],
)
def test_control_hostile_einval(frame: Frame) -> None:
    expect_error(lambda: decode_dcp_control(frame))


def test_control_encoder_misuse() -> None:
    with pytest.raises(ValueError):
        encode_dcp_control(DcpControl(0, "", "x"))
    with pytest.raises(ValueError):
        encode_dcp_control(DcpControl(0, "x", ""))


# -- DCP_STREAM_REQ -----------------------------------------------------------------------------


def test_stream_request_layout() -> None:
    message = StreamRequest(7, 0x99, StreamFlag.TO_LATEST, 5, 2**64 - 1, 0xAB, 4, 6)
    wire = encode_stream_request(message)
    assert wire[:24] == bytes.fromhex("80 53 0000 30 00 0007 00000030 00000099 0000000000000000")
    assert wire[24:] == struct.pack(">IIQQQQQ", 4, 0, 5, 2**64 - 1, 0xAB, 4, 6)


def test_stream_request_json_value_keeps_datatype_raw() -> None:
    # dcp-wire.md §6.1 / kv_engine dcp_stream_req_validator: datatype must be RAW, value or not.
    wire = encode_stream_request(StreamRequest(0, 0, 0, 0, 0, 0, 0, 0, {"sid": 3}))
    assert wire[5] == Datatype.RAW
    assert json.loads(decode_single(wire).value) == {"sid": 3}


json_values = st.fixed_dictionaries(
    {},
    optional={
        "sid": st.integers(1, 0xFFFF),
        "uid": st.text(max_size=8),
        "collections": st.lists(st.text(max_size=8), max_size=3),
        "purge_seqno": u64.map(str),
    },
)
valid_stream_flags = st.integers(0, 0x1FF).map(lambda f: f & STREAM_FLAGS_VALID)


@SETTINGS
@given(st.builds(StreamRequest, u16, u32, valid_stream_flags, u64, u64, u64, u64, u64, json_values))
def test_stream_request_round_trip(message: StreamRequest) -> None:
    feed_three_ways(encode_stream_request(message), [message], decode=decode_stream_request)
    assert message.stream_id == message.value.get("sid")
    purge = message.value.get("purge_seqno")
    assert message.client_purge_seqno == (None if purge is None else int(purge))


def _stream_req(
    flags: int = 0, *, extras: bytes | None = None, key: bytes = b"", value: bytes = b""
) -> Frame:
    if extras is None:
        extras = struct.pack(">IIQQQQQ", flags, 0, 0, 0, 0, 0, 0)
    return Frame(
        0x80, Opcode.DCP_STREAM_REQ, datatype=1 if value else 0, extras=extras, key=key, value=value
    )


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(_stream_req(extras=bytes(47)), id="extras-47"),
        pytest.param(_stream_req(extras=bytes(49)), id="extras-49"),
        pytest.param(_stream_req(extras=b""), id="no-extras"),
        pytest.param(_stream_req(key=b"k"), id="key"),
        pytest.param(_stream_req(StreamFlag.NO_VALUE_OBSOLETE), id="obsolete-novalue-flag"),
        pytest.param(_stream_req(0x200), id="bit-0x200"),
        pytest.param(_stream_req(0x8000_0000), id="top-bit"),
        pytest.param(_stream_req(value=b"{"), id="bad-json"),
        pytest.param(_stream_req(value=b'"sid"'), id="json-not-object"),
        pytest.param(_stream_req(value=b"\xff"), id="json-not-utf8"),
        pytest.param(_stream_req(value=b"[" * 50_000), id="deeply-nested-json"),
        pytest.param(_stream_req(value=b'{"purge_seqno": 5}'), id="purge-not-string"),
        pytest.param(_stream_req(value=b'{"purge_seqno": "-5"}'), id="purge-negative"),
        pytest.param(_stream_req(value=b'{"purge_seqno": ""}'), id="purge-empty"),
        pytest.param(_stream_req(value='{"purge_seqno": "²"}'.encode()), id="purge-superscript"),
        pytest.param(_stream_req(value='{"purge_seqno": "١٢"}'.encode()), id="purge-arabic-digits"),
        pytest.param(
            _stream_req(value=b'{"purge_seqno": "18446744073709551616"}'), id="purge-over-u64"
        ),
        pytest.param(
            _stream_req(value=b'{"purge_seqno": "' + b"9" * 5000 + b'"}'), id="purge-huge"
        ),
    ],
)
def test_stream_request_hostile_einval(frame: Frame) -> None:
    expect_error(lambda: decode_stream_request(frame))


@pytest.mark.parametrize("sid", ["0", "65536", "-1", '"5"', "true", "1.0", "null2"])
def test_stream_request_bad_sid(sid: str) -> None:
    frame = _stream_req(value=b'{"sid": ' + sid.encode() + b"}")
    status = Status.EINVAL if sid == "null2" else Status.DCP_STREAM_ID_INVALID  # null2: bad JSON
    expect_error(lambda: decode_stream_request(frame), status)


def test_stream_request_null_sid_means_none() -> None:
    message = decode_stream_request(_stream_req(value=b'{"sid": null}'))
    assert message.stream_id is None


def test_stream_request_purge_seqno_max() -> None:
    message = decode_stream_request(_stream_req(value=b'{"purge_seqno": "18446744073709551615"}'))
    assert message.client_purge_seqno == 2**64 - 1


def test_stream_flags() -> None:
    assert STREAM_FLAGS_VALID == 0x1F7
    assert not STREAM_FLAGS_VALID & StreamFlag.NO_VALUE_OBSOLETE


# -- failover log / rollback seqno (response bodies) ----------------------------------------------

failover_logs = st.lists(st.tuples(u64, u64), min_size=1, max_size=25)


@SETTINGS
@given(failover_logs, u32, st.booleans())
def test_failover_log_round_trip(entries: list[tuple[int, int]], opaque: int, dcp: bool) -> None:
    request = decode_single(encode_get_failover_log(3, opaque, dcp=dcp))
    assert request.opcode == (Opcode.DCP_GET_FAILOVER_LOG if dcp else Opcode.GET_FAILOVER_LOG)
    assert (request.vbucket, request.opaque, request.extras, request.key, request.value) == (
        3,
        opaque,
        b"",
        b"",
        b"",
    )
    wire = encode_response(request, value=encode_failover_log(entries))
    feed_three_ways(wire, [entries], decode=lambda f: decode_failover_log(f.value))


def test_failover_log_layout_newest_first() -> None:
    body = encode_failover_log([(0xAA, 10), (0xBB, 0)])
    assert body == struct.pack(">QQQQ", 0xAA, 10, 0xBB, 0)


@pytest.mark.parametrize("size", [0, 1, 15, 17, 26 * 16, 100 * 16])
def test_failover_log_hostile_einval(size: int) -> None:
    expect_error(lambda: decode_failover_log(bytes(size)))


def test_failover_log_encoder_misuse() -> None:
    with pytest.raises(ValueError):
        encode_failover_log([])
    with pytest.raises(ValueError):
        encode_failover_log([(1, 1)] * 26)


@SETTINGS
@given(u64, u32)
def test_rollback_round_trip(seqno: int, opaque: int) -> None:
    request = Frame(0x80, Opcode.DCP_STREAM_REQ, opaque=opaque)
    wire = encode_response(request, Status.ROLLBACK, value=encode_rollback_seqno(seqno))
    frame = decode_single(wire)
    assert frame.status == Status.ROLLBACK
    feed_three_ways(wire, [seqno], decode=lambda f: decode_rollback_seqno(f.value))


@pytest.mark.parametrize("size", [0, 7, 9, 16])
def test_rollback_hostile_einval(size: int) -> None:
    expect_error(lambda: decode_rollback_seqno(bytes(size)))


# -- stream end, close stream, noop, buffer ack, set vbucket state ---------------------------------


@SETTINGS
@given(stream_ends(stream_ids))
def test_stream_end_round_trip(message: StreamEnd) -> None:
    feed_three_ways(encode_stream_end(message), [message], decode=decode_stream_end)


def test_stream_end_layout_with_stream_id() -> None:
    wire = encode_stream_end(StreamEnd(2, 3, StreamEndReason.CLOSED, stream_id=0x0102))
    assert wire == (
        bytes.fromhex("08 55 03 00 04 00 0002 00000007 00000003 0000000000000000")
        + b"\x22\x01\x02"
        + b"\x00\x00\x00\x01"
    )


@pytest.mark.parametrize(
    ("frame", "status"),
    [
        pytest.param(Frame(0x80, 0x55, extras=bytes(3)), Status.EINVAL, id="extras-3"),
        pytest.param(Frame(0x80, 0x55, extras=bytes(5)), Status.EINVAL, id="extras-5"),
        pytest.param(Frame(0x80, 0x55, extras=bytes(4), key=b"k"), Status.EINVAL, id="key"),
        pytest.param(Frame(0x80, 0x55, extras=bytes(4), value=b"v"), Status.EINVAL, id="value"),
        pytest.param(Frame(0x80, 0x55, extras=b"\x00\x00\x00\x09"), Status.EINVAL, id="reason-9"),
        pytest.param(Frame(0x80, 0x55, extras=b"\xff\xff\xff\xff"), Status.EINVAL, id="reason-max"),
        pytest.param(
            Frame(0x08, 0x55, extras=bytes(4), framing_extras=b"\x21\x01"),
            Status.DCP_STREAM_ID_INVALID,
            id="sid-1-byte",
        ),
        pytest.param(
            Frame(0x08, 0x55, extras=bytes(4), framing_extras=b"\x22\x00\x00"),
            Status.DCP_STREAM_ID_INVALID,
            id="sid-0",
        ),
        pytest.param(
            Frame(0x08, 0x55, extras=bytes(4), framing_extras=b"\xf2"),
            Status.EINVAL,
            id="frame-info-truncated",
        ),
    ],
)
def test_stream_end_hostile(frame: Frame, status: Status) -> None:
    expect_error(lambda: decode_stream_end(frame), status)


def test_stream_end_reasons() -> None:
    assert [int(r) for r in StreamEndReason] == list(range(9))


@SETTINGS
@given(u16, u32, stream_ids)
def test_close_stream_round_trip(vbucket: int, opaque: int, stream_id: int | None) -> None:
    wire = encode_close_stream(vbucket, opaque, stream_id)
    expected = Frame(
        Magic.REQUEST if stream_id is None else Magic.ALT_REQUEST,
        Opcode.DCP_CLOSE_STREAM,
        vbucket=vbucket,
        opaque=opaque,
        framing_extras=b"" if stream_id is None else b"\x22" + stream_id.to_bytes(2, "big"),
    )
    [frame] = feed_three_ways(wire, [expected])
    assert frame.stream_id == stream_id
    assert len(wire) == 24 + (0 if stream_id is None else 3)


@SETTINGS
@given(u32)
def test_noop_round_trip(opaque: int) -> None:
    wire = encode_dcp_noop(opaque)
    [frame] = feed_three_ways(wire, [Frame(Magic.REQUEST, Opcode.DCP_NOOP, opaque=opaque)])
    reply = decode_single(encode_response(frame))
    # dcp-wire.md §7.9: the client answers with magic 0x81, opcode 0x5c, status 0, same opaque.
    assert (reply.magic, reply.opcode, reply.status, reply.opaque) == (0x81, 0x5C, 0, opaque)


@SETTINGS
@given(st.integers(1, 2**32 - 1))
def test_buffer_ack_round_trip(acked: int) -> None:
    wire = encode_buffer_ack(acked)
    assert wire[:24] == bytes.fromhex("80 5d 0000 04 00 0000 00000004 00000000 0000000000000000")
    feed_three_ways(wire, [acked], decode=decode_buffer_ack)


@pytest.mark.parametrize("size", [0, 3, 5, 8])
def test_buffer_ack_hostile_einval(size: int) -> None:
    expect_error(lambda: decode_buffer_ack(Frame(0x80, 0x5D, extras=bytes(size))))


@pytest.mark.parametrize("acked", [0, -1, 2**32])
def test_buffer_ack_encoder_misuse(acked: int) -> None:
    with pytest.raises(ValueError):
        encode_buffer_ack(acked)


@SETTINGS
@given(u16, u32, st.sampled_from(list(WireVbucketState)))
def test_set_vbucket_state_round_trip(vbucket: int, opaque: int, state: WireVbucketState) -> None:
    wire = encode_set_vbucket_state(vbucket, opaque, state)
    [frame] = feed_three_ways(wire, [state], decode=decode_set_vbucket_state)
    assert (frame.vbucket, frame.opaque, frame.extras) == (vbucket, opaque, bytes((state,)))


@pytest.mark.parametrize("extras", [b"", b"\x00", b"\x05", b"\xff", b"\x01\x01"])
def test_set_vbucket_state_hostile_einval(extras: bytes) -> None:
    expect_error(lambda: decode_set_vbucket_state(Frame(0x80, 0x5B, extras=extras)))


# -- JSON helper -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[]", b"1", b"null", b"[" * 10_000 + b"]" * 10_000, b"{" * 10],
)
def test_json_object_hostile_einval(raw: bytes) -> None:
    expect_error(lambda: decode_json_object(raw, "test"))


def test_json_object_ok() -> None:
    assert decode_json_object(b'{"a": [1, {"b": null}]}', "test") == {"a": [1, {"b": None}]}


def test_raw_stream_request_from_wire() -> None:
    wire = raw_frame(Opcode.DCP_STREAM_REQ, extras=bytes(48), value=b'{"sid": 4}', datatype=1)
    assert decode_stream_request(decode_single(wire)).stream_id == 4
