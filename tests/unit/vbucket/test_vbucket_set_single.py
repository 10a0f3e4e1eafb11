"""The one-write path (`VBucket.set_single`, and `set_many` of a run of one) at the edges the
runs-of-one twin seldom reaches: a pending durable write with no lock in the vbucket, a key
whose newest version in memory is an EXPIRATION, an expiry exactly equal to the clock, and
GET_LOCKED entries left on other keys. Each case is checked against `set` one write at a time
on a twin vbucket with the same history and clock (review 6f)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed import limits
from changefeed.protocol.errors import LockedError, StatusError, SyncWriteInProgressError
from changefeed.protocol.kv import MutationResult
from changefeed.storage import Op
from changefeed.vbucket import VBucket
from changefeed.vbucket.active import ActiveRole
from changefeed.vbucket.values import check_fields, fields_in_range, write_in_range

from .test_vbucket_set_many import (
    NOW,
    Clock,
    answer,
    empty_vbucket,
    memory,
    run_of_one,
    stored,
)
from .twins import assert_flushed_alike

Write = tuple[bytes, bytes, int, int, int]
Setup = Callable[[VBucket, Clock], None]


def write(key: bytes, value: bytes = b"v", expiry: int = 0) -> Write:
    return (key, value, 0, expiry, 0)


def set_one_by_one(vbucket: VBucket, batch: list[Write]) -> list[MutationResult | StatusError]:
    out: list[MutationResult | StatusError] = []
    for key, value, flag, expiry, datatype in batch:
        try:
            out.append(vbucket.set(key, value, flags=flag, expiry=expiry, datatype=datatype))
        except StatusError as error:
            out.append(error)
    return out


def assert_path_equals_set(tmp_path: Path, setup: Setup, batch: list[Write], path: str) -> None:
    """`batch` through `path` ("single": `set_single` as a bucket calls it, then `set_many` if
    it declines; "runs of one": `set_many` per write; "run": one `set_many`) on a vbucket
    against `set` one by one on its twin: answers, seqnos, memory and the store."""
    run_vb, run_store, run_clock = empty_vbucket(tmp_path / "run", 1000)
    one_vb, one_store, one_clock = empty_vbucket(tmp_path / "one", 1000)
    try:
        setup(run_vb, run_clock)
        setup(one_vb, one_clock)
        if path == "run":
            columns = [list(column) for column in zip(*batch, strict=True)]
            got = run_vb.set_many(*columns).results()
        else:
            got = [one for w in batch for one in run_of_one(run_vb, run_store, w, path == "single")]
        want = set_one_by_one(one_vb, batch)
        assert list(map(answer, got)) == list(map(answer, want))
        assert run_vb.high_seqno == one_vb.high_seqno
        assert memory(run_vb) == memory(one_vb)
        assert run_vb.role.locks_held == one_vb.role.locks_held
        assert_flushed_alike(run_vb, run_store, one_vb, one_store, stored)
    finally:
        run_store.close()
        one_store.close()


PATHS = ["single", "runs of one", "run"]


def durable_pending(vbucket: VBucket, clock: Clock) -> None:
    vbucket.set(b"d", b"stored")
    vbucket.flush()
    vbucket.set(b"d", b"pending", level=1)  # no lock anywhere in the vbucket


@pytest.mark.parametrize("path", PATHS)
def test_a_pending_key_without_locks_is_refused(tmp_path: Path, path: str) -> None:
    """With no lock in the vbucket only the pending check stands between a plain SET and a
    key with a durable write pending: SYNC_WRITE_IN_PROGRESS, no seqno taken."""
    batch = [write(b"d"), write(b"other")]
    assert_path_equals_set(tmp_path, durable_pending, batch, path)


@pytest.mark.parametrize("single", [False, True])
def test_a_pending_key_without_locks_answers_sync_write_in_progress(
    tmp_path: Path, single: bool
) -> None:
    vbucket, store, clock = empty_vbucket(tmp_path, 1000)
    try:
        durable_pending(vbucket, clock)
        high = vbucket.high_seqno
        (got,) = run_of_one(vbucket, store, write(b"d"), single)
        assert isinstance(got, SyncWriteInProgressError), got
        assert vbucket.high_seqno == high
    finally:
        store.close()


def expiration_in_memory(vbucket: VBucket, clock: Clock) -> None:
    """A write refused after its key was found expired leaves the EXPIRATION in memory."""
    vbucket.set(b"e", b"soon", expiry=int(NOW) + 5)
    vbucket.flush()
    clock.now = NOW + 10
    refused = vbucket.set_many([b"e"], [b"v"], [1 << 32], [0], [0]).results()[0]
    assert isinstance(refused, StatusError), refused
    found = vbucket.manager.find(b"e")
    assert found is not None and found.op is Op.EXPIRATION, found


@pytest.mark.parametrize("path", PATHS)
def test_a_key_whose_expiration_is_in_memory_is_new(tmp_path: Path, path: str) -> None:
    """The next write of a key whose newest version is an EXPIRATION is rev 1, as `set`
    makes it (not the expiration's rev + 1)."""
    assert_path_equals_set(tmp_path, expiration_in_memory, [write(b"e"), write(b"f")], path)


def expires_now(vbucket: VBucket, clock: Clock) -> None:
    """ "edge" in memory and "flushed" in the store, each expiring exactly at the clock."""
    vbucket.set(b"flushed", b"old", expiry=int(NOW) + 10)
    vbucket.flush()
    vbucket.set(b"edge", b"old", expiry=int(NOW) + 10)
    clock.now = NOW + 10
    assert clock.now == int(NOW) + 10


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("key", [b"edge", b"flushed"])
def test_an_expiry_equal_to_the_clock_is_expired(tmp_path: Path, path: str, key: bytes) -> None:
    """An expiry equal to now is past (`set` queues the key's expiration before the write):
    the boundary of every path's expiry check."""
    assert_path_equals_set(tmp_path, expires_now, [write(key), write(b"new")], path)


@pytest.mark.parametrize("path", ["runs of one", "run"])
def test_a_run_s_earlier_write_expiring_now_is_expired(tmp_path: Path, path: str) -> None:
    """A key written twice in a run, the first write expiring exactly now: the second finds
    it expired, as `set` would."""

    def at_ten(vbucket: VBucket, clock: Clock) -> None:
        clock.now = NOW + 10

    batch = [write(b"k", b"first", int(NOW) + 10), write(b"k", b"second")]
    assert_path_equals_set(tmp_path, at_ten, batch, path)


def stale_locks(vbucket: VBucket, clock: Clock) -> None:
    """Two lock entries left on keys never written again: one unlocked, one timed out."""
    vbucket.set(b"unlocked", b"x")
    vbucket.set(b"timed out", b"y")
    vbucket.unlock(b"unlocked", vbucket.get_locked(b"unlocked", 5.0).cas)
    vbucket.get_locked(b"timed out", 5.0)
    clock.now = NOW + 3600
    assert vbucket.role.locks_held == 2


def test_stale_locks_on_other_keys_keep_writes_on_the_fast_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock entry on another key does not decline `set_single` nor a run's clean path
    (before, any entry in the vbucket sent every write one by one, for good)."""
    vbucket, store, clock = empty_vbucket(tmp_path, 1000)
    try:
        stale_locks(vbucket, clock)
        for at in range(20):
            key = b"k%d" % at
            found, missing = vbucket.lookup_memory([key])
            outcome = vbucket.set_single(
                key, b"v", 0, 0, 0, found=found[0], stored=store.get_many(5, missing),
                fields_checked=False,
            )  # fmt: skip
            assert outcome is not None and not outcome.errors, (key, outcome)
        monkeypatch.setattr(ActiveRole, "_set_one_by_one", None)  # called: a TypeError
        answers = vbucket.set_many([b"r1", b"r2", b"k0"], [b"v"] * 3, [0] * 3, [0] * 3, [0] * 3)
        assert not answers.errors, answers
        assert vbucket.role.locks_held == 2
    finally:
        store.close()


@pytest.mark.parametrize("path", PATHS)
def test_writes_beside_stale_locks_answer_what_set_does(tmp_path: Path, path: str) -> None:
    """Stale entries and a write of a stale-locked key itself (it drops the entry)."""
    batch = [write(b"a"), write(b"unlocked"), write(b"b"), write(b"timed out")]
    assert_path_equals_set(tmp_path, stale_locks, batch, path)


def live_lock(vbucket: VBucket, clock: Clock) -> None:
    vbucket.set(b"held", b"x")
    vbucket.get_locked(b"held", 30.0)


@pytest.mark.parametrize("path", PATHS)
def test_a_live_lock_on_the_written_key_still_refuses(tmp_path: Path, path: str) -> None:
    assert_path_equals_set(tmp_path, live_lock, [write(b"a"), write(b"held")], path)


def test_a_live_lock_declines_set_single_and_set_many_answers_locked(tmp_path: Path) -> None:
    vbucket, store, clock = empty_vbucket(tmp_path, 1000)
    try:
        live_lock(vbucket, clock)
        high = vbucket.high_seqno
        found, missing = vbucket.lookup_memory([b"held"])
        declined = vbucket.set_single(
            b"held", b"v", 0, 0, 0, found=found[0], stored=store.get_many(5, missing),
            fields_checked=True,
        )  # fmt: skip
        assert declined is None
        (got,) = vbucket.set_many([b"held"], [b"v"], [0], [0], [0]).results()
        assert isinstance(got, LockedError), got
        assert vbucket.high_seqno == high
        assert vbucket.role.locks_held == 1
    finally:
        store.close()


@settings(max_examples=300, deadline=None)
@given(
    key=st.binary(max_size=limits.STORED_KEY_SIZE_MAX + 2),
    value_size=st.sampled_from([0, 1, limits.VALUE_SIZE_MAX, limits.VALUE_SIZE_MAX + 1]),
    flags=st.integers(-2, 1 << 33) | st.sampled_from([0, 0xFFFF_FFFF, 1 << 32, -1]),
    expiry=st.integers(-2, 1 << 33) | st.sampled_from([0, 0xFFFF_FFFF, 1 << 32, -1]),
    datatype=st.integers(-9, 17),
)
def test_write_in_range_is_check_fields_and_fields_in_range(
    key: bytes, value_size: int, flags: int, expiry: int, datatype: int
) -> None:
    """The one-write check agrees with the column check and with `check_fields` raising."""
    value = bytes(value_size)
    try:
        check_fields(key, value, flags, expiry, datatype)
        accepted = True
    except StatusError:
        accepted = False
    assert write_in_range(key, value, flags, expiry, datatype) is accepted
    assert fields_in_range(([key], [value], [flags], [expiry], [datatype])) is accepted


def test_a_single_write_memory_has_no_room_for_takes_no_seqno(tmp_path: Path) -> None:
    """TMPFAIL from `set_single`: no seqno or CAS taken, and 0 in their columns."""
    vbucket, store, _ = empty_vbucket(tmp_path, 2)
    try:
        outcomes = []
        for at in range(4):
            outcome = vbucket.set_single(
                b"k%d" % at, b"v" * 8, 0, 0, 0, found=None, stored={b"k%d" % at: None},
                fields_checked=True,
            )  # fmt: skip
            assert outcome is not None
            outcomes.append(outcome)
        refused = [outcome for outcome in outcomes if outcome.errors]
        assert refused, outcomes
        for outcome in refused:
            assert outcome.errors[0].code == 0x86, outcome  # TMPFAIL
            assert (list(outcome.seqnos), list(outcome.cases)) == ([0], [0]), outcome
        assert vbucket.high_seqno == len(outcomes) - len(refused), outcomes
    finally:
        store.close()
