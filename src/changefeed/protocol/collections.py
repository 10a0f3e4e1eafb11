"""Collection ids on the wire: the unsigned LEB128 key prefix, GET_COLLECTION_ID's answer, the
UNKNOWN_COLLECTION body, the DCP stream-request filter and the DCP system event. No I/O.
(DCP_SEQNO_ADVANCED is in dcp_items.py.)

Rules (kv_engine docs/Collections.md, "encoding collection ID with LEB128"): a connection that
negotiated HELLO Collections (0x12) starts every document key with the collection id as an
unsigned LEB128 of a u32, at most 5 bytes, in its shortest (canonical) form; 0x00 is the default
collection. A prefix without a stop byte in 5 bytes, a non-canonical one, one above 2**32 - 1 or
a key that is nothing but the prefix is EINVAL.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final

from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.frame_info import encode_stream_id
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.status import Status

LEB128_BYTES_MAX: Final = 5  # ceil(32 / 7): a u32
# Where a vbucket keeps its system events: kv_engine reserves collection ids 1..7; here id 1
# holds one document per event (`system_event_key`), written to every vbucket like any change,
# so an event has a seqno, sits in the checkpoint, is persisted, backfilled and replicated in
# seqno order with the documents. No client can address it (no manifest names it).
SYSTEM_COLLECTION: Final = 1
COLLECTION_ID_MAX: Final = 0xFFFF_FFFF
DEFAULT_COLLECTION: Final = 0

# GET_COLLECTION_ID / GET_SCOPE_ID response extras: manifest uid u64 | id u32.
ID_EXTRAS: Final = struct.Struct(">QI")
# DCP_SYSTEM_EVENT extras (dcp-wire.md §7.12): by_seqno u64 | event u32 | version u8.
SYSTEM_EVENT_EXTRAS: Final = struct.Struct(">QIB")
# Version 0 BeginCollection value: manifest uid u64 | scope id u32 | collection id u32 (+ max_ttl
# u32 in version 1). EndCollection: manifest uid | scope id | collection id. Scope events:
# manifest uid | scope id.
COLLECTION_EVENT_V0: Final = struct.Struct(">QII")
COLLECTION_EVENT_V1: Final = struct.Struct(">QIII")
SCOPE_EVENT: Final = struct.Struct(">QI")

assert ID_EXTRAS.size == 12
assert SYSTEM_EVENT_EXTRAS.size == 13
assert COLLECTION_EVENT_V0.size == 16 and COLLECTION_EVENT_V1.size == 20


class SystemEvent(IntEnum):
    """DCP system event ids (dcp-wire.md §7.12)."""

    BEGIN_COLLECTION = 0
    END_COLLECTION = 1
    CREATE_SCOPE = 3
    DROP_SCOPE = 4


def encode_leb128(value: int) -> bytes:
    """The shortest unsigned LEB128 of a u32 (our own value: a bad one is a ValueError)."""
    if not 0 <= value <= COLLECTION_ID_MAX:
        raise ValueError(f"collection id {value} is not a u32")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_leb128(data: bytes | memoryview) -> tuple[int, int]:
    """Decode the collection id at the front of `data`.

    Returns:
        (collection id, bytes it took).

    Raises:
        ProtocolError(EINVAL): no stop byte within 5 bytes, a non-canonical encoding, or a
            value above a u32.
    """
    value = 0
    for index in range(min(len(data), LEB128_BYTES_MAX)):
        byte = data[index]
        value |= (byte & 0x7F) << (7 * index)
        if not byte & 0x80:
            if index and byte == 0:  # a trailing zero group: a longer form than needed
                raise ProtocolError(
                    f"collection id prefix {bytes(data[: index + 1]).hex()} is not canonical"
                )
            if value > COLLECTION_ID_MAX:
                raise ProtocolError(f"collection id {value} is above 2**32 - 1")
            return value, index + 1
    raise ProtocolError(
        f"collection id prefix {bytes(data[:LEB128_BYTES_MAX]).hex() or '(empty)'} has no "
        f"stop byte within {LEB128_BYTES_MAX} bytes"
    )


def split_key(key: bytes) -> tuple[int, bytes]:
    """Split a collections connection's key into (collection id, document key).

    Raises:
        ProtocolError(EINVAL): a bad prefix (`decode_leb128`), or no document key after it.
    """
    cid, used = decode_leb128(key)
    if used == len(key):
        raise ProtocolError(f"key {key.hex()} is only a collection id prefix, with no key")
    return cid, key[used:]


def split_keys(keys: Sequence[bytes]) -> tuple[list[int], list[bytes]]:
    """`split_key` of every key of a run (a collections stream's `ChangeColumns.key`): the
    collection ids and the document keys, in order. An id below 128 is its key's first byte,
    read without the decoder (the common case: the Spark source splits whole batches).

    Raises:
        ProtocolError(EINVAL): a malformed prefix, as `split_key`.
    """
    cids: list[int] = []
    docs: list[bytes] = []
    for key in keys:  # bounded by the run
        first = key[0] if key else 0x80
        if first < 0x80 and len(key) > 1:
            cids.append(first)
            docs.append(key[1:])
        else:
            cid, doc = split_key(key)
            cids.append(cid)
            docs.append(doc)
    return cids, docs


def encode_id_extras(manifest_uid: int, ident: int) -> bytes:
    """GET_COLLECTION_ID / GET_SCOPE_ID success extras."""
    return ID_EXTRAS.pack(manifest_uid, ident)


def decode_id_extras(extras: bytes) -> tuple[int, int]:
    """(manifest uid, id) of a GET_COLLECTION_ID / GET_SCOPE_ID answer.

    Raises:
        ProtocolError: the extras are not 12 bytes.
    """
    if len(extras) != ID_EXTRAS.size:
        raise ProtocolError(f"collection id extras have {len(extras)} bytes, expected 12")
    uid, ident = ID_EXTRAS.unpack(extras)
    return int(uid), int(ident)


def unknown_collection_body(manifest_uid: int) -> bytes:
    """UNKNOWN_COLLECTION / UNKNOWN_SCOPE body: the manifest uid the node decided by, as hex
    with no 0x (kv_engine docs/Collections.md, "Error Code 0x88"); an SDK compares it with the
    uid it knows and fetches the manifest again when the node's is newer."""
    return json.dumps({"manifest_uid": f"{manifest_uid:x}"}).encode()


def manifest_uid_of_error(body: bytes) -> int | None:
    """The manifest uid of an UNKNOWN_COLLECTION / UNKNOWN_SCOPE body, or None if it has none."""
    try:
        data = json.loads(body)
        return int(data["manifest_uid"], 16)
    except (ValueError, TypeError, KeyError, RecursionError):
        return None


# -- DCP stream-request filter (dcp-wire.md §6.1) --------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamFilter:
    """What a stream carries: every collection (neither set), a set of collections, or one
    scope's collections (kv_engine's filter JSON: ``{"collections": ["8"]}`` or
    ``{"scope": "8"}``, ids in hex)."""

    collections: frozenset[int] | None = None
    scope: int | None = None

    def __post_init__(self) -> None:
        if self.collections is not None and self.scope is not None:
            raise ValueError("a stream filter names collections or a scope, not both")

    @property
    def everything(self) -> bool:
        return self.collections is None and self.scope is None

    def to_json(self) -> bytes:
        """The stream-request value ("" for everything)."""
        if self.collections is not None:
            ids = [f"{cid:x}" for cid in sorted(self.collections)]
            return json.dumps({"collections": ids}).encode()
        if self.scope is not None:
            return json.dumps({"scope": f"{self.scope:x}"}).encode()
        return b""


def _hex_id(value: object, what: str) -> int:
    if not isinstance(value, str) or not value or len(value) > 8:
        raise ProtocolError(f"stream filter {what} {value!r} is not a hex id string")
    try:
        return int(value, 16)
    except ValueError:
        raise ProtocolError(f"stream filter {what} {value!r} is not a hex id string") from None


def decode_stream_filter(value: bytes) -> StreamFilter:
    """The filter of a stream request's value (empty: everything). Unknown keys are ignored, as
    kv_engine does ("uid", "sid", "purge_seqno" are read elsewhere).

    Raises:
        ProtocolError(EINVAL): not a JSON object, ids that are not hex strings, an empty
            collection list, or both "collections" and "scope".
    """
    if not value:
        return StreamFilter()
    try:
        data = json.loads(value)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json can go
        raise ProtocolError(f"stream request value {value[:100]!r} is not JSON") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"stream request value {value[:100]!r} is not a JSON object")
    return stream_filter_of(data)


def stream_filter_of(data: dict[str, Any]) -> StreamFilter:
    """The filter of an already parsed stream-request value (`decode_stream_filter`)."""
    collections = data.get("collections")
    scope = data.get("scope")
    if collections is not None and scope is not None:
        raise ProtocolError("a stream filter names collections or a scope, not both")
    if collections is not None:
        if not isinstance(collections, list) or not collections:
            raise ProtocolError(f"stream filter collections {collections!r} is not a list of ids")
        return StreamFilter(collections=frozenset(_hex_id(c, "collection") for c in collections))
    if scope is not None:
        return StreamFilter(scope=_hex_id(scope, "scope"))
    return StreamFilter()


def manifest_uid_of_request(data: dict[str, Any]) -> int | None:
    """The manifest uid of a parsed stream-request value (kv_engine stream-request-value.md,
    "uid": hex, no 0x): the newest manifest the client saw in this stream's system events, or
    None when it sent none.

    Raises:
        ProtocolError(EINVAL): "uid" is not a hex string of at most 16 digits.
    """
    raw = data.get("uid")
    if raw is None:
        return None
    if not isinstance(raw, str) or not 0 < len(raw) <= 16:
        raise ProtocolError(f"stream request uid {raw!r} is not a hex manifest uid")
    try:
        return int(raw, 16)
    except ValueError:
        raise ProtocolError(f"stream request uid {raw!r} is not a hex manifest uid") from None


# -- DCP messages ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SystemEventMessage:
    """A DCP_SYSTEM_EVENT: a collection or scope created or dropped at `seqno`.

    Attributes:
        name: the collection's (or scope's) name; b"" for a drop, as kv_engine sends.
        collection_id: None for scope events.
        max_ttl: a created collection's maxTTL (version 1 of the value), else None.
    """

    vbucket: int
    opaque: int
    seqno: int
    event: SystemEvent
    manifest_uid: int
    scope_id: int
    collection_id: int | None = None
    name: bytes = b""
    max_ttl: int | None = None


def encode_system_event(message: SystemEventMessage, stream_id: int | None = None) -> bytes:
    """The DCP_SYSTEM_EVENT frame of `message` (dcp-wire.md §7.12, versions 0 and 1)."""
    version = 0
    if message.event in (SystemEvent.BEGIN_COLLECTION, SystemEvent.END_COLLECTION):
        if message.collection_id is None:
            raise ValueError("a collection event needs a collection id")
        if message.max_ttl is not None and message.event is SystemEvent.BEGIN_COLLECTION:
            version = 1
            value = COLLECTION_EVENT_V1.pack(
                message.manifest_uid, message.scope_id, message.collection_id, message.max_ttl
            )
        else:
            value = COLLECTION_EVENT_V0.pack(
                message.manifest_uid, message.scope_id, message.collection_id
            )
    else:
        value = SCOPE_EVENT.pack(message.manifest_uid, message.scope_id)
    return _dcp_frame(
        Opcode.DCP_SYSTEM_EVENT,
        message.vbucket,
        message.opaque,
        SYSTEM_EVENT_EXTRAS.pack(message.seqno, message.event, version),
        message.name,
        value,
        stream_id,
    )


def decode_system_event(frame: Frame) -> SystemEventMessage:
    """Decode a DCP_SYSTEM_EVENT frame.

    Raises:
        ProtocolError: extras of the wrong size, an unknown event or version, or a value whose
            size does not match the event.
    """
    if len(frame.extras) != SYSTEM_EVENT_EXTRAS.size:
        raise ProtocolError(f"system event extras have {len(frame.extras)} bytes, expected 13")
    seqno, event_id, version = SYSTEM_EVENT_EXTRAS.unpack(frame.extras)
    try:
        event = SystemEvent(event_id)
    except ValueError:
        raise ProtocolError(f"unknown system event {event_id}") from None
    value = frame.value
    common = (frame.vbucket, frame.opaque, int(seqno), event)
    if event in (SystemEvent.BEGIN_COLLECTION, SystemEvent.END_COLLECTION):
        if version == 0 and len(value) == COLLECTION_EVENT_V0.size:
            uid, sid, cid = COLLECTION_EVENT_V0.unpack(value)
            return SystemEventMessage(*common, int(uid), int(sid), int(cid), bytes(frame.key))
        if version == 1 and len(value) == COLLECTION_EVENT_V1.size:
            uid, sid, cid, ttl = COLLECTION_EVENT_V1.unpack(value)
            return SystemEventMessage(
                *common, int(uid), int(sid), int(cid), bytes(frame.key), int(ttl)
            )
    elif version == 0 and len(value) == SCOPE_EVENT.size:
        uid, sid = SCOPE_EVENT.unpack(value)
        return SystemEventMessage(*common, int(uid), int(sid), None, bytes(frame.key))
    raise ProtocolError(
        f"system event {event.name} version {version} with a {len(value)}-byte value"
    )


def _dcp_frame(
    opcode: Opcode,
    vbucket: int,
    opaque: int,
    extras: bytes,
    key: bytes,
    value: bytes,
    stream_id: int | None,
) -> bytes:
    framing = b""
    magic = Magic.REQUEST
    if stream_id is not None:
        magic = Magic.ALT_REQUEST
        framing = encode_stream_id(stream_id)
    return encode_frame(
        magic,
        opcode,
        vbucket=vbucket,
        opaque=opaque,
        extras=extras,
        key=key,
        value=value,
        framing_extras=framing,
    )


def unknown_status_of(scope_known: bool) -> Status:
    """UNKNOWN_SCOPE when the scope of a path is missing, else UNKNOWN_COLLECTION."""
    return Status.UNKNOWN_COLLECTION if scope_known else Status.UNKNOWN_SCOPE


# -- system events as stored documents -------------------------------------------------------


def system_event_key(event: SystemEvent, ident: int) -> bytes:
    """The document key (inside SYSTEM_COLLECTION) of `event` for collection or scope `ident`:
    unique, since an id is created and dropped once (collections_manifest.py)."""
    return f"_event:{int(event)}:{ident:x}".encode()


def encode_system_event_doc(message: SystemEventMessage) -> bytes:
    """The stored value of a system event (its seqno, vbucket and opaque are the stream's)."""
    doc: dict[str, Any] = {
        "event": int(message.event),
        "uid": message.manifest_uid,
        "scope": message.scope_id,
        "name": message.name.decode(),
    }
    if message.collection_id is not None:
        doc["collection"] = message.collection_id
    if message.max_ttl is not None:
        doc["maxTTL"] = message.max_ttl
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_system_event_doc(
    value: bytes, *, vbucket: int, opaque: int, seqno: int
) -> SystemEventMessage:
    """The system event a stored document holds, as the message of a stream.

    Raises:
        ValueError: the document is not one `encode_system_event_doc` wrote (a damaged store).
    """
    try:
        doc = json.loads(value)
        return SystemEventMessage(
            vbucket,
            opaque,
            seqno,
            SystemEvent(doc["event"]),
            int(doc["uid"]),
            int(doc["scope"]),
            None if doc.get("collection") is None else int(doc["collection"]),
            str(doc.get("name", "")).encode(),
            None if doc.get("maxTTL") is None else int(doc["maxTTL"]),
        )
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise ValueError(f"system event document {value[:100]!r}: {error}") from None
