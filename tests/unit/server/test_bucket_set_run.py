"""``Bucket.set_run`` (a received batch of plain SETs over many vbuckets, the keys memory does
not hold looked up in one read transaction) against ``Bucket.store_command`` one write at a
time on a twin bucket with the same history, clock and seed: the same answers (seqno, CAS,
vb_uuid or the error), the same items in memory and the same store — through stored,
in-memory, deleted and expired keys, a replica vbucket, a vbucket the node does not have,
repeated keys, relative expiries and fields out of range. Also ``Store.get_many_across``
against ``Store.get_many`` per vbucket."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed import limits
from changefeed.checkpoint import Item
from changefeed.protocol.errors import StatusError
from changefeed.protocol.frame_info import DurabilityLevel
from changefeed.protocol.kv import MutationResult, StoreCommand
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.set_run import SetRun, SetRunAnswers
from changefeed.server.bucket import Bucket
from changefeed.storage import Store
from changefeed.vbucket_state import VBucketState
from support.buckets import ManualClock, open_bucket

NOW = 1_700_000_000.0
VBUCKETS = 4
REPLICA_VB = 3
ABSENT_VB = 9  # not on this node
KEYS = [b"stored", b"memory", b"gone", b"expired", b"new1", b"new2", b"new3"]


def with_history(bucket: Bucket, clock: ManualClock) -> None:
    """In vbuckets 0-2: a stored key, a deleted one, one that expires (all flushed), then one
    only in memory; vbucket 3 becomes a replica."""
    for vb in range(3):
        vbucket = bucket.vbucket(vb)
        vbucket.set(b"stored", b"on disk")
        vbucket.set(b"gone", b"deleted next")
        vbucket.delete(b"gone")
        vbucket.set(b"expired", b"soon", expiry=int(NOW) + 5)
        vbucket.flush()
        vbucket.set(b"memory", b"in memory only")
    bucket.vbucket(REPLICA_VB).set_state(VBucketState.REPLICA)
    clock.now = NOW + 10  # "expired" is past its expiry


def answers_of(answers: SetRunAnswers, count: int) -> list[object]:
    return [
        (type(answers.errors[i]).__name__, answers.errors[i].code)
        if i in answers.errors
        else (int(answers.seqnos[i]), int(answers.cases[i]), int(answers.vb_uuids[i]))
        for i in range(count)
    ]


def one_by_one(bucket: Bucket, run: SetRun, level: int = 0) -> list[object]:
    """`store_command` of each SET of `run` (at durability `level`): what `set_run` answers."""
    got: list[object] = []
    for i in range(len(run)):
        command = StoreCommand(
            Opcode.SET, run.vbuckets[i], run.opaques[i], run.keys[i], run.values[i],
            flags=run.flags[i], expiry=run.expiries[i], datatype=run.datatypes[i],
        )  # fmt: skip
        try:
            result: MutationResult = bucket.store_command(command, level=level)
        except StatusError as error:
            got.append((type(error).__name__, error.code))
            continue
        got.append((result.seqno, result.cas, result.vb_uuid))
    return got


def memory(bucket: Bucket, vb: int) -> dict[bytes, Item]:
    manager = bucket.vbucket(vb).manager
    return {one.key: one for c in manager.checkpoints() for one in c.live_items()}


def stored(store: Store, vb: int) -> list[object]:
    return [
        (r.seqno, r.key, r.op, r.value, r.cas, r.rev_seqno, r.flags, r.expiry, r.datatype,
         r.delete_time)
        for r in store.scan(vb, 0, store.high_seqno(vb))
    ]  # fmt: skip


writes = st.lists(
    st.tuples(
        st.sampled_from([0, 1, 2, REPLICA_VB, ABSENT_VB]),
        st.sampled_from(KEYS),
        st.binary(max_size=8),
        st.sampled_from([0, 7, 0xFFFF_FFFF]),  # flags
        st.sampled_from([0, 60, int(NOW) + 100]),  # expiry: none, relative, absolute
        st.sampled_from([0, 1, 8]),  # datatype; 8 is refused
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(batch=writes, checked=st.booleans())
def test_set_run_answers_and_applies_what_set_does_one_by_one(
    tmp_path_factory: pytest.TempPathFactory,
    batch: list[tuple[int, bytes, bytes, int, int, int]],
    checked: bool,
) -> None:
    checked = checked and all(datatype <= 7 for *_, datatype in batch)  # as take_set_run vouches
    run = SetRun()
    for opaque, (vb, key, value, flags, expiry, datatype) in enumerate(batch):
        run.vbuckets.append(vb)
        run.opaques.append(opaque)
        run.keys.append(key)
        run.values.append(value)
        run.flags.append(flags)
        run.expiries.append(expiry)
        run.datatypes.append(datatype)
    run.checked = checked
    run_clock, one_clock = ManualClock(NOW), ManualClock(NOW)
    with (
        open_bucket(tmp_path_factory.mktemp("run"), run_clock, vbuckets=VBUCKETS) as run_bucket,
        open_bucket(tmp_path_factory.mktemp("one"), one_clock, vbuckets=VBUCKETS) as one_bucket,
    ):
        with_history(run_bucket, run_clock)
        with_history(one_bucket, one_clock)
        got = answers_of(run_bucket.set_run(run), len(run))
        assert got == one_by_one(one_bucket, run)
        for vb in range(VBUCKETS):
            assert run_bucket.vbucket(vb).high_seqno == one_bucket.vbucket(vb).high_seqno
            assert memory(run_bucket, vb) == memory(one_bucket, vb)
            run_bucket.vbucket(vb).flush()
            one_bucket.vbucket(vb).flush()
            assert stored(run_bucket.store, vb) == stored(one_bucket.store, vb)


def test_an_empty_run_answers_nothing(tmp_path: Path) -> None:
    with open_bucket(tmp_path, ManualClock(NOW), vbuckets=VBUCKETS) as bucket:
        answers = bucket.set_run(SetRun())
        assert answers_of(answers, 0) == []
        assert not answers.errors


@settings(max_examples=40, deadline=None)
@given(
    wanted=st.dictionaries(
        st.integers(0, 3),
        st.lists(st.sampled_from([*KEYS, b"", b"k" * 300]), max_size=6, unique=True),
        max_size=4,
    )
)
def test_get_many_across_is_get_many_of_each_vbucket(
    tmp_path_factory: pytest.TempPathFactory, wanted: dict[int, list[bytes]]
) -> None:
    clock = ManualClock(NOW)
    with open_bucket(tmp_path_factory.mktemp("b"), clock, vbuckets=VBUCKETS) as bucket:
        with_history(bucket, clock)
        for vb in range(3):
            bucket.vbucket(vb).flush()  # "memory" is stored too
        store = bucket.store
        assert store.get_many_across(wanted) == {
            vb: store.get_many(vb, keys) for vb, keys in wanted.items()
        }


def run_against_one_by_one(tmp_path: Path, now: float, run: SetRun) -> list[object]:
    """`set_run` of `run` on a fresh bucket, asserted equal to `store_command` one write at a
    time on another; returns the answers."""
    (tmp_path / "run").mkdir()
    (tmp_path / "one").mkdir()
    with (
        open_bucket(tmp_path / "run", ManualClock(now), vbuckets=VBUCKETS) as run_bucket,
        open_bucket(tmp_path / "one", ManualClock(now), vbuckets=VBUCKETS) as one_bucket,
    ):
        got = answers_of(run_bucket.set_run(run), len(run))
        assert got == one_by_one(one_bucket, run)
        return got


def test_a_checked_run_still_checks_expiries_made_absolute(tmp_path: Path) -> None:
    """`take_set_run` vouches for the wire's u32 fields, not for a relative expiry that the
    clock turns into a time past u32: that write is refused as `set` refuses it."""
    late = float(0xFFFF_FFFF - 30)
    run = SetRun(
        vbuckets=[0, 1], opaques=[1, 2], keys=[b"a", b"b"], values=[b"v", b"v"],
        flags=[0, 0], expiries=[60, 0], datatypes=[0, 0], checked=True,
    )  # fmt: skip
    got = run_against_one_by_one(tmp_path, late, run)
    assert got[0] == ("InvalidArgumentsError", 0x04)


def test_a_value_over_the_limit_is_refused_as_set_refuses_it(tmp_path: Path) -> None:
    """A run not taken from the wire (`checked` False) has its fields checked: a value over
    VALUE_SIZE_MAX is refused as `set` refuses it and the other writes of the run still apply."""
    big = b"x" * (limits.VALUE_SIZE_MAX + 1)
    run = SetRun(
        vbuckets=[0, 0, 1], opaques=[1, 2, 3], keys=[b"a", b"b", b"c"], values=[b"v", big, b"v"],
        flags=[0, 0, 0], expiries=[0, 0, 0], datatypes=[0, 0, 0],
    )  # fmt: skip
    got = run_against_one_by_one(tmp_path, NOW, run)
    assert got[1][0] == "InvalidArgumentsError" and got[0][0] == 1 and got[2][0] == 1


@contextlib.contextmanager
def small_quota_bucket(path: Path, clock: ManualClock) -> Iterator[Bucket]:
    """A bucket with the smallest checkpoint quota (1 MiB): a run with a value near it might
    pass the upper mark, so `set_run` applies it one write at a time (`_set_one_by_one`)."""
    path.mkdir()
    with open_bucket(path, clock, vbuckets=VBUCKETS, checkpoint_quota_bytes=1024 * 1024) as b:
        yield b


def prepares(bucket: Bucket, vb: int) -> list[tuple[bytes, int, int, int, bytes, int]]:
    return [
        (p.key, p.seqno, p.level, p.expiry, p.value, p.datatype)
        for p in bucket.vbucket(vb).pending_prepares
    ]


NEAR_QUOTA = b"x" * 960_000  # with the run's other writes, past the 1 MiB quota's upper mark


@pytest.mark.parametrize(
    "level", [0, int(DurabilityLevel.MAJORITY), int(DurabilityLevel.PERSIST_TO_MAJORITY)]
)
def test_a_run_memory_might_not_hold_keeps_its_level_and_expiries(
    tmp_path: Path, level: int
) -> None:
    """A run memory might not hold goes one write at a time: each write keeps the run's
    durability `level` (a prepare, as `store_command(level=...)` queues one) and its relative
    expiry is made absolute by the clock (60 s from now, not 60 s after 1970)."""
    run = SetRun(
        vbuckets=[0, 1, 2, 1, 0], opaques=[1, 2, 3, 4, 5],
        keys=[b"rel", b"abs", b"big", b"none", b"rel30"],
        values=[b"r1", b"a", NEAR_QUOTA, b"n", b"r2"],
        flags=[1, 2, 3, 4, 5], expiries=[60, int(NOW) + 100, 0, 0, 30], datatypes=[1, 0, 0, 1, 0],
        checked=True,
    )  # fmt: skip
    run_clock, one_clock = ManualClock(NOW), ManualClock(NOW)
    with (
        small_quota_bucket(tmp_path / "run", run_clock) as run_bucket,
        small_quota_bucket(tmp_path / "one", one_clock) as one_bucket,
    ):
        assert run_bucket.might_pass_upper_mark(run.keys, run.values)  # the path under test
        got = answers_of(run_bucket.set_run(run, level=level), len(run))
        assert got == one_by_one(one_bucket, run, level)
        assert isinstance(got[0], tuple) and isinstance(got[0][0], int)  # the first write took
        for vb in range(VBUCKETS):
            assert prepares(run_bucket, vb) == prepares(one_bucket, vb)
            assert memory(run_bucket, vb) == memory(one_bucket, vb)
        # What the twin comparison relies on, said outright: durable writes are pending
        # prepares, and "rel" expires 60 s from now.
        assert bool(prepares(run_bucket, 0)) == bool(level)
        assert memory(run_bucket, 0)[b"rel"].expiry == int(NOW) + 60
        assert memory(run_bucket, 0)[b"rel30"].expiry == int(NOW) + 30
        for vb in range(VBUCKETS):
            run_bucket.vbucket(vb).flush()
            one_bucket.vbucket(vb).flush()
            assert stored(run_bucket.store, vb) == stored(one_bucket.store, vb)
