"""expiry: a bounded scan finds due mutations of one vbucket and says where to resume."""

from __future__ import annotations

import pytest

from changefeed.storage import CorruptRecordError, Store
from changefeed.storage.keys import SEQNO_KEY


def fill(store: Store) -> None:
    """vb 1: seqnos 1..10; even seqnos expire at 100 + seqno, 5 is a tombstone; vb 2 alike."""
    with store.write_batch() as batch:
        for vb in (1, 2):
            for seqno in range(1, 11):
                key = b"k%02d" % seqno
                if seqno == 5:
                    batch.delete(vb, key, seqno, cas=seqno, delete_time=1)
                else:
                    expiry = 100 + seqno if seqno % 2 == 0 else 0
                    batch.set(vb, key, seqno, b"v", cas=seqno, expiry=expiry)


def sweep(store: Store, vb: int, records_max: int, expiry_max: int) -> tuple[list[bytes], int]:
    """Every due key of a whole sweep, and how many scans it took."""
    keys: list[bytes] = []
    start, scans = 0, 0
    while True:  # bounded: every scan moves on or ends
        scan = store.find_expired(
            vb, start_seqno=start, records_max=records_max, expiry_max=expiry_max
        )
        scans += 1
        assert scan.visited <= records_max
        keys += scan.keys
        if scan.next_seqno is None:
            return keys, scans
        assert scan.next_seqno > start
        start = scan.next_seqno


def test_finds_due_mutations_only(store: Store) -> None:
    fill(store)
    scan = store.find_expired(1, start_seqno=0, records_max=100, expiry_max=106)
    assert scan.keys == [b"k02", b"k04", b"k06"]  # expiry 0 never expires; 5 is a tombstone
    assert (scan.visited, scan.next_seqno) == (10, None)
    assert store.find_expired(1, start_seqno=0, records_max=100, expiry_max=101).keys == []


def test_chunks_resume_where_they_stopped(store: Store) -> None:
    fill(store)
    first = store.find_expired(1, start_seqno=0, records_max=3, expiry_max=1000)
    assert (first.keys, first.visited, first.next_seqno) == ([b"k02"], 3, 4)
    second = store.find_expired(1, start_seqno=4, records_max=3, expiry_max=1000)
    assert (second.keys, second.visited, second.next_seqno) == ([b"k04", b"k06"], 3, 7)
    for records_max in (1, 2, 3, 9, 10, 11):  # every chunking sweeps the same keys
        keys, scans = sweep(store, 1, records_max, 1000)
        assert keys == [b"k02", b"k04", b"k06", b"k08", b"k10"], records_max
        assert scans == -(-10 // records_max)  # the last scan sees the end: no empty one


def test_one_vbucket_at_a_time(store: Store) -> None:
    fill(store)
    assert store.find_expired(0, start_seqno=0, records_max=100, expiry_max=1000).visited == 0
    scan = store.find_expired(2, start_seqno=8, records_max=100, expiry_max=1000)
    assert (scan.keys, scan.visited, scan.next_seqno) == ([b"k08", b"k10"], 3, None)
    empty = store.find_expired(3, start_seqno=0, records_max=5, expiry_max=1000)
    assert (empty.keys, empty.visited, empty.next_seqno) == ([], 0, None)


def test_arguments_are_checked(store: Store) -> None:
    with pytest.raises(ValueError, match="records_max"):
        store.find_expired(1, start_seqno=0, records_max=0, expiry_max=1)
    with pytest.raises(ValueError, match="start_seqno"):
        store.find_expired(1, start_seqno=-1, records_max=1, expiry_max=1)
    with pytest.raises(ValueError, match="vb"):
        store.find_expired(99_999, start_seqno=0, records_max=1, expiry_max=1)


def test_a_corrupt_due_record_is_reported_not_acted_on(store: Store) -> None:
    fill(store)
    with store._env.begin(write=True) as txn:
        key = SEQNO_KEY.pack(1, 4)
        original = txn.get(key, db=store._by_seqno)
        assert original is not None
        data = bytearray(original)
        data[12:20] = (9).to_bytes(8, "big")  # the by_seqno inside the extras disagrees
        txn.put(key, bytes(data), db=store._by_seqno)
    with pytest.raises(CorruptRecordError, match="vb 1 seqno 4"):
        store.find_expired(1, start_seqno=0, records_max=100, expiry_max=1000)
    # Not due: not decoded, so the scan does not stop there.
    assert store.find_expired(1, start_seqno=0, records_max=100, expiry_max=103).keys == [b"k02"]
    with store._env.begin(write=True) as txn:  # leave the store whole for the fixture's check
        txn.put(key, original, db=store._by_seqno)
