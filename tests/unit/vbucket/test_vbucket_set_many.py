"""``VBucket.set_many`` (a received batch of SETs, queued as one run) against ``set`` one write
at a time on a twin vbucket with the same clock: the same answers, the same items in memory
(every field and the body) and the same store after a flush — through repeated keys, keys
found expired, locked keys, pending durable writes, bad fields and memory running out."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed import limits
from changefeed.checkpoint import Item, MemoryBudget, item_size_bytes
from changefeed.protocol.errors import StatusError
from changefeed.protocol.kv import MutationResult
from changefeed.storage import Op, Store
from changefeed.vbucket import VBucket, VBucketState
from changefeed.vbucket.active import ActiveRole

from .twins import assert_flushed_alike

VB = 5
NOW = 1_700_000_000.0
KEYS = [b"a", b"b", b"c", b"expired", b"locked", b"durable"]
ONE = item_size_bytes(Item(1, b"a", Op.MUTATION, b"v" * 8, 1))


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def empty_vbucket(path: Path, quota_items: int) -> tuple[VBucket, Store, Clock]:
    store = Store(path, map_size_bytes=64 * 1024 * 1024, durable=False)
    clock = Clock()
    budget = MemoryBudget(quota_items * ONE)
    vbucket = VBucket(store, VB, state=VBucketState.ACTIVE, clock=clock,
                      rng=random.Random(1), budget=budget)  # fmt: skip
    return vbucket, store, clock


def twin(path: Path, quota_items: int) -> tuple[VBucket, Store, Clock]:
    """A vbucket holding the same history as its twin: a stored key, one that expires, a
    locked key and a pending durable write."""
    vbucket, store, clock = empty_vbucket(path, quota_items)
    vbucket.set(b"a", b"stored")
    vbucket.set(b"expired", b"soon", expiry=int(NOW) + 5)
    vbucket.set(b"locked", b"held")
    vbucket.flush()
    vbucket.get_locked(b"locked", 30.0)
    vbucket.set(b"durable", b"pending", level=1)
    vbucket.flush()
    clock.now = NOW + 10  # "expired" is now past its expiry
    return vbucket, store, clock


def answer(outcome: MutationResult | StatusError) -> object:
    if isinstance(outcome, MutationResult):
        return (outcome.vbucket, outcome.seqno, outcome.cas, outcome.vb_uuid)
    return (type(outcome).__name__, outcome.code)


def memory(vbucket: VBucket) -> dict[bytes, Item]:
    """Each key's newest item in memory (a run may deduplicate inside one checkpoint what one
    write at a time put in two: an expiration and the write after it)."""
    return {one.key: one for c in vbucket.manager.checkpoints() for one in c.live_items()}


def stored(store: Store) -> list[object]:
    return [
        (r.seqno, r.key, r.op, r.value, r.cas, r.rev_seqno, r.flags, r.expiry, r.datatype,
         r.delete_time)
        for r in store.scan(VB, 0, store.high_seqno(VB))
    ]  # fmt: skip


def assert_run_equals_one_by_one(
    run_vb: VBucket, run_store: Store, one_vb: VBucket, one_store: Store,
    batch: list[tuple[bytes, bytes, int, int, int]],
) -> None:  # fmt: skip
    """`set_many` of `batch` on `run_vb` against `set` of each write on its twin `one_vb`:
    the same answers, seqnos, memory and (after a flush) store."""
    keys, values, flags, expiries, datatypes = (list(c) for c in zip(*batch, strict=True))
    got = run_vb.set_many(keys, values, flags, expiries, datatypes).results()
    want: list[MutationResult | StatusError] = []
    full = False
    for key, value, flag, expiry, datatype in batch:
        if full:  # the run stops where memory ran out; one by one, later ones may fit
            want.append(got[len(want)])
            continue
        try:
            want.append(one_vb.set(key, value, flags=flag, expiry=expiry, datatype=datatype))
        except StatusError as error:
            want.append(error)
            full = error.code == 0x86  # TMPFAIL
    assert list(map(answer, got)) == list(map(answer, want))
    assert run_vb.high_seqno == one_vb.high_seqno
    assert memory(run_vb) == memory(one_vb)
    assert_flushed_alike(run_vb, run_store, one_vb, one_store, stored)


writes = st.lists(
    st.tuples(
        st.sampled_from([*KEYS, b"k" * (limits.STORED_KEY_SIZE_MAX + 1)]),
        st.binary(max_size=8),
        st.integers(0, 3),  # flags
        st.sampled_from([0, int(NOW) + 100]),  # expiry
        st.sampled_from([0, 1, 8]),  # datatype; 8 is refused
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=40, deadline=None)
@given(batch=writes, quota_items=st.sampled_from([8, 14, 1000]))
def test_set_many_answers_and_queues_what_set_does_one_by_one(
    tmp_path_factory: pytest.TempPathFactory,
    batch: list[tuple[bytes, bytes, int, int, int]],
    quota_items: int,
) -> None:
    run_vb, run_store, _ = twin(tmp_path_factory.mktemp("run"), quota_items)
    one_vb, one_store, _ = twin(tmp_path_factory.mktemp("one"), quota_items)
    try:
        assert_run_equals_one_by_one(run_vb, run_store, one_vb, one_store, batch)
    finally:
        run_store.close()
        one_store.close()


def plain_twin(path: Path, quota_items: int) -> tuple[VBucket, Store]:
    """A vbucket with stored, in-memory, deleted and expiring keys, and no lock or pending
    durable write: runs of distinct keys can take set_many's clean path."""
    vbucket, store, clock = empty_vbucket(path, quota_items)
    vbucket.set(b"a", b"stored")
    vbucket.set(b"b", b"twice")
    vbucket.set(b"b", b"rev 2")
    vbucket.set(b"gone", b"soon deleted")
    vbucket.delete(b"gone")
    vbucket.set(b"expired", b"soon", expiry=int(NOW) + 5)
    vbucket.flush()
    vbucket.set(b"c", b"in memory only")
    clock.now = NOW + 10
    return vbucket, store


@contextlib.contextmanager
def plain_vbucket(path: Path, quota_items: int) -> Iterator[VBucket]:
    """`plain_twin`'s vbucket, for a test of one vbucket; its store closed after."""
    vbucket, store = plain_twin(path, quota_items)
    try:
        yield vbucket
    finally:
        store.close()


distinct_writes = st.lists(
    st.tuples(
        st.sampled_from([b"a", b"b", b"c", b"gone", b"expired", b"n1", b"n2", b"n3", b"n4"]),
        st.binary(max_size=8),
        st.sampled_from([0, 3, 0xFFFF_FFFF, 0x1_0000_0000]),  # flags; the last is refused
        st.sampled_from([0, int(NOW) + 100]),  # expiry
        st.sampled_from([0, 1, 7, 8]),  # datatype; 8 is refused
    ),
    min_size=1,
    max_size=9,
    unique_by=lambda write: write[0],
)


@settings(max_examples=60, deadline=None)
@given(batch=distinct_writes, quota_items=st.sampled_from([9, 1000]))
def test_runs_of_distinct_keys_answer_what_set_does(
    tmp_path_factory: pytest.TempPathFactory,
    batch: list[tuple[bytes, bytes, int, int, int]],
    quota_items: int,
) -> None:
    """The clean path (distinct keys, nothing locked or pending) and its fallbacks (a key
    found expired, a bad field) against `set` one by one: answers, memory and store."""
    run_vb, run_store = plain_twin(tmp_path_factory.mktemp("run"), quota_items)
    one_vb, one_store = plain_twin(tmp_path_factory.mktemp("one"), quota_items)
    try:
        assert_run_equals_one_by_one(run_vb, run_store, one_vb, one_store, batch)
    finally:
        run_store.close()
        one_store.close()


repeating_writes = st.lists(
    st.tuples(
        st.sampled_from([b"a", b"b", b"c", b"gone", b"expired", b"n1", b"n2"]),
        st.binary(max_size=8),
        st.integers(0, 3),  # flags
        st.sampled_from([0, 0, int(NOW) + 100, int(NOW) + 5]),  # expiry; the last is past
        st.sampled_from([0, 1]),  # datatype
    ),
    min_size=2,
    max_size=12,
)


@settings(max_examples=80, deadline=None)
@given(batch=repeating_writes)
def test_runs_that_write_a_key_twice_answer_what_set_does(
    tmp_path_factory: pytest.TempPathFactory,
    batch: list[tuple[bytes, bytes, int, int, int]],
) -> None:
    """A key written twice in a run (no lock, nothing pending): the second write finds the
    first, as `set` one at a time does — rev_seqno, memory and store — and a first write that
    expires at once is found expired (an expiration queued before the second)."""
    run_vb, run_store = plain_twin(tmp_path_factory.mktemp("run"), 1000)
    one_vb, one_store = plain_twin(tmp_path_factory.mktemp("one"), 1000)
    try:
        assert_run_equals_one_by_one(run_vb, run_store, one_vb, one_store, batch)
    finally:
        run_store.close()
        one_store.close()


def test_a_run_writing_a_key_twice_takes_no_step_per_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with plain_vbucket(tmp_path, 1000) as vbucket:
        monkeypatch.setattr(ActiveRole, "_set_one_by_one", None)  # called: a TypeError
        keys = [b"a", b"new", b"a", b"new", b"a"]
        answers = vbucket.set_many(keys, [b"v"] * 5, [0] * 5, [0] * 5, [0] * 5)
        assert not answers.errors
        revs = {one.key: one.rev_seqno for one in memory(vbucket).values() if one.key in keys}
        assert revs == {b"a": 4, b"new": 2}  # "a" was stored at rev 1


def test_a_clean_run_takes_no_step_per_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Distinct keys, valid fields, nothing locked, pending or expired: the columns path,
    never the write-by-write one; seqnos and CASes rise by one per write."""
    with plain_vbucket(tmp_path, 1000) as vbucket:
        monkeypatch.setattr(ActiveRole, "_set_one_by_one", None)  # called: a TypeError
        keys = [b"a", b"b", b"c", b"gone", b"new"]
        high = vbucket.high_seqno
        answers = vbucket.set_many(keys, [b"v"] * 5, [1] * 5, [0] * 5, [0] * 5)
        assert not answers.errors
        assert list(answers.seqnos) == list(range(high + 1, high + 6))
        assert list(answers.cases) == list(range(answers.cases[0], answers.cases[0] + 5))
        revs = {one.key: one.rev_seqno for one in memory(vbucket).values() if one.key in keys}
        assert revs == {b"a": 2, b"b": 3, b"c": 2, b"gone": 1, b"new": 1}


def test_a_clean_run_stops_where_memory_runs_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with plain_vbucket(tmp_path, 8) as vbucket:
        monkeypatch.setattr(ActiveRole, "_set_one_by_one", None)
        high = vbucket.high_seqno
        keys = [b"n%d" % i for i in range(9)]
        answers = vbucket.set_many(keys, [b"v"] * 9, [0] * 9, [0] * 9, [0] * 9)
        assert sorted(answers.errors) == [7, 8]
        assert {error.code for error in answers.errors.values()} == {0x86}  # TMPFAIL
        assert vbucket.high_seqno == high + 7  # the refused writes took no seqno
        assert set(memory(vbucket)) >= set(keys[:7]) and not set(memory(vbucket)) & {b"n7", b"n8"}


def run_of_one(
    vbucket: VBucket, store: Store, write: tuple[bytes, bytes, int, int, int], single: bool
) -> list[MutationResult | StatusError]:
    """`set_many` of one write, or (`single`) `set_single` as a bucket calls it (the lookup
    in memory, then the store's), `set_many` if it declines."""
    key, value, flag, expiry, datatype = write
    if single:
        found, missing = vbucket.lookup_memory([key])
        outcome = vbucket.set_single(
            key, value, flag, expiry, datatype, found=found[0],
            stored=store.get_many(VB, missing), fields_checked=False,
        )  # fmt: skip
        if outcome is not None:
            return outcome.results()
    return vbucket.set_many([key], [value], [flag], [expiry], [datatype]).results()


single_writes = st.lists(
    st.tuples(
        st.sampled_from([*KEYS, b"gone", b"new", b"k" * (limits.STORED_KEY_SIZE_MAX + 1)]),
        st.binary(max_size=8),
        st.sampled_from([0, 3, 0x1_0000_0000]),  # flags; the last is refused
        st.sampled_from([0, int(NOW) + 100, int(NOW) + 5]),  # expiry; the last is past
        st.sampled_from([0, 1, 8]),  # datatype; 8 is refused
    ),
    min_size=1,
    max_size=16,
)


@settings(max_examples=80, deadline=None)
@given(batch=single_writes, quota_items=st.sampled_from([7, 9, 1000]), plain=st.booleans())
def test_runs_of_one_write_answer_what_set_does(
    tmp_path_factory: pytest.TempPathFactory,
    batch: list[tuple[bytes, bytes, int, int, int]],
    quota_items: int,
    plain: bool,
) -> None:
    """A window of a few SETs over many vbuckets gives each vbucket a run of one write (its
    own path, `ActiveRole._set_single`, through `set_many` or, every other write, through
    `VBucket.set_single` as a bucket calls it): a run of one after another against `set` one by one
    on the twin, with no flush between (memory fills up at the small quotas) — every answer
    in order, then memory and the store. Locked, pending, expired, deleted and new keys,
    refused fields; `plain`: no lock or pending write in the vbucket (else every run of one
    goes the general way)."""
    if plain:
        run_vb, run_store = plain_twin(tmp_path_factory.mktemp("run"), quota_items)
        one_vb, one_store = plain_twin(tmp_path_factory.mktemp("one"), quota_items)
    else:
        run_vb, run_store, _ = twin(tmp_path_factory.mktemp("run"), quota_items)
        one_vb, one_store, _ = twin(tmp_path_factory.mktemp("one"), quota_items)
    try:
        for at, (key, value, flag, expiry, datatype) in enumerate(batch):
            got = run_of_one(run_vb, run_store, (key, value, flag, expiry, datatype), at % 2 == 1)
            try:
                want: MutationResult | StatusError = one_vb.set(
                    key, value, flags=flag, expiry=expiry, datatype=datatype
                )
            except StatusError as error:
                want = error
            assert list(map(answer, got)) == [answer(want)]
            assert run_vb.high_seqno == one_vb.high_seqno
        assert memory(run_vb) == memory(one_vb)
        assert_flushed_alike(run_vb, run_store, one_vb, one_store, stored)
    finally:
        run_store.close()
        one_store.close()


def test_a_run_of_one_clean_write_takes_the_single_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One clean write (stored, in memory, deleted or new key) never reaches the run path."""
    with plain_vbucket(tmp_path, 1000) as vbucket:
        monkeypatch.setattr(ActiveRole, "_clean_run_revs", None)  # called: a TypeError
        for key, rev in [(b"a", 2), (b"b", 3), (b"c", 2), (b"gone", 1), (b"new", 1)]:
            high = vbucket.high_seqno
            answers = vbucket.set_many([key], [b"v"], [1], [0], [0])
            assert not answers.errors and list(answers.seqnos) == [high + 1]
            assert memory(vbucket)[key].rev_seqno == rev
