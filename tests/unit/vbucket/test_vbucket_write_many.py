"""``VBucket.write_many`` (a window's SETs and DELETEs of one vbucket, in request order, in one
pass) against ``set`` / ``delete`` one write at a time on a twin vbucket with the same clock:
the same answers (seqno, CAS, error and its message), the same items in memory and the same
store after a flush — through keys SET, DELETEd and SET again, DELETEs of keys only in the
store, DELETEs whose CAS is right (the CAS the SET before them got), stale or wrong, locked
keys, pending durable writes, keys found expired, bad fields and memory running out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from changefeed import limits
from changefeed.protocol.errors import StatusError
from changefeed.protocol.kv import MutationResult
from changefeed.storage import Store
from changefeed.vbucket import WRITE_DELETE, WRITE_SET, RunLookup, VBucket, VBucketState
from changefeed.vbucket.active import ActiveRole

from .test_vbucket_set_many import NOW, memory, plain_twin, stored, twin
from .twins import assert_flushed_alike

LONG_KEY = b"k" * (limits.STORED_KEY_SIZE_MAX + 1)
WRONG_CAS = 77


@dataclass(frozen=True)
class Write:
    delete: bool
    key: bytes
    value: bytes
    expiry: int
    cas_pick: int  # a DELETE's: 0 none, 1 the key's CAS before the run, 2 the last write's, 3 wrong


writes = st.lists(
    st.builds(
        Write,
        st.booleans(),
        st.sampled_from(
            [
                b"a",
                b"b",
                b"c",
                b"gone",
                b"expired",
                b"locked",
                b"unlocked",
                b"durable",
                b"n1",
                LONG_KEY,
            ]
        ),
        st.binary(max_size=8),
        st.sampled_from([0, 0, int(NOW) + 100, int(NOW) + 5]),  # the last is already past
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=24,
)


def answer(outcome: MutationResult | StatusError) -> object:
    if isinstance(outcome, MutationResult):
        return (outcome.seqno, outcome.cas, outcome.vb_uuid)
    return (type(outcome).__name__, outcome.code, str(outcome))


def lock_twin(path: Path, quota_items: int) -> tuple[VBucket, Store]:
    """`plain_twin` with a key locked and unlocked again (its lock's CAS is what it shows,
    until a write drops the lock) and a key locked now."""
    vbucket, store = plain_twin(path, quota_items)
    vbucket.set(b"unlocked", b"was locked")
    vbucket.set(b"locked", b"held")
    vbucket.unlock(b"unlocked", vbucket.get_locked(b"unlocked", 30.0).cas)
    vbucket.get_locked(b"locked", 30.0)
    return vbucket, store


def shown_cases(vbucket: VBucket, batch: list[Write]) -> dict[bytes, int]:
    """The CAS each key of `batch` shows (a GET: an unlocked lock's, a held lock's marker),
    WRONG_CAS for a missing one. A GET may queue an expiration: both twins are asked."""
    before = {}
    for key in sorted({write.key for write in batch}):
        try:
            found = vbucket.get(key)
        except StatusError:
            found = None
        before[key] = found.cas if found is not None else WRONG_CAS
    return before


def one_by_one(
    vbucket: VBucket, batch: list[Write], before: dict[bytes, int]
) -> tuple[list[object], list[int]]:
    """`batch` through `set` / `delete` one at a time: the answers and each write's CAS as
    asked (a DELETE's `cas_pick` resolved against `before` and what the writes before it
    got)."""
    last: dict[bytes, int] = {}
    answers: list[object] = []
    cases: list[int] = []
    for write in batch:
        cas = 0
        try:
            if write.delete:
                pick = (0, before[write.key], last.get(write.key, WRONG_CAS), WRONG_CAS)
                cas = pick[write.cas_pick]
                result = vbucket.delete(write.key, cas=cas)
            else:
                result = vbucket.set(write.key, write.value, flags=3, expiry=write.expiry)
        except StatusError as error:
            answers.append(answer(error))
        else:
            answers.append(answer(result))
            last[write.key] = result.cas
        cases.append(cas)
    return answers, cases


def in_one_pass(vbucket: VBucket, batch: list[Write], cases: list[int]) -> list[object]:
    keys = [write.key for write in batch]
    in_memory, missing = vbucket.lookup_memory(keys)
    lookup = RunLookup(in_memory, vbucket.store.get_many(vbucket.vb, missing))
    ops = [WRITE_DELETE if write.delete else WRITE_SET for write in batch]
    columns = (
        keys,
        [b"" if write.delete else write.value for write in batch],
        [0 if write.delete else 3 for write in batch],
        [0 if write.delete else write.expiry for write in batch],
        [0] * len(batch),
    )
    return list(map(answer, vbucket.write_many(ops, columns, cases, lookup=lookup).results()))


def assert_one_pass_equals_one_by_one(
    pass_vb: VBucket, pass_store: Store, one_vb: VBucket, one_store: Store, batch: list[Write]
) -> None:
    before = shown_cases(one_vb, batch)
    assert shown_cases(pass_vb, batch) == before
    want, cases = one_by_one(one_vb, batch, before)
    assert in_one_pass(pass_vb, batch, cases) == want
    assert pass_vb.high_seqno == one_vb.high_seqno
    assert memory(pass_vb) == memory(one_vb)
    assert_flushed_alike(pass_vb, pass_store, one_vb, one_store, stored)


S, D = False, True


@settings(max_examples=60, deadline=None)
@given(batch=writes, quota_items=st.sampled_from([8, 14, 1000]), make=st.sampled_from([0, 1, 2]))
@example(  # SET, DELETE with the SET's CAS, SET again; a DELETE of a key only in the store
    [
        Write(S, b"n1", b"x", 0, 0),
        Write(D, b"n1", b"", 0, 2),
        Write(S, b"n1", b"y", 0, 0),
        Write(D, b"a", b"", 0, 1),
    ],
    1000,
    0,
)
@example(  # a DELETE with a wrong CAS between SETs of its key; a DELETE of a deleted key
    [
        Write(S, b"a", b"x", 0, 0),
        Write(D, b"a", b"", 0, 3),
        Write(S, b"a", b"y", 0, 0),
        Write(D, b"gone", b"", 0, 0),
        Write(D, b"a", b"", 0, 1),
    ],
    1000,
    0,
)
@example(  # a key found expired, then DELETEd (not found) and SET; a SET written expired
    [
        Write(D, b"expired", b"", 0, 0),
        Write(S, b"expired", b"z", int(NOW) + 5, 0),
        Write(D, b"expired", b"", 0, 0),
    ],
    1000,
    0,
)
def test_write_many_answers_and_queues_what_set_and_delete_do(
    tmp_path_factory: pytest.TempPathFactory, batch: list[Write], quota_items: int, make: int
) -> None:
    """`make`: 0 twins with no lock and nothing pending (`plain_twin`: the one-pass path),
    1 with a lock held and one unlocked (`lock_twin`), 2 with a pending durable write too
    (`twin`: a run with its key goes one by one)."""
    build = (plain_twin, lock_twin, twin)[make]
    pass_vb, pass_store = build(tmp_path_factory.mktemp("pass"), quota_items)[:2]
    one_vb, one_store = build(tmp_path_factory.mktemp("one"), quota_items)[:2]
    try:
        assert_one_pass_equals_one_by_one(pass_vb, pass_store, one_vb, one_store, batch)
    finally:
        pass_store.close()
        one_store.close()


@pytest.mark.parametrize("quota_items", [8, 14])
def test_writes_past_where_memory_ran_out_are_answered_one_by_one(
    tmp_path_factory: pytest.TempPathFactory, quota_items: int
) -> None:
    """Memory runs out part of the way: one at a time, a later small write may still fit."""
    batch = [Write(S, b"n%d" % n, b"v" * 8, 0, 0) for n in range(12)]
    batch[5:5] = [Write(D, b"a", b"", 0, 0), Write(D, b"b", b"", 0, 1), Write(D, b"n1", b"", 0, 2)]
    pass_vb, pass_store = plain_twin(tmp_path_factory.mktemp("pass"), quota_items)
    one_vb, one_store = plain_twin(tmp_path_factory.mktemp("one"), quota_items)
    try:
        assert_one_pass_equals_one_by_one(pass_vb, pass_store, one_vb, one_store, batch)
    finally:
        pass_store.close()
        one_store.close()


def test_an_unlocked_key_rewritten_then_deleted_with_the_new_cas(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A SET drops the key's unlocked lock: a DELETE after it checks the SET's CAS, and a
    DELETE with the lock's CAS before any write matches it."""
    batch = [Write(D, b"unlocked", b"", 0, 1)]
    pass_vb, pass_store = lock_twin(tmp_path_factory.mktemp("pass"), 1000)
    one_vb, one_store = lock_twin(tmp_path_factory.mktemp("one"), 1000)
    again = [Write(S, b"unlocked", b"x", 0, 0), Write(D, b"unlocked", b"", 0, 2)]
    try:
        assert_one_pass_equals_one_by_one(pass_vb, pass_store, one_vb, one_store, batch)
        assert_one_pass_equals_one_by_one(pass_vb, pass_store, one_vb, one_store, again)
    finally:
        pass_store.close()
        one_store.close()
    pass_vb, pass_store = lock_twin(tmp_path_factory.mktemp("pass2"), 1000)
    one_vb, one_store = lock_twin(tmp_path_factory.mktemp("one2"), 1000)
    try:
        assert_one_pass_equals_one_by_one(pass_vb, pass_store, one_vb, one_store, again)
    finally:
        pass_store.close()
        one_store.close()


def test_a_mixed_run_takes_no_step_per_write(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SETs and DELETEs of a vbucket with nothing pending and room in memory: one pass, one
    queued run (`set` / `delete` are never called), seqnos rising by one per write."""
    pass_vb, pass_store = plain_twin(tmp_path_factory.mktemp("pass"), 1000)
    one_vb, one_store = plain_twin(tmp_path_factory.mktemp("one"), 1000)
    batch = [Write(S, b"n1", b"x", 0, 0), Write(D, b"n1", b"", 0, 2), Write(S, b"n1", b"y", 0, 0),
             Write(D, b"a", b"", 0, 1), Write(S, b"b", b"z", 0, 0)]  # fmt: skip
    try:
        before = shown_cases(one_vb, batch)
        assert shown_cases(pass_vb, batch) == before
        want, cases = one_by_one(one_vb, batch, before)
        monkeypatch.setattr(ActiveRole, "set", None)  # called: a TypeError
        monkeypatch.setattr(ActiveRole, "delete", None)
        high = pass_vb.high_seqno
        got = in_one_pass(pass_vb, batch, cases)
        assert got == want
        assert [seqno for seqno, _, _ in got] == list(range(high + 1, high + 6))  # type: ignore[misc]
    finally:
        pass_store.close()
        one_store.close()


def test_a_vbucket_that_is_not_active_refuses_every_write(tmp_path: Path) -> None:
    vbucket, store = plain_twin(tmp_path, 1000)
    try:
        vbucket.set_state(VBucketState.REPLICA)
        high = vbucket.high_seqno
        outcome = vbucket.write_many(
            [WRITE_SET, WRITE_DELETE], ([b"a", b"b"], [b"v", b""], [0, 0], [0, 0], [0, 0]),
            [0, 0], lookup=RunLookup([None, None], {}),
        )  # fmt: skip
        assert sorted(outcome.errors) == [0, 1]
        assert {type(error).__name__ for error in outcome.errors.values()} == {"NotMyVbucketError"}
        assert vbucket.high_seqno == high
    finally:
        store.close()
