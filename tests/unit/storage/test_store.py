"""Store: examples of the contract, then a model-based state machine against a dict model."""

from __future__ import annotations

import dataclasses
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from changefeed import limits
from changefeed.storage import (
    CorruptRecordError,
    Op,
    Record,
    StorageError,
    StorageFullError,
    Store,
    VBucketMeta,
    WriteBatch,
)
from changefeed.storage.keys import SEQNO_KEY, VB_KEY

ALL = limits.SEQNO_MAX


def test_new_store_is_empty_and_clean(tmp_path: Path) -> None:
    with Store(tmp_path / "s", durable=False) as store:
        assert store.was_clean_shutdown
        assert store.vbuckets() == []
        assert store.vbucket_meta(0) is None
        assert (store.high_seqno(0), store.purge_seqno(0), store.item_count(0)) == (0, 0, 0)
        assert store.get(0, b"k") is None
        assert list(store.scan(0, 0, ALL)) == []
        store._check_invariants()


def test_set_get_and_dcp_body(store: Store) -> None:
    with store.write_batch() as batch:
        batch.set(1, b"key", 5, b"value", cas=77, flags=0xDEADBEEF, expiry=9, datatype=1)
    record = store.get(1, b"key")
    assert record == Record.create(
        1, 5, b"key", Op.MUTATION, cas=77, value=b"value", flags=0xDEADBEEF, expiry=9, datatype=1
    )
    assert record is not None
    assert record.body == struct.pack(">QQIIIHB", 5, 1, 0xDEADBEEF, 9, 0, 0, 0) + b"keyvalue"
    assert store.get(0, b"key") is None
    assert store.get(1, b"") is None
    assert store.get(1, b"k" * 300) is None
    assert (store.high_seqno(1), store.item_count(1)) == (5, 1)


def test_a_key_has_one_version_newest_wins(store: Store) -> None:
    with store.write_batch() as batch:
        batch.set(0, b"a", 1, b"1", cas=1)
        batch.set(0, b"b", 2, b"2", cas=1)
        batch.set(0, b"a", 3, b"3", cas=1)  # same batch: replaces seqno 1
    with store.write_batch() as batch:
        batch.set(0, b"b", 4, b"4", cas=1)  # later batch: replaces seqno 2
    assert [(r.seqno, r.key, r.value) for r in store.scan(0, 0, ALL)] == [
        (3, b"a", b"3"),
        (4, b"b", b"4"),
    ]
    assert store.item_count(0) == 2
    assert store.high_seqno(0) == 4


def test_tombstones_are_kept_and_not_counted(store: Store) -> None:
    with store.write_batch() as batch:
        batch.set(0, b"a", 1, b"1", cas=1)
        batch.set(0, b"b", 2, b"2", cas=1)
    with store.write_batch() as batch:
        batch.delete(0, b"a", 3, cas=2, delete_time=100, rev_seqno=2)
        batch.delete(0, b"b", 4, cas=3, expiration=True, value=b"xattr", datatype=4)
        batch.delete(0, b"never", 5, cas=4)
    a = store.get(0, b"a")
    assert a is not None
    assert (a.deleted, a.op, a.delete_time, a.rev_seqno, a.extras_len) == (
        True,
        Op.DELETION,
        100,
        2,
        21,
    )
    assert a.body == struct.pack(">QQIB", 3, 2, 100, 0) + b"a"
    b = store.get(0, b"b")
    assert b is not None
    assert (b.op, b.value, b.datatype) == (Op.EXPIRATION, b"xattr", 4)
    assert store.item_count(0) == 0
    assert [r.seqno for r in store.scan(0, 0, ALL)] == [3, 4, 5]


def test_scan_bounds_are_inclusive_and_per_vb(store: Store) -> None:
    with store.write_batch() as batch:
        for seqno in range(1, 11):
            batch.set(1, b"k%d" % seqno, seqno, b"v", cas=seqno)
            batch.set(2, b"k%d" % seqno, seqno * 2, b"v", cas=seqno)
    assert [r.seqno for r in store.scan(1, 3, 6)] == [3, 4, 5, 6]
    assert [r.seqno for r in store.scan(1, 10, ALL)] == [10]
    assert [r.seqno for r in store.scan(2, 5, 9)] == [6, 8]
    assert list(store.scan(1, 6, 3)) == []
    assert list(store.scan(3, 0, ALL)) == []
    assert {r.vb for r in store.scan(1, 0, ALL)} == {1}
    with pytest.raises(ValueError, match="scan range"):
        store.scan(1, -1, 5)
    with pytest.raises(ValueError, match="vb"):
        store.scan(limits.VBUCKETS_MAX, 0, 5)


def test_scan_reads_one_snapshot(store: Store) -> None:
    with store.write_batch() as batch:
        for seqno in range(1, 6):
            batch.set(0, b"k%d" % seqno, seqno, b"old", cas=1)
    scan = store.scan(0, 0, ALL)
    assert next(scan).seqno == 1
    with store.write_batch() as batch:
        batch.set(0, b"k2", 6, b"new", cas=1)
        batch.set(0, b"k9", 7, b"new", cas=1)
    assert [(r.seqno, r.value) for r in scan] == [
        (2, b"old"),
        (3, b"old"),
        (4, b"old"),
        (5, b"old"),
    ]
    assert [r.seqno for r in store.scan(0, 0, ALL)] == [1, 3, 4, 5, 6, 7]
    abandoned = store.scan(0, 0, ALL)
    next(abandoned)
    abandoned.close()  # frees the reader slot


def test_seqnos_must_increase(store: Store) -> None:
    with store.write_batch() as batch:
        batch.set(0, b"a", 5, b"1", cas=1)
        for bad_seqno in (5, 4, 0, -1):
            with pytest.raises(ValueError, match="above the high seqno 5"):
                batch.set(0, b"b", bad_seqno, b"2", cas=1)
            with pytest.raises(ValueError, match="above the high seqno 5"):
                batch.delete(0, b"b", bad_seqno, cas=1)
        batch.set(0, b"b", 6, b"2", cas=1)  # the batch is still usable after a refused call
        batch.set(1, b"b", 1, b"2", cas=1)  # seqnos are per vb
    with store.write_batch() as batch, pytest.raises(ValueError, match="above the high seqno 6"):
        batch.set(0, b"c", 6, b"3", cas=1)
    assert [r.seqno for r in store.scan(0, 0, ALL)] == [5, 6]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda b: b.set(0, b"", 1, b"v", cas=1), "key length"),
        (lambda b: b.set(0, b"k" * 256, 1, b"v", cas=1), "key length"),
        (lambda b: b.set(0, b"k", 1, b"v" * (limits.VALUE_SIZE_MAX + 1), cas=1), "VALUE_SIZE_MAX"),
        (lambda b: b.set(0, b"k", 1, b"v", cas=1, datatype=8), "datatype"),
        (lambda b: b.set(0, b"k", 1, b"v", cas=-1), "out of range"),
        (lambda b: b.set(0, b"k", 2**64, b"v", cas=1), "out of range"),
        (lambda b: b.set(0, b"k", 1, b"v", cas=1, flags=2**32), "out of range"),
        (lambda b: b.delete(0, b"k", 1, cas=1, delete_time=-1), "out of range"),
        (lambda b: b.set(9, b"k", 1, b"v", cas=1), "vb 9 has no metadata"),
        (lambda b: b.delete(9, b"k", 1, cas=1), "vb 9 has no metadata"),
        (lambda b: b.set_vbucket_meta(9, snap_start=1), "needs its state"),
        (lambda b: b.set_vbucket_meta(limits.VBUCKETS_MAX, state="active"), "outside"),
        (lambda b: b.set_vbucket_meta(0, state="zombie"), "vbucket state"),
        (lambda b: b.set_vbucket_meta(0, snap_start=5, snap_end=4), "snapshot range"),
        (lambda b: b.set_vbucket_meta(0, snap_start=1), "snapshot range"),
        (lambda b: b.set_vbucket_meta(0, failover_log=[(1, 1)] * 26), "FAILOVER_LOG"),
    ],
)
def test_misuse_raises_value_error_and_changes_nothing(store: Store, call: Any, match: str) -> None:
    before = [store.vbucket_meta(vb) for vb in range(10)]
    with store.write_batch() as batch, pytest.raises(ValueError, match=match):
        call(batch)
    assert [store.vbucket_meta(vb) for vb in range(10)] == before
    assert all(list(store.scan(vb, 0, ALL)) == [] for vb in range(4))


def test_an_exception_aborts_the_whole_batch(store: Store) -> None:
    with store.write_batch() as batch:
        batch.set(0, b"keep", 1, b"v", cas=1)
    with pytest.raises(KeyError), store.write_batch() as batch:
        batch.set(0, b"lost", 2, b"v", cas=1)
        batch.set_vbucket_meta(0, state="replica", snap_start=0, snap_end=2)
        batch.set_vbucket_meta(5, state="active")
        raise KeyError("boom")
    assert store.get(0, b"lost") is None
    assert store.vbucket_meta(0) == VBucketMeta("active", [(1000, 0)], 1, 0, 0, 0)
    assert store.vbucket_meta(5) is None
    with pytest.raises(RuntimeError, match="ended"):
        batch.set(0, b"late", 3, b"v", cas=1)
    with store.write_batch() as batch:
        batch.set(0, b"next", 2, b"v", cas=1)  # seqno 2 is free again
    assert store.high_seqno(0) == 2


def test_one_batch_at_a_time(store: Store) -> None:
    with store.write_batch() as batch:
        assert isinstance(batch, Store.WriteBatch)
        assert Store.WriteBatch is WriteBatch
        with pytest.raises(RuntimeError, match="already open"), store.write_batch():
            pass
        with pytest.raises(RuntimeError, match="inside a write batch"):
            store.compact(tombstone_age_s=0)
        with pytest.raises(RuntimeError, match="inside a write batch"):
            store.rollback(0, 0)
        with pytest.raises(RuntimeError, match="inside a write batch"):
            store.close()
    with pytest.raises(RuntimeError, match="ended"):
        batch.set_vbucket_meta(0, state="dead")


def test_vbucket_meta_create_and_change(store: Store) -> None:
    with store.write_batch() as batch:
        batch.set_vbucket_meta(7, state="replica")
        batch.set(7, b"k", 3, b"v", cas=1)
        batch.set_vbucket_meta(7, failover_log=[(9, 3), (8, 0)], snap_start=1, snap_end=3)
        batch.set_vbucket_meta(0, state="dead")
    assert store.vbucket_meta(7) == VBucketMeta("replica", [(9, 3), (8, 0)], 3, 0, 1, 3)
    assert store.vbucket_meta(0) == VBucketMeta("dead", [(1000, 0)], 0, 0, 0, 0)
    assert store.vbuckets() == [0, 1, 2, 3, 7]
    meta = store.vbucket_meta(7)
    assert meta is not None
    meta.failover_log.clear()  # a copy
    assert store.vbucket_meta(7) == VBucketMeta("replica", [(9, 3), (8, 0)], 3, 0, 1, 3)


def test_put_record_stores_the_received_body(store: Store) -> None:
    body = struct.pack(">QQIIIHB", 12, 4, 5, 6, 0, 0, 0) + b"doc" + b"{}"
    record = Record.from_dcp_body(2, Op.MUTATION, body, extras_len=31, key_len=3, cas=8, datatype=1)
    tombstone = Record.create(2, 13, b"gone", Op.DELETION, cas=9, delete_time=77)
    with store.write_batch() as batch:
        batch.put_record(record)
        batch.put_record(tombstone)
        with pytest.raises(ValueError, match="above the high seqno 13"):
            batch.put_record(record)
    assert store.get(2, b"doc") == record
    stored = store.get(2, b"doc")
    assert stored is not None
    assert stored.body == body
    assert store.get(2, b"gone") == tombstone
    assert (store.high_seqno(2), store.item_count(2)) == (13, 1)


def test_compaction_purges_old_tombstones(store: Store) -> None:
    with store.write_batch() as batch:
        batch.set(0, b"live", 1, b"v", cas=1)
        batch.delete(0, b"old", 2, cas=1, delete_time=100)
        batch.delete(0, b"mid", 3, cas=1, delete_time=150, expiration=True)
        batch.delete(0, b"new", 4, cas=1, delete_time=200)
        batch.delete(1, b"old", 1, cas=1, delete_time=100)
    assert store.compact(tombstone_age_s=50, now=200, vbuckets=[0]) == {0: 3}
    assert [r.key for r in store.scan(0, 0, ALL)] == [b"live", b"new"]
    assert store.get(0, b"old") is None
    assert store.get(1, b"old") is not None  # vb 1 was not compacted
    assert store.compact(tombstone_age_s=50, now=200) == {0: 3, 1: 1, 2: 0, 3: 0}
    assert store.compact(tombstone_age_s=0, now=1e12) == {0: 4, 1: 1, 2: 0, 3: 0}
    assert store.compact(tombstone_age_s=0) == {0: 4, 1: 1, 2: 0, 3: 0}  # time.time()
    assert (store.purge_seqno(0), store.item_count(0), store.high_seqno(0)) == (4, 1, 4)
    with pytest.raises(ValueError, match="vb 9"):
        store.compact(tombstone_age_s=0, vbuckets=[0, 9])
    with pytest.raises(ValueError, match="tombstone_age_s"):
        store.compact(tombstone_age_s=-1)


def test_rollback_truncates_and_keys_disappear(store: Store) -> None:
    with store.write_batch() as batch:
        batch.set(0, b"a", 1, b"a1", cas=1)
        batch.set(0, b"b", 2, b"b1", cas=1)
        batch.delete(0, b"c", 3, cas=1, delete_time=1)
        batch.set_vbucket_meta(0, snap_start=0, snap_end=3)
    store.compact(tombstone_age_s=0, now=10)
    with store.write_batch() as batch:
        batch.set(0, b"a", 4, b"a2", cas=1)  # the only version of "a" is now seqno 4
        batch.set(0, b"d", 5, b"d1", cas=1)
        batch.set_vbucket_meta(0, snap_start=4, snap_end=5)
    assert store.purge_seqno(0) == 3
    store.rollback(0, 2)
    assert [(r.key, r.seqno) for r in store.scan(0, 0, ALL)] == [(b"b", 2)]
    assert store.get(0, b"a") is None  # older version not kept: re-fetch from the active
    assert store.vbucket_meta(0) == VBucketMeta("active", [(1000, 0)], 2, 2, 2, 2)
    assert store.item_count(0) == 1
    store.rollback(0, 9)  # above the high seqno: nothing changes
    assert store.vbucket_meta(0) == VBucketMeta("active", [(1000, 0)], 2, 2, 2, 2)
    with store.write_batch() as batch:
        batch.set(0, b"a", 3, b"a3", cas=1)  # writing resumes after the rollback point
    store.rollback(0, 0)
    assert list(store.scan(0, 0, ALL)) == []
    assert store.vbucket_meta(0) == VBucketMeta("active", [(1000, 0)], 0, 0, 0, 0)
    with pytest.raises(ValueError, match="vb 9"):
        store.rollback(9, 0)
    with pytest.raises(ValueError, match="rollback seqno"):
        store.rollback(0, -1)


def test_everything_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Store(path, durable=True) as store:
        with store.write_batch() as batch:
            batch.set_vbucket_meta(3, state="pending", failover_log=[(5, 0)], snap_end=9)
            batch.set(3, b"a", 4, b"v", cas=1)
            batch.delete(3, b"b", 9, cas=2, delete_time=5)
        store.compact(tombstone_age_s=0, now=5)
        expected = (store.vbucket_meta(3), list(store.scan(3, 0, ALL)), store.item_count(3))
    with Store(path, durable=True) as store:
        assert store.was_clean_shutdown
        assert (store.vbucket_meta(3), list(store.scan(3, 0, ALL)), store.item_count(3)) == expected
        assert store.purge_seqno(3) == 9
        store._check_invariants()


def test_unclean_shutdown_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "s"
    store = Store(path, durable=False)
    with store.write_batch() as batch:
        batch.set_vbucket_meta(0, state="active")
    store._env.close()  # as if the process died: close() never ran (tests/chaos uses kill -9)
    with Store(path, durable=False) as reopened:
        assert not reopened.was_clean_shutdown
        assert reopened.vbuckets() == [0]
    with Store(path, durable=False) as reopened:
        assert reopened.was_clean_shutdown


def test_closed_store_refuses(tmp_path: Path) -> None:
    store = Store(tmp_path / "s", durable=False)
    with store.write_batch() as batch:
        batch.set_vbucket_meta(0, state="active")
        batch.set(0, b"a", 1, b"v", cas=1)
    scan = store.scan(0, 0, ALL)
    store.close()
    store.close()  # idempotent
    for call in (
        lambda: store.get(0, b"a"),
        lambda: store.scan(0, 0, 1),
        lambda: store.write_batch().__enter__(),
        lambda: store.vbucket_meta(0),
        lambda: store.high_seqno(0),
        lambda: store.compact(tombstone_age_s=0),
    ):
        with pytest.raises(StorageError, match="closed"):
            call()
    with pytest.raises(StorageError):
        list(scan)  # the environment it read is gone


def test_full_map_raises_storage_full_and_keeps_serving(tmp_path: Path) -> None:
    with Store(tmp_path / "s", durable=False, map_size_bytes=1 << 20) as store:
        with store.write_batch() as batch:
            batch.set_vbucket_meta(0, state="active")
            batch.set(0, b"first", 1, b"v", cas=1)
        with pytest.raises(StorageFullError, match="map_size_bytes=1048576"):
            for start in range(2, 10_000, 100):
                with store.write_batch() as batch:
                    for seqno in range(start, start + 100):
                        batch.set(0, b"k%d" % seqno, seqno, b"x" * 1000, cas=1)
        high = store.high_seqno(0)
        assert [r.seqno for r in store.scan(0, 0, ALL)][-1] == high
        assert store.get(0, b"first") is not None
        store._check_invariants()
        with store.write_batch() as batch:  # small writes still fit
            batch.set(0, b"first", high + 1, b"w", cas=2)
        store._check_invariants()


def test_batch_bytes_are_bounded(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "STORAGE_BATCH_BYTES_MAX", 1000)
    with store.write_batch() as batch:
        batch.set(0, b"a", 1, b"x" * 400, cas=1)
        batch.set(0, b"a", 2, b"x" * 400, cas=1)  # replaces seqno 1: its bytes are released
        with pytest.raises(ValueError, match="STORAGE_BATCH_BYTES_MAX"):
            batch.set(0, b"b", 3, b"x" * 600, cas=1)
        batch.set(0, b"b", 3, b"x" * 400, cas=1)
    assert [r.seqno for r in store.scan(0, 0, ALL)] == [2, 3]


def test_corrupt_record_is_reported_with_vb_and_seqno(tmp_path: Path) -> None:
    with Store(tmp_path / "s", durable=False) as store:
        with store.write_batch() as batch:
            batch.set_vbucket_meta(2, state="active")
            batch.set(2, b"a", 1, b"v", cas=1)
            batch.set(2, b"b", 2, b"v", cas=1)
        with store._env.begin(write=True) as txn:
            txn.put(SEQNO_KEY.pack(2, 2), b"\x99garbage", db=store._by_seqno)
        assert store.get(2, b"a") is not None
        with pytest.raises(CorruptRecordError, match="vb 2 seqno 2") as caught:
            store.get(2, b"b")
        assert (caught.value.vb, caught.value.seqno) == (2, 2)
        scan = store.scan(2, 0, ALL)
        assert next(scan).seqno == 1
        with pytest.raises(CorruptRecordError, match="vb 2 seqno 2"):
            next(scan)
        with pytest.raises(CorruptRecordError, match="vb 2 seqno 2"):
            store.rollback(2, 1)
        with store._env.begin(write=True) as txn:  # by_key now points at a missing record
            txn.delete(SEQNO_KEY.pack(2, 2), db=store._by_seqno)
        with pytest.raises(CorruptRecordError, match="no record"):
            store.get(2, b"b")
        with (
            pytest.raises(CorruptRecordError, match="missing record"),
            store.write_batch() as batch,
        ):
            batch.set(2, b"b", 3, b"v", cas=1)
        assert store.high_seqno(2) == 2  # the failed batch left nothing behind


def test_index_disagreement_is_reported_by_compaction(tmp_path: Path) -> None:
    with Store(tmp_path / "s", durable=False) as store:
        with store.write_batch() as batch:
            batch.set_vbucket_meta(1, state="active")
            batch.delete(1, b"a", 1, cas=1)
        with store._env.begin(write=True) as txn:
            txn.delete(VB_KEY.pack(1) + b"a", db=store._by_key)
        with pytest.raises(CorruptRecordError, match="vb 1 seqno 1: record has no by_key entry"):
            store.compact(tombstone_age_s=0, now=1)
        assert store.purge_seqno(1) == 0


def test_corrupt_metadata_fails_open(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Store(path, durable=False) as store:
        with store.write_batch() as batch:
            batch.set_vbucket_meta(6, state="active")
        with store._env.begin(write=True) as txn:
            txn.put(VB_KEY.pack(6), b'{"v": 1}', db=store._vbmeta)
    for _ in range(2):  # the failed open closed the environment: the second fails the same way
        with pytest.raises(CorruptRecordError, match="vb 6"):
            Store(path, durable=False)


# --- model-based: the store against a dict model ------------------------------------------------

VBS = (0, 1, 2)
KEYS = (b"a", b"b", b"c", b"d", b"e", b"f")
STATES = ("active", "replica", "pending", "dead")

vb_ids = st.sampled_from(VBS)
key_names = st.sampled_from(KEYS)
gaps = st.integers(1, 3)
set_ops = st.tuples(
    st.just("set"), vb_ids, key_names, gaps, st.binary(max_size=20), st.integers(0, 2**64 - 1),
    st.integers(0, 2**32 - 1), st.integers(0, 7),
)  # fmt: skip
delete_ops = st.tuples(
    st.just("delete"), vb_ids, key_names, gaps, st.binary(max_size=4), st.integers(0, 99),
    st.booleans(), st.integers(1, 9),
)  # fmt: skip
put_ops = st.tuples(st.just("put"), vb_ids, key_names, gaps, st.binary(max_size=20))
meta_ops = st.tuples(
    st.just("meta"), vb_ids, st.none() | st.sampled_from(STATES),
    st.none() | st.lists(st.tuples(st.integers(1, 2**48), st.integers(0, 99)), max_size=3),
    st.none() | st.tuples(st.integers(0, 50), st.integers(0, 50)),
)  # fmt: skip
stale_ops = st.tuples(st.just("stale"), vb_ids, key_names, st.integers(0, 2))
batch_ops = st.lists(
    st.one_of(set_ops, set_ops, delete_ops, put_ops, meta_ops, stale_ops), max_size=12
)


@dataclasses.dataclass
class ModelVb:
    state: str = "active"
    failover_log: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    high_seqno: int = 0
    purge_seqno: int = 0
    snap_start: int = 0
    snap_end: int = 0
    records: dict[bytes, Record] = dataclasses.field(default_factory=dict)

    def meta(self) -> VBucketMeta:
        return VBucketMeta(
            self.state, list(self.failover_log), self.high_seqno, self.purge_seqno,
            self.snap_start, self.snap_end,
        )  # fmt: skip

    def write(self, record: Record) -> None:
        assert record.seqno > self.high_seqno
        self.records[record.key] = record
        self.high_seqno = record.seqno


class StoreMachine(RuleBasedStateMachine):
    """Random batches, compactions, rollbacks and reopens; the store must equal the model."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.TemporaryDirectory()
        self.path = Path(self.directory.name) / "s"
        self.store = Store(self.path, durable=False)
        self.model: dict[int, ModelVb] = {}
        with self.store.write_batch() as batch:
            for vb in VBS[:2]:  # vb 2 is created by a "meta" op, if ever
                batch.set_vbucket_meta(vb, state="active", failover_log=[(100 + vb, 0)])
                self.model[vb] = ModelVb(failover_log=[(100 + vb, 0)])

    @rule(ops=batch_ops, abort=st.integers(0, 5))
    def write_batch(self, ops: list[tuple[Any, ...]], abort: int) -> None:
        working = {
            vb: dataclasses.replace(m, failover_log=list(m.failover_log), records=dict(m.records))
            for vb, m in self.model.items()
        }
        try:
            with self.store.write_batch() as batch:
                for op in ops:
                    self.apply_op(batch, working, op)
                if abort == 0:
                    raise InterruptedError("abort this batch")
        except InterruptedError:
            return
        self.model = working

    def apply_op(self, batch: WriteBatch, working: dict[int, ModelVb], op: tuple[Any, ...]) -> None:
        kind, vb = op[0], op[1]
        vbm = working.get(vb)
        if kind == "meta":
            self.apply_meta(batch, working, op)
        elif vbm is None:
            with pytest.raises(ValueError, match="no metadata"):
                batch.set(vb, b"k", 1, b"v", cas=1)
        elif kind == "stale":
            with pytest.raises(ValueError, match="above the high seqno"):
                batch.set(vb, op[2], vbm.high_seqno - op[3], b"v", cas=1)
        else:
            vbm.write(self.apply_item(batch, vbm.high_seqno + op[3], op))

    @staticmethod
    def apply_meta(batch: WriteBatch, working: dict[int, ModelVb], op: tuple[Any, ...]) -> None:
        _, vb, state, log, snap = op
        arguments = {"state": state, "failover_log": log}
        if snap is not None:
            arguments.update(snap_start=snap[0], snap_end=snap[1])
        vbm = working.get(vb)
        if (vbm is None and state is None) or (snap is not None and snap[0] > snap[1]):
            with pytest.raises(ValueError):
                batch.set_vbucket_meta(vb, **arguments)
            return
        batch.set_vbucket_meta(vb, **arguments)
        vbm = working.setdefault(vb, ModelVb(state=state))
        vbm.state = state or vbm.state
        vbm.failover_log = vbm.failover_log if log is None else log
        if snap is not None:
            vbm.snap_start, vbm.snap_end = snap

    @staticmethod
    def apply_item(batch: WriteBatch, seqno: int, op: tuple[Any, ...]) -> Record:
        """Write one set/delete/put op at `seqno`; return the record the model expects."""
        kind, vb, key = op[:3]
        if kind == "set":
            _, _, _, _, value, cas, flags, datatype = op
            fields = {"flags": flags, "expiry": flags // 2, "datatype": datatype}
            batch.set(vb, key, seqno, value, cas=cas, rev_seqno=seqno, **fields)
            return Record.create(
                vb, seqno, key, Op.MUTATION, cas=cas, value=value, rev_seqno=seqno, **fields
            )
        if kind == "delete":
            _, _, _, _, value, delete_time, expiration, cas = op
            batch.delete(
                vb, key, seqno, cas=cas, delete_time=delete_time, expiration=expiration,
                value=value, rev_seqno=7,
            )  # fmt: skip
            record_op = Op.EXPIRATION if expiration else Op.DELETION
            return Record.create(
                vb, seqno, key, record_op, cas=cas, value=value, delete_time=delete_time,
                rev_seqno=7,
            )  # fmt: skip
        record = Record.create(vb, seqno, key, Op.MUTATION, cas=seqno, value=op[4])
        batch.put_record(record)
        return record

    @rule(now=st.integers(0, 150), age=st.integers(0, 60), chosen=st.none() | st.sets(vb_ids))
    def compact(self, now: int, age: int, chosen: set[int] | None) -> None:
        if chosen is not None and not chosen <= set(self.model):
            with pytest.raises(ValueError, match="no metadata"):
                self.store.compact(tombstone_age_s=age, now=now, vbuckets=chosen)
            return
        expected = {}
        for vb in sorted(self.model if chosen is None else chosen):
            vbm = self.model[vb]
            purged = [r for r in vbm.records.values() if r.deleted and r.delete_time <= now - age]
            for record in purged:
                del vbm.records[record.key]
            vbm.purge_seqno = max([vbm.purge_seqno] + [r.seqno for r in purged])
            expected[vb] = vbm.purge_seqno
        assert self.store.compact(tombstone_age_s=age, now=now, vbuckets=chosen) == expected

    @rule(vb=vb_ids, back=st.integers(-2, 8))
    def rollback(self, vb: int, back: int) -> None:
        vbm = self.model.get(vb)
        if vbm is None:
            with pytest.raises(ValueError, match="no metadata"):
                self.store.rollback(vb, 0)
            return
        seqno = max(0, vbm.high_seqno - back)
        point = self.store.rollback(vb, seqno)
        # The model's rule: a discarded record with older versions cannot be undone exactly.
        if any(r.seqno > seqno and r.rev_seqno > 1 for r in vbm.records.values()):
            assert point == 0, (point, seqno)
            seqno = 0
        else:
            assert point == seqno, (point, seqno)
        if seqno < vbm.high_seqno:
            vbm.records = {k: r for k, r in vbm.records.items() if r.seqno <= seqno}
            vbm.high_seqno = vbm.snap_start = vbm.snap_end = seqno
            vbm.purge_seqno = min(vbm.purge_seqno, seqno)

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = Store(self.path, durable=False)
        assert self.store.was_clean_shutdown

    @rule(vb=vb_ids, start=st.integers(0, 60), length=st.integers(-1, 30))
    def scan_range(self, vb: int, start: int, length: int) -> None:
        end = max(start + length, 0)
        records = self.model[vb].records.values() if vb in self.model else []
        expected = sorted((r for r in records if start <= r.seqno <= end), key=lambda r: r.seqno)
        assert list(self.store.scan(vb, start, end)) == expected

    @invariant()
    def store_equals_model(self) -> None:
        assert self.store.vbuckets() == sorted(self.model)
        for vb in VBS:
            vbm = self.model.get(vb)
            if vbm is None:
                assert self.store.vbucket_meta(vb) is None
                continue
            assert self.store.vbucket_meta(vb) == vbm.meta()
            assert self.store.high_seqno(vb) == vbm.high_seqno
            assert self.store.purge_seqno(vb) == vbm.purge_seqno
            assert self.store.item_count(vb) == sum(not r.deleted for r in vbm.records.values())
            for key in KEYS:
                assert self.store.get(vb, key) == vbm.records.get(key)
            in_order = sorted(vbm.records.values(), key=lambda r: r.seqno)
            assert list(self.store.scan(vb, 0, ALL)) == in_order
            middle = vbm.high_seqno // 2
            assert list(self.store.scan(vb, middle, vbm.high_seqno)) == [
                r for r in in_order if r.seqno >= middle
            ]
        self.store._check_invariants()

    def teardown(self) -> None:
        self.store.close()
        self.directory.cleanup()


StoreMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase


def test_one_store_per_environment_per_process(store: Store) -> None:
    with pytest.raises(StorageError, match="already open"):
        Store(Path(store._env.path()), durable=False)
