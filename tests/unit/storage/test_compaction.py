"""compaction: purge and truncation stay inside one vbucket and keep both indexes in step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed import limits
from changefeed.storage import CorruptRecordError, Store
from changefeed.storage.compaction import discard_after, purge_tombstones
from changefeed.storage.keys import BY_KEY_VALUE, VB_KEY


@pytest.fixture
def filled(tmp_path: Path) -> Iterator[Store]:
    """vbs 4, 5 (the same keys, adjacent key ranges), 6: mutations and tombstones mixed."""
    with Store(tmp_path / "s", durable=False) as store:
        with store.write_batch() as batch:
            for vb in (4, 5, 6):
                batch.set_vbucket_meta(vb, state="replica")
                batch.set(vb, b"m1", 1, b"v", cas=1)
                batch.delete(vb, b"t2", 2, cas=1, delete_time=20)
                batch.set(vb, b"m3", 3, b"v", cas=1)
                batch.delete(vb, b"t4", 4, cas=1, delete_time=40, expiration=True)
                batch.delete(vb, b"t5", 5, cas=1, delete_time=50)
        yield store


def test_purge_removes_old_tombstones_of_one_vb(filled: Store) -> None:
    with filled._env.begin(write=True) as txn:
        assert purge_tombstones(txn, filled._by_seqno, filled._by_key, 5, 40) == (4, 2)
        assert purge_tombstones(txn, filled._by_seqno, filled._by_key, 5, 40) == (0, 0)
        assert purge_tombstones(txn, filled._by_seqno, filled._by_key, 7, 1e9) == (0, 0)
        txn.abort()
    assert filled.compact(tombstone_age_s=0, now=40, vbuckets=[5]) == {5: 4}
    assert [r.seqno for r in filled.scan(5, 0, 99)] == [1, 3, 5]
    assert [r.seqno for r in filled.scan(4, 0, 99)] == [1, 2, 3, 4, 5]
    assert [r.seqno for r in filled.scan(6, 0, 99)] == [1, 2, 3, 4, 5]
    filled._check_invariants()


def test_discard_after_truncates_one_vb(filled: Store) -> None:
    with filled._env.begin(write=True) as txn:
        assert discard_after(txn, filled._by_seqno, filled._by_key, 5, 2) == (3, 1)
        assert discard_after(txn, filled._by_seqno, filled._by_key, 5, 2) == (0, 0)
        assert discard_after(txn, filled._by_seqno, filled._by_key, 6, limits.SEQNO_MAX) == (0, 0)
        txn.abort()
    filled.rollback(5, 2)
    assert [r.seqno for r in filled.scan(5, 0, 99)] == [1, 2]
    assert [r.seqno for r in filled.scan(4, 0, 99)] == [1, 2, 3, 4, 5]
    assert [r.seqno for r in filled.scan(6, 0, 99)] == [1, 2, 3, 4, 5]
    assert (filled.item_count(5), filled.item_count(4)) == (1, 2)
    filled._check_invariants()


def test_a_by_key_entry_that_disagrees_is_corruption(filled: Store) -> None:
    with filled._env.begin(write=True) as txn:
        txn.put(VB_KEY.pack(6) + b"t4", BY_KEY_VALUE.pack(4, 1), db=filled._by_key)  # wrong op
    with pytest.raises(CorruptRecordError, match="vb 6 seqno 4: by_key entry says seqno 4 op 1"):
        filled.compact(tombstone_age_s=0, now=100, vbuckets=[6])
    with pytest.raises(CorruptRecordError, match="vb 6 seqno 4"):
        filled.rollback(6, 0)
    assert [r.seqno for r in filled.scan(6, 0, 99)] == [1, 2, 3, 4, 5]  # nothing half-done
    assert filled.purge_seqno(6) == 0
