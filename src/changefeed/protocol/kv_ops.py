"""The KV commands of a Couchbase SDK's collection API beyond GET/SET/DELETE, and the cluster
map push: GET_META, TOUCH, GAT, GET_LOCKED, UNLOCK_KEY, INCREMENT/DECREMENT, APPEND/PREPEND,
ClustermapChangeNotification (kv_engine's docs/BinaryProtocol.md; layouts as the Couchbase C++
SDK core encodes them). Sans-IO: frames in, dataclasses out, and back.

Layouts (big-endian)::

    GET_META request extras 0 or 1: format u8 (1, or 2 = the response carries the datatype)
        response extras: deleted u32 | flags u32 | expiry u32 | rev seqno u64 [| datatype u8]
    TOUCH, GAT request extras 4: expiry u32 (0 = never); GAT response extras 4: flags u32
    GET_LOCKED request extras 0 or 4: lock time u32 in seconds (0 = the default);
        response as GET's, the header CAS unlocks
    UNLOCK_KEY request: key, header CAS = the lock's CAS (must not be 0)
    INCREMENT/DECREMENT request extras 20: delta u64 | initial u64 | expiry u32
        (expiry 0xffffffff: fail if the document is missing instead of creating it);
        response value: the new value u64 (extras: the mutation token when negotiated)
    APPEND/PREPEND request: key, value; header CAS optional
    ClustermapChangeNotification (server request, magic 0x82, opcode 0x01, opaque 0):
        extras 16: epoch i64 | revision i64; key: the bucket; value: the map JSON (empty for
        the "brief" form)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from changefeed import limits
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.opcode import Datatype, Magic, Opcode, ServerOpcode
from changefeed.protocol.status import Status

U32: Final = struct.Struct(">I")
U64: Final = struct.Struct(">Q")
GET_META_V1: Final = struct.Struct(">IIIQ")
GET_META_V2: Final = struct.Struct(">IIIQB")
ARITHMETIC_EXTRAS: Final = struct.Struct(">QQI")
MAP_VERSION: Final = struct.Struct(">qq")
# INCREMENT/DECREMENT expiry meaning "do not create a missing document" (memcached).
ARITHMETIC_NO_CREATE: Final = 0xFFFF_FFFF
# The CAS a GET shows for a document someone else holds locked (kv_engine's LOCKED_CAS).
LOCKED_CAS: Final = 0xFFFF_FFFF_FFFF_FFFF


def _name(opcode: int) -> str:
    try:
        return Opcode(opcode).name
    except ValueError:
        return f"opcode {opcode:#04x}"


def _check_key(frame: Frame) -> bytes:
    if not frame.key:
        raise ProtocolError(f"{_name(frame.opcode)} needs a key")
    if len(frame.key) > limits.KEY_SIZE_MAX:
        raise ProtocolError(f"key of {len(frame.key)} bytes exceeds {limits.KEY_SIZE_MAX}")
    return frame.key


def _no_value(frame: Frame) -> None:
    if frame.value:
        raise ProtocolError(f"{_name(frame.opcode)} must not have a value")


# -- GET_META ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DocumentMeta:
    """What GET_META answers: a live document's or a tombstone's metadata.

    Attributes:
        expiry: absolute expiry (0 never); a tombstone's is its delete time, as kv_engine's.
        rev_seqno: the document's revision (GET_META's "seqno" field).
    """

    deleted: bool
    flags: int
    expiry: int
    rev_seqno: int
    datatype: int
    cas: int


def decode_get_meta(frame: Frame) -> tuple[bytes, int]:
    """(key, response format 1 or 2).

    Raises:
        ProtocolError: extras other than one format byte of 1 or 2, a value, or a bad key.
    """
    _no_value(frame)
    key = _check_key(frame)
    if not frame.extras:
        return key, 1
    if len(frame.extras) != 1 or frame.extras[0] not in (1, 2):
        raise ProtocolError(f"GET_META extras {frame.extras[:8].hex()} are not a format 1 or 2")
    return key, frame.extras[0]


def encode_get_meta_extras(meta: DocumentMeta, version: int) -> bytes:
    fields = (int(meta.deleted), meta.flags, meta.expiry, meta.rev_seqno)
    if version == 2:
        return GET_META_V2.pack(*fields, meta.datatype)
    return GET_META_V1.pack(*fields)


def decode_get_meta_extras(extras: bytes, cas: int = 0) -> DocumentMeta:
    """A GET_META response's extras (format 1 or 2, told apart by their length)."""
    if len(extras) == GET_META_V2.size:
        deleted, flags, expiry, rev_seqno, datatype = GET_META_V2.unpack(extras)
    elif len(extras) == GET_META_V1.size:
        deleted, flags, expiry, rev_seqno = GET_META_V1.unpack(extras)
        datatype = 0
    else:
        raise ProtocolError(f"GET_META response extras of {len(extras)} bytes")
    return DocumentMeta(deleted != 0, flags, expiry, rev_seqno, datatype, cas)


# -- TOUCH / GAT / GET_LOCKED / UNLOCK --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Touch:
    """TOUCH or GAT: set ``key``'s expiry (wire rules: 0 never, <= 30 days relative)."""

    key: bytes
    expiry: int


def encode_touch(
    opcode: int, key: bytes, expiry: int, *, vbucket: int = 0, opaque: int = 0
) -> bytes:
    if opcode not in (Opcode.TOUCH, Opcode.GAT):
        raise ValueError(f"not TOUCH or GAT: {opcode}")
    return encode_frame(
        Magic.REQUEST, opcode, vbucket=vbucket, opaque=opaque, extras=U32.pack(expiry), key=key
    )


def decode_touch(frame: Frame) -> Touch:
    """Raises ProtocolError unless the extras are one u32 and there is a key and no value."""
    if len(frame.extras) != U32.size:
        raise ProtocolError(f"{_name(frame.opcode)} extras of {len(frame.extras)} bytes")
    _no_value(frame)
    return Touch(_check_key(frame), int(U32.unpack(frame.extras)[0]))


def decode_get_locked(frame: Frame) -> tuple[bytes, int]:
    """(key, requested lock time in seconds; 0 = the node's default)."""
    if len(frame.extras) not in (0, U32.size):
        raise ProtocolError(f"GET_LOCKED extras of {len(frame.extras)} bytes, not 0 or 4")
    _no_value(frame)
    key = _check_key(frame)
    return key, int(U32.unpack(frame.extras)[0]) if frame.extras else 0


def encode_get_locked(key: bytes, lock_s: int, *, vbucket: int = 0, opaque: int = 0) -> bytes:
    return encode_frame(
        Magic.REQUEST,
        Opcode.GET_LOCKED,
        vbucket=vbucket,
        opaque=opaque,
        extras=U32.pack(lock_s),
        key=key,
    )


def decode_unlock(frame: Frame) -> tuple[bytes, int]:
    """(key, the lock's CAS). Raises ProtocolError for extras, a value or CAS 0."""
    if frame.extras:
        raise ProtocolError("UNLOCK_KEY takes no extras")
    _no_value(frame)
    key = _check_key(frame)
    if frame.cas == 0:
        raise ProtocolError("UNLOCK_KEY needs the lock's CAS")
    return key, frame.cas


# -- INCREMENT / DECREMENT --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arithmetic:
    """INCREMENT or DECREMENT of the unsigned decimal number stored at ``key``.

    Attributes:
        expiry: of a document created with ``initial``; ARITHMETIC_NO_CREATE: fail instead.
    """

    opcode: int
    key: bytes
    delta: int
    initial: int
    expiry: int
    cas: int = 0


def encode_arithmetic(command: Arithmetic, *, vbucket: int = 0, opaque: int = 0) -> bytes:
    if command.opcode not in (Opcode.INCREMENT, Opcode.DECREMENT):
        raise ValueError(f"not INCREMENT or DECREMENT: {command.opcode}")
    extras = ARITHMETIC_EXTRAS.pack(command.delta, command.initial, command.expiry)
    return encode_frame(
        Magic.REQUEST,
        command.opcode,
        vbucket=vbucket,
        opaque=opaque,
        cas=command.cas,
        extras=extras,
        key=command.key,
    )


def decode_arithmetic(frame: Frame) -> Arithmetic:
    if len(frame.extras) != ARITHMETIC_EXTRAS.size:
        raise ProtocolError(f"{_name(frame.opcode)} extras of {len(frame.extras)} bytes")
    _no_value(frame)
    key = _check_key(frame)
    delta, initial, expiry = ARITHMETIC_EXTRAS.unpack(frame.extras)
    return Arithmetic(frame.opcode, key, delta, initial, expiry, frame.cas)


def decode_arithmetic_value(value: bytes) -> int:
    if len(value) != U64.size:
        raise ProtocolError(f"arithmetic response value of {len(value)} bytes, not 8")
    return int(U64.unpack(value)[0])


def parse_counter(value: bytes) -> int | None:
    """A stored counter: ASCII decimal digits of a u64 (memcached's rule), else None."""
    if not 0 < len(value) <= 20 or not value.isdigit():
        return None
    number = int(value)
    return number if number <= 0xFFFF_FFFF_FFFF_FFFF else None


def apply_arithmetic(opcode: int, current: int, delta: int) -> int:
    """Increment wraps at 2**64; decrement stops at 0 (memcached)."""
    if opcode == Opcode.INCREMENT:
        return (current + delta) & 0xFFFF_FFFF_FFFF_FFFF
    return max(0, current - delta)


# -- APPEND / PREPEND -------------------------------------------------------------------------


def decode_concat(frame: Frame) -> tuple[bytes, bytes]:
    """(key, value to add) of APPEND or PREPEND."""
    if frame.extras:
        raise ProtocolError(f"{_name(frame.opcode)} takes no extras")
    key = _check_key(frame)
    if len(frame.value) > limits.VALUE_SIZE_MAX:
        raise ProtocolError(f"value of {len(frame.value)} bytes", Status.E2BIG)
    return key, frame.value


# -- cluster map push -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClusterMapNotification:
    """A ClustermapChangeNotification: the map's version, its bucket, its JSON (b"" if brief)."""

    epoch: int
    revision: int
    bucket: str
    config: bytes


def encode_clustermap_notification(notification: ClusterMapNotification) -> bytes:
    return encode_frame(
        Magic.SERVER_REQUEST,
        ServerOpcode.CLUSTERMAP_CHANGE_NOTIFICATION,
        datatype=Datatype.JSON if notification.config else Datatype.RAW,
        extras=MAP_VERSION.pack(notification.epoch, notification.revision),
        key=notification.bucket.encode(),
        value=notification.config,
    )


def decode_clustermap_notification(frame: Frame) -> ClusterMapNotification:
    """A server request a client received. Raises ProtocolError for another opcode or
    extras that are not the 16-byte version."""
    if frame.magic != Magic.SERVER_REQUEST or frame.opcode != (
        ServerOpcode.CLUSTERMAP_CHANGE_NOTIFICATION
    ):
        raise ProtocolError(f"not a cluster map notification: {frame.magic:#x}/{frame.opcode:#x}")
    if len(frame.extras) != MAP_VERSION.size:
        raise ProtocolError(f"map notification extras of {len(frame.extras)} bytes, not 16")
    epoch, revision = MAP_VERSION.unpack(frame.extras)
    return ClusterMapNotification(epoch, revision, frame.key.decode(errors="replace"), frame.value)
