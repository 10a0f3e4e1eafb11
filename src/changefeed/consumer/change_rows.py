"""Change rows: the one Arrow form of a change stream, and the conversion into it.

A change row is one change (mutation, deletion, expiration) or one rollback of one vbucket, with
the columns of ``CHANGE_ROW_SCHEMA``. Every reader that hands changes on as Arrow builds its
batches here: spark/ (the data source and the mirror writer) today, the ipc/ shared-memory
fan-out next. It sits in consumer/ because both may depend on consumer/ and protocol/ but not on
each other, and not in protocol/, which stays free of pyarrow (sans-IO, bytes in and out). It
imports only pyarrow, protocol/ and the standard library.

The types are the strictest reader's: Spark's Python data sources must return exactly the Arrow
types Spark derives from the DDL (``string``/``binary``, not the ``large_`` variants; ``int32``
for ``int``; spark-python-datasource.md, gotcha 6). So the wire's unsigned fields are narrowed:
flags and expiry (u32) are reinterpreted as two's-complement int32, and a CAS (u64) above
``INT64_MAX`` is refused rather than wrapped.

``ChangeRows`` collects rows as Python lists and ``to_batch`` turns them into one record batch.
Not here: which rows a reader wants (end seqnos are the caller's), how many rows make a batch
(``limits.ROWS_PER_BATCH_MAX``), what a sink does with a rollback row (spark/mirror.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import pyarrow as pa

from changefeed import limits
from changefeed.protocol.batch import ChangeColumns
from changefeed.protocol.opcode import Opcode

CHANGE_ROW_SCHEMA: Final = pa.schema(
    [
        ("vbucket", pa.int32()),  # u16 on the wire
        ("seqno", pa.int64()),  # the change's by_seqno; for a rollback, the seqno rolled back to
        ("key", pa.string()),  # the key as UTF-8; "" for a rollback
        ("value", pa.binary()),  # the document as sent; b"" for tombstones and rollbacks
        ("op", pa.string()),  # one of OPS
        ("cas", pa.int64()),  # u64 on the wire, refused above INT64_MAX
        ("expiry", pa.int32()),  # u32 on the wire, as int32; 0 for tombstones
        ("flags", pa.int32()),  # u32 on the wire, as int32; 0 for tombstones
        ("rev_seqno", pa.int64()),
        ("snap_start", pa.int64()),  # the snapshot holding the change (a rollback: its seqno)
        ("snap_end", pa.int64()),  # ... its end, at most the reader's end seqno
    ]
)

OP_MUTATION: Final = "mutation"
OP_DELETION: Final = "deletion"
OP_EXPIRATION: Final = "expiration"
OP_ROLLBACK: Final = "rollback"
OPS: Final = (OP_MUTATION, OP_DELETION, OP_EXPIRATION, OP_ROLLBACK)
OP_BY_OPCODE: Final = {
    int(Opcode.DCP_MUTATION): OP_MUTATION,
    int(Opcode.DCP_DELETION): OP_DELETION,
    int(Opcode.DCP_EXPIRATION): OP_EXPIRATION,
}

# CAS values are u64; Arrow's int64 (Spark's long) is signed. CAS from our nodes fit in 63 bits
# (hybrid clock in nanoseconds), so they pass unchanged; a larger one would wrap, which we refuse
# to do silently.
INT64_MAX: Final = 2**63 - 1

assert len(CHANGE_ROW_SCHEMA) == 11, CHANGE_ROW_SCHEMA
assert set(OP_BY_OPCODE.values()) == set(OPS) - {OP_ROLLBACK}, OP_BY_OPCODE


@dataclass(slots=True)
class ChangeRows:
    """Change rows being collected, one list per column of ``CHANGE_ROW_SCHEMA``, same order."""

    vbucket: list[int] = field(default_factory=list)
    seqno: list[int] = field(default_factory=list)
    key: list[str] = field(default_factory=list)
    value: list[bytes] = field(default_factory=list)
    op: list[str] = field(default_factory=list)
    cas: list[int] = field(default_factory=list)
    expiry: list[int] = field(default_factory=list)
    flags: list[int] = field(default_factory=list)
    rev_seqno: list[int] = field(default_factory=list)
    snap_start: list[int] = field(default_factory=list)
    snap_end: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqno)

    def append_changes(
        self,
        columns: ChangeColumns,
        snapshots: Mapping[int, tuple[int, int]],
        end_seqnos: Mapping[int, int] | None = None,
    ) -> set[int]:
        """Append a row for each change in ``columns`` (decoded by ``protocol.decode_batch``).

        Args:
            columns: changes in wire order.
            snapshots: ``vbucket -> (snap_start, snap_end)`` of the snapshot the changes of that
                vbucket belong to; needed for every vbucket in ``columns``.
            end_seqnos: a bounded read's ``vbucket -> end seqno``: changes past it are left out
                and ``snap_end`` is cut to it. ``None`` keeps every change.

        Returns:
            The vbuckets with a change at or past their end seqno (empty without ``end_seqnos``).

        Raises:
            ValueError: a CAS above ``INT64_MAX``; no row of ``columns`` is then appended.
        """
        count = len(self)
        ends = end_seqnos
        if ends is None:
            ends = dict.fromkeys(columns.vbucket, limits.SEQNO_MAX)
        try:
            reached = self._append_changes(columns, snapshots, ends)
        except ValueError:
            self._truncate(count)
            raise
        assert len(self) - count <= len(columns), (count, len(self), len(columns))
        if end_seqnos is None:
            assert len(self) - count == len(columns), (count, len(self), len(columns))
            return set()
        return reached

    def _append_changes(
        self,
        columns: ChangeColumns,
        snapshots: Mapping[int, tuple[int, int]],
        ends: Mapping[int, int],
    ) -> set[int]:
        # Per row, the hot loop of every reader: columns and appends are bound to locals.
        reached: set[int] = set()
        vbuckets, seqnos, opcodes, cas_values = (
            columns.vbucket, columns.seqno, columns.opcode, columns.cas
        )  # fmt: skip
        keys, values, expiries, flags_values, rev_seqnos = (
            columns.key, columns.value, columns.expiry, columns.flags, columns.rev_seqno
        )  # fmt: skip
        op_by_opcode = OP_BY_OPCODE
        for i in range(len(columns)):
            vb = vbuckets[i]
            seqno = seqnos[i]
            end = ends[vb]
            if seqno >= end:
                reached.add(vb)
                if seqno > end:
                    continue  # past this read: the next one starts at the end seqno
            cas = cas_values[i]
            if cas > INT64_MAX:
                raise ValueError(
                    f"vbucket {vb} seqno {seqno}: CAS {cas} does not fit an int64 (Spark long)"
                )
            snap_start, snap_end = snapshots[vb]
            self.vbucket.append(vb)
            self.seqno.append(seqno)
            self.key.append(keys[i].decode("utf-8", "surrogateescape"))
            self.value.append(values[i])
            self.op.append(op_by_opcode[opcodes[i]])
            self.cas.append(cas)
            expiry = expiries[i]
            self.expiry.append(expiry - 2**32 if expiry >= 2**31 else expiry)  # u32 -> int32
            flags = flags_values[i]
            self.flags.append(flags - 2**32 if flags >= 2**31 else flags)  # u32 -> int32
            self.rev_seqno.append(rev_seqnos[i])
            self.snap_start.append(snap_start)
            self.snap_end.append(min(snap_end, end))
        return reached

    def append_rollback(self, vbucket: int, seqno: int) -> None:
        """Append a rollback row: every change of ``vbucket`` after ``seqno`` is void."""
        assert seqno >= 0, seqno
        self.vbucket.append(vbucket)
        self.seqno.append(seqno)
        self.key.append("")
        self.value.append(b"")
        self.op.append(OP_ROLLBACK)
        self.cas.append(0)
        self.expiry.append(0)
        self.flags.append(0)
        self.rev_seqno.append(0)
        self.snap_start.append(seqno)
        self.snap_end.append(seqno)

    def to_batch(self) -> pa.RecordBatch:
        """The rows collected so far as one record batch of ``CHANGE_ROW_SCHEMA``."""
        arrays = [pa.array(getattr(self, f.name), f.type) for f in CHANGE_ROW_SCHEMA]
        batch = pa.RecordBatch.from_arrays(arrays, schema=CHANGE_ROW_SCHEMA)
        assert batch.num_rows == len(self), (batch.num_rows, len(self))
        return batch

    def _truncate(self, count: int) -> None:
        for name in CHANGE_ROW_SCHEMA.names:
            del getattr(self, name)[count:]


assert tuple(ChangeRows.__slots__) == tuple(CHANGE_ROW_SCHEMA.names), ChangeRows.__slots__
