"""`VBucket.commit_many` (a run of SyncWrite commits queued as one checkpoint run) against
`commit` one key at a time on a twin vbucket: the same answers, the same documents read back
(CAS included: a key locked while its prepare was pending is unlocked by its commit) and, once
flushed, the same records field for field, high completed seqno and pending prepares on disk."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import CheckpointManager, CheckpointMemoryFullError
from changefeed.protocol.errors import KeyNotFoundError, StatusError
from changefeed.protocol.kv import MutationResult
from changefeed.storage import Store
from changefeed.vbucket import VBucket

NOW = 1_700_000_000.0
JSON_DATATYPE = 0x01  # not the default (raw, 0)

writes = st.lists(
    st.tuples(st.integers(0, 7), st.integers(0, 3), st.booleans()),  # key, level, plain first
    min_size=1,
    max_size=20,
)


def twin(root: Path, name: str) -> tuple[Store, VBucket]:
    store = Store(root / name, map_size_bytes=64 << 20, durable=False)
    return store, VBucket(store, 0, clock=lambda: NOW, rng=random.Random(1))


def prepare_all(vbucket: VBucket, script: list[tuple[int, int, bool]]) -> list[bytes]:
    """Plain writes and prepares (flags, expiry and datatype not the defaults, so a commit that
    dropped one shows; a key written twice has rev seqno 2); the keys with a prepare pending,
    oldest first."""
    for number, (key_number, level, plain_first) in enumerate(script):
        key = b"k%d" % key_number
        if vbucket.pending_prepare(key) is not None:
            continue
        if plain_first:
            vbucket.set(key, b"plain%d" % number, flags=7, expiry=int(NOW) + 9000)
        if level:
            vbucket.set(
                key, b"durable%d" % number, flags=0xABC0 + number, expiry=int(NOW) + 3600 + number,
                datatype=JSON_DATATYPE, level=level,
            )  # fmt: skip
    return [prepare.key for prepare in vbucket.pending_prepares]


def lock_some(twins: tuple[VBucket, VBucket], keys: list[bytes], data: st.DataObject) -> None:
    """GET_LOCKED some of `keys` (those with a version to lock) on both twins alike."""
    for key in keys:
        if data.draw(st.booleans()) and twins[0].get(key) is not None:
            for vbucket in twins:
                vbucket.get_locked(key, 15)


def read_back(vbucket: VBucket, key: bytes) -> tuple[object, ...] | None:
    """What a GET of `key` sees, every field of the document."""
    doc = vbucket.get(key)
    if doc is None:
        return None
    return doc.value, doc.cas, doc.flags, doc.expiry, doc.datatype, doc.seqno, doc.rev_seqno


def one_at_a_time(vbucket: VBucket, keys: list[bytes]) -> list[MutationResult | StatusError]:
    out: list[MutationResult | StatusError] = []
    for key in keys:
        try:
            out.append(vbucket.commit(key))
        except KeyNotFoundError as error:
            out.append(error)
    return out


def summary(vbucket: VBucket, store: Store) -> tuple[object, ...]:
    vbucket.flush()
    records = [
        (r.key, r.seqno, r.op, r.value, r.cas, r.flags, r.expiry, r.datatype, r.rev_seqno)
        for r in store.scan(0, 0, 1 << 40)
    ]
    pending = [(p.key, p.seqno) for p in vbucket.pending_prepares]
    return records, store.high_completed_seqno(0), pending, vbucket.high_seqno


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(writes, st.data())
def test_commit_many_is_commit_one_key_at_a_time(
    script: list[tuple[int, int, bool]], data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as root:
        store_a, run_of = twin(Path(root), "a")
        store_b, singles = twin(Path(root), "b")
        try:
            pending = prepare_all(run_of, script)
            assert prepare_all(singles, script) == pending
            lock_some((run_of, singles), pending, data)
            # Some of the pending keys, in their order, and a key with nothing pending.
            chosen = [k for k in pending if data.draw(st.booleans())]
            keys = [*chosen, b"nothing-pending"] if data.draw(st.booleans()) else chosen
            got = run_of.commit_many(keys)
            want = one_at_a_time(singles, keys)
            assert [type(x) for x in got] == [type(x) for x in want]
            assert [x for x in got if isinstance(x, MutationResult)] == [
                x for x in want if isinstance(x, MutationResult)
            ]
            for key in pending:
                assert read_back(run_of, key) == read_back(singles, key), key
            assert summary(run_of, store_a) == summary(singles, store_b)
        finally:
            store_a.close()
            store_b.close()


def pending_with_room_for_two(vbucket: VBucket, count: int) -> CheckpointManager:
    """Prepares k0.. (``count`` of them) left pending on ``vbucket``, whose checkpoint memory
    then runs out after two items of any run queued; returns its manager."""
    for n in range(count):
        vbucket.set(b"k%d" % n, b"v%d" % n, level=1)
    manager = vbucket.manager
    real: Callable[..., int] = manager.queue_run

    def two_fit(items: list[object], *, commits: bool = False) -> int:
        return real(items[:2], commits=commits)  # memory ran out after two

    manager.queue_run = two_fit  # type: ignore[method-assign,assignment]
    return manager


def test_memory_full_part_of_the_way_leaves_the_rest_pending(tmp_path: Path) -> None:
    store, vbucket = twin(tmp_path, "a")
    try:
        manager = pending_with_room_for_two(vbucket, 4)
        got = vbucket.commit_many([b"k0", b"k1", b"k2", b"k3"])
        assert [r.seqno for r in got if isinstance(r, MutationResult)] == [5, 6]
        assert len(got) == 2
        assert [p.key for p in vbucket.pending_prepares] == [b"k2", b"k3"]
        assert vbucket.get(b"k1").value == b"v1"

        def full(items: list[object], *, commits: bool = False) -> int:
            raise CheckpointMemoryFullError("full")

        manager.queue_run = full  # type: ignore[method-assign,assignment]
        try:
            vbucket.commit_many([b"k2"])
        except CheckpointMemoryFullError:
            pass
        else:
            raise AssertionError("a run that does not fit at all raises")
        assert [p.key for p in vbucket.pending_prepares] == [b"k2", b"k3"]
    finally:
        store.close()


def test_memory_full_part_of_the_way_with_keys_not_pending(tmp_path: Path) -> None:
    """A run mixing pending keys and keys with nothing pending: the answers end at the first
    commit memory did not take (a KeyNotFound before it is answered, none after it)."""
    store, vbucket = twin(tmp_path, "a")
    try:
        pending_with_room_for_two(vbucket, 3)
        got = vbucket.commit_many([b"k0", b"x", b"k1", b"y", b"k2", b"z"])
        assert [type(r) for r in got] == [
            MutationResult, KeyNotFoundError, MutationResult, KeyNotFoundError
        ]  # fmt: skip
        assert [r.seqno for r in got if isinstance(r, MutationResult)] == [4, 5]
        assert [p.key for p in vbucket.pending_prepares] == [b"k2"]
    finally:
        store.close()
