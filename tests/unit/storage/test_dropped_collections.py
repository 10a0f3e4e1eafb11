"""Compaction purges a dropped collection's records (documents and tombstones) lazily, chunk by
chunk, without raising the purge seqno; other collections' records and tombstones not yet due
stay; the item count follows. Checked against a model for random contents and chunk sizes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from changefeed.storage import Store
from changefeed.storage.keys import collection_of, stored_key

DROPPED = 9


@pytest.mark.parametrize("seed", range(6))
def test_dropped_collection_records_go_and_the_rest_stays(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    records_max = rng.choice([1, 3, 16, 1024])
    with Store(tmp_path / "s", durable=False) as store:
        with store.write_batch() as batch:
            batch.set_vbucket_meta(0, state="active")
        model: dict[bytes, bool] = {}  # stored key -> live
        with store.write_batch() as batch:
            for seqno in range(1, 80):
                cid = rng.choice([0, 8, DROPPED])
                key = stored_key(cid, b"k%02d" % rng.randrange(30))
                if rng.random() < 0.3:
                    batch.delete(0, key, seqno, cas=seqno, delete_time=1_000)  # not due
                    model[key] = False
                else:
                    batch.set(0, key, seqno, b"v", cas=seqno)
                    model[key] = True
        start: int | None = 0
        while start is not None:  # bounded: each chunk moves on
            chunk = store.compact_chunk(
                0, delete_time_max=10, start_seqno=start, records_max=records_max,
                dropped=lambda cid: cid == DROPPED,
            )  # fmt: skip
            assert chunk.purged == 0  # no tombstone was due
            start = chunk.next_seqno
        store._check_invariants()
        kept = {k: live for k, live in model.items() if collection_of(k) != DROPPED}
        stored = {r.key: not r.deleted for r in store.scan(0, 0, 1000)}
        assert stored == kept
        assert store.item_count(0) == sum(kept.values())
        assert store.purge_seqno(0) == 0  # consumers learn of the drop from its event
