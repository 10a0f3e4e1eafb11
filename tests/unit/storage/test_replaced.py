"""drop_replaced (the older versions a batch replaces, deleted as C-level passes) against the
per-entry loop it replaced: the same records left in by_seqno, the same per-vbucket count of
replaced mutations, and the same refusal, naming the same vbucket and seqno, for an entry that
is malformed or points at a missing record — wherever in the batch it sits (the
transaction then aborts, so what it held at the refusal is not compared)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import lmdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.storage.errors import CorruptRecordError
from changefeed.storage.keys import BY_KEY_VALUE, SEQNO_KEY, VB_KEY, decode_by_key_value
from changefeed.storage.record import Op
from changefeed.storage.replaced import drop_replaced

# (vb, op) of each committed version, its seqno its place in its vbucket; keys distinct.
versions = st.lists(
    st.tuples(st.integers(0, 3), st.sampled_from([Op.MUTATION, Op.DELETION, Op.EXPIRATION])),
    min_size=1,
    max_size=40,
)


def open_env() -> Iterator[tuple[lmdb.Environment, lmdb._Database, lmdb._Database]]:
    with tempfile.TemporaryDirectory() as directory:
        env = lmdb.open(directory, map_size=1 << 24, max_dbs=2, sync=False, metasync=False)
        try:
            yield env, env.open_db(b"by_seqno"), env.open_db(b"by_key")
        finally:
            env.close()


def committed(spec: list[tuple[int, Op]]) -> list[tuple[bytes, bytes]]:
    """The by_key entries (key, value) of the versions in `spec`."""
    seqnos = dict.fromkeys(range(4), 0)
    entries = []
    for n, (vb, op) in enumerate(spec):
        seqnos[vb] += 1 + n % 3  # gaps, as after deduplication
        entries.append((VB_KEY.pack(vb) + b"key-%d" % n, BY_KEY_VALUE.pack(seqnos[vb], op)))
    return entries


def model(txn: lmdb.Transaction, by_seqno: lmdb._Database, found: list[tuple[bytes, bytes]]):
    """The loop drop_replaced replaced (batch.py before it)."""
    replaced: dict[int, int] = {}
    for key, old in found:
        vb = VB_KEY.unpack_from(key)[0]
        old_seqno, old_op = decode_by_key_value(vb, old)
        if not txn.delete(SEQNO_KEY.pack(vb, old_seqno), db=by_seqno):
            raise CorruptRecordError(vb, old_seqno, "by_key points at a missing record")
        if old_op == Op.MUTATION:
            replaced[vb] = replaced.get(vb, 0) + 1
    return replaced


def outcome(
    drop: object, entries: list[tuple[bytes, bytes]], found: list[tuple[bytes, bytes]]
) -> tuple[object, list[tuple[bytes, bytes]]]:
    """What `drop` answers (or raises) and what by_seqno holds after it, on a fresh env
    holding a record (seqno key -> b"r") for each of `entries`."""
    for env, by_seqno, _ in open_env():
        with env.begin(write=True) as txn:
            for key, value in entries:
                old = SEQNO_KEY.pack(VB_KEY.unpack_from(key)[0], BY_KEY_VALUE.unpack(value)[0])
                txn.put(old, b"r", db=by_seqno)
        with env.begin(write=True) as txn:
            try:
                answer: object = drop(txn, by_seqno, found)  # type: ignore[operator]
            except CorruptRecordError as error:
                answer = (type(error), error.vb, error.seqno, error.reason)
            left = list(txn.cursor(db=by_seqno))
        return answer, left
    raise AssertionError("unreachable")


# Up to two damaged entries (a review found several named otherwise than the loop does).
damage = st.lists(
    st.tuples(st.sampled_from(["short", "long", "missing"]), st.integers(0, 99)), max_size=2
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(versions, damage)
def test_drop_replaced_matches_the_loop(
    spec: list[tuple[int, Op]], bads: list[tuple[str, int]]
) -> None:
    entries = committed(spec)
    found = list(entries)
    held = list(entries)  # the records by_seqno holds
    for bad, at in bads:
        at %= len(found)
        key, value = found[at]
        if bad == "short":
            found[at] = (key, value[:8])
        elif bad == "long":
            found[at] = (key, value + b"\x00")
        elif entries[at] in held:
            held.remove(entries[at])
    ours = outcome(drop_replaced, held, found)
    theirs = outcome(model, held, found)
    if not bads:
        assert ours == theirs
        assert ours[1] == [], ours  # every record replaced
        mutations = sum(op == Op.MUTATION for _, op in spec)
        assert sum(ours[0].values()) == mutations, (ours, spec)  # type: ignore[union-attr]
    elif isinstance(theirs[0], tuple):  # the same refusal; the aborted transaction's state
        assert ours[0] == theirs[0]  # does not matter
        assert ours[0][0] is CorruptRecordError, ours
    else:  # two damages that cancel out (a value cut short, then lengthened to 9 bytes)
        assert ours == theirs


def test_a_missing_record_is_named_by_vb_and_seqno() -> None:
    entries = committed([(1, Op.MUTATION), (2, Op.MUTATION), (2, Op.DELETION)])
    answer, _ = outcome(drop_replaced, entries[:1] + entries[2:], entries)
    seqno = BY_KEY_VALUE.unpack(entries[1][1])[0]
    assert answer == (CorruptRecordError, 2, seqno, "by_key points at a missing record")


def test_a_malformed_entry_is_named_by_vb() -> None:
    entries = committed([(3, Op.MUTATION), (1, Op.MUTATION)])
    found = [entries[0], (entries[1][0], b"\x00" * 5)]
    answer, _ = outcome(drop_replaced, entries, found)
    assert answer == (CorruptRecordError, 1, None, "by_key value has 5 bytes, expected 9")


@pytest.mark.parametrize("count", [0, 1])
def test_counts_only_vbuckets_with_replaced_mutations(count: int) -> None:
    spec = [(0, Op.DELETION)] + [(3, Op.MUTATION)] * count
    answer, left = outcome(drop_replaced, committed(spec), committed(spec))
    assert answer == ({3: 1} if count else {})
    assert left == []
