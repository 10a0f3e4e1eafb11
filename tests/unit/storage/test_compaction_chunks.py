"""Chunked compaction: a purge split into bounded transactions equals the whole purge, and each
chunk's purge seqno is durable with the purge itself."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from changefeed import limits
from changefeed.storage import Store
from changefeed.storage.compaction import PurgeChunk, purge_tombstones_chunk


def summary(chunk: PurgeChunk) -> tuple[int, int, int, int | None]:
    return chunk.purged, chunk.seqno_purged_max, chunk.visited, chunk.next_seqno


def fill(store: Store, vb: int, ops: list[tuple[bytes, bool, int]]) -> None:
    """Write (key, deleted, delete_time) at seqnos 1, 2, ... in one batch."""
    with store.write_batch() as batch:
        for seqno, (key, deleted, delete_time) in enumerate(ops, start=1):
            if deleted:
                batch.delete(vb, key, seqno, cas=seqno, delete_time=delete_time)
            else:
                batch.set(vb, key, seqno, b"v" * (seqno % 7), cas=seqno)


def compact_in_chunks(
    store: Store, vb: int, delete_time_max: float, records_max: int, seqno_max: int
) -> tuple[int, int, int]:
    """(purged, visited, chunks) of a whole chunked compaction."""
    start = 0
    purged = visited = chunks = 0
    while True:  # bounded: every chunk moves on or ends
        chunk = store.compact_chunk(
            vb,
            delete_time_max=delete_time_max,
            start_seqno=start,
            seqno_max=seqno_max,
            records_max=records_max,
        )
        chunks += 1
        purged += chunk.purged
        visited += chunk.visited
        assert chunk.visited <= records_max
        assert chunk.purged <= chunk.visited
        store._check_invariants()
        if chunk.next_seqno is None:
            return purged, visited, chunks
        assert chunk.next_seqno > start
        start = chunk.next_seqno


@pytest.mark.parametrize("records_max", [1, 2, 3, 7, 64])
def test_chunks_purge_what_one_pass_purges(tmp_path: Path, records_max: int) -> None:
    rng = random.Random(records_max)
    ops = [(b"k%03d" % i, rng.random() < 0.5, rng.randrange(100)) for i in range(60)]
    with (
        Store(tmp_path / "whole", durable=False) as whole,
        Store(tmp_path / "chunked", durable=False) as chunked,
    ):
        for store in (whole, chunked):
            with store.write_batch() as batch:
                batch.set_vbucket_meta(3, state="active")
            fill(store, 3, ops)
        assert whole.compact(tombstone_age_s=0, now=50, vbuckets=[3])
        purged, visited, chunks = compact_in_chunks(chunked, 3, 50, records_max, 10**6)
        assert visited == 60
        assert chunks == -(-60 // records_max)  # the last chunk sees the end: no empty one
        expected = sum(deleted and time <= 50 for _, deleted, time in ops)
        assert purged == expected
        assert chunked.purge_seqno(3) == whole.purge_seqno(3)
        assert list(chunked.scan(3, 0, 99)) == list(whole.scan(3, 0, 99))
        assert chunked.item_count(3) == whole.item_count(3)


def test_seqno_max_bounds_the_purge(store: Store) -> None:
    fill(store, 1, [(b"a", True, 1), (b"b", False, 0), (b"c", True, 1), (b"d", True, 1)])
    chunk = store.compact_chunk(1, delete_time_max=10, seqno_max=3)
    assert summary(chunk) == (2, 3, 3, None)
    assert store.purge_seqno(1) == 3
    assert [r.seqno for r in store.scan(1, 0, 9)] == [2, 4]  # 4 is above seqno_max
    # Nothing to purge: the purge seqno stays, and nothing is written.
    chunk = store.compact_chunk(1, delete_time_max=0, start_seqno=0)
    assert (chunk.purged, chunk.seqno_purged_max, store.purge_seqno(1)) == (0, 0, 3)


def test_a_chunks_purge_seqno_survives_reopening(tmp_path: Path) -> None:
    with Store(tmp_path / "s", durable=False) as store:
        with store.write_batch() as batch:
            batch.set_vbucket_meta(0, state="active")
        fill(store, 0, [(b"a", True, 1), (b"b", True, 1), (b"c", True, 1)])
        chunk = store.compact_chunk(0, delete_time_max=5, records_max=2)
        assert (chunk.purged, chunk.next_seqno, store.purge_seqno(0)) == (2, 3, 2)
    with Store(tmp_path / "s", durable=False) as reopened:  # the first chunk is on disk
        assert reopened.purge_seqno(0) == 2
        assert [r.seqno for r in reopened.scan(0, 0, 9)] == [3]
        reopened._check_invariants()


def test_bad_arguments_are_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="no metadata"):
        store.compact_chunk(9, delete_time_max=0)
    with pytest.raises(ValueError, match="records_max"):
        store.compact_chunk(0, delete_time_max=0, records_max=0)
    with pytest.raises(ValueError, match="SEQNO_MAX"):
        store.compact_chunk(0, delete_time_max=0, start_seqno=limits.SEQNO_MAX + 1)
    with store.write_batch(), pytest.raises(RuntimeError, match="inside a write batch"):
        store.compact_chunk(0, delete_time_max=0)


def test_the_unbounded_chunk_is_the_whole_purge(store: Store) -> None:
    fill(store, 2, [(b"a", True, 1), (b"b", False, 0), (b"c", True, 9)])
    with store._env.begin(write=True) as txn:
        chunk = purge_tombstones_chunk(txn, store._by_seqno, store._by_key, 2, 5)
        assert summary(chunk) == (1, 1, 3, None)
        txn.abort()
