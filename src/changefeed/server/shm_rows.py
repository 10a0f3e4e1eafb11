"""Change rows straight from a stream's items: the shared-memory publisher's stream encoder.

A `DcpProducer` stream decides *what* goes out (markers, runs of checkpoint items or stored
records, the end) and a `StreamEncoder` (producer/encoder.py) *how*. `DcpEncoder` frames DCP
messages for a socket; `RowEncoder` here collects the same runs for a group's `RowCollector`,
which turns them into change rows (``CHANGE_ROW_SCHEMA``) once per batch, for every reader of
the group at once. Before, the publisher framed DCP messages and decoded them straight back
(`decode_batch`), about 1.7 us of node CPU per row.

What a row holds is what a DCP reader of the same stream gets (consumer/change_rows.py): a
mutation, deletion or expiration per visible item, in the stream's order, with the snapshot
of the marker before it (``snap_start``/``snap_end`` per row, so no batch is cut at markers);
SyncWrite prepares and aborts are no row (an application stream never sends them); a commit
is the committed document. Most columns come from the items' bodies without a Python step per
row: an item's body is extras | key | value in storage/record.py's layout, so after one join
of the bodies the seqno, rev_seqno, flags and expiry are read out of the extras with numpy,
and keys and values are taken by offsets (one copy each). Per item, Python reads only the
body, the key's length, the CAS and the op.

A stored record (a disk backfill) is decoded and checked first (`decode_record`): a damaged
record raises instead of becoming a row. Budgets count `ROW_UNITS` per row: a stream's turn
(``STREAM_QUANTUM_BYTES``) and a pump (``PUMP_BYTES_MAX``) bound the rows built per call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Final

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from changefeed.checkpoint import Item, SnapshotStart
from changefeed.consumer.change_rows import (
    CHANGE_ROW_SCHEMA,
    INT64_MAX,
    OP_DELETION,
    OP_EXPIRATION,
    OP_MUTATION,
)
from changefeed.protocol.dcp import StreamEndReason, StreamRequest
from changefeed.storage import Op
from changefeed.storage.record import (
    DELETION_EXTRAS_SIZE,
    MUTATION_EXTRAS_SIZE,
    decode_record,
    stored_seqno,
)

ROW_UNITS: Final = 64  # what one row counts against a byte budget (a marker or an end: too)
_MUTATION: Final = int(Op.MUTATION)
# Plain ints by op (an IntEnum converts to a numpy int ~30% slower than a dict lookup).
_OP_CODES: Final = {op: int(op) for op in Op}
_LAST_VISIBLE: Final = max(int(Op.MUTATION), int(Op.DELETION), int(Op.EXPIRATION))
assert min(int(Op.PREPARE), int(Op.ABORT)) > _LAST_VISIBLE, "sync ops come after the others"
# Extras offsets, storage/record.py (both layouts start with by_seqno and rev_seqno).
_SEQNO_AT, _REV_AT, _FLAGS_AT, _EXPIRY_AT = 0, 8, 16, 20
_BINARY_BYTES_MAX: Final = 2**31 - 1


@functools.cache
def _op_names() -> pa.Array:
    """Row op names indexed by storage `Op` value (0 unused: never taken)."""
    return pa.array(["", OP_MUTATION, OP_DELETION, OP_EXPIRATION], pa.string())


class RowCollector:
    """The rows a group's streams produced since the last `take`.

    Runs are kept as the items themselves (shared, never copied) with their vbucket and
    snapshot; the columns are built once per `take`, however many runs and readers.
    """

    def __init__(self) -> None:
        self._items: list[Item] = []
        self._run_vbs: list[int] = []
        self._run_lengths: list[int] = []
        self._run_starts: list[int] = []
        self._run_ends: list[int] = []
        self._snapshots: dict[int, tuple[int, int]] = {}
        self.ended: list[tuple[int, StreamEndReason]] = []  # streams that ended, in order

    def __len__(self) -> int:
        return len(self._items)

    def encoder(self, request: StreamRequest) -> RowEncoder:
        """The encoder of a stream of this group (`DcpProducer`'s ``encoder_factory``)."""
        return RowEncoder(request.vbucket, self)

    def snapshot(self, vb: int, snap_start: int, snap_end: int) -> None:
        self._snapshots[vb] = (snap_start, snap_end)

    def add(self, vb: int, items: Sequence[Item]) -> None:
        """Rows for the visible `items` of `vb`, in the snapshot of its last marker (prepares
        and aborts are dropped when the rows are built: no Python step per item here)."""
        snap_start, snap_end = self._snapshots[vb]
        self._items.extend(items)
        self._run_vbs.append(vb)
        self._run_lengths.append(len(items))
        self._run_starts.append(snap_start)
        self._run_ends.append(snap_end)

    def take(self) -> pa.RecordBatch | None:
        """The rows collected so far, as one batch of ``CHANGE_ROW_SCHEMA`` (None: none).

        Raises:
            ValueError: a CAS or rev_seqno above ``INT64_MAX``, or a key that is not UTF-8
                (the rows are dropped with it).
        """
        items = self._items
        if not items:
            return None
        lengths = np.array(self._run_lengths, np.intp)
        vbs = np.repeat(np.array(self._run_vbs, np.int32), lengths)
        snap_start = np.repeat(np.array(self._run_starts, np.int64), lengths)
        snap_end = np.repeat(np.array(self._run_ends, np.int64), lengths)
        self._items = []
        self._run_vbs, self._run_lengths, self._run_starts, self._run_ends = [], [], [], []
        ops = np.fromiter(map(_OP_CODES.__getitem__, [item.op for item in items]), np.int8)
        sync = ops > _LAST_VISIBLE
        if bool(sync.any()):  # SyncWrite prepares and aborts: no row (as on DCP)
            visible = ~sync
            items = [item for item, keep in zip(items, visible.tolist(), strict=True) if keep]
            if not items:
                return None
            vbs, snap_start, snap_end, ops = (
                vbs[visible],
                snap_start[visible],
                snap_end[visible],
                ops[visible],
            )
        return rows_of_items(items, vbs, snap_start, snap_end, ops)


class RowEncoder:
    """One stream's encoder: its runs go to the group's `RowCollector` (`out` stays empty)."""

    event_bytes_min = ROW_UNITS

    def __init__(self, vb: int, collector: RowCollector) -> None:
        self.vb = vb
        self.collector = collector

    def snapshot_marker(self, out: list[bytes], marker: SnapshotStart, purge_seqno: int) -> int:
        self.collector.snapshot(self.vb, marker.snap_start, marker.snap_end)
        return ROW_UNITS

    def items(self, out: list[bytes], items: Sequence[Item], bytes_max: int) -> tuple[int, int]:
        count = min(len(items), bytes_max // ROW_UNITS + 1)  # at least one, as a frame
        self.collector.add(self.vb, items if count == len(items) else items[:count])
        return count, count * ROW_UNITS

    def stored(self, out: list[bytes], records: Sequence[bytes], bytes_max: int) -> tuple[int, int]:
        count = min(len(records), bytes_max // ROW_UNITS + 1)
        vb = self.vb
        items = [
            Item.from_record(decode_record(vb, stored_seqno(record), record))
            for record in records[:count]
        ]
        self.collector.add(vb, items)
        return count, count * ROW_UNITS

    def stream_end(self, out: list[bytes], reason: StreamEndReason) -> int:
        self.collector.ended.append((self.vb, reason))
        return ROW_UNITS


def rows_of_items(
    items: Sequence[Item],
    vbs: NDArray[np.int32],
    snap_start: NDArray[np.int64],
    snap_end: NDArray[np.int64],
    ops: NDArray[np.int8],
) -> pa.RecordBatch:
    """Change rows of visible `items` (mutations, deletions, expirations), one per item, with
    each row's vbucket, snapshot and op (storage `Op` values).

    Raises:
        ValueError: a CAS or rev_seqno above ``INT64_MAX``, or a key that is not UTF-8.
    """
    count = len(items)
    bodies = [item.body for item in items]
    data = b"".join(bodies)
    body_lengths = np.fromiter(map(len, bodies), np.int64, count)
    body_end = np.cumsum(body_lengths)
    body_start = body_end - body_lengths
    key_lengths = np.fromiter(map(len, [item.key for item in items]), np.int64, count)
    cas = np.fromiter([item.cas for item in items], np.uint64, count)
    mutation = ops == _MUTATION
    key_start = body_start + np.where(mutation, MUTATION_EXTRAS_SIZE, DELETION_EXTRAS_SIZE)
    raw = np.frombuffer(data, np.uint8)
    seqnos = _field(raw, body_start + _SEQNO_AT, ">u8")
    rev_seqnos = _field(raw, body_start + _REV_AT, ">u8")
    # Flags and expiry are in a mutation's extras only; a tombstone's row has 0.
    flags = np.zeros(count, np.uint32)
    expiry = np.zeros(count, np.uint32)
    at = body_start[mutation]
    flags[mutation] = _field(raw, at + _FLAGS_AT, ">u4")
    expiry[mutation] = _field(raw, at + _EXPIRY_AT, ">u4")
    for name, values in (("CAS", cas), ("rev_seqno", rev_seqnos), ("seqno", seqnos)):
        over = values > INT64_MAX
        if bool(over.any()):
            row = int(np.argmax(over))
            raise ValueError(
                f"vbucket {vbs[row]} seqno {seqnos[row]}: {name} {int(values[row])} does not "
                "fit an int64 (Spark long)"
            )
    keys, values = _keys_and_values(data, key_start, key_start + key_lengths, body_end)
    try:
        keys = keys.cast(pa.string())  # checks UTF-8
    except pa.ArrowInvalid:
        for row, key in enumerate(keys.to_pylist()):
            try:
                key.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"vbucket {vbs[row]} seqno {seqnos[row]}: key {key!r} is not UTF-8 "
                    f"({error.reason}); change rows hold keys as strings"
                ) from None
        raise
    arrays = [
        pa.array(vbs),
        pa.array(seqnos.astype(np.int64)),
        keys,
        values,
        _op_names().take(pa.array(ops)),
        pa.array(cas.astype(np.int64)),
        pa.array(expiry.view(np.int32)),  # u32 -> int32, two's complement
        pa.array(flags.view(np.int32)),
        pa.array(rev_seqnos.astype(np.int64)),
        pa.array(snap_start),
        pa.array(snap_end),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=CHANGE_ROW_SCHEMA)


def _field(raw: NDArray[np.uint8], at: NDArray[np.int64], dtype: str) -> NDArray[np.uint64]:
    """The big-endian unsigned integer of `dtype` at each offset of `raw`."""
    size = np.dtype(dtype).itemsize
    gathered = raw[at[:, None] + np.arange(size)]
    values: NDArray[np.uint64] = gathered.view(dtype).reshape(len(at)).astype(np.uint64)
    return values


def _keys_and_values(
    data: bytes,
    key_start: NDArray[np.int64],
    key_end: NDArray[np.int64],
    value_end: NDArray[np.int64],
) -> tuple[pa.Array, pa.Array]:
    """Keys (binary) and values from `data` by offsets: `data` viewed as one binary array whose
    elements are, item by item, the key, the value and the next item's extras; elements 3i and
    3i + 1 are taken (one copy each)."""
    count = len(key_start)
    large = len(data) > _BINARY_BYTES_MAX
    offsets = np.empty(3 * count, np.int64 if large else np.int32)
    offsets[0::3] = key_start
    offsets[1::3] = key_end
    offsets[2::3] = value_end
    pieces = pa.Array.from_buffers(
        pa.large_binary() if large else pa.binary(),
        3 * count - 1,
        [None, pa.py_buffer(offsets), pa.py_buffer(data)],
    )
    rows = np.arange(count, dtype=np.int64)
    keys = pieces.take(pa.array(3 * rows)).cast(pa.binary())
    values = pieces.take(pa.array(3 * rows + 1)).cast(pa.binary())
    return keys, values
