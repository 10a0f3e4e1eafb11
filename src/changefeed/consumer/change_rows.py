"""Change rows: the one Arrow form of a change stream, and the conversion into it.

A change row is one change (mutation, deletion, expiration) or one rollback of one vbucket, with
the columns of ``CHANGE_ROW_SCHEMA``. Every reader that hands changes on as Arrow builds its
batches here: spark/ (the data source and the mirror writer) today, the ipc/ shared-memory
fan-out next. It sits in consumer/ because both may depend on consumer/ and protocol/ but not on
each other, and not in protocol/, which stays free of pyarrow (sans-IO, bytes in and out). It
imports only pyarrow, numpy, protocol/ and the standard library.

The types are the strictest reader's: Spark's Python data sources must return exactly the Arrow
types Spark derives from the DDL (``string``/``binary``, not the ``large_`` variants; ``int32``
for ``int``; spark-python-datasource.md, gotcha 6). So the wire's unsigned fields are narrowed:
flags and expiry (u32) are reinterpreted as two's-complement int32, and a CAS (u64) above
``INT64_MAX`` is refused rather than wrapped.

``ChangeRows`` collects rows as record batches, built from decoded columns with array operations:
no Python step per row, and keys and values go from the decoder's one bytes buffer to Arrow
binary arrays by offsets (one copy each, in Arrow's ``take``). Keys become strings by Arrow's
binary → string cast, which checks UTF-8; a key that is not UTF-8 is refused with a
``ValueError`` naming its change, as is a CAS, seqno or rev_seqno above ``INT64_MAX``.
Not here: which rows a reader wants (end seqnos are the caller's), how many rows make a batch
(``limits.ROWS_PER_BATCH_MAX``), what a sink does with a rollback row (spark/mirror.py).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Final

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

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


# The op names by opcode, as an Arrow array indexed by ``opcode - _FIRST_OPCODE``.
_FIRST_OPCODE: Final = min(OP_BY_OPCODE)
_OP_NAME_LIST: Final = [OP_BY_OPCODE[code] for code in range(_FIRST_OPCODE, max(OP_BY_OPCODE) + 1)]
assert len(_OP_NAME_LIST) == len(OP_BY_OPCODE), "item opcodes are consecutive"


@functools.cache
def _op_names() -> pa.Array:
    """The op names as an Arrow array, built on first use: pyarrow's first ``pa.array`` call
    imports pandas (~0.4 s), which a process that only plans (Spark's streaming source runner)
    then never pays."""
    return pa.array(_OP_NAME_LIST, pa.string())


# Arrow's binary type indexes its bytes with int32 offsets; larger buffers take the large type.
_BINARY_BYTES_MAX: Final = 2**31 - 1


class ChangeRows:
    """Change rows being collected, as record batches of ``CHANGE_ROW_SCHEMA``."""

    __slots__ = ("_batches", "_rows")

    def __init__(self) -> None:
        self._batches: list[pa.RecordBatch] = []
        self._rows = 0

    def __len__(self) -> int:
        return self._rows

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
                vbucket belong to; needed for every vbucket with a row appended.
            end_seqnos: a bounded read's ``vbucket -> end seqno`` (needed for every vbucket in
                ``columns``): changes past it are left out and ``snap_end`` is cut to it.
                ``None`` keeps every change.

        Returns:
            The vbuckets with a change at or past their end seqno (empty without ``end_seqnos``).

        Raises:
            ValueError: a CAS, seqno or rev_seqno above ``INT64_MAX``, or a key that is not
                UTF-8; no row of ``columns`` is then appended.
        """
        if not len(columns):
            return set()
        vbuckets = columns.array("vbucket")
        seqnos = columns.array("seqno")
        # One Python step per vbucket present, none per row.
        present, vb_index = np.unique(vbuckets, return_inverse=True)
        vb_ids: list[int] = present.tolist()
        if end_seqnos is None:
            ends = [limits.SEQNO_MAX] * len(vb_ids)
            rows = np.arange(len(columns))
            reached: set[int] = set()
        else:
            ends = [end_seqnos[vb] for vb in vb_ids]
            row_end = np.array(ends, np.uint64)[vb_index]
            reached = {vb_ids[i] for i in np.unique(vb_index[seqnos >= row_end]).tolist()}
            rows = np.flatnonzero(seqnos <= row_end)  # past the end: the next read starts there
        batch = _record_batch(columns, rows, vb_index[rows], vb_ids, ends, snapshots)
        assert batch.num_rows == len(rows) <= len(columns), (batch.num_rows, len(columns))
        if end_seqnos is None:
            assert batch.num_rows == len(columns), (batch.num_rows, len(columns))
        if batch.num_rows:
            self._batches.append(batch)
            self._rows += batch.num_rows
        return reached

    def append_rollback(self, vbucket: int, seqno: int) -> None:
        """Append a rollback row: every change of ``vbucket`` after ``seqno`` is void."""
        assert seqno >= 0, seqno
        row = {"vbucket": vbucket, "seqno": seqno, "key": "", "value": b"", "op": OP_ROLLBACK,
               "cas": 0, "expiry": 0, "flags": 0, "rev_seqno": 0, "snap_start": seqno,
               "snap_end": seqno}  # fmt: skip
        assert list(row) == CHANGE_ROW_SCHEMA.names, list(row)
        self._batches.append(pa.RecordBatch.from_pylist([row], schema=CHANGE_ROW_SCHEMA))
        self._rows += 1

    def to_batch(self) -> pa.RecordBatch:
        """The rows collected so far as one record batch of ``CHANGE_ROW_SCHEMA``."""
        if len(self._batches) > 1:
            table = pa.Table.from_batches(self._batches, CHANGE_ROW_SCHEMA).combine_chunks()
            self._batches = table.to_batches()
            assert len(self._batches) == 1, len(self._batches)
        if not self._batches:
            empty = [pa.array([], f.type) for f in CHANGE_ROW_SCHEMA]
            return pa.RecordBatch.from_arrays(empty, schema=CHANGE_ROW_SCHEMA)
        batch = self._batches[0]
        assert batch.schema == CHANGE_ROW_SCHEMA, batch.schema
        assert batch.num_rows == len(self), (batch.num_rows, len(self))
        return batch


def _record_batch(
    columns: ChangeColumns,
    rows: NDArray[np.intp],
    vb_index: NDArray[np.intp],
    vb_ids: list[int],
    ends: list[int],
    snapshots: Mapping[int, tuple[int, int]],
) -> pa.RecordBatch:
    """The change rows of ``columns[rows]`` (``vb_index``: each row's entry in ``vb_ids``)."""
    seqnos = columns.array("seqno")[rows]
    cas_values = columns.array("cas")[rows]
    rev_seqnos = columns.array("rev_seqno")[rows]
    for name, values in (("CAS", cas_values), ("seqno", seqnos), ("rev_seqno", rev_seqnos)):
        _refuse_over_int64(name, values, columns, rows)
    snap_start, snap_end = _snapshots(vb_index, vb_ids, ends, snapshots)
    keys, values = _keys_and_values(columns, rows)
    opcodes = columns.array("opcode")[rows].astype(np.intp) - _FIRST_OPCODE
    assert not len(opcodes) or 0 <= opcodes.min() <= opcodes.max() < len(_OP_NAME_LIST), opcodes
    arrays = [
        pa.array(columns.array("vbucket")[rows].astype(np.int32)),
        pa.array(seqnos.astype(np.int64)),
        keys,
        values,
        _op_names().take(pa.array(opcodes)),
        pa.array(cas_values.astype(np.int64)),
        pa.array(columns.array("expiry")[rows].view(np.int32)),  # u32 -> int32, two's complement
        pa.array(columns.array("flags")[rows].view(np.int32)),  # u32 -> int32, two's complement
        pa.array(rev_seqnos.astype(np.int64)),
        pa.array(snap_start[vb_index]),
        pa.array(snap_end[vb_index]),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=CHANGE_ROW_SCHEMA)


def _snapshots(
    vb_index: NDArray[np.intp],
    vb_ids: list[int],
    ends: list[int],
    snapshots: Mapping[int, tuple[int, int]],
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """``snap_start`` and ``snap_end`` (cut to the end seqno) per entry of ``vb_ids``, looked up
    for the vbuckets that have rows only (one dictionary lookup per vbucket)."""
    with_rows = np.unique(vb_index)
    found = np.array([snapshots[vb_ids[i]] for i in with_rows.tolist()], np.uint64)
    snap_start = np.zeros(len(vb_ids), np.uint64)
    snap_end = np.zeros(len(vb_ids), np.uint64)
    if len(found):
        snap_start[with_rows] = found[:, 0]
        snap_end[with_rows] = np.minimum(found[:, 1], np.array(ends, np.uint64)[with_rows])
    for name, values in (("snap_start", snap_start), ("snap_end", snap_end)):
        if bool(np.any(values > INT64_MAX)):
            raise OverflowError(f"a {name} over int64: {int(values.max())}")
    return snap_start.astype(np.int64), snap_end.astype(np.int64)


def _refuse_over_int64(
    name: str, values: NDArray[np.uint64], columns: ChangeColumns, rows: NDArray[np.intp]
) -> None:
    # u64 on the wire, int64 (Spark's long) in the row: refused rather than wrapped.
    over = values > INT64_MAX
    if bool(over.any()):
        row = int(rows[int(np.argmax(over))])
        raise ValueError(
            f"vbucket {columns.vbucket[row]} seqno {columns.seqno[row]}: {name} "
            f"{int(values[int(np.argmax(over))])} does not fit an int64 (Spark long)"
        )


def _keys_and_values(columns: ChangeColumns, rows: NDArray[np.intp]) -> tuple[pa.Array, pa.Array]:
    """Keys (as UTF-8 strings) and values of ``columns[rows]``, by offsets into its data.

    The data buffer is viewed as one binary array whose elements are, change by change, the
    key, the value and the bytes up to the next key (headers, controls): its offsets are the
    columns' own. Taking elements 3i and 3i + 1 copies each key and value once.
    """
    count = len(columns)
    large = len(columns.data) > _BINARY_BYTES_MAX
    offsets = np.empty(3 * count, np.int64 if large else np.int32)
    offsets[0::3] = columns.key_start
    offsets[1::3] = columns.key_end
    offsets[2::3] = columns.value_end
    pieces = pa.Array.from_buffers(
        pa.large_binary() if large else pa.binary(),
        3 * count - 1,
        [None, pa.py_buffer(offsets), pa.py_buffer(columns.data)],
    )
    keys = pieces.take(pa.array(3 * rows))
    values = pieces.take(pa.array(3 * rows + 1)).cast(pa.binary())
    try:
        return keys.cast(pa.string()), values  # the cast checks UTF-8
    except pa.ArrowInvalid:
        _refuse_non_utf8(keys, columns, rows)
        raise


def _refuse_non_utf8(keys: pa.Array, columns: ChangeColumns, rows: NDArray[np.intp]) -> None:
    """Raise ValueError for the first key that is not UTF-8 (an error path: per key)."""
    for index, key in enumerate(keys.to_pylist()):
        try:
            key.decode("utf-8")
        except UnicodeDecodeError as error:
            row = int(rows[index])
            raise ValueError(
                f"vbucket {columns.vbucket[row]} seqno {columns.seqno[row]}: key {key!r} is "
                f"not UTF-8 ({error.reason}); change rows hold keys as strings"
            ) from None
