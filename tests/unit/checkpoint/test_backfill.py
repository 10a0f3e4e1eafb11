"""Disk backfill: the queue's byte bound, the disk cursor pausing on it, the Disk marker."""

from __future__ import annotations

from pathlib import Path

from changefeed.checkpoint import (
    MARKER_FLAG_DISK,
    Backfill,
    BackfillQueue,
    DiskCursor,
    Item,
    SnapshotStart,
    item_size_bytes,
)
from changefeed.checkpoint.backfill import StoredRun
from changefeed.storage import Op, Store
from changefeed.storage.record import decode_record, stored_seqno

from .helpers import VB, item, open_store


def write(store: Store, items: list[Item]) -> None:
    with store.write_batch() as batch:
        for one in items:
            if one.op is Op.MUTATION:
                batch.set(VB, one.key, one.seqno, one.value, cas=one.cas)
            else:
                batch.delete(VB, one.key, one.seqno, cas=one.cas, delete_time=one.delete_time)


def test_queue_is_bounded_in_bytes_but_always_takes_one_item() -> None:
    big = item(1, "big", b"x" * 5000)
    queue = BackfillQueue(bytes_max=1000)
    assert not queue.full
    queue.push(big)  # larger than the bound, but the queue was empty
    assert queue.full
    assert queue.bytes == item_size_bytes(big)
    assert queue.pop() == big
    assert queue.pop() is None
    assert queue.bytes == 0


def test_disk_cursor_pauses_when_the_queue_is_full_and_resumes(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    write(store, [item(s, f"k{s}", b"x" * 100) for s in range(1, 51)])
    one = item_size_bytes(item(1, "k1", b"x" * 100))
    queue = BackfillQueue(bytes_max=10 * one)
    cursor = DiskCursor(store, VB, 1, 50)
    cursor.fill(queue)
    assert len(queue) == 10  # paused at the bound
    assert not cursor.done
    drained = [queue.pop() for _ in range(10)]
    assert [one.seqno for one in drained if one is not None] == list(range(1, 11))
    while not cursor.done:
        cursor.fill(queue)
        while queue.pop() is not None:
            pass
    assert cursor.items_read == 50
    assert cursor.last_seqno == 50


def test_backfill_yields_a_disk_marker_then_the_newest_versions_in_range(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    write(store, [item(1, "a"), item(2, "b"), item(3, "c")])
    write(store, [item(4, "a"), item(5, "b", op=Op.DELETION), item(6, "d")])
    backfill = Backfill(store, VB, 2, 5, bytes_max=1)  # a 1-byte bound: one item at a time
    events = []
    while (event := backfill.next()) is not None:
        events.append(event)
        assert len(backfill.queue) <= 1
    assert events[0] == SnapshotStart(2, 5, MARKER_FLAG_DISK)
    assert [(e.seqno, e.key, e.op) for e in events[1:] if isinstance(e, Item)] == [
        (3, b"c", Op.MUTATION),
        (4, b"a", Op.MUTATION),
        (5, b"b", Op.DELETION),  # tombstones are backfilled too
    ]
    assert backfill.complete
    backfill.close()


def test_closing_an_unfinished_backfill_frees_its_scan(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    write(store, [item(s, f"k{s}") for s in range(1, 20)])
    for _ in range(2 * 512):  # more than the store's reader slots: each close must free one
        backfill = Backfill(store, VB, 1, 19, bytes_max=1)
        assert backfill.next() is not None
        assert backfill.next() is not None
        backfill.close()
        assert backfill.disk_cursor.done


def test_read_run_hands_out_the_stored_bodies_in_runs(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    write(store, [item(s, f"k{s}", b"x" * 100) for s in range(1, 31)])
    write(store, [item(31, "k3"), item(32, "k4", op=Op.DELETION)])  # 3 and 4 become gaps
    per_item = Backfill(store, VB, 2, 31)
    expected = [e for e in iter(per_item.next, None) if isinstance(e, Item)]
    backfill = Backfill(store, VB, 2, 31)
    assert backfill.read_run(8, 1 << 20) == SnapshotStart(2, 31, MARKER_FLAG_DISK)
    runs = []
    while (run := backfill.read_run(8, 1 << 20)) is not None:  # bounded by the range
        assert isinstance(run, StoredRun)
        assert len(run) <= 8
        runs.append(run)
    assert backfill.complete
    assert backfill.disk_cursor.items_read == len(expected) == 28  # 2..31 but 3 and 4
    records = [data for run in runs for data in run.records]
    assert [Item.from_record(decode_record(VB, stored_seqno(d), d)) for d in records] == expected
    assert [(run.first_seqno, run.last_seqno) for run in runs[:2]] == [(2, 11), (12, 19)]
    assert runs[0].seqno(1) == 5
    backfill.close()


def test_read_run_reads_no_further_than_its_byte_budget(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    write(store, [item(s, f"k{s:03d}", b"x" * 100) for s in range(1, 21)])
    backfill = Backfill(store, VB, 1, 20)
    assert isinstance(backfill.read_run(64, 1), SnapshotStart)
    run = backfill.read_run(64, 1)  # one record reaches any budget: it comes alone
    assert isinstance(run, StoredRun)
    assert len(run) == 1
    record_bytes = len(run.records[0])
    run = backfill.read_run(64, 3 * record_bytes)
    assert isinstance(run, StoredRun)
    assert len(run) == 3
    assert backfill.disk_cursor.last_seqno == 4  # nothing past the run was read
    backfill.close()


def test_items_next_already_decoded_come_first_then_runs(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    write(store, [item(s, f"k{s}") for s in range(1, 11)])
    backfill = Backfill(store, VB, 1, 10, bytes_max=3 * item_size_bytes(item(1, "k1")))
    assert isinstance(backfill.next(), SnapshotStart)
    first = backfill.next()  # fills the queue with 3 decoded items
    assert isinstance(first, Item)
    assert first.seqno == 1
    queued = backfill.read_run(64, 1 << 20)
    assert isinstance(queued, list)
    assert [one.seqno for one in queued] == [2, 3]
    run = backfill.read_run(64, 1 << 20)
    assert isinstance(run, StoredRun)
    assert (run.first_seqno, run.last_seqno) == (4, 10)
    assert backfill.read_run(64, 1 << 20) is None
    assert backfill.complete
    backfill.close()
