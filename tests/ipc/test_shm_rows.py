"""`server/shm_rows.py` builds change rows straight from a stream's items; the model is the path it
replaced and every DCP reader takes: frame the items (`DcpEncoder`), decode the frames
(`decode_batch`) and convert them (`ChangeRows.append_changes`). For any runs of mutations,
tombstones, SyncWrite prepares/aborts and commits, over several vbuckets and snapshots, in
memory or read from disk, both give the same rows."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import Item, SnapshotStart
from changefeed.checkpoint.item import CommitItem, SyncItem
from changefeed.checkpoint.snapshot import MARKER_FLAG_MEMORY
from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA, ChangeRows
from changefeed.producer.encoder import DcpEncoder
from changefeed.producer.item_encoding import ItemOptions
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp import StreamEndReason, StreamRequest
from changefeed.server.shm_rows import ROW_UNITS, RowCollector, RowEncoder
from changefeed.storage import Op, Record
from changefeed.storage.record import encode_stored

Run = tuple[int, tuple[int, int], list[Item]]  # vbucket, snapshot, items
U32 = st.integers(0, 2**32 - 1)


@st.composite
def items_of(draw: st.DrawFn, first_seqno: int) -> list[Item]:
    out: list[Item] = []
    seqno = first_seqno
    for _ in range(draw(st.integers(1, 12))):
        seqno += draw(st.integers(1, 3))  # gaps: deduplicated seqnos
        key = draw(st.text(min_size=1, max_size=12)).encode()
        cas = draw(st.integers(1, 2**63 - 1))
        rev = draw(st.integers(1, 2**63 - 1))
        kind = draw(st.sampled_from(["mutation", "deletion", "expiration", "sync", "commit"]))
        if kind == "mutation":
            value = draw(st.binary(max_size=40))
            item = Item(seqno, key, Op.MUTATION, value, cas, draw(U32), draw(U32), 0, rev)
        elif kind in ("deletion", "expiration"):
            op = Op.DELETION if kind == "deletion" else Op.EXPIRATION
            item = Item(seqno, key, op, b"", cas, 0, 0, 0, rev, draw(U32))
        elif kind == "sync":
            op = draw(st.sampled_from([Op.PREPARE, Op.ABORT]))
            doc = Op.MUTATION if op is Op.PREPARE else Op.DELETION
            item = SyncItem(seqno, key, op, doc, b"x" if op is Op.PREPARE else b"", cas)
        else:
            item = CommitItem(seqno, key, Op.MUTATION, b"committed", cas, 7, 0, 0, rev)
            item.prepared_seqno = max(seqno - 1, 1)
        out.append(item)
    return out


@st.composite
def runs_of(draw: st.DrawFn) -> list[Run]:
    runs: list[Run] = []
    last = {vb: 0 for vb in range(4)}
    for _ in range(draw(st.integers(1, 6))):
        vb = draw(st.integers(0, 3))
        items = draw(items_of(last[vb]))
        snapshot = (last[vb] + 1, items[-1].seqno + draw(st.integers(0, 2)))
        last[vb] = snapshot[1]
        runs.append((vb, snapshot, items))
    return runs


def model_rows(runs: list[Run]) -> pa.RecordBatch:
    """Frame, decode, convert: what a `DcpClient` of the same streams gets (it asks for the
    expiry opcode: an expiration is a row `op = expiration`)."""
    rows = ChangeRows()
    for vb, (snap_start, snap_end), items in runs:
        encoder = DcpEncoder(vb, 1, ItemOptions(delete_times=True, expiry_opcode=True))
        out: list[bytes] = []
        encoder.snapshot_marker(out, SnapshotStart(snap_start, snap_end, MARKER_FLAG_MEMORY), 0)
        encoder.items(out, items, 2**30)
        changes = decode_batch(b"".join(out)).changes
        rows.append_changes(changes, {vb: (snap_start, snap_end)})
    return rows.to_batch()


def encoders(collector: RowCollector) -> dict[int, RowEncoder]:
    return {
        vb: collector.encoder(StreamRequest(vb, vb, 0, 0, 2**64 - 1, 0, 0, 0)) for vb in range(4)
    }


def collected(runs: list[Run], *, from_disk: bool = False) -> pa.RecordBatch:
    collector = RowCollector()
    by_vb = encoders(collector)
    for vb, (snap_start, snap_end), items in runs:
        encoder = by_vb[vb]
        assert (
            encoder.snapshot_marker([], SnapshotStart(snap_start, snap_end, MARKER_FLAG_MEMORY), 0)
            > 0
        )
        if from_disk:  # the store holds no prepare or abort
            records = [encode_stored(_record(vb, i)) for i in items if not isinstance(i, SyncItem)]
            if records:
                assert encoder.stored([], records, 2**30) == (len(records), len(records) * 64)
        else:
            assert encoder.items([], items, 2**30) == (len(items), len(items) * ROW_UNITS)
    batch = collector.take()
    assert collector.take() is None  # taken once
    if batch is None:
        return ChangeRows().to_batch()
    return batch


def _record(vb: int, item: Item) -> Record:
    return Record.create(
        vb, item.seqno, item.key, item.op, cas=item.cas, value=item.value,
        rev_seqno=item.rev_seqno, flags=item.flags, expiry=item.expiry,
        delete_time=item.delete_time,
    )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(runs_of())
def test_rows_from_items_equal_rows_from_dcp_frames(runs: list[Run]) -> None:
    expected = model_rows(runs)
    got = collected(runs)
    assert got.schema == CHANGE_ROW_SCHEMA
    assert got.to_pylist() == expected.to_pylist()


@settings(max_examples=25, deadline=None)
@given(runs_of())
def test_rows_from_stored_records_equal_rows_from_dcp_frames(runs: list[Run]) -> None:
    assert collected(runs, from_disk=True).to_pylist() == model_rows(runs).to_pylist()


def test_a_budget_takes_rows_from_the_front_of_a_run_and_at_least_one() -> None:
    collector = RowCollector()
    encoder = encoders(collector)[2]
    encoder.snapshot_marker([], SnapshotStart(1, 10, MARKER_FLAG_MEMORY), 0)
    items = [Item(s, b"k%d" % s, Op.MUTATION, b"v", 1) for s in range(1, 11)]
    assert encoder.items([], items, 0) == (1, ROW_UNITS)  # one, as a frame overshoots
    assert encoder.items([], items[1:], 3 * ROW_UNITS) == (4, 4 * ROW_UNITS)
    batch = collector.take()
    assert batch is not None
    assert batch.column("seqno").to_pylist() == [1, 2, 3, 4, 5]


def test_stream_ends_are_reported_to_the_publisher() -> None:
    collector = RowCollector()
    assert encoders(collector)[3].stream_end([], StreamEndReason.STATE_CHANGED) > 0
    assert collector.ended == [(3, StreamEndReason.STATE_CHANGED)]


def test_a_key_that_is_not_utf8_is_refused_naming_it() -> None:
    collector = RowCollector()
    encoder = encoders(collector)[1]
    encoder.snapshot_marker([], SnapshotStart(1, 2, MARKER_FLAG_MEMORY), 0)
    encoder.items(
        [], [Item(1, b"ok", Op.MUTATION, b"", 1), Item(2, b"\xff", Op.MUTATION, b"", 1)], 2**20
    )
    with pytest.raises(ValueError, match=r"vbucket 1 seqno 2: key b'\\xff' is not UTF-8"):
        collector.take()


def test_a_cas_over_int64_is_refused_naming_it() -> None:
    collector = RowCollector()
    encoder = encoders(collector)[0]
    encoder.snapshot_marker([], SnapshotStart(1, 1, MARKER_FLAG_MEMORY), 0)
    encoder.items([], [Item(1, b"k", Op.MUTATION, b"", 2**63)], 2**20)
    with pytest.raises(ValueError, match=r"vbucket 0 seqno 1: CAS 9223372036854775808"):
        collector.take()
