"""`Store.key_range_seqnos` over `keys.collection_key_ranges`: one collection's keys (named,
default, escaped default with a 0xff first byte, multi-byte LEB128 ids whose bytes neighbour
other ids) and exactly their newest seqnos, tombstones included, in every vbucket — checked
against a dictionary model for random contents (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.storage import Store
from changefeed.storage.keys import collection_key_ranges, collection_of, stored_key

# Ids whose LEB128 forms sit next to each other in byte order: 0x7f | 0x80 (80 01) | 0xff
# (ff 01) | 0x100 (80 02) | 0x148 (c8 02) | 200 (c8 01), and 1 (the system collection).
COLLECTIONS = (0, 1, 8, 9, 0x7F, 0x80, 0xFF, 0x100, 200, 0x148, 2**21 + 5)
KEYS = st.binary(min_size=1, max_size=6)
WRITES = st.lists(
    st.tuples(st.integers(0, 2), st.sampled_from(COLLECTIONS), KEYS, st.booleans()),
    min_size=1,
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(writes=WRITES)
def test_a_collections_key_ranges_hold_exactly_its_keys(
    tmp_path_factory: pytest.TempPathFactory, writes: list[tuple[int, int, bytes, bool]]
) -> None:
    directory = tmp_path_factory.mktemp("ranges")
    model: dict[tuple[int, bytes], int] = {}  # (vb, stored key) -> newest seqno
    with Store(directory / "s", durable=False) as store:
        with store.write_batch() as batch:
            for vb in range(3):
                batch.set_vbucket_meta(vb, state="active")
        seqnos = dict.fromkeys(range(3), 0)
        with store.write_batch() as batch:
            for vb, cid, key, deleted in writes:
                seqnos[vb] += 1
                stored = stored_key(cid, key)
                if deleted:
                    batch.delete(vb, stored, seqnos[vb], cas=seqnos[vb], delete_time=1)
                else:
                    batch.set(vb, stored, seqnos[vb], b"v", cas=seqnos[vb])
                model[vb, stored] = seqnos[vb]
        for vb in range(3):
            for cid in COLLECTIONS:
                got: list[int] = []
                for first, end in collection_key_ranges(cid):
                    got += store.key_range_seqnos(vb, first, end)
                expected = sorted(
                    s for (v, k), s in model.items() if v == vb and collection_of(k) == cid
                )
                assert sorted(got) == expected, (vb, cid)


def test_ranges_are_disjoint_and_ordered() -> None:
    spans = [span for cid in COLLECTIONS for span in collection_key_ranges(cid)]
    spans.sort()
    for (_, end), (first, _) in itertools.pairwise(spans):
        assert end is not None and end <= first, spans
