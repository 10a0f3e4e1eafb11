"""``Store.scan_bodies``: the records ``scan`` yields, as stored bytes, in runs bounded by count
and bytes, inside one snapshot; the range is exact even next to another vbucket's records."""

from __future__ import annotations

import random

import pytest

from changefeed.storage import Op, Record, StorageError, Store
from changefeed.storage.record import encode_stored, stored_seqno


def write(store: Store, vb: int, seqnos: range, *, value_bytes: int = 10) -> None:
    with store.write_batch() as batch:
        for seqno in seqnos:
            key = b"k%d" % seqno
            if seqno % 5 == 0:
                batch.delete(vb, key, seqno, cas=seqno + 7, delete_time=seqno)
            else:
                batch.set(vb, key, seqno, b"v" * value_bytes, cas=seqno + 7, flags=seqno)


def expected(store: Store, vb: int, start: int, end: int) -> list[bytes]:
    return [encode_stored(record) for record in store.scan(vb, start, end)]


def read_all(store: Store, vb: int, start: int, end: int, run: int, bytes_max: int) -> list[bytes]:
    scan = store.scan_bodies(vb, start, end)
    got: list[bytes] = []
    while not scan.done:  # bounded: each read advances or ends the scan
        records = scan.read(run, bytes_max)
        assert len(records) <= run
        if len(records) > 1:
            assert sum(map(len, records[:-1])) < bytes_max  # only the last may reach the bound
        got += records
    assert scan.read(run, bytes_max) == []
    return got


@pytest.mark.parametrize("run", [1, 3, 64])
@pytest.mark.parametrize("bytes_max", [1, 100, 1 << 20])
def test_runs_hold_exactly_the_scanned_records(store: Store, run: int, bytes_max: int) -> None:
    write(store, 1, range(1, 40))
    write(store, 2, range(1, 40))  # the next vbucket's records follow in LMDB's key order
    write(store, 0, range(1, 40))
    for start, end in ((1, 39), (5, 17), (17, 17), (30, 100), (39, 39)):
        assert read_all(store, 1, start, end, run, bytes_max) == expected(store, 1, start, end)


def test_gaps_and_an_end_past_the_last_record_stop_at_the_range(store: Store) -> None:
    write(store, 1, range(1, 30))
    write(store, 2, range(1, 5))
    with store.write_batch() as batch:  # rewrite keys: their old seqnos become gaps
        for seqno, old in ((30, 3), (31, 4), (32, 10)):
            batch.set(1, b"k%d" % old, seqno, b"new", cas=1)
    for start, end in ((1, 12), (2, 29), (1, 40)):
        assert read_all(store, 1, start, end, 64, 1 << 20) == expected(store, 1, start, end)
    seqnos = [stored_seqno(data) for data in read_all(store, 1, 1, 12, 64, 1 << 20)]
    assert seqnos == [1, 2, 5, 6, 7, 8, 9, 11, 12]


def test_a_scan_reads_the_snapshot_taken_when_it_opened(store: Store) -> None:
    write(store, 0, range(1, 10))
    scan = store.scan_bodies(0, 1, 100)
    first = scan.read(3, 1 << 20)
    write(store, 0, range(10, 20))  # committed after the scan opened: not seen
    rest = []
    while not scan.done:  # bounded by the snapshot's records
        rest += scan.read(4, 1 << 20)
    assert [stored_seqno(data) for data in first + rest] == list(range(1, 10))


def test_next_record_and_read_share_one_position(store: Store) -> None:
    write(store, 3, range(1, 21))
    scan = store.scan_bodies(3, 2, 19)
    one = scan.next_record()
    assert isinstance(one, Record)
    assert one.seqno == 2
    run = scan.read(5, 1 << 20)
    assert [stored_seqno(data) for data in run] == [3, 4, 5, 6, 7]
    two = scan.next_record()
    assert two is not None
    assert two.seqno == 8
    assert two.op is Op.MUTATION
    assert encode_stored(two) == expected(store, 3, 8, 8)[0]
    rest = scan.read(64, 1 << 20)
    assert [stored_seqno(data) for data in rest] == list(range(9, 20))
    assert scan.done  # the record at end_seqno was read: the snapshot is released
    assert scan.next_record() is None


def test_empty_ranges_are_done_at_once(store: Store) -> None:
    write(store, 0, range(1, 5))
    for vb, start, end in ((0, 5, 9), (0, 3, 2), (1, 1, 10)):
        scan = store.scan_bodies(vb, start, end)
        assert scan.done
        assert scan.read(8, 1 << 20) == []
        assert scan.next_record() is None


def test_closing_frees_the_reader_slot(store: Store) -> None:
    write(store, 0, range(1, 10))
    for _ in range(2 * 512):  # more than the store's reader slots
        scan = store.scan_bodies(0, 1, 9)
        assert scan.read(2, 1 << 20)
        scan.close()
        scan.close()  # idempotent
        assert scan.done


def test_a_scan_of_a_closed_store_fails_as_a_storage_error(store: Store) -> None:
    write(store, 0, range(1, 200), value_bytes=1000)
    scan = store.scan_bodies(0, 1, 199)
    assert scan.read(1, 1 << 20)
    store.close()
    with pytest.raises(StorageError):
        while not scan.done:  # bounded: fails on the first read
            scan.read(64, 1 << 20)


def test_arguments_are_checked(store: Store) -> None:
    with pytest.raises(ValueError):
        store.scan_bodies(-1, 1, 2)
    with pytest.raises(ValueError):
        store.scan_bodies(0, 1, 2**64)


def test_random_ranges_and_bounds_match_scan(store: Store) -> None:
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for vb in (0, 1, 2):
        write(store, vb, range(1, 120), value_bytes=rng.randrange(0, 300))
    for _ in range(60):
        vb = rng.randrange(3)
        start = rng.randrange(0, 130)
        end = rng.randrange(start, 140)
        run, bytes_max = rng.randrange(1, 70), rng.randrange(1, 5000)
        assert read_all(store, vb, start, end, run, bytes_max) == expected(store, vb, start, end)
