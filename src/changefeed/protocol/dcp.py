"""DCP control messages: open, control, stream request and its answers, stream end, close stream,
noop, buffer ack, set-vbucket-state, get failover log (dcp-wire.md §4–§7).

Data-plane messages (mutation, deletion, expiration, seqno-advanced) are in ``dcp_items.py``;
snapshot markers in ``snapshot_marker.py``. Decoders check sizes and flag masks — the rules that
are about bytes. Rules about state (a second DCP_OPEN, ``snap_start <= start <= snap_end``) are
the producer's.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Any, TypeGuard

from changefeed import limits
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.frame_info import encode_stream_id
from changefeed.protocol.opcode import Datatype, Magic, Opcode
from changefeed.protocol.quick_init import quick_init
from changefeed.protocol.status import Status

OPEN_EXTRAS = struct.Struct(">II")  # reserved seqno (send 0), flags
STREAM_REQ_EXTRAS = struct.Struct(
    ">IIQQQQQ"
)  # flags reserved start end vb_uuid snap_start snap_end
FAILOVER_ENTRY = struct.Struct(">QQ")  # vb_uuid, seqno
U64 = struct.Struct(">Q")
U32 = struct.Struct(">I")
assert OPEN_EXTRAS.size == 8
assert STREAM_REQ_EXTRAS.size == 48
assert FAILOVER_ENTRY.size == 16


class OpenFlag(IntFlag):
    """DCP_OPEN flags (dcp-wire.md §4)."""

    PRODUCER = 0x001
    INCLUDE_XATTRS = 0x004
    NO_VALUE = 0x008
    INCLUDE_DELETE_TIMES = 0x020
    NO_VALUE_WITH_UNDERLYING_DATATYPE = 0x040
    INCLUDE_DELETED_USER_XATTRS = 0x100
    SKIP_DELETES_IN_INITIAL_BACKFILL = 0x200


OPEN_FLAGS_VALID = 0x001 | 0x004 | 0x008 | 0x020 | 0x040 | 0x100 | 0x200


class StreamFlag(IntFlag):
    """DCP_STREAM_REQ flags (dcp-wire.md §6.1)."""

    TAKEOVER = 0x001
    DISK_ONLY = 0x002
    TO_LATEST = 0x004
    NO_VALUE_OBSOLETE = 0x008  # rejected: use DCP_OPEN NoValue
    ACTIVE_VB_ONLY = 0x010
    STRICT_VB_UUID = 0x020
    FROM_LATEST = 0x040
    IGNORE_PURGED_TOMBSTONES = 0x080
    CACHE_TRANSFER = 0x100


STREAM_FLAGS_VALID = 0x1FF & ~0x008


class StreamEndReason(IntEnum):
    """DCP_STREAM_END reasons (dcp-wire.md §7.6)."""

    OK = 0
    CLOSED = 1
    STATE_CHANGED = 2
    DISCONNECTED = 3
    SLOW = 4
    BACKFILL_FAIL = 5
    ROLLBACK = 6  # defined; producers send STATE_CHANGED on the wire instead
    FILTER_EMPTY = 7
    LOST_PRIVILEGES = 8


class WireVbucketState(IntEnum):
    """vbucket_state_t on the wire (SET_VBUCKET_STATE, GET_ALL_VB_SEQNOS filter); the store's
    and every layer's enum is `changefeed.vbucket_state.VBucketState`."""

    ACTIVE = 1
    REPLICA = 2
    PENDING = 3
    DEAD = 4


def _framing(stream_id: int | None) -> tuple[int, bytes]:
    if stream_id is None:
        return Magic.REQUEST, b""
    return Magic.ALT_REQUEST, encode_stream_id(stream_id)


def _require(condition: bool, message: str, status: Status = Status.EINVAL) -> None:
    if not condition:
        raise ProtocolError(message, status)


# -- DCP_OPEN ---------------------------------------------------------------------------------


class StreamRole(enum.StrEnum):
    """Who reads a producer connection's streams; given at DCP_OPEN, never guessed from a name.

    APPLICATION: a client (Spark, `changefeed stream`); its cursors may be dropped under memory
        pressure, the stream then continues from disk.
    REPLICA: a replica vbucket of the cluster pulling from its active; its cursors are kept
        unless the connection allows cursor dropping (dcp-wire.md §10).

    Carried as the key ``stream_role`` of the DCP_OPEN JSON value, a changefeed extension beside
    Couchbase's ``consumer_name``: kv_engine recognises replication by a "replication" substring
    of the connection name, which any client can hit by accident.
    """

    APPLICATION = "application"
    REPLICA = "replica"


@dataclass(frozen=True, slots=True)
class DcpOpen:
    opaque: int
    name: str
    flags: int
    consumer_name: str | None = None
    role: StreamRole = StreamRole.APPLICATION


def encode_dcp_open(message: DcpOpen) -> bytes:
    if not message.name:
        raise ValueError("DCP_OPEN needs a connection name")
    value = b""
    datatype = 0
    body: dict[str, str] = {}
    if message.consumer_name is not None:
        body["consumer_name"] = message.consumer_name
    if message.role is not StreamRole.APPLICATION:
        body["stream_role"] = message.role.value
    if body:
        value = json.dumps(body).encode()
        datatype = Datatype.JSON
    return encode_frame(
        Magic.REQUEST,
        Opcode.DCP_OPEN,
        datatype=datatype,
        opaque=message.opaque,
        extras=OPEN_EXTRAS.pack(0, message.flags),
        key=message.name.encode(),
        value=value,
    )


def decode_dcp_open(frame: Frame) -> DcpOpen:
    """Raises ProtocolError(EINVAL) for bad sizes, unknown or conflicting flags, bad value."""
    _require(len(frame.extras) == OPEN_EXTRAS.size, "DCP_OPEN extras must be 8 bytes")
    _require(bool(frame.key), "DCP_OPEN needs a connection name")
    _, flags = OPEN_EXTRAS.unpack(frame.extras)
    _require(not flags & ~OPEN_FLAGS_VALID, f"DCP_OPEN unknown flags 0x{flags:x}")
    both = OpenFlag.NO_VALUE | OpenFlag.NO_VALUE_WITH_UNDERLYING_DATATYPE
    _require(flags & both != both, "DCP_OPEN NoValue flags are exclusive")
    if flags & OpenFlag.INCLUDE_DELETED_USER_XATTRS:
        _require(bool(flags & OpenFlag.INCLUDE_XATTRS), "IncludeDeletedUserXattrs needs Xattrs")
    name = _utf8(frame.key, "connection name")
    consumer_name = None
    role = StreamRole.APPLICATION
    if frame.value:
        _require(frame.datatype == Datatype.JSON, "DCP_OPEN value must have datatype JSON")
        body = decode_json_object(frame.value, "DCP_OPEN value")
        keys = sorted(body)
        _require(set(body) <= {"consumer_name", "stream_role"}, f"DCP_OPEN value keys {keys}")
        if "consumer_name" in body:
            consumer_name = body["consumer_name"]
            _require(isinstance(consumer_name, str), "consumer_name must be a string")
        if "stream_role" in body:
            raw_role = body["stream_role"]
            roles = [r.value for r in StreamRole]
            _require(raw_role in roles, f"stream_role {str(raw_role)[:40]!r} not in {roles}")
            role = StreamRole(raw_role)
    return DcpOpen(frame.opaque, name, flags, consumer_name, role)


# -- DCP_CONTROL ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DcpControl:
    opaque: int
    key: str
    value: str


def encode_dcp_control(message: DcpControl) -> bytes:
    if not message.key or not message.value:
        raise ValueError("DCP_CONTROL needs a key and a value")
    return encode_frame(
        Magic.REQUEST,
        Opcode.DCP_CONTROL,
        opaque=message.opaque,
        key=message.key.encode(),
        value=message.value.encode(),
    )


def decode_dcp_control(frame: Frame) -> DcpControl:
    _require(not frame.extras, "DCP_CONTROL must not have extras")
    _require(bool(frame.key), "DCP_CONTROL needs a key")
    _require(bool(frame.value), "DCP_CONTROL needs a value")
    return DcpControl(frame.opaque, _utf8(frame.key, "key"), _utf8(frame.value, "value"))


# -- DCP_STREAM_REQ ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """A consumer asks for ``(start_seqno, end_seqno]`` of one vbucket (dcp-wire.md §6.1)."""

    vbucket: int
    opaque: int
    flags: int
    start_seqno: int
    end_seqno: int
    vb_uuid: int
    snap_start: int
    snap_end: int
    value: dict[str, Any] = field(default_factory=dict)

    @property
    def stream_id(self) -> int | None:
        sid = self.value.get("sid")
        return sid if isinstance(sid, int) else None

    @property
    def client_purge_seqno(self) -> int | None:
        """The ``purge_seqno`` the client last saw (a decimal string on the wire), if sent."""
        raw = self.value.get("purge_seqno")
        return int(raw) if _is_u64_decimal(raw) else None


def encode_stream_request(message: StreamRequest) -> bytes:
    value = json.dumps(message.value).encode() if message.value else b""
    return encode_frame(
        Magic.REQUEST,
        Opcode.DCP_STREAM_REQ,
        # dcp-wire.md §6.1: datatype RAW even with a JSON value; the server's validator answers
        # EINVAL to any other datatype on a stream request.
        datatype=Datatype.RAW,
        vbucket=message.vbucket,
        opaque=message.opaque,
        extras=STREAM_REQ_EXTRAS.pack(
            message.flags,
            0,
            message.start_seqno,
            message.end_seqno,
            message.vb_uuid,
            message.snap_start,
            message.snap_end,
        ),
        value=value,
    )


def decode_stream_request(frame: Frame) -> StreamRequest:
    """Raises ProtocolError(EINVAL) for bad sizes, a key, unknown flags, or a bad JSON value."""
    _require(len(frame.extras) == STREAM_REQ_EXTRAS.size, "DCP_STREAM_REQ extras must be 48")
    _require(not frame.key, "DCP_STREAM_REQ must not have a key")
    flags, _, start, end, uuid, snap_start, snap_end = STREAM_REQ_EXTRAS.unpack(frame.extras)
    _require(not flags & ~STREAM_FLAGS_VALID, f"DCP_STREAM_REQ invalid flags 0x{flags:x}")
    value: dict[str, Any] = {}
    if frame.value:
        value = decode_json_object(frame.value, "DCP_STREAM_REQ value")
        sid = value.get("sid")
        if sid is not None:
            _require(
                isinstance(sid, int) and not isinstance(sid, bool) and 1 <= sid <= 0xFFFF,
                f"invalid sid {sid!r}",
                Status.DCP_STREAM_ID_INVALID,
            )
        purge = value.get("purge_seqno")
        if purge is not None:
            _require(_is_u64_decimal(purge), "purge_seqno must be a decimal u64 string")
    return StreamRequest(
        frame.vbucket, frame.opaque, flags, start, end, uuid, snap_start, snap_end, value
    )


def encode_failover_log(entries: list[tuple[int, int]]) -> bytes:
    """Body of a stream-request success and of GET_FAILOVER_LOG: newest entry first."""
    if not 0 < len(entries) <= limits.FAILOVER_LOG_ENTRIES_MAX:
        raise ValueError(f"failover log of {len(entries)} entries")
    return b"".join(FAILOVER_ENTRY.pack(uuid, seqno) for uuid, seqno in entries)


def decode_failover_log(value: bytes) -> list[tuple[int, int]]:
    """Raises ProtocolError(EINVAL) unless the body is 1..25 whole 16-byte entries."""
    _require(len(value) % FAILOVER_ENTRY.size == 0, f"failover log of {len(value)} bytes")
    count = len(value) // FAILOVER_ENTRY.size
    _require(0 < count <= limits.FAILOVER_LOG_ENTRIES_MAX, f"failover log of {count} entries")
    return [(u, s) for u, s in FAILOVER_ENTRY.iter_unpack(value)]


def encode_rollback_seqno(seqno: int) -> bytes:
    """Body of a ROLLBACK (0x23) stream-request response: one u64."""
    return U64.pack(seqno)


def decode_rollback_seqno(value: bytes) -> int:
    _require(len(value) == U64.size, f"rollback body of {len(value)} bytes, not 8")
    return int(U64.unpack(value)[0])


# -- stream end, close stream, noop, buffer ack, set vbucket state, failover log ------------


@dataclass(frozen=True, slots=True)
class StreamEnd:
    vbucket: int
    opaque: int
    reason: StreamEndReason
    stream_id: int | None = None


def encode_stream_end(message: StreamEnd) -> bytes:
    magic, framing = _framing(message.stream_id)
    return encode_frame(
        magic,
        Opcode.DCP_STREAM_END,
        vbucket=message.vbucket,
        opaque=message.opaque,
        extras=U32.pack(message.reason),
        framing_extras=framing,
    )


def decode_stream_end(frame: Frame) -> StreamEnd:
    _require(len(frame.extras) == 4, "DCP_STREAM_END extras must be 4 bytes")
    _require(not frame.key and not frame.value, "DCP_STREAM_END has no key or value")
    code = U32.unpack(frame.extras)[0]
    try:
        reason = StreamEndReason(code)
    except ValueError:
        raise ProtocolError(f"unknown stream end reason {code}") from None
    return StreamEnd(frame.vbucket, frame.opaque, reason, frame.stream_id)


def encode_close_stream(vbucket: int, opaque: int, stream_id: int | None = None) -> bytes:
    magic, framing = _framing(stream_id)
    return encode_frame(
        magic, Opcode.DCP_CLOSE_STREAM, vbucket=vbucket, opaque=opaque, framing_extras=framing
    )


def encode_dcp_noop(opaque: int) -> bytes:
    return encode_frame(Magic.REQUEST, Opcode.DCP_NOOP, opaque=opaque)


def encode_buffer_ack(acked_bytes: int) -> bytes:
    """Connection-level flow-control ack (opaque 0, vbucket 0)."""
    if not 0 < acked_bytes < 2**32:
        raise ValueError(f"buffer ack of {acked_bytes} bytes")
    return encode_frame(
        Magic.REQUEST, Opcode.DCP_BUFFER_ACKNOWLEDGEMENT, extras=U32.pack(acked_bytes)
    )


def decode_buffer_ack(frame: Frame) -> int:
    _require(len(frame.extras) == 4, "DCP_BUFFER_ACKNOWLEDGEMENT extras must be 4 bytes")
    return int(U32.unpack(frame.extras)[0])


SEQNO_ACK_EXTRAS = struct.Struct(">Q")  # dcp-wire.md §7.15: the prepared seqno
SEQNO_ACK_EXTRAS_WITH_PERSISTED = struct.Struct(">QQ")


@quick_init  # built per item: see protocol/quick_init.py
@dataclass(frozen=True, slots=True)
class SeqnoAcknowledged:
    """DCP_SEQNO_ACKNOWLEDGED, consumer to producer: what a replica holds of a vbucket.

    On the wire Couchbase sends one u64, the seqno the replica has received (its "prepared"
    seqno). changefeed replicas append a second u64, the seqno they have persisted, so the
    active can tell held-in-memory from on-disk; an 8-byte ack (a Couchbase consumer) reports
    received only, and `persisted` is None.
    """

    vbucket: int
    opaque: int
    received: int
    persisted: int | None = None


def encode_seqno_acknowledged(message: SeqnoAcknowledged) -> bytes:
    if message.persisted is None:
        extras = SEQNO_ACK_EXTRAS.pack(message.received)
    else:
        extras = SEQNO_ACK_EXTRAS_WITH_PERSISTED.pack(message.received, message.persisted)
    return encode_frame(
        Magic.REQUEST,
        Opcode.DCP_SEQNO_ACKNOWLEDGED,
        vbucket=message.vbucket,
        opaque=message.opaque,
        extras=extras,
    )


def decode_seqno_acknowledged(frame: Frame) -> SeqnoAcknowledged:
    """Raises ProtocolError (EINVAL) for extras of another size or persisted above received."""
    if len(frame.extras) == SEQNO_ACK_EXTRAS.size:
        (received,) = SEQNO_ACK_EXTRAS.unpack(frame.extras)
        return SeqnoAcknowledged(frame.vbucket, frame.opaque, received)
    _require(
        len(frame.extras) == SEQNO_ACK_EXTRAS_WITH_PERSISTED.size,
        f"DCP_SEQNO_ACKNOWLEDGED extras must be 8 or 16 bytes, not {len(frame.extras)}",
    )
    received, persisted = SEQNO_ACK_EXTRAS_WITH_PERSISTED.unpack(frame.extras)
    _require(persisted <= received, f"persisted seqno {persisted} above received {received}")
    return SeqnoAcknowledged(frame.vbucket, frame.opaque, received, persisted)


def encode_set_vbucket_state(vbucket: int, opaque: int, state: WireVbucketState) -> bytes:
    return encode_frame(
        Magic.REQUEST,
        Opcode.DCP_SET_VBUCKET_STATE,
        vbucket=vbucket,
        opaque=opaque,
        extras=bytes((state,)),
    )


def decode_set_vbucket_state(frame: Frame) -> WireVbucketState:
    _require(len(frame.extras) == 1, "DCP_SET_VBUCKET_STATE extras must be 1 byte")
    try:
        return WireVbucketState(frame.extras[0])
    except ValueError:
        raise ProtocolError(f"unknown vbucket state {frame.extras[0]}") from None


def encode_get_failover_log(vbucket: int, opaque: int, *, dcp: bool = True) -> bytes:
    """0x54 on a DCP connection, 0x96 on any connection."""
    opcode = Opcode.DCP_GET_FAILOVER_LOG if dcp else Opcode.GET_FAILOVER_LOG
    return encode_frame(Magic.REQUEST, opcode, vbucket=vbucket, opaque=opaque)


# -- helpers ----------------------------------------------------------------------------------


def decode_json_object(raw: bytes, what: str) -> dict[str, Any]:
    """Parse a JSON object sent by a peer. Raises ProtocolError(EINVAL) otherwise."""
    try:
        body = json.loads(raw)
    # RecursionError: a peer can nest "[[[[..." deeper than the C scanner's recursion limit.
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ProtocolError(f"{what} is not JSON: {error}") from None
    _require(isinstance(body, dict), f"{what} must be a JSON object")
    assert isinstance(body, dict)
    return body


def _is_u64_decimal(raw: object) -> TypeGuard[str]:
    # str.isdigit() alone accepts non-ASCII digits ("\u00b2") that int() refuses, and int() refuses
    # strings over sys.int_info.str_digits_check_threshold digits: check ASCII and the u64 range.
    return (
        isinstance(raw, str)
        and 0 < len(raw) <= 20
        and raw.isascii()
        and raw.isdigit()
        and int(raw) <= limits.SEQNO_MAX
    )


def _utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"{what} is not UTF-8") from None
