"""KV commands a Couchbase-style client needs: HELLO, SELECT_BUCKET, GET, SET/ADD/REPLACE,
DELETE, STAT, GET_ALL_VB_SEQNOS, OBSERVE_SEQNO, GET_CLUSTER_CONFIG (dcp-wire.md §1.6, §2.2,
§7.16, §7.17). SASL payloads are in ``sasl.py``.

Layouts::

    SET/ADD/REPLACE request extras 8: flags u32 | expiry u32; key; value; header cas = expected
    GET response extras 4: flags u32; value; header cas
    mutation response extras 16 (MutationSeqno feature): vb_uuid u64 | seqno u64
    GET_ALL_VB_SEQNOS request extras 0, 4 (state filter) or 8; response value: (vb u16, seqno u64)*
    OBSERVE_SEQNO request value: vb_uuid u64; response value: format u8 | vb u16 | vb_uuid u64
        | persisted u64 | current u64 [format 1: | old_vb_uuid u64 | old_seqno u64]
    COMPACT_DB request (header vbucket = the vbucket) extras 24, kv_engine's CompactDbPayload:
        purge_before_ts u64 | purge_before_seq u64 | drop_deletes u8 | pad u8 | pad u16
        | pad u32 (pads 0); no key, no value. Success response value: JSON summary (ours;
        kv_engine answers with the status only, so a client may ignore it)
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from changefeed import limits
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.quick_init import quick_init
from changefeed.protocol.status import Status

STORE_EXTRAS = struct.Struct(">II")
GET_RESPONSE_EXTRAS = struct.Struct(">I")
MUTATION_TOKEN = struct.Struct(">QQ")
VB_SEQNO = struct.Struct(">HQ")
OBSERVE_SEQNO = struct.Struct(">BHQQQ")
OBSERVE_SEQNO_FAILOVER = struct.Struct(">QQ")
U16 = struct.Struct(">H")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
COMPACT_DB_EXTRAS = struct.Struct(">QQBBHI")  # ts, seq, drop_deletes, three pads
STORE_OPCODES = frozenset((Opcode.SET, Opcode.ADD, Opcode.REPLACE))

assert COMPACT_DB_EXTRAS.size == 24


def encode_request(
    opcode: int,
    *,
    vbucket: int = 0,
    opaque: int = 0,
    cas: int = 0,
    extras: bytes = b"",
    key: bytes = b"",
    value: bytes = b"",
    datatype: int = 0,
) -> bytes:
    return encode_frame(
        Magic.REQUEST,
        opcode,
        datatype=datatype,
        vbucket=vbucket,
        opaque=opaque,
        cas=cas,
        extras=extras,
        key=key,
        value=value,
    )


def _check_key(key: bytes) -> None:
    if not key:
        raise ProtocolError("command needs a key")
    if len(key) > limits.KEY_SIZE_MAX:
        raise ProtocolError(f"key of {len(key)} bytes exceeds {limits.KEY_SIZE_MAX}")


# -- HELLO ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    agent: str
    features: tuple[int, ...]


def encode_hello(opaque: int, agent: str, features: list[int]) -> bytes:
    value = b"".join(U16.pack(f) for f in features)
    return encode_request(Opcode.HELLO, opaque=opaque, key=agent.encode(), value=value)


def decode_hello(frame: Frame) -> Hello:
    """Request or response: the value is a list of u16 feature codes."""
    if frame.extras:
        raise ProtocolError("HELLO must not have extras")
    if len(frame.value) % 2:
        raise ProtocolError(f"HELLO features of odd length {len(frame.value)}")
    features = tuple(f for (f,) in U16.iter_unpack(frame.value))
    return Hello(frame.key.decode(errors="replace"), features)


def encode_hello_features(features: list[int]) -> bytes:
    return b"".join(U16.pack(f) for f in features)


# -- SET / ADD / REPLACE / GET / DELETE -------------------------------------------------------


@quick_init  # built per item: see quick_init.py
@dataclass(frozen=True, slots=True)
class StoreCommand:
    """SET, ADD or REPLACE: write ``value`` at ``key``; ``cas`` != 0 means compare-and-swap."""

    opcode: int
    vbucket: int
    opaque: int
    key: bytes
    value: bytes
    flags: int = 0
    expiry: int = 0
    cas: int = 0
    datatype: int = 0


def encode_store(command: StoreCommand, framing_extras: bytes = b"") -> bytes:
    """A SET/ADD/REPLACE request; ``framing_extras`` (e.g. a durability frame) make it alt-magic."""
    if command.opcode not in STORE_OPCODES:
        raise ValueError(f"not a store opcode: {command.opcode}")
    return encode_frame(
        Magic.ALT_REQUEST if framing_extras else Magic.REQUEST,
        command.opcode,
        framing_extras=framing_extras,
        vbucket=command.vbucket,
        opaque=command.opaque,
        cas=command.cas,
        extras=STORE_EXTRAS.pack(command.flags, command.expiry),
        key=command.key,
        value=command.value,
        datatype=command.datatype,
    )


def decode_store(frame: Frame) -> StoreCommand:
    if len(frame.extras) != STORE_EXTRAS.size:
        raise ProtocolError(f"store command extras of {len(frame.extras)} bytes, not 8")
    _check_key(frame.key)
    if len(frame.value) > limits.VALUE_SIZE_MAX:
        raise ProtocolError(f"value of {len(frame.value)} bytes", Status.E2BIG)
    flags, expiry = STORE_EXTRAS.unpack(frame.extras)
    return StoreCommand(
        frame.opcode,
        frame.vbucket,
        frame.opaque,
        frame.key,
        frame.value,
        flags,
        expiry,
        frame.cas,
        frame.datatype,
    )


def decode_key_only(frame: Frame) -> bytes:
    """GET and DELETE carry only a key (DELETE may carry a CAS in the header)."""
    if frame.extras:
        raise ProtocolError("command must not have extras")
    if frame.value:
        raise ProtocolError("command must not have a value")
    _check_key(frame.key)
    return frame.key


@quick_init  # built per item: see quick_init.py
@dataclass(frozen=True, slots=True, kw_only=True)
class MutationResult:
    """What a write answers, on both sides of the wire: the vbucket it went to, the seqno and
    CAS it got, and the vb_uuid of the history branch it is on (the mutation token).

    The node builds it when it takes a write; a client decodes it from the response (CAS from
    the header, token from the extras when MutationSeqno was negotiated, else vb_uuid and seqno 0).
    """

    vbucket: int
    seqno: int
    cas: int
    vb_uuid: int


def encode_mutation_token(vb_uuid: int, seqno: int) -> bytes:
    """Extras of a SET/DELETE response when MutationSeqno was negotiated."""
    return MUTATION_TOKEN.pack(vb_uuid, seqno)


def decode_mutation_token(extras: bytes) -> tuple[int, int] | None:
    if not extras:
        return None
    if len(extras) != MUTATION_TOKEN.size:
        raise ProtocolError(f"mutation token of {len(extras)} bytes, not 16")
    uuid, seqno = MUTATION_TOKEN.unpack(extras)
    return int(uuid), int(seqno)


def decode_get_response_flags(extras: bytes) -> int:
    if len(extras) != GET_RESPONSE_EXTRAS.size:
        raise ProtocolError(f"GET response extras of {len(extras)} bytes, not 4")
    return int(GET_RESPONSE_EXTRAS.unpack(extras)[0])


# -- GET_ALL_VB_SEQNOS / OBSERVE_SEQNO --------------------------------------------------------


def encode_vb_seqnos(pairs: list[tuple[int, int]]) -> bytes:
    return b"".join(VB_SEQNO.pack(vb, seqno) for vb, seqno in pairs)


def decode_vb_seqnos(value: bytes) -> list[tuple[int, int]]:
    if len(value) % VB_SEQNO.size:
        raise ProtocolError(f"vbucket seqno list of {len(value)} bytes")
    return [(vb, seqno) for vb, seqno in VB_SEQNO.iter_unpack(value)]


def decode_vb_state_filter(frame: Frame) -> int:
    """GET_ALL_VB_SEQNOS: 0 = every alive vbucket, 1..4 = one state."""
    if len(frame.extras) not in (0, 4, 8):
        raise ProtocolError(f"GET_ALL_VB_SEQNOS extras of {len(frame.extras)} bytes")
    if not frame.extras:
        return 0
    state = int(U32.unpack_from(frame.extras)[0])
    if state > 4:
        raise ProtocolError(f"unknown vbucket state filter {state}")
    return state


@dataclass(frozen=True, slots=True)
class ObserveSeqnoResult:
    vbucket: int
    vb_uuid: int
    persisted_seqno: int
    current_seqno: int
    old_vb_uuid: int | None = None  # set when the requested uuid is an older branch
    old_seqno: int | None = None


def encode_observe_seqno_result(r: ObserveSeqnoResult) -> bytes:
    fmt = 0 if r.old_vb_uuid is None else 1
    out = OBSERVE_SEQNO.pack(fmt, r.vbucket, r.vb_uuid, r.persisted_seqno, r.current_seqno)
    if fmt:
        out += OBSERVE_SEQNO_FAILOVER.pack(r.old_vb_uuid, r.old_seqno or 0)
    return out


def decode_observe_seqno_result(value: bytes) -> ObserveSeqnoResult:
    if len(value) not in (OBSERVE_SEQNO.size, OBSERVE_SEQNO.size + OBSERVE_SEQNO_FAILOVER.size):
        raise ProtocolError(f"OBSERVE_SEQNO response of {len(value)} bytes")
    fmt, vb, uuid, persisted, current = OBSERVE_SEQNO.unpack_from(value)
    if fmt == 0 and len(value) == OBSERVE_SEQNO.size:
        return ObserveSeqnoResult(vb, uuid, persisted, current)
    if fmt == 1 and len(value) > OBSERVE_SEQNO.size:
        old_uuid, old_seqno = OBSERVE_SEQNO_FAILOVER.unpack_from(value, OBSERVE_SEQNO.size)
        return ObserveSeqnoResult(vb, uuid, persisted, current, old_uuid, old_seqno)
    raise ProtocolError(f"OBSERVE_SEQNO format {fmt} with {len(value)} bytes")


def decode_observe_seqno_request(frame: Frame) -> int:
    if len(frame.value) != U64.size:
        raise ProtocolError(f"OBSERVE_SEQNO request value of {len(frame.value)} bytes, not 8")
    return int(U64.unpack(frame.value)[0])


# -- SEQNO_PERSISTENCE -----------------------------------------------------------------------


def encode_seqno_persistence(vbucket: int, seqno: int, opaque: int = 0) -> bytes:
    """SEQNO_PERSISTENCE (0xb6): answered once ``vbucket`` has persisted ``seqno`` (kv_engine:
    the seqno is the request's 8 bytes of extras, big-endian)."""
    return encode_request(
        Opcode.SEQNO_PERSISTENCE, vbucket=vbucket, opaque=opaque, extras=U64.pack(seqno)
    )


def decode_seqno_persistence(frame: Frame) -> int:
    """The seqno a SEQNO_PERSISTENCE request waits for.

    Raises:
        ProtocolError: the extras are not 8 bytes, or a key or value came with them (EINVAL).
    """
    if len(frame.extras) != U64.size or frame.key or frame.value:
        raise ProtocolError(
            f"SEQNO_PERSISTENCE takes 8 bytes of extras and no key or value, got "
            f"{len(frame.extras)}/{len(frame.key)}/{len(frame.value)}"
        )
    return int(U64.unpack(frame.extras)[0])


# -- COMPACT_DB -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CompactDb:
    """COMPACT_DB (0x3a): purge the tombstones of one vbucket now; answered when done.

    Attributes:
        vbucket: the vbucket to compact (the header's vbucket field).
        opaque: echoed in the response.
        purge_before_ts: purge tombstones deleted before this Unix time (seconds, the node's
            clock); 0 asks for the node's own purge age (``tombstone_purge_age_s``).
        purge_before_seq: purge only tombstones at or below this seqno; 0 means no bound.
        drop_deletes: purge every tombstone whatever its delete time.
    """

    vbucket: int
    opaque: int
    purge_before_ts: int = 0
    purge_before_seq: int = 0
    drop_deletes: bool = False


def encode_compact_db(request: CompactDb) -> bytes:
    extras = COMPACT_DB_EXTRAS.pack(
        request.purge_before_ts, request.purge_before_seq, int(request.drop_deletes), 0, 0, 0
    )
    return encode_request(
        Opcode.COMPACT_DB, vbucket=request.vbucket, opaque=request.opaque, extras=extras
    )


def decode_compact_db(frame: Frame) -> CompactDb:
    if len(frame.extras) != COMPACT_DB_EXTRAS.size:
        raise ProtocolError(f"COMPACT_DB extras of {len(frame.extras)} bytes, not 24")
    if frame.key or frame.value:
        raise ProtocolError("COMPACT_DB takes no key and no value")
    ts, seq, drop_deletes, pad1, pad2, pad3 = COMPACT_DB_EXTRAS.unpack(frame.extras)
    if drop_deletes > 1 or pad1 or pad2 or pad3:
        raise ProtocolError(f"COMPACT_DB drop_deletes {drop_deletes} or padding not zero")
    return CompactDb(frame.vbucket, frame.opaque, ts, seq, bool(drop_deletes))


@dataclass(frozen=True, slots=True)
class CompactionSummary:
    """What a COMPACT_DB did, the JSON value of its success response.

    Attributes:
        vbucket: the vbucket compacted.
        purged: tombstones removed.
        purge_seqno: the vbucket's purge seqno afterwards.
        visited: records looked at.
    """

    vbucket: int
    purged: int
    purge_seqno: int
    visited: int


def encode_compaction_summary(summary: CompactionSummary) -> bytes:
    fields = {
        "vbucket": summary.vbucket,
        "purged": summary.purged,
        "purge_seqno": summary.purge_seqno,
        "visited": summary.visited,
    }
    return json.dumps(fields).encode()


def decode_compaction_summary(value: bytes) -> CompactionSummary:
    """The summary a node sent; a peer's bytes, so every field is checked."""
    try:
        raw = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProtocolError(f"COMPACT_DB response is not JSON: {error}") from None
    names = ("vbucket", "purged", "purge_seqno", "visited")
    if not isinstance(raw, dict) or not all(
        type(raw.get(name)) is int and 0 <= raw[name] <= limits.SEQNO_MAX for name in names
    ):
        raise ProtocolError(f"COMPACT_DB response {value[:100]!r} lacks its counters")
    return CompactionSummary(raw["vbucket"], raw["purged"], raw["purge_seqno"], raw["visited"])
