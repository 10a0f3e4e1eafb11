"""`Store.scan_keyed_bodies` against `scan_bodies`: for random contents (several collections,
tombstones, keys written again), ranges and run sizes, the keyed scan hands out exactly the
full scan's records whose keys are in the ranges, plus the range's last record, in seqno order
and byte for byte; `next_record` agrees (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.storage import Store
from changefeed.storage.keys import collection_key_ranges, collection_of, stored_key
from changefeed.storage.record import stored_seqno

COLLECTIONS = (0, 1, 8, 9, 0x80, 300)
WRITES = st.lists(
    st.tuples(st.sampled_from(COLLECTIONS), st.integers(0, 9), st.booleans()),
    min_size=1,
    max_size=50,
)


@settings(max_examples=50, deadline=None)
@given(
    writes=WRITES,
    wanted=st.frozensets(st.sampled_from(COLLECTIONS[1:]), min_size=1),
    bounds=st.tuples(st.integers(1, 60), st.integers(1, 60)),
    records_max=st.integers(1, 7),
    bytes_max=st.integers(1, 400),
)
def test_keyed_scan_is_the_full_scan_filtered(
    tmp_path_factory: pytest.TempPathFactory,
    writes: list[tuple[int, int, bool]],
    wanted: frozenset[int],
    bounds: tuple[int, int],
    records_max: int,
    bytes_max: int,
) -> None:
    start, end = min(bounds), max(bounds)
    ranges = [span for cid in sorted(wanted) for span in collection_key_ranges(cid)]
    with Store(tmp_path_factory.mktemp("keyed") / "s", durable=False) as store:
        with store.write_batch() as batch:
            batch.set_vbucket_meta(1, state="active")
        with store.write_batch() as batch:
            for seqno, (cid, n, deleted) in enumerate(writes, start=1):
                key = stored_key(cid, b"k%d" % n)
                if deleted:
                    batch.delete(1, key, seqno, cas=seqno, delete_time=1)
                else:
                    batch.set(1, key, seqno, b"v%d" % seqno, cas=seqno)
        full = list(store.scan(1, start, end))
        expected = [r for r in full if collection_of(r.key) in wanted]
        if full and full[-1] not in expected:
            expected.append(full[-1])  # the range's last record, whatever its key
        bodies = {r.seqno: r for r in full}
        scan = store.scan_keyed_bodies(1, start, end, ranges)
        got: list[bytes] = []
        while not scan.done:  # bounded: every read hands out at least one record or ends
            run = scan.read(records_max, bytes_max)
            assert len(run) <= records_max
            got += run
        assert [stored_seqno(r) for r in got] == [r.seqno for r in expected]
        stored = {stored_seqno(b): b for b in store.scan_bodies(1, start, end).read(999, 10**9)}
        assert got == [stored[r.seqno] for r in expected]  # byte for byte
        one_by_one = store.scan_keyed_bodies(1, start, end, ranges)
        decoded = []
        while (record := one_by_one.next_record()) is not None:  # bounded by the range
            decoded.append(record)
        assert decoded == [bodies[r.seqno] for r in expected]
        store._check_invariants()
