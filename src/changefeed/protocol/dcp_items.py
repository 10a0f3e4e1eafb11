"""DCP data messages: mutation, deletion (V1/V2), expiration, seqno-advanced (dcp-wire.md §7.3–7.5,
§7.13).

Extras layouts (big-endian)::

    MUTATION   31: 0 by_seqno u64 | 8 rev_seqno u64 | 16 flags u32 | 20 expiration u32
                   | 24 lock_time u32 | 28 nmeta u16 (must be 0) | 30 nru u8
    DELETION   18: 0 by_seqno | 8 rev_seqno | 16 nmeta u16                      (V1)
    DELETION   21: 0 by_seqno | 8 rev_seqno | 16 delete_time u32 | 20 unused u8  (V2)
    EXPIRATION 20: 0 by_seqno | 8 rev_seqno | 16 delete_time u32

Header: cas = document CAS, datatype = payload datatype, vbucket = vb, opaque = stream opaque.
``encode_item_body`` frames a body the store already holds (extras + key + value) without
re-encoding it; ``deletion_v1_body`` and ``expiration_body`` turn a stored deletion V2 body into
the other two tombstone bodies, and ``HEADER_FRONT`` is the header without its CAS, for framing a
stored record whose CAS already precedes its body (storage/record.py).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from changefeed import limits
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import ALT_HEADER, HEADER, HEADER_FORMAT, Frame, encode_frame
from changefeed.protocol.frame_info import encode_stream_id
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.quick_init import quick_init

# The extras layouts, declared once, one format character per field. Everything else that reads
# or writes these bytes builds its struct from these strings: the header + extras structs below,
# batch.py's column decoder, and storage/record.py, which stores a mutation's extras as sent.
MUTATION_EXTRAS_FORMAT = (  # dcp-wire.md §7.3
    ">"
    "Q"  # 0  by_seqno
    "Q"  # 8  rev_seqno
    "I"  # 16 flags
    "I"  # 20 expiration
    "I"  # 24 lock_time
    "H"  # 28 nmeta: extended metadata length, must be 0
    "B"  # 30 nru
)  # 31 bytes
DELETION_V1_EXTRAS_FORMAT = (  # dcp-wire.md §7.4, without IncludeDeleteTimes
    ">"
    "Q"  # 0  by_seqno
    "Q"  # 8  rev_seqno
    "H"  # 16 nmeta: must be 0
)  # 18 bytes
DELETION_V2_EXTRAS_FORMAT = (  # dcp-wire.md §7.4, with IncludeDeleteTimes
    ">"
    "Q"  # 0  by_seqno
    "Q"  # 8  rev_seqno
    "I"  # 16 delete_time
    "B"  # 20 unused
)  # 21 bytes
EXPIRATION_EXTRAS_FORMAT = (  # dcp-wire.md §7.5
    ">"
    "Q"  # 0  by_seqno
    "Q"  # 8  rev_seqno
    "I"  # 16 delete_time
)  # 20 bytes

MUTATION_EXTRAS = struct.Struct(MUTATION_EXTRAS_FORMAT)
DELETION_V1_EXTRAS = struct.Struct(DELETION_V1_EXTRAS_FORMAT)
DELETION_V2_EXTRAS = struct.Struct(DELETION_V2_EXTRAS_FORMAT)
EXPIRATION_EXTRAS = struct.Struct(EXPIRATION_EXTRAS_FORMAT)
SEQNO_ADVANCED_EXTRAS = struct.Struct(">Q")
assert MUTATION_EXTRAS.size == 31
assert DELETION_V1_EXTRAS.size == 18
assert DELETION_V2_EXTRAS.size == 21
assert EXPIRATION_EXTRAS.size == 20


# The classic header without its last field, the CAS: magic, opcode, key length, extras length,
# datatype, vbucket, body length, opaque (16 bytes).
HEADER_FRONT = struct.Struct(HEADER_FORMAT[:-1])
assert HEADER_FORMAT.endswith("Q") and HEADER_FRONT.size == limits.HEADER_SIZE - 8

# Offsets inside the tombstone extras (layouts above): by_seqno and rev_seqno come first in all
# three, then V1 has nmeta where V2 and EXPIRATION have delete_time; V2 ends with an unused byte.
_SEQNOS_SIZE = struct.calcsize(">QQ")
_DELETION_V1_NMETA = b"\x00\x00"
assert DELETION_V1_EXTRAS.size == _SEQNOS_SIZE + len(_DELETION_V1_NMETA)
assert EXPIRATION_EXTRAS.size == DELETION_V2_EXTRAS.size - 1


def deletion_v1_body(v2_body: bytes) -> bytes:
    """The deletion V1 body (18-byte extras, nmeta 0) of a deletion V2 body (21-byte extras)."""
    return b"".join(
        (v2_body[:_SEQNOS_SIZE], _DELETION_V1_NMETA, v2_body[DELETION_V2_EXTRAS.size :])
    )


def expiration_body(v2_body: bytes) -> bytes:
    """The expiration body (20-byte extras) of a deletion V2 body: without the unused byte."""
    return v2_body[: EXPIRATION_EXTRAS.size] + v2_body[DELETION_V2_EXTRAS.size :]


def _header_then(extras_format: str) -> struct.Struct:
    """The classic header followed by ``extras_format``: one struct call per item."""
    assert extras_format.startswith(">"), extras_format
    assert HEADER_FORMAT.startswith(">"), HEADER_FORMAT
    return struct.Struct(HEADER_FORMAT + extras_format[1:])


# Header and extras in one struct: the hot encode path (here and producer/item_encoding.py) packs
# a mutation with one call, and batch.py decodes each item with one unpack.
MUTATION_PREFIX = _header_then(MUTATION_EXTRAS_FORMAT)
DELETION_V1_PREFIX = _header_then(DELETION_V1_EXTRAS_FORMAT)
DELETION_V2_PREFIX = _header_then(DELETION_V2_EXTRAS_FORMAT)
EXPIRATION_PREFIX = _header_then(EXPIRATION_EXTRAS_FORMAT)
assert MUTATION_PREFIX.size == limits.HEADER_SIZE + MUTATION_EXTRAS.size
assert DELETION_V1_PREFIX.size == limits.HEADER_SIZE + DELETION_V1_EXTRAS.size
assert DELETION_V2_PREFIX.size == limits.HEADER_SIZE + DELETION_V2_EXTRAS.size
assert EXPIRATION_PREFIX.size == limits.HEADER_SIZE + EXPIRATION_EXTRAS.size


@dataclass(frozen=True, slots=True)
class Mutation:
    vbucket: int
    opaque: int
    seqno: int
    key: bytes
    value: bytes
    cas: int = 0
    rev_seqno: int = 1
    flags: int = 0
    expiry: int = 0
    lock_time: int = 0
    datatype: int = 0
    stream_id: int | None = None


@dataclass(frozen=True, slots=True)
class Deletion:
    """A deletion; ``delete_time`` is None for the V1 encoding (no IncludeDeleteTimes)."""

    vbucket: int
    opaque: int
    seqno: int
    key: bytes
    cas: int = 0
    rev_seqno: int = 1
    delete_time: int | None = 0
    value: bytes = b""
    datatype: int = 0
    stream_id: int | None = None


@dataclass(frozen=True, slots=True)
class Expiration:
    vbucket: int
    opaque: int
    seqno: int
    key: bytes
    cas: int = 0
    rev_seqno: int = 1
    delete_time: int = 0
    value: bytes = b""
    datatype: int = 0
    stream_id: int | None = None


@dataclass(frozen=True, slots=True)
class SeqnoAdvanced:
    vbucket: int
    opaque: int
    seqno: int
    stream_id: int | None = None


def encode_mutation(m: Mutation) -> bytes:
    if m.seqno == 0:
        raise ValueError("mutation seqno must not be 0")
    if m.stream_id is None:
        prefix = MUTATION_PREFIX.pack(
            Magic.REQUEST,
            Opcode.DCP_MUTATION,
            len(m.key),
            31,
            m.datatype,
            m.vbucket,
            31 + len(m.key) + len(m.value),
            m.opaque,
            m.cas,
            m.seqno,
            m.rev_seqno,
            m.flags,
            m.expiry,
            m.lock_time,
            0,
            0,
        )
        return b"".join((prefix, m.key, m.value))
    extras = MUTATION_EXTRAS.pack(m.seqno, m.rev_seqno, m.flags, m.expiry, m.lock_time, 0, 0)
    return _encode_with_stream_id(Opcode.DCP_MUTATION, m, extras, m.value)


def encode_deletion(d: Deletion) -> bytes:
    if d.delete_time is None:
        extras = DELETION_V1_EXTRAS.pack(d.seqno, d.rev_seqno, 0)
    else:
        extras = DELETION_V2_EXTRAS.pack(d.seqno, d.rev_seqno, d.delete_time, 0)
    return _encode_with_stream_id(Opcode.DCP_DELETION, d, extras, d.value)


def encode_expiration(e: Expiration) -> bytes:
    extras = EXPIRATION_EXTRAS.pack(e.seqno, e.rev_seqno, e.delete_time)
    return _encode_with_stream_id(Opcode.DCP_EXPIRATION, e, extras, e.value)


def encode_seqno_advanced(s: SeqnoAdvanced) -> bytes:
    magic = Magic.REQUEST if s.stream_id is None else Magic.ALT_REQUEST
    framing = b"" if s.stream_id is None else encode_stream_id(s.stream_id)
    return encode_frame(
        magic,
        Opcode.DCP_SEQNO_ADVANCED,
        vbucket=s.vbucket,
        opaque=s.opaque,
        extras=SEQNO_ADVANCED_EXTRAS.pack(s.seqno),
        framing_extras=framing,
    )


def _encode_with_stream_id(
    opcode: int, item: Mutation | Deletion | Expiration, extras: bytes, value: bytes
) -> bytes:
    framing = b"" if item.stream_id is None else encode_stream_id(item.stream_id)
    return encode_frame(
        Magic.ALT_REQUEST if framing else Magic.REQUEST,
        opcode,
        datatype=item.datatype,
        vbucket=item.vbucket,
        opaque=item.opaque,
        cas=item.cas,
        extras=extras,
        key=item.key,
        value=value,
        framing_extras=framing,
    )


def encode_item_body(
    opcode: int,
    *,
    vbucket: int,
    opaque: int,
    cas: int,
    datatype: int,
    extras_len: int,
    key_len: int,
    body: bytes | memoryview,
    stream_id: int | None = None,
) -> list[bytes | memoryview]:
    """Frame a stored body (``extras + key + value``) as a DCP message: header, then the body.

    Returns the pieces to write (e.g. with ``transport.writelines``) so the body is not copied.
    """
    if extras_len + key_len > len(body):
        raise ValueError(f"extras {extras_len} + key {key_len} > body {len(body)}")
    if stream_id is None:
        header = HEADER.pack(
            Magic.REQUEST, opcode, key_len, extras_len, datatype, vbucket, len(body), opaque, cas
        )
        return [header, body]
    framing = encode_stream_id(stream_id)
    header = ALT_HEADER.pack(
        Magic.ALT_REQUEST,
        opcode,
        len(framing),
        key_len,
        extras_len,
        datatype,
        vbucket,
        len(framing) + len(body),
        opaque,
        cas,
    )
    return [header, framing, body]


def decode_mutation(frame: Frame) -> Mutation:
    """Raises ProtocolError(EINVAL): extras not 31 bytes, seqno 0, nmeta != 0, no key."""
    if len(frame.extras) != MUTATION_EXTRAS.size:
        raise ProtocolError(f"DCP_MUTATION extras of {len(frame.extras)} bytes, not 31")
    seqno, rev, flags, expiry, lock_time, nmeta, _ = MUTATION_EXTRAS.unpack(frame.extras)
    _check_item(frame, seqno, nmeta)
    return Mutation(
        frame.vbucket,
        frame.opaque,
        seqno,
        frame.key,
        frame.value,
        frame.cas,
        rev,
        flags,
        expiry,
        lock_time,
        frame.datatype,
        frame.stream_id,
    )


def decode_deletion(frame: Frame) -> Deletion:
    """Either extras size (18 = V1, 21 = V2) is accepted."""
    if len(frame.extras) == DELETION_V1_EXTRAS.size:
        seqno, rev, nmeta = DELETION_V1_EXTRAS.unpack(frame.extras)
        delete_time: int | None = None
    elif len(frame.extras) == DELETION_V2_EXTRAS.size:
        seqno, rev, delete_time, _ = DELETION_V2_EXTRAS.unpack(frame.extras)
        nmeta = 0
    else:
        raise ProtocolError(f"DCP_DELETION extras of {len(frame.extras)} bytes, not 18 or 21")
    _check_item(frame, seqno, nmeta)
    return Deletion(
        frame.vbucket,
        frame.opaque,
        seqno,
        frame.key,
        frame.cas,
        rev,
        delete_time,
        frame.value,
        frame.datatype,
        frame.stream_id,
    )


def decode_expiration(frame: Frame) -> Expiration:
    if len(frame.extras) != EXPIRATION_EXTRAS.size:
        raise ProtocolError(f"DCP_EXPIRATION extras of {len(frame.extras)} bytes, not 20")
    seqno, rev, delete_time = EXPIRATION_EXTRAS.unpack(frame.extras)
    _check_item(frame, seqno, 0)
    return Expiration(
        frame.vbucket,
        frame.opaque,
        seqno,
        frame.key,
        frame.cas,
        rev,
        delete_time,
        frame.value,
        frame.datatype,
        frame.stream_id,
    )


def decode_seqno_advanced(frame: Frame) -> SeqnoAdvanced:
    if len(frame.extras) != SEQNO_ADVANCED_EXTRAS.size:
        raise ProtocolError(f"DCP_SEQNO_ADVANCED extras of {len(frame.extras)} bytes, not 8")
    (seqno,) = SEQNO_ADVANCED_EXTRAS.unpack(frame.extras)
    return SeqnoAdvanced(frame.vbucket, frame.opaque, seqno, frame.stream_id)


def _check_item(frame: Frame, seqno: int, nmeta: int) -> None:
    if seqno == 0:
        raise ProtocolError("DCP item with seqno 0")
    if nmeta != 0:
        raise ProtocolError(f"DCP item with nmeta {nmeta}")
    if not frame.key:
        raise ProtocolError("DCP item without a key")


# -- the sync-write family (dcp-wire.md §7.15), sent only on replica streams -----------------------

PREPARE_EXTRAS = struct.Struct(">QQIIIBBB")  # by_seqno rev flags exp lock_time nru deleted level
ABORT_EXTRAS = struct.Struct(">QQ")  # prepared_seqno, abort_seqno (COMMIT's layout too)
assert PREPARE_EXTRAS.size == 31
assert ABORT_EXTRAS.size == 16
# Header and extras in one struct, as MUTATION_PREFIX: the producer packs each with one call.
PREPARE_PREFIX = _header_then(PREPARE_EXTRAS.format)
ENDING_PREFIX = _header_then(ABORT_EXTRAS.format)  # DCP_COMMIT and DCP_ABORT
assert PREPARE_PREFIX.size == limits.HEADER_SIZE + PREPARE_EXTRAS.size
assert ENDING_PREFIX.size == limits.HEADER_SIZE + ABORT_EXTRAS.size


@quick_init  # built per item: see quick_init.py
@dataclass(frozen=True, slots=True)
class Prepare:
    """DCP_PREPARE: a durable write pending on the active (its document, not yet visible)."""

    vbucket: int
    opaque: int
    seqno: int
    key: bytes
    value: bytes
    cas: int
    rev_seqno: int
    flags: int
    expiry: int
    deleted: bool
    level: int
    datatype: int = 0
    delete_time: int = 0


@quick_init  # built per item: see quick_init.py
@dataclass(frozen=True, slots=True)
class Abort:
    """DCP_ABORT: the prepare at `prepared_seqno` ended unseen, at `abort_seqno`."""

    vbucket: int
    opaque: int
    key: bytes
    prepared_seqno: int
    abort_seqno: int


@quick_init  # built per item: see quick_init.py
@dataclass(frozen=True, slots=True)
class Commit:
    """DCP_COMMIT: the prepare at `prepared_seqno` is committed at `commit_seqno` (the replica
    holds the prepare's document)."""

    vbucket: int
    opaque: int
    key: bytes
    prepared_seqno: int
    commit_seqno: int


def encode_prepare(p: Prepare) -> bytes:
    """A deleted prepare carries its delete time in the expiration field (kv_engine does).

    Raises:
        ValueError: a field does not fit the frame (our bug), naming it and its value.
    """
    expiration = p.delete_time if p.deleted else p.expiry
    try:
        extras = PREPARE_EXTRAS.pack(
            p.seqno, p.rev_seqno, p.flags, expiration, 0, 0, int(p.deleted), p.level
        )
        return encode_frame(
            Magic.REQUEST,
            Opcode.DCP_PREPARE,
            datatype=p.datatype,
            vbucket=p.vbucket,
            opaque=p.opaque,
            cas=p.cas,
            extras=extras,
            key=p.key,
            value=p.value,
        )
    except struct.error as error:
        fields = (
            ("seqno", p.seqno, 64), ("rev_seqno", p.rev_seqno, 64), ("flags", p.flags, 32),
            ("delete_time" if p.deleted else "expiry", expiration, 32), ("level", p.level, 8),
            ("cas", p.cas, 64), ("vbucket", p.vbucket, 16), ("opaque", p.opaque, 32),
        )  # fmt: skip
        raise _out_of_range("DCP_PREPARE", fields, error) from None


def decode_prepare(frame: Frame) -> Prepare:
    """Raises ProtocolError(EINVAL): extras not 31 bytes, seqno 0, no key, CAS 0, level 0."""
    if len(frame.extras) != PREPARE_EXTRAS.size:
        raise ProtocolError(f"DCP_PREPARE extras of {len(frame.extras)} bytes, not 31")
    seqno, rev, flags, expiry, _, _, deleted, level = PREPARE_EXTRAS.unpack(frame.extras)
    _check_item(frame, seqno, 0)
    if frame.cas == 0 or not 1 <= level <= 3 or deleted > 1:
        raise ProtocolError(f"DCP_PREPARE cas {frame.cas}, level {level}, deleted {deleted}")
    return Prepare(
        frame.vbucket, frame.opaque, seqno, frame.key, frame.value, frame.cas, rev,
        flags, 0 if deleted else expiry, bool(deleted), level, frame.datatype,
        expiry if deleted else 0,
    )  # fmt: skip


def encode_abort(a: Abort) -> bytes:
    return _encode_ending(
        Opcode.DCP_ABORT, a.vbucket, a.opaque, a.key, a.prepared_seqno, a.abort_seqno
    )


def encode_commit(c: Commit) -> bytes:
    return _encode_ending(
        Opcode.DCP_COMMIT, c.vbucket, c.opaque, c.key, c.prepared_seqno, c.commit_seqno
    )


def decode_commit(frame: Frame) -> Commit:
    """Raises ProtocolError(EINVAL): extras not 16 bytes, no key, commit not after prepare."""
    prepared, committed = _decode_ending(frame, "DCP_COMMIT")
    return Commit(frame.vbucket, frame.opaque, frame.key, prepared, committed)


def decode_abort(frame: Frame) -> Abort:
    """Raises ProtocolError(EINVAL): extras not 16 bytes, no key, abort not after prepare."""
    prepared, aborted = _decode_ending(frame, "DCP_ABORT")
    return Abort(frame.vbucket, frame.opaque, frame.key, prepared, aborted)


def _encode_ending(
    opcode: Opcode, vbucket: int, opaque: int, key: bytes, prepared_seqno: int, seqno: int
) -> bytes:
    """COMMIT and ABORT share one layout: the prepare's seqno, their own, then the key.
    A field that does not fit raises ValueError naming it (our bug)."""
    try:
        return encode_frame(
            Magic.REQUEST,
            opcode,
            vbucket=vbucket,
            opaque=opaque,
            extras=ABORT_EXTRAS.pack(prepared_seqno, seqno),
            key=key,
        )
    except struct.error as error:
        fields = (
            ("prepared_seqno", prepared_seqno, 64), ("seqno", seqno, 64),
            ("vbucket", vbucket, 16), ("opaque", opaque, 32),
        )  # fmt: skip
        raise _out_of_range(opcode.name, fields, error) from None


def _out_of_range(
    message: str, fields: Iterable[tuple[str, int, int]], error: struct.error
) -> ValueError:
    """The error for a frame `struct` refused to pack: the first of `fields` (name, value,
    bits) out of its unsigned range, else `error`'s own text."""
    for name, value, bits in fields:
        if not 0 <= value < 1 << bits:
            return ValueError(f"{message}: {name} {value} does not fit {bits} bits")
    return ValueError(f"{message}: {error}")


def _decode_ending(frame: Frame, name: str) -> tuple[int, int]:
    if len(frame.extras) != ABORT_EXTRAS.size:
        raise ProtocolError(f"{name} extras of {len(frame.extras)} bytes, not 16")
    prepared, seqno = ABORT_EXTRAS.unpack(frame.extras)
    if not frame.key or not 0 < prepared < seqno:
        raise ProtocolError(f"{name} of prepare {prepared} at {seqno}")
    return int(prepared), int(seqno)
