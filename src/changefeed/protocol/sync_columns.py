"""DCP_PREPARE and DCP_COMMIT frames of a received batch as columns (``batch.decode_batch``).

A replica stream carries a prepare and a commit per durable write. As control frames each
cost a ``Frame``, then a ``Prepare`` or ``Commit`` (about 2.5 µs per frame, five times a
mutation's decode); here a frame is one ``struct.unpack_from`` of header and extras into a
row, and the rows of a batch become one list per field.

Only frames the message decoders would take become rows: classic request magic, a header
``check_header`` passed, and the checks of ``dcp_items.decode_prepare`` / ``decode_commit``
(extras size, seqno, key, CAS, level, deleted flag; a commit after its prepare). Any other
frame of those opcodes stays a control ``Frame``, so its decoder raises the same error at
the same place in the stream as before. DCP_ABORT is rare and stays a control frame.

Each row keeps where it sits in wire order: the changes and the control frames of the batch
that precede it (``position``, ``control``), so a reader interleaves the three lists
exactly as the frames arrived (``consumer/dcp_session.py``).

Not here: what the fields mean to a replica (cluster/replica_stream.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from changefeed import limits
from changefeed.protocol.dcp_items import (
    ABORT_EXTRAS,
    ENDING_PREFIX,
    PREPARE_EXTRAS,
    PREPARE_PREFIX,
)
from changefeed.protocol.opcode import Magic, Opcode

Buffer = bytes | bytearray | memoryview

OP_PREPARE: Final = int(Opcode.DCP_PREPARE)
OP_COMMIT: Final = int(Opcode.DCP_COMMIT)
_REQUEST: Final = int(Magic.REQUEST)
_HEADER_SIZE: Final = limits.HEADER_SIZE
_PREPARE_SIZE: Final = PREPARE_PREFIX.size
_ENDING_SIZE: Final = ENDING_PREFIX.size
_PREPARE_EXTRAS_SIZE: Final = PREPARE_EXTRAS.size
_ENDING_EXTRAS_SIZE: Final = ABORT_EXTRAS.size
_unpack_prepare: Final = PREPARE_PREFIX.unpack_from
_unpack_ending: Final = ENDING_PREFIX.unpack_from

# The columns, in a row's order. ``seqno`` is a prepare's own seqno or a commit's commit seqno;
# ``prepared_seqno`` a commit's prepare (0 for a prepare). A prepare's ``expiry`` and
# ``delete_time`` are as ``decode_prepare`` gives them (a deleted prepare's expiration field is
# its delete time). A commit has no CAS, flags, expiry, level nor value (0, b"").
FIELDS: Final = (
    "opcode", "vbucket", "opaque", "seqno", "prepared_seqno", "cas", "rev_seqno", "flags",
    "expiry", "delete_time", "datatype", "deleted", "level", "key", "value",
    "position", "control", "wire_size",
)  # fmt: skip

# A row: the FIELDS' values (deleted as a bool, key and value as bytes).
Row = tuple[
    int, int, int, int, int, int, int, int, int, int, int, bool, int, bytes, bytes, int, int, int
]


def is_sync(buffer: Buffer, pos: int) -> bool:
    """Whether the frame at ``pos`` is a classic-magic DCP_PREPARE or DCP_COMMIT."""
    return buffer[pos] == _REQUEST and buffer[pos + 1] in (OP_PREPARE, OP_COMMIT)


def sync_row(buffer: Buffer, pos: int, total: int, position: int, control: int) -> Row | None:
    """The row of the header-checked DCP_PREPARE / DCP_COMMIT frame at ``pos`` (``total``
    bytes), or None when the message decoder would refuse it (it stays a control frame)."""
    assert is_sync(buffer, pos), bytes(buffer[pos : pos + 2])
    extlen = buffer[pos + 4]
    if buffer[pos + 1] == OP_PREPARE:
        if extlen != _PREPARE_EXTRAS_SIZE or total < _PREPARE_SIZE:
            return None
        fields = _unpack_prepare(buffer, pos)
        (_, opcode, keylen, _, datatype, vb, _, opaque, cas,
         seqno, rev, flags, expiry, _, _, deleted, level) = fields  # fmt: skip
        # decode_prepare's checks: seqno, key, CAS, level, the deleted flag.
        if not seqno or not keylen or not cas or not 1 <= level <= 3 or deleted > 1:
            return None
        key_at = pos + _PREPARE_SIZE
        key = bytes(buffer[key_at : key_at + keylen])
        value = bytes(buffer[key_at + keylen : pos + total])
        if deleted:
            return (opcode, vb, opaque, seqno, 0, cas, rev, flags, 0, expiry, datatype, True,
                    level, key, value, position, control, total)  # fmt: skip
        return (opcode, vb, opaque, seqno, 0, cas, rev, flags, expiry, 0, datatype, False,
                level, key, value, position, control, total)  # fmt: skip
    if extlen != _ENDING_EXTRAS_SIZE or total < _ENDING_SIZE:
        return None
    (_, opcode, keylen, _, datatype, vb, _, opaque, _,
     prepared, committed) = _unpack_ending(buffer, pos)  # fmt: skip
    if not keylen or not 0 < prepared < committed:  # decode_commit's checks
        return None
    key_at = pos + _ENDING_SIZE
    key = bytes(buffer[key_at : key_at + keylen])
    return (opcode, vb, opaque, committed, prepared, 0, 0, 0, 0, 0, datatype, False, 0,
            key, b"", position, control, total)  # fmt: skip


class SyncColumns:
    """The sync frames of one batch, one list per field of ``FIELDS``, in wire order.

    Treat the lists as read-only. ``position[i]``: changes of the batch before frame ``i``;
    ``control[i]``: control frames of the batch before it.
    """

    __slots__ = FIELDS

    opcode: list[int]
    vbucket: list[int]
    opaque: list[int]
    seqno: list[int]
    prepared_seqno: list[int]
    cas: list[int]
    rev_seqno: list[int]
    flags: list[int]
    expiry: list[int]
    delete_time: list[int]
    datatype: list[int]
    deleted: list[bool]
    level: list[int]
    key: list[bytes]
    value: list[bytes]
    position: list[int]
    control: list[int]
    wire_size: list[int]

    def __init__(self, rows: Sequence[Row] = ()) -> None:
        if rows:
            for name, column in zip(FIELDS, map(list, zip(*rows, strict=True)), strict=True):
                setattr(self, name, column)  # in C: one list per column
        else:
            for name in FIELDS:
                setattr(self, name, [])
        count = len(self.opcode)
        assert count == len(rows), (count, len(rows))
        if count:  # O(1) here; the order of every row: _check_invariants()
            assert self.position[0] <= self.position[-1], (self.position[0], self.position[-1])
            assert self.control[0] <= self.control[-1], (self.control[0], self.control[-1])

    @classmethod
    def of_columns(cls, columns: dict[str, list[Any]]) -> SyncColumns:
        """Columns built elsewhere (batch.py's numpy decoder): every name of ``FIELDS``, each
        a list as long as the others, as the rows would have given them."""
        assert columns.keys() == set(FIELDS), sorted(columns)
        made = cls()
        for name, column in columns.items():
            setattr(made, name, column)
        assert all(len(column) == len(made) for column in columns.values()), len(made)
        return made

    def __len__(self) -> int:
        return len(self.opcode)

    def __repr__(self) -> str:
        return f"SyncColumns({len(self)} frames)"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SyncColumns):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in FIELDS)

    __hash__ = None  # type: ignore[assignment]  # compared by content

    def renumber_controls(self, kept_before: Sequence[int]) -> None:
        """Control frames were taken out of the batch: ``kept_before[i]`` is how many of the
        first ``i`` stay (``Batch.keep_controls``); each row then counts only those."""
        assert len(kept_before) > max(self.control, default=0), len(kept_before)
        self.control = [kept_before[control] for control in self.control]

    def run_end(self, start: int) -> int:
        """Where the run from ``start`` ends: the frames after it of the same vbucket and
        opcode with nothing between them (no change, no control frame)."""
        assert 0 <= start < len(self), (start, len(self))
        vbs, opcodes, positions, controls = self.vbucket, self.opcode, self.position, self.control
        vb, opcode, position, control = (
            vbs[start],
            opcodes[start],
            positions[start],
            controls[start],
        )
        stop = start + 1
        count = len(self)
        while (
            stop < count  # bounded by the frames
            and vbs[stop] == vb
            and opcodes[stop] == opcode
            and positions[stop] == position
            and controls[stop] == control
        ):
            stop += 1
        return stop

    def _check_invariants(self) -> None:
        """O(n): every column as long; wire positions never fall; opcodes are sync ones."""
        count = len(self)
        assert all(len(getattr(self, name)) == count for name in FIELDS), FIELDS
        assert all(a <= b for a, b in zip(self.position, self.position[1:], strict=False))
        assert all(a <= b for a, b in zip(self.control, self.control[1:], strict=False))
        assert set(self.opcode) <= {OP_PREPARE, OP_COMMIT}, set(self.opcode)
