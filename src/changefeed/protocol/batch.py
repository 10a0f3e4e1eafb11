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

import struct
from dataclasses import dataclass, field

from changefeed import limits
from changefeed.protocol.dcp_items import (
    DELETION_V1_EXTRAS,
    DELETION_V2_EXTRAS,
    EXPIRATION_EXTRAS,
    MUTATION_EXTRAS,
)
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, check_header, decode_frame
from changefeed.protocol.opcode import Magic, Opcode

_HEADER_SIZE = limits.HEADER_SIZE
_MUTATION = struct.Struct(">BBHBBHIIQ" + "QQIIIHB")
_DELETION_V1 = struct.Struct(">BBHBBHIIQ" + "QQH")
_DELETION_V2 = struct.Struct(">BBHBBHIIQ" + "QQIB")
_EXPIRATION = struct.Struct(">BBHBBHIIQ" + "QQI")
assert _MUTATION.size == _HEADER_SIZE + MUTATION_EXTRAS.size
assert _DELETION_V1.size == _HEADER_SIZE + DELETION_V1_EXTRAS.size
assert _DELETION_V2.size == _HEADER_SIZE + DELETION_V2_EXTRAS.size
assert _EXPIRATION.size == _HEADER_SIZE + EXPIRATION_EXTRAS.size

ITEM_OPCODES = (Opcode.DCP_MUTATION, Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION)


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
    pos = start
    end = len(buffer)
    changes = batch.changes
    while end - pos >= _HEADER_SIZE and len(changes) < items_max:
        total = _HEADER_SIZE + check_header(buffer, pos, frame_size_max)
        if end - pos < total:
            break
        opcode = buffer[pos + 1]
        if buffer[pos] == Magic.REQUEST and opcode in ITEM_OPCODES:
            _append_item(changes, buffer, pos, total, opcode)
            batch.item_bytes += total
        else:
            batch.controls.append((len(changes), decode_frame(buffer, pos, total)))
        pos += total
    batch.consumed = pos - start
    return batch


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
