"""One stored version of a key, and the bytes it is stored as.

Contract: a `Record` is an immutable value whose `body` is, byte for byte, the body of the DCP
message that carries it (dcp-wire.md §7.3, §7.4): extras, then key, then value. A producer sends
`body` as is; neither key nor value is re-encoded. The stored form (the `by_seqno` value) is a
12-byte prefix followed by that body:

    0  tag       u8   (LAYOUT_VERSION << 4) | op: 0x11 mutation, 0x12 deletion, 0x13 expiration
    1  datatype  u8   dcp-wire.md §1.4: 0x01 JSON, 0x02 Snappy, 0x04 XATTR; bits above 0x07 invalid
    2  key_len   u16  bytes of key inside the body (1 .. limits.STORED_KEY_SIZE_MAX)
    4  cas       u64  document CAS (a DCP header field, so not part of the body)
    12 body           extras | key | value

    mutation extras, 31 bytes (dcp-wire.md §7.3, protocol.dcp_items.MUTATION_EXTRAS_FORMAT):
      0 by_seqno u64 | 8 rev_seqno u64 | 16 flags u32 | 20 expiration u32 | 24 lock_time u32 = 0
      | 28 nmeta u16 = 0 | 30 nru u8 = 0
    deletion / expiration extras, 21 bytes (deletion V2, dcp-wire.md §7.4,
    protocol.dcp_items.DELETION_V2_EXTRAS_FORMAT):
      0 by_seqno u64 | 8 rev_seqno u64 | 16 delete_time u32 | 20 unused u8 = 0

The extras layouts are the wire's, so they are declared once, in protocol/dcp_items.py; this
module builds its structs from those declarations (storage may import protocol, never the reverse).

DCP_EXPIRATION's own extras are 20 bytes (§7.5): a producer sending that opcode sends
`body[:20] + body[21:]`, or sends the record as a DELETION V2.

Decoding checks every field the layout fixes (tag, zero fields, lengths, the by_seqno inside the
extras against the LMDB key) and raises `CorruptRecordError` naming vb and seqno; it never lets a
`struct.error` out. It does not checksum values: LMDB's copy-on-write commits make a torn write
impossible, and a flipped bit inside a value goes undetected.

Not here: LMDB access, index keys (keys.py), vbucket metadata (vbmeta.py).
"""

from __future__ import annotations

import dataclasses
import struct
from enum import IntEnum
from typing import Final

from changefeed import limits
from changefeed.protocol.dcp_items import (
    DELETION_V1_EXTRAS,
    DELETION_V2_EXTRAS,
    DELETION_V2_EXTRAS_FORMAT,
    EXPIRATION_EXTRAS,
    MUTATION_EXTRAS,
    MUTATION_EXTRAS_FORMAT,
)
from changefeed.storage.errors import CorruptRecordError

LAYOUT_VERSION: Final = 1
DATATYPE_MASK: Final = 0x07  # dcp-wire.md §1.4: bits above 0x07 are invalid
MUTATION_EXTRAS_SIZE: Final = 31
DELETION_EXTRAS_SIZE: Final = 21


class Op(IntEnum):
    """What a record does to its key.

    PREPARE and ABORT are SyncWrite items (checkpoint/item.py `SyncItem`): a pending durable
    write and its abandonment. They are never stored in `by_seqno` and have no tag; a pending
    prepare is kept in the `prepared` database (store.py) in its document's layout.
    """

    MUTATION = 1
    DELETION = 2
    EXPIRATION = 3
    PREPARE = 4
    ABORT = 5


PREFIX_FORMAT: Final = ">BBHQ"  # tag, datatype, key_len, cas (the layout above)
PREFIX: Final = struct.Struct(PREFIX_FORMAT)
DELETION_EXTRAS: Final = DELETION_V2_EXTRAS  # tombstones are stored as deletion V2 bodies
# Prefix and extras in one struct, so a scan decodes a record's head with one unpack.
MUTATION_HEAD: Final = struct.Struct(PREFIX_FORMAT + MUTATION_EXTRAS_FORMAT[1:])
DELETION_HEAD: Final = struct.Struct(PREFIX_FORMAT + DELETION_V2_EXTRAS_FORMAT[1:])
_DELETION_V1_EXTRAS: Final = DELETION_V1_EXTRAS  # dcp-wire.md §7.4 V1: seqno, rev, nmeta
_EXPIRATION_EXTRAS: Final = EXPIRATION_EXTRAS  # dcp-wire.md §7.5: seqno, rev, delete_time

assert PREFIX.size == 12
assert MUTATION_EXTRAS.size == MUTATION_EXTRAS_SIZE
assert DELETION_EXTRAS.size == DELETION_EXTRAS_SIZE
assert MUTATION_HEAD.size == PREFIX.size + MUTATION_EXTRAS_SIZE
assert DELETION_HEAD.size == PREFIX.size + DELETION_EXTRAS_SIZE
assert _DELETION_V1_EXTRAS.size == 18
assert _EXPIRATION_EXTRAS.size == 20

TAG_MUTATION: Final = (LAYOUT_VERSION << 4) | Op.MUTATION
TAG_DELETION: Final = (LAYOUT_VERSION << 4) | Op.DELETION
TAG_EXPIRATION: Final = (LAYOUT_VERSION << 4) | Op.EXPIRATION
_OP_BY_TAG: Final = {TAG_DELETION: Op.DELETION, TAG_EXPIRATION: Op.EXPIRATION}

# The stored form as a disk backfill frames it without decoding (producer/item_encoding.py): the
# prefix's first three fields, and the CAS, which ends the prefix right before the body, so a
# DCP header's last field (cas, dcp-wire.md §1) followed by the body is `stored[4:]`.
STORED_HEAD: Final = struct.Struct(">BBH")  # tag, datatype, key_len
STORED_CAS_OFFSET: Final = STORED_HEAD.size
STORED_BODY_OFFSET: Final = PREFIX.size
OP_BY_TAG: Final = {TAG_MUTATION: Op.MUTATION, **_OP_BY_TAG}
EXTRAS_SIZE_BY_OP: Final = {
    Op.MUTATION: MUTATION_EXTRAS_SIZE,
    Op.DELETION: DELETION_EXTRAS_SIZE,
    Op.EXPIRATION: DELETION_EXTRAS_SIZE,
}
_STORED_SEQNO: Final = struct.Struct(">Q")  # by_seqno: the first field of both extras layouts
assert PREFIX_FORMAT.startswith(">" + STORED_HEAD.format[1:]), (PREFIX_FORMAT, STORED_HEAD.format)
assert PREFIX_FORMAT.endswith("Q") and STORED_CAS_OFFSET + 8 == STORED_BODY_OFFSET
assert MUTATION_EXTRAS_FORMAT[1] == DELETION_V2_EXTRAS_FORMAT[1] == _STORED_SEQNO.format[1]
_U64_MAX: Final = 0xFFFF_FFFF_FFFF_FFFF
_BYTES_SHOWN_MAX: Final = 100  # repr shows at most this many bytes of a key, value or body


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Record:
    """One version of a key: a mutation, or a tombstone (deletion or expiration).

    Built by the store when it reads, by `Record.create` from fields, or by
    `Record.from_dcp_body` from a received DCP body. Building one directly checks that `body`
    matches the other fields (O(len(body))).

    Attributes:
        vb, seqno, key, op, rev_seqno, cas, datatype, value: as on the wire.
        flags, expiry: document flags and expiration (mutations; 0 for tombstones).
        delete_time: seconds since the epoch when deleted (tombstones; 0 for mutations).
        body: the DCP message body, extras | key | value.
        extras_len: 31 (mutation) or 21 (deletion V2 / expiration).
    """

    vb: int
    seqno: int
    key: bytes
    op: Op
    rev_seqno: int
    cas: int
    flags: int
    expiry: int
    datatype: int
    delete_time: int
    value: bytes
    body: bytes
    extras_len: int

    def __post_init__(self) -> None:
        expected = _encode_body(
            self.op,
            self.seqno,
            self.key,
            self.value,
            self.rev_seqno,
            self.flags,
            self.expiry,
            self.delete_time,
            self.datatype,
        )
        if self.op is not Op.MUTATION and (self.flags or self.expiry):
            raise ValueError(f"a tombstone has no flags or expiry: {self!r}")
        if self.op is Op.MUTATION and self.delete_time:
            raise ValueError(f"a mutation has no delete_time: {self!r}")
        if not 0 <= self.vb < limits.VBUCKETS_MAX:
            raise ValueError(f"vb {self.vb} outside 0..{limits.VBUCKETS_MAX - 1}")
        if not 0 <= self.cas <= _U64_MAX:
            raise ValueError(f"cas {self.cas} is not a u64")
        if self.extras_len != _extras_size(self.op):
            raise ValueError(f"extras_len {self.extras_len} does not match {self.op!r}")
        if self.body != expected:
            raise ValueError(f"body does not match the other fields: {self!r}")

    @property
    def deleted(self) -> bool:
        """True for a tombstone (deletion or expiration)."""
        return self.op is not Op.MUTATION

    def __repr__(self) -> str:
        return (
            f"Record(vb={self.vb}, seqno={self.seqno}, key={_shown(self.key)}, op={self.op.name}, "
            f"rev_seqno={self.rev_seqno}, cas={self.cas}, flags={self.flags}, "
            f"expiry={self.expiry}, datatype={self.datatype}, delete_time={self.delete_time}, "
            f"value={_shown(self.value)}, extras_len={self.extras_len})"
        )

    @classmethod
    def create(
        cls,
        vb: int,
        seqno: int,
        key: bytes,
        op: Op,
        *,
        cas: int,
        value: bytes = b"",
        rev_seqno: int = 1,
        flags: int = 0,
        expiry: int = 0,
        datatype: int = 0,
        delete_time: int = 0,
    ) -> Record:
        """Build a record from its fields, encoding the body.

        Raises:
            ValueError: a field is out of range (see `encode_record`).
        """
        stored = encode_record(
            op,
            seqno,
            key,
            value,
            cas=cas,
            rev_seqno=rev_seqno,
            flags=flags,
            expiry=expiry,
            datatype=datatype,
            delete_time=delete_time,
        )
        if not 0 <= vb < limits.VBUCKETS_MAX:
            raise ValueError(f"vb {vb} outside 0..{limits.VBUCKETS_MAX - 1}")
        return decode_record(vb, seqno, stored)

    @classmethod
    def from_dcp_body(
        cls,
        vb: int,
        op: Op,
        body: bytes,
        *,
        extras_len: int,
        key_len: int,
        cas: int,
        datatype: int,
    ) -> Record:
        """Build a record from a received DCP mutation/deletion/expiration body.

        A mutation body (31-byte extras) or deletion V2 body (21) whose lock_time, nmeta, nru
        or unused byte are zero is kept as is: no copy when `body` is bytes. A deletion V1 body
        (18), an expiration body (20) or non-zero ignorable fields get their extras re-encoded.

        Args:
            extras_len, key_len: the header's extras and key lengths.
            cas, datatype: the header's CAS and datatype.

        Raises:
            ValueError: the lengths do not fit the body or the op, or a field is invalid.
        """
        if not isinstance(op, Op):
            raise ValueError(f"op {op!r} is not an Op")
        if key_len <= 0 or extras_len < 0 or extras_len + key_len > len(body):
            raise ValueError(f"extras {extras_len} + key {key_len} do not fit in {len(body)} bytes")
        return _from_dcp_body(vb, op, bytes(body), extras_len, key_len, cas, datatype)


def _shown(data: bytes) -> str:
    if len(data) <= _BYTES_SHOWN_MAX:
        return repr(data)
    return f"{data[:_BYTES_SHOWN_MAX]!r}...({len(data)} bytes)"


def _extras_size(op: Op) -> int:
    return MUTATION_EXTRAS_SIZE if op is Op.MUTATION else DELETION_EXTRAS_SIZE


_FIELD_NAMES: Final = tuple(field.name for field in dataclasses.fields(Record))
assert _FIELD_NAMES == (
    "vb", "seqno", "key", "op", "rev_seqno", "cas", "flags", "expiry",
    "datatype", "delete_time", "value", "body", "extras_len",
), _FIELD_NAMES  # fmt: skip


class _UncheckedRecord:
    """Record's slot layout without its frozen __setattr__ or checks; see _new_record."""

    __slots__ = _FIELD_NAMES

    def __init__(
        self, vb: int, seqno: int, key: bytes, op: Op, rev_seqno: int, cas: int, flags: int,
        expiry: int, datatype: int, delete_time: int, value: bytes, body: bytes, extras_len: int,
    ) -> None:  # fmt: skip
        self.vb = vb
        self.seqno = seqno
        self.key = key
        self.op = op
        self.rev_seqno = rev_seqno
        self.cas = cas
        self.flags = flags
        self.expiry = expiry
        self.datatype = datatype
        self.delete_time = delete_time
        self.value = value
        self.body = body
        self.extras_len = extras_len


assert Record.__slots__ == _UncheckedRecord.__slots__, Record.__slots__
assert Record.__basicsize__ == _UncheckedRecord.__basicsize__


def _new_record(
    vb: int, seqno: int, key: bytes, op: Op, rev_seqno: int, cas: int, flags: int,
    expiry: int, datatype: int, delete_time: int, value: bytes, body: bytes, extras_len: int,
) -> Record:  # fmt: skip
    """Build a Record from fields already checked, skipping __init__ and __post_init__.

    The frozen dataclass __init__ sets each field through object.__setattr__; filling an
    unchecked twin with the same slots and then switching its class is 0.4 us faster per
    record (1.3 -> 0.9 us per decoded record; a scan spends most of its time here). The
    result is an ordinary, frozen Record (test_record.py checks it equals one from __init__).
    """
    record = _UncheckedRecord(
        vb, seqno, key, op, rev_seqno, cas, flags, expiry, datatype, delete_time, value, body,
        extras_len,
    )  # fmt: skip
    record.__class__ = Record  # type: ignore[assignment]
    return record  # type: ignore[return-value]


def _encode_body(
    op: Op,
    seqno: int,
    key: bytes,
    value: bytes,
    rev_seqno: int,
    flags: int,
    expiry: int,
    delete_time: int,
    datatype: int,
) -> bytes:
    """Encode extras | key | value, checking every field; raises ValueError."""
    if not isinstance(op, Op):
        raise ValueError(f"op {op!r} is not an Op")
    _check_fields(seqno, key, value, datatype)
    try:
        if op is Op.MUTATION:
            extras = MUTATION_EXTRAS.pack(seqno, rev_seqno, flags, expiry, 0, 0, 0)
        else:
            extras = DELETION_EXTRAS.pack(seqno, rev_seqno, delete_time, 0)
    except struct.error as error:
        raise ValueError(f"field out of range for {op.name} seqno {seqno}: {error}") from None
    return extras + key + value


def _check_fields(seqno: int, key: bytes, value: bytes, datatype: int) -> None:
    if not 1 <= seqno <= limits.SEQNO_MAX:
        raise ValueError(f"seqno {seqno} outside 1..SEQNO_MAX")
    if not 1 <= len(key) <= limits.STORED_KEY_SIZE_MAX:
        raise ValueError(f"key length {len(key)} outside 1..{limits.STORED_KEY_SIZE_MAX}")
    if len(value) > limits.VALUE_SIZE_MAX:
        raise ValueError(f"value length {len(value)} over VALUE_SIZE_MAX")
    if not 0 <= datatype <= DATATYPE_MASK:
        raise ValueError(f"datatype {datatype:#x} has bits above {DATATYPE_MASK:#x}")


def encode_record(
    op: Op,
    seqno: int,
    key: bytes,
    value: bytes,
    *,
    cas: int,
    rev_seqno: int = 1,
    flags: int = 0,
    expiry: int = 0,
    datatype: int = 0,
    delete_time: int = 0,
) -> bytes:
    """Encode the stored form (prefix | body) of one record from its fields.

    Raises:
        ValueError: seqno outside 1..SEQNO_MAX, key length outside 1..STORED_KEY_SIZE_MAX, value
            over VALUE_SIZE_MAX, datatype bits above 0x07, an integer that does not fit its
            field, flags/expiry on a tombstone or delete_time on a mutation.
    """
    if op is not Op.MUTATION and (flags or expiry):
        raise ValueError(f"a tombstone has no flags or expiry (seqno {seqno})")
    if op is Op.MUTATION and delete_time:
        raise ValueError(f"a mutation has no delete_time (seqno {seqno})")
    body = _encode_body(op, seqno, key, value, rev_seqno, flags, expiry, delete_time, datatype)
    try:
        prefix = PREFIX.pack((LAYOUT_VERSION << 4) | op, datatype, len(key), cas)
    except struct.error:
        raise ValueError(f"cas {cas} is not a u64 (seqno {seqno})") from None
    return prefix + body


def encode_stored(record: Record) -> bytes:
    """The stored form of a record: the prefix, then `record.body` unchanged."""
    tag = (LAYOUT_VERSION << 4) | record.op
    return PREFIX.pack(tag, record.datatype, len(record.key), record.cas) + record.body


def stored_seqno(data: bytes) -> int:
    """The by_seqno inside a stored record's extras (both layouts start with it).

    Unchecked: for records the store wrote, read whole by `Store.scan_bodies`; `decode_record`
    is the checked way.
    """
    seqno: int = _STORED_SEQNO.unpack_from(data, STORED_BODY_OFFSET)[0]
    return seqno


def decode_record(vb: int, seqno: int, data: bytes) -> Record:
    """Decode the stored form of the record at (vb, seqno); copies `data` once into `body`.

    Raises:
        CorruptRecordError: any check of the layout fails.
    """
    # The hot path of every scan: constants are module globals bound once, the record is built
    # as in _new_record (inlined), and _field_problem only explains a failure.
    size = len(data)
    tag = data[0] if size else 0
    if tag == TAG_MUTATION and size >= _MUTATION_HEAD_SIZE:
        (_, datatype, key_len, cas, by_seqno, rev_seqno, flags, expiry, lock_time, nmeta, nru) = (
            _unpack_mutation_head(data)
        )
        op = _MUTATION
        extras_len = MUTATION_EXTRAS_SIZE
        delete_time = 0
        fixed_ok = not (lock_time or nmeta or nru)
    elif tag in _OP_BY_TAG and size >= _DELETION_HEAD_SIZE:
        (_, datatype, key_len, cas, by_seqno, rev_seqno, delete_time, unused) = (
            _unpack_deletion_head(data)
        )
        op = _OP_BY_TAG[tag]
        extras_len = DELETION_EXTRAS_SIZE
        flags = expiry = 0
        fixed_ok = not unused
    else:
        raise CorruptRecordError(vb, seqno, _head_problem(tag, size))
    key_end = extras_len + key_len
    value_len = size - _PREFIX_SIZE - key_end
    if (
        by_seqno != seqno
        or not fixed_ok
        or not 0 < key_len <= _KEY_SIZE_MAX
        or not 0 <= value_len <= _VALUE_SIZE_MAX
        or datatype & _DATATYPE_INVALID
    ):
        reason = _field_problem(by_seqno, seqno, fixed_ok, key_len, value_len, datatype)
        raise CorruptRecordError(vb, seqno, reason)
    body = data[_PREFIX_SIZE:]
    record = _UncheckedRecord(
        vb, seqno, body[extras_len:key_end], op, rev_seqno, cas, flags, expiry, datatype,
        delete_time, body[key_end:], body, extras_len,
    )  # fmt: skip
    record.__class__ = Record  # type: ignore[assignment]  # see _new_record
    return record  # type: ignore[return-value]


_MUTATION: Final = Op.MUTATION
_PREFIX_SIZE: Final = PREFIX.size
_MUTATION_HEAD_SIZE: Final = MUTATION_HEAD.size
_DELETION_HEAD_SIZE: Final = DELETION_HEAD.size
_KEY_SIZE_MAX: Final = limits.STORED_KEY_SIZE_MAX
_VALUE_SIZE_MAX: Final = limits.VALUE_SIZE_MAX
_DATATYPE_INVALID: Final = ~DATATYPE_MASK
_unpack_mutation_head: Final = MUTATION_HEAD.unpack_from
_unpack_deletion_head: Final = DELETION_HEAD.unpack_from


def _head_problem(tag: int, size: int) -> str:
    if tag == TAG_MUTATION:
        return f"mutation record of {size} bytes, shorter than its {MUTATION_HEAD.size}-byte head"
    if tag in _OP_BY_TAG:
        return f"tombstone record of {size} bytes, shorter than its {DELETION_HEAD.size}-byte head"
    if size == 0:
        return "empty record"
    return f"unknown tag {tag:#04x} (layout version {tag >> 4}, op {tag & 0x0F})"


def _field_problem(
    by_seqno: int, seqno: int, fixed_ok: bool, key_len: int, value_len: int, datatype: int
) -> str:
    if by_seqno != seqno:
        return f"extras carry by_seqno {by_seqno}"
    if not fixed_ok:
        return "non-zero lock_time, nmeta, nru or unused extras byte"
    if not 0 < key_len <= limits.STORED_KEY_SIZE_MAX:
        return f"key length {key_len} outside 1..{limits.STORED_KEY_SIZE_MAX}"
    if value_len < 0:
        return f"record is {-value_len} bytes shorter than its extras and key"
    if value_len > limits.VALUE_SIZE_MAX:
        return f"value length {value_len} over VALUE_SIZE_MAX"
    return f"datatype {datatype:#x} has bits above {DATATYPE_MASK:#x}"


def _from_dcp_body(
    vb: int, op: Op, body: bytes, extras_len: int, key_len: int, cas: int, datatype: int
) -> Record:
    key = body[extras_len : extras_len + key_len]
    value = body[extras_len + key_len :]
    delete_time = flags = expiry = 0
    if op is Op.MUTATION and extras_len == MUTATION_EXTRAS_SIZE:
        seqno, rev_seqno, flags, expiry, lock_time, nmeta, nru = MUTATION_EXTRAS.unpack_from(body)
        if nmeta:
            raise ValueError(f"nmeta {nmeta} must be 0 (dcp-wire.md §7.3)")
        reusable = not (lock_time or nru)
    elif op is not Op.MUTATION and extras_len == DELETION_EXTRAS_SIZE:
        seqno, rev_seqno, delete_time, unused = DELETION_EXTRAS.unpack_from(body)
        reusable = not unused
    elif op is Op.EXPIRATION and extras_len == _EXPIRATION_EXTRAS.size:
        seqno, rev_seqno, delete_time = _EXPIRATION_EXTRAS.unpack_from(body)
        reusable = False
    elif op is Op.DELETION and extras_len == _DELETION_V1_EXTRAS.size:
        seqno, rev_seqno, nmeta = _DELETION_V1_EXTRAS.unpack_from(body)
        reusable = False
    else:
        raise ValueError(f"{op.name} with {extras_len} bytes of extras (dcp-wire.md §7.3-7.5)")
    if not reusable:
        return Record.create(
            vb,
            seqno,
            key,
            op,
            cas=cas,
            value=value,
            rev_seqno=rev_seqno,
            flags=flags,
            expiry=expiry,
            datatype=datatype,
            delete_time=delete_time,
        )
    _check_fields(seqno, key, value, datatype)
    if not 0 <= vb < limits.VBUCKETS_MAX:
        raise ValueError(f"vb {vb} outside 0..{limits.VBUCKETS_MAX - 1}")
    if not 0 <= cas <= _U64_MAX:
        raise ValueError(f"cas {cas} is not a u64")
    return _new_record(
        vb,
        seqno,
        key,
        op,
        rev_seqno,
        cas,
        flags,
        expiry,
        datatype,
        delete_time,
        value,
        body,
        extras_len,
    )
