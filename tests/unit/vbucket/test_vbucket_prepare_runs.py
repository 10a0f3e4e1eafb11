"""``VBucket.set_many`` with a durability level (a run of durable SETs, each queued as a
prepare) against ``set`` with that level one write at a time on a twin vbucket with the same
clock: the same answers, the same pending prepares, the same checkpoints item for item, and
the same store after a flush — through keys written twice in the run (the second is
SYNC_WRITE_IN_PROGRESS), keys already pending, locked keys, keys found expired, bad fields,
and memory running out part of the way."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed import limits
from changefeed.checkpoint import CheckpointMemoryFullError, Item, MemoryBudget, item_size_bytes
from changefeed.protocol.errors import StatusError
from changefeed.protocol.kv import MutationResult
from changefeed.protocol.opcode import DATATYPE_MASK
from changefeed.storage import Op, Store
from changefeed.vbucket import VBucket, VBucketState

from .twins import assert_flushed_alike

VB = 3
NOW = 1_700_000_000.0
ONE = item_size_bytes(Item(1, b"a", Op.MUTATION, b"v" * 8, 1))
TMPFAIL = 0x86
U32_MAX = 0xFFFF_FFFF


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def twin(path: Path, quota_items: int, lock: bool) -> tuple[VBucket, Store]:
    """A vbucket with a stored key, one that expires, a pending durable write, a committed
    one, a key in memory only and, with `lock`, a locked key (a run then goes one by one)."""
    store = Store(path, map_size_bytes=64 * 1024 * 1024, durable=False)
    clock = Clock()
    vbucket = VBucket(store, VB, state=VBucketState.ACTIVE, clock=clock, rng=random.Random(1),
                      budget=MemoryBudget(quota_items * ONE))  # fmt: skip
    vbucket.set(b"a", b"stored")
    vbucket.set(b"expired", b"soon", expiry=int(NOW) + 5)
    vbucket.set(b"locked", b"held")
    vbucket.set(b"done", b"durable", level=1)
    vbucket.flush()
    vbucket.commit(b"done")
    if lock:
        vbucket.get_locked(b"locked", 30.0)
    vbucket.set(b"pending", b"durable", level=2)
    vbucket.set(b"c", b"in memory only")
    clock.now = NOW + 10  # "expired" is now past its expiry
    return vbucket, store


def answer(outcome: MutationResult | StatusError) -> object:
    if isinstance(outcome, MutationResult):
        return (outcome.vbucket, outcome.seqno, outcome.cas, outcome.vb_uuid)
    return (type(outcome).__name__, outcome.code)


def checkpoints(vbucket: VBucket) -> list[list[object]]:
    return [
        [(type(i).__name__, i.seqno, i.key, i.op, i.body, i.cas, getattr(i, "level", None))
         for i in checkpoint.live_items()]
        for checkpoint in vbucket.manager.checkpoints()
    ]  # fmt: skip


def stored(store: Store) -> list[object]:
    records = [
        (r.seqno, r.key, r.op, r.value, r.cas, r.rev_seqno, r.flags, r.expiry, r.datatype)
        for r in store.scan(VB, 0, store.high_seqno(VB))
    ]
    prepares = [(level, r.seqno, r.key, r.value, r.cas) for level, r in store.prepares(VB)]
    return [records, prepares, store.high_seqno(VB)]


def queued_whole(batch: list[tuple[bytes, bytes, int, int, int]], lock: bool) -> bool:
    """Whether `set_many` with a level queues `batch` as one run (its docstring's clean run:
    no lock held, no key pending, found expired or repeated, every field in range), so that
    memory running out fails every write after it; otherwise it goes write by write."""
    keys = [write[0] for write in batch]
    return (
        not lock
        and len(set(keys)) == len(keys)
        and not {b"pending", b"expired"} & set(keys)
        and all(
            0 < len(key) <= limits.KEY_SIZE_MAX and flags <= U32_MAX and datatype <= DATATYPE_MASK
            for key, _, flags, _, datatype in batch
        )
    )


def commit(vbucket: VBucket, key: bytes) -> MutationResult | StatusError:
    try:
        return vbucket.commit(key)
    except StatusError as error:
        return error


writes = st.lists(
    st.tuples(
        st.sampled_from([b"a", b"c", b"done", b"pending", b"locked", b"expired",
                         b"k" * (limits.STORED_KEY_SIZE_MAX + 1)]
                        + [b"n%d" % i for i in range(8)]),  # new keys: memory runs out
        st.binary(max_size=8),
        st.sampled_from([0, 3] * 4 + [0x1_0000_0000]),  # flags; the last is refused
        st.sampled_from([0, int(NOW) + 100]),  # expiry
        st.sampled_from([0, 1] * 4 + [8]),  # datatype; 8 is refused
    ),
    min_size=1,
    max_size=12,
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    batch=writes,
    quota_items=st.sampled_from([6, 6, 10, 16, 1000]),  # 6: memory runs out part of the way
    level=st.integers(1, 3),
    lock=st.sampled_from([False, False, True]),
)
def test_a_run_of_prepares_is_set_with_the_level_one_by_one(
    tmp_path_factory: pytest.TempPathFactory,
    batch: list[tuple[bytes, bytes, int, int, int]],
    quota_items: int,
    level: int,
    lock: bool,
) -> None:
    run_vb, run_store = twin(tmp_path_factory.mktemp("run"), quota_items, lock)
    one_vb, one_store = twin(tmp_path_factory.mktemp("one"), quota_items, lock)
    try:
        keys, values, flags, expiries, datatypes = (list(c) for c in zip(*batch, strict=True))
        got = run_vb.set_many(keys, values, flags, expiries, datatypes, level=level).results()
        want: list[MutationResult | StatusError] = []
        whole = queued_whole(batch, lock)
        full = False
        for key, value, flag, expiry, datatype in batch:
            if full and whole:  # a run queued whole stops where memory ran out
                want.append(CheckpointMemoryFullError(f"vb {VB}: checkpoint memory is full"))
                continue
            try:  # one by one, a later write may still fit
                want.append(one_vb.set(key, value, flags=flag, expiry=expiry,
                                       datatype=datatype, level=level))  # fmt: skip
            except StatusError as error:
                want.append(error)
                full = full or error.code == TMPFAIL
        assert list(map(answer, got)) == list(map(answer, want))
        assert run_vb.high_seqno == one_vb.high_seqno
        assert run_vb.pending_prepares == one_vb.pending_prepares
        assert checkpoints(run_vb) == checkpoints(one_vb)
        assert_flushed_alike(run_vb, run_store, one_vb, one_store, stored)
        for key in keys:  # and they commit the same (or both find memory full)
            if run_vb.pending_prepare(key) is not None:
                assert answer(commit(run_vb, key)) == answer(commit(one_vb, key))
        assert_flushed_alike(run_vb, run_store, one_vb, one_store, stored)
    finally:
        run_store.close()
        one_store.close()


def test_a_clean_run_of_prepares_is_queued_as_one_run(tmp_path: Path) -> None:
    """New distinct keys: one `queue_prepares` (no `queue` per write), each pending."""
    vbucket, store = twin(tmp_path, 1000, lock=False)
    try:
        calls: list[str] = []
        manager = vbucket.manager
        queue, queue_prepares = manager.queue, manager.queue_prepares
        manager.queue = lambda item: (calls.append("queue"), queue(item))[1]  # type: ignore[method-assign]
        manager.queue_prepares = lambda items: (calls.append("run"), queue_prepares(items))[1]  # type: ignore[method-assign]
        keys = [b"new-%d" % i for i in range(50)]
        result = vbucket.set_many(keys, [b"v"] * 50, [0] * 50, [0] * 50, [0] * 50, level=1)
        assert calls == ["run"] and not result.errors
        assert [p.key for p in vbucket.pending_prepares][-50:] == keys
        assert list(result.seqnos) == [p.seqno for p in vbucket.pending_prepares][-50:]
    finally:
        store.close()
