"""Store.get_many_across (records of many keys, read with one by_seqno lookup: lookup.py)
against Store.get one key at a time: the same record (every field) or None for every key,
after writes, overwrites and deletions over several vbuckets; and the same refusal, naming the
same vbucket and seqno, for an index entry that is malformed, points at a missing record, or
points at another key's record — wherever among the hits it sits."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed import limits
from changefeed.storage import Store
from changefeed.storage.errors import CorruptRecordError
from changefeed.storage.keys import BY_KEY_VALUE, SEQNO_KEY, VB_KEY

KEYS = [b"k%d" % n for n in range(8)]
writes = st.lists(
    st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from(KEYS), st.booleans()), min_size=1, max_size=8
    ),
    max_size=4,
)
EXTRA = [b"", b"x" * (limits.STORED_KEY_SIZE_MAX + 1), b"never"]  # unstorable or never written


def written(path: Path, batches: list[list[tuple[int, bytes, bool]]]) -> Store:
    store = Store(path, durable=False)
    with store.write_batch() as batch:
        for vb in range(3):
            batch.set_vbucket_meta(vb, state="active")
    seqnos = dict.fromkeys(range(3), 0)
    for changes in batches:
        with store.write_batch() as batch:
            for vb, key, delete in changes:
                seqnos[vb] += 1
                seqno = seqnos[vb]
                if delete:
                    batch.delete(vb, key, seqno, cas=seqno, delete_time=seqno)
                else:
                    batch.set(vb, key, seqno, b"v%d" % seqno, cas=seqno, flags=seqno, expiry=7)
    return store


def one_by_one(store: Store, wanted: dict[int, list[bytes]]) -> object:
    try:
        return {vb: {key: store.get(vb, key) for key in keys} for vb, keys in wanted.items()}
    except CorruptRecordError as error:
        return (error.vb, error.seqno, error.reason)


def at_once(store: Store, wanted: dict[int, list[bytes]]) -> object:
    try:
        return store.get_many_across(wanted)
    except CorruptRecordError as error:
        return (error.vb, error.seqno, error.reason)


# Up to two damaged entries (a review found several named otherwise than one at a time).
damage = st.lists(
    st.tuples(st.sampled_from(["short", "missing", "other", "op"]), st.integers(0, 99)),
    max_size=2,
)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(writes, damage)
def test_get_many_across_answers_what_get_answers(
    tmp_path_factory: pytest.TempPathFactory,
    batches: list[list[tuple[int, bytes, bool]]],
    bads: list[tuple[str, int]],
) -> None:
    with written(tmp_path_factory.mktemp("s"), batches) as store:
        wanted = {vb: [*KEYS, *EXTRA] for vb in range(3)}
        with store._env.begin() as txn:
            entries = list(txn.cursor(db=store._by_key))
        for bad, at in bads if entries else ():
            key, value = entries[at % len(entries)]
            vb = VB_KEY.unpack_from(key)[0]
            seqno = BY_KEY_VALUE.unpack(value)[0]
            with store._env.begin(write=True) as txn:
                if bad == "short":
                    txn.put(key, value[:5], db=store._by_key)
                elif bad == "missing":
                    txn.delete(SEQNO_KEY.pack(vb, seqno), db=store._by_seqno)
                elif bad == "op":  # the entry's op disagrees with its record's
                    txn.put(key, value[:8] + bytes([3 - value[8] % 3]), db=store._by_key)
                else:  # points at another key's record of its vbucket, if there is one
                    others = [v for k, v in entries if k != key and k[:2] == key[:2]]
                    if others:
                        txn.put(key, others[0], db=store._by_key)
        assert at_once(store, wanted) == one_by_one(store, wanted)
        store.close(clean=False)


def test_a_missing_record_among_hits_is_named(tmp_path: Path) -> None:
    with written(tmp_path / "s", [[(1, b"a", False), (1, b"b", False), (2, b"c", False)]]) as s:
        with s._env.begin(write=True) as txn:
            txn.delete(SEQNO_KEY.pack(1, 2), db=s._by_seqno)
        with pytest.raises(CorruptRecordError, match=r"vb 1 seqno 2: .*b'b' has no record"):
            s.get_many_across({1: [b"a", b"b"], 2: [b"c"]})
        s.close(clean=False)
