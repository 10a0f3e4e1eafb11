"""Batch decoding: a received buffer → columns of changes plus the control frames between them.

The per-item hot path of a consumer. Instead of one ``Frame`` and one message object per
mutation, each DCP mutation/deletion/expiration is read with a single ``struct.unpack_from`` over
header and extras and appended to column lists, ready for ``pyarrow``. Anything else (snapshot
markers, stream ends, noops, responses) is decoded as a ``Frame`` and returned with its
position, so the caller can interleave control and data in wire order.

Validation is the same as the per-frame path (``check_header`` first, then the item rules); a
test holds the two paths equal on every input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from changefeed import limits
from changefeed.protocol.dcp_items import (
    DELETION_V1_EXTRAS,
    DELETION_V1_PREFIX,
    DELETION_V2_EXTRAS,
    DELETION_V2_PREFIX,
    EXPIRATION_EXTRAS,
    EXPIRATION_PREFIX,
    MUTATION_EXTRAS,
    MUTATION_PREFIX,
)
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, check_header, decode_frame
from changefeed.protocol.opcode import DATATYPE_MASK, Magic, Opcode
from changefeed.protocol.status import Status

_HEADER_SIZE = limits.HEADER_SIZE
# Header + extras in one unpack per item; the layouts are declared once, in dcp_items.py.
_MUTATION = MUTATION_PREFIX
_DELETION_V1 = DELETION_V1_PREFIX
_DELETION_V2 = DELETION_V2_PREFIX
_EXPIRATION = EXPIRATION_PREFIX
assert _MUTATION.size == _HEADER_SIZE + MUTATION_EXTRAS.size
assert _DELETION_V1.size == _HEADER_SIZE + DELETION_V1_EXTRAS.size
assert _DELETION_V2.size == _HEADER_SIZE + DELETION_V2_EXTRAS.size
assert _EXPIRATION.size == _HEADER_SIZE + EXPIRATION_EXTRAS.size

ITEM_OPCODES = (Opcode.DCP_MUTATION, Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION)
_REQUEST = int(Magic.REQUEST)
_OP_MUTATION = int(Opcode.DCP_MUTATION)
_MUTATION_SIZE = _MUTATION.size


@dataclass(slots=True)
class ChangeColumns:
    """Column lists, one entry per change, in wire order. ``opcode`` tells the kind."""

    opcode: list[int] = field(default_factory=list)
    vbucket: list[int] = field(default_factory=list)
    opaque: list[int] = field(default_factory=list)
    seqno: list[int] = field(default_factory=list)
    rev_seqno: list[int] = field(default_factory=list)
    cas: list[int] = field(default_factory=list)
    flags: list[int] = field(default_factory=list)
    expiry: list[int] = field(default_factory=list)
    delete_time: list[int] = field(default_factory=list)
    datatype: list[int] = field(default_factory=list)
    key: list[bytes] = field(default_factory=list)
    value: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqno)


@dataclass(slots=True)
class Batch:
    """What one ``decode_batch`` call found.

    Attributes:
        changes: the data items, as columns.
        controls: ``(position, frame)`` pairs; ``position`` = changes that precede the frame.
        consumed: bytes of the buffer used (whole frames only).
        item_bytes: wire bytes of the changes (what flow control acks).
    """

    changes: ChangeColumns = field(default_factory=ChangeColumns)
    controls: list[tuple[int, Frame]] = field(default_factory=list)
    consumed: int = 0
    item_bytes: int = 0


def decode_batch(
    buffer: bytes | bytearray | memoryview,
    start: int = 0,
    *,
    frame_size_max: int = limits.FRAME_SIZE_MAX,
    items_max: int = 1 << 20,
) -> Batch:
    """Decode every complete frame in ``buffer[start:]`` (up to ``items_max`` changes).

    Raises:
        ProtocolError: as the per-frame decoders would, at the first bad frame.
    """
    batch = Batch()
    # One copy of the unread region as bytes: key and value slices are then single copies.
    data = bytes(buffer[start:])
    pos = 0
    end = len(data)
    changes = batch.changes
    count = 0
    while end - pos >= _HEADER_SIZE and count < items_max:
        if data[pos] == _REQUEST and data[pos + 1] == _OP_MUTATION and end - pos >= _MUTATION_SIZE:
            total = _append_mutation(changes, data, pos, end, frame_size_max)
            if total == 0:
                break  # incomplete: wait for more bytes
            batch.item_bytes += total
            count += 1
            pos += total
            continue
        total = _HEADER_SIZE + check_header(data, pos, frame_size_max)
        if end - pos < total:
            break
        opcode = data[pos + 1]
        if data[pos] == _REQUEST and opcode in ITEM_OPCODES:
            _append_item(changes, data, pos, total, opcode)
            batch.item_bytes += total
            count += 1
        else:
            batch.controls.append((count, decode_frame(data, pos, total)))
        pos += total
    batch.consumed = pos
    return batch


def _append_mutation(c: ChangeColumns, data: bytes, pos: int, end: int, frame_size_max: int) -> int:
    """The hot path: a classic-magic DCP_MUTATION, header and extras in one unpack.

    Returns the frame's size, or 0 if it is not complete yet. Checks exactly what
    ``check_header`` and ``_append_item`` check, in the same order.
    """
    (_, _, keylen, extlen, datatype, vb, bodylen, opaque, cas,
     seqno, rev, flags, expiry, _, nmeta, _) = _MUTATION.unpack_from(data, pos)  # fmt: skip
    if bodylen > frame_size_max:
        raise ProtocolError(f"body of {bodylen} bytes exceeds {frame_size_max}", Status.E2BIG)
    if datatype & ~DATATYPE_MASK:
        raise ProtocolError(f"invalid datatype 0x{datatype:02x}", Status.EINVAL)
    if extlen + keylen > bodylen:
        raise ProtocolError(
            f"framing 0 + extras {extlen} + key {keylen} > body {bodylen}", Status.EINVAL
        )
    total: int = _HEADER_SIZE + bodylen
    if end - pos < total:
        return 0
    if extlen != MUTATION_EXTRAS.size:
        raise ProtocolError(f"DCP_MUTATION with extras of {extlen} bytes")
    if seqno == 0:
        raise ProtocolError("DCP item with seqno 0")
    if nmeta:
        raise ProtocolError(f"DCP item with nmeta {nmeta}")
    if not keylen:
        raise ProtocolError("DCP item without a key")
    key_at = pos + _MUTATION_SIZE
    c.opcode.append(_OP_MUTATION)
    c.datatype.append(datatype)
    c.vbucket.append(vb)
    c.opaque.append(opaque)
    c.cas.append(cas)
    c.seqno.append(seqno)
    c.rev_seqno.append(rev)
    c.flags.append(flags)
    c.expiry.append(expiry)
    c.delete_time.append(0)
    c.key.append(data[key_at : key_at + keylen])
    c.value.append(data[key_at + keylen : pos + total])
    return total


def _append_item(
    c: ChangeColumns, buffer: bytes | bytearray | memoryview, pos: int, total: int, opcode: int
) -> None:
    extlen = buffer[pos + 4]
    expiry = flags = delete_time = nmeta = 0
    if opcode == Opcode.DCP_MUTATION and extlen == MUTATION_EXTRAS.size:
        fields = _MUTATION.unpack_from(buffer, pos)
        seqno, rev, flags, expiry, _, nmeta, _ = fields[9:]
    elif opcode == Opcode.DCP_DELETION and extlen == DELETION_V2_EXTRAS.size:
        fields = _DELETION_V2.unpack_from(buffer, pos)
        seqno, rev, delete_time, _ = fields[9:]
    elif opcode == Opcode.DCP_DELETION and extlen == DELETION_V1_EXTRAS.size:
        fields = _DELETION_V1.unpack_from(buffer, pos)
        seqno, rev, nmeta = fields[9:]
    elif opcode == Opcode.DCP_EXPIRATION and extlen == EXPIRATION_EXTRAS.size:
        fields = _EXPIRATION.unpack_from(buffer, pos)
        seqno, rev, delete_time = fields[9:]
    else:
        name = Opcode(opcode).name
        raise ProtocolError(f"{name} with extras of {extlen} bytes")
    keylen = fields[2]
    if seqno == 0:
        raise ProtocolError("DCP item with seqno 0")
    if nmeta:
        raise ProtocolError(f"DCP item with nmeta {nmeta}")
    if not keylen:
        raise ProtocolError("DCP item without a key")
    key_at = pos + _HEADER_SIZE + extlen
    c.opcode.append(opcode)
    c.datatype.append(fields[4])
    c.vbucket.append(fields[5])
    c.opaque.append(fields[7])
    c.cas.append(fields[8])
    c.seqno.append(seqno)
    c.rev_seqno.append(rev)
    c.flags.append(flags)
    c.expiry.append(expiry)
    c.delete_time.append(delete_time)
    c.key.append(bytes(buffer[key_at : key_at + keylen]))
    c.value.append(bytes(buffer[key_at + keylen : pos + total]))
