"""``VBucket``: seqnos and CAS, set/add/replace/delete/get (memory then store), states and the
failover log, refusal under memory pressure, lazy expiry, and recovery from the store."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.checkpoint import (
    CAUGHT_UP,
    CheckpointMemoryFullError,
    Item,
    MemoryBudget,
    item_size_bytes,
)
from changefeed.protocol.errors import (
    InvalidArgumentsError,
    KeyExistsError,
    KeyNotFoundError,
    NotMyVbucketError,
    TemporaryFailureError,
)
from changefeed.protocol.status import Status
from changefeed.storage import Op, Store
from changefeed.vbucket import VBucket, VBucketState

VB = 3
SEED = 20240611


class FakeClock:
    """Wall-clock seconds that only move when the test says so."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(tmp_path, map_size_bytes=256 * 1024 * 1024, durable=False)
    yield opened
    opened.close()


def make(
    store: Store,
    clock: FakeClock | None = None,
    *,
    state: VBucketState = VBucketState.ACTIVE,
    budget: MemoryBudget | None = None,
) -> VBucket:
    print(f"rng seed {SEED}")
    return VBucket(
        store, VB, state=state, clock=clock or FakeClock(), rng=random.Random(SEED), budget=budget
    )


def test_a_new_vbucket_is_created_in_the_store_with_a_fresh_failover_log(store: Store) -> None:
    vbucket = make(store)
    assert vbucket.state is VBucketState.ACTIVE
    assert vbucket.high_seqno == vbucket.persisted_seqno == vbucket.purge_seqno == 0
    assert len(vbucket.failover_log) == 1
    assert vbucket.failover_log.latest == (vbucket.vb_uuid, 0)
    meta = store.vbucket_meta(VB)
    assert meta is not None
    assert meta.state == "active"
    assert meta.failover_log == vbucket.failover_log.entries


def test_writes_get_increasing_seqnos_and_cas_even_with_a_stopped_clock(store: Store) -> None:
    vbucket = make(store)
    results = [vbucket.set(b"k%d" % n, b"v") for n in range(5)]
    assert [r.seqno for r in results] == [1, 2, 3, 4, 5]
    cas_values = [r.cas for r in results]
    assert cas_values == sorted(set(cas_values))
    assert all(r.vb_uuid == vbucket.vb_uuid for r in results)
    assert vbucket.high_seqno == 5


def test_get_reads_memory_first_then_the_store(store: Store) -> None:
    vbucket = make(store)
    first = vbucket.set(b"a", b"1", flags=7, datatype=1)
    document = vbucket.get(b"a")
    assert document is not None
    assert (document.value, document.cas, document.flags, document.seqno) == (b"1", first.cas, 7, 1)
    vbucket.flush()
    vbucket.manager.close_open_checkpoint()  # freed: only the store has it now
    assert vbucket.manager.find(b"a") is None
    from_store = vbucket.get(b"a")
    assert from_store == document
    assert vbucket.get(b"missing") is None


def test_cas_checks(store: Store) -> None:
    vbucket = make(store)
    written = vbucket.set(b"a", b"1")
    with pytest.raises(KeyExistsError):
        vbucket.set(b"a", b"2", cas=written.cas + 1)
    with pytest.raises(KeyNotFoundError):
        vbucket.set(b"nope", b"2", cas=123)
    again = vbucket.set(b"a", b"2", cas=written.cas)
    assert again.cas > written.cas
    with pytest.raises(KeyExistsError):
        vbucket.delete(b"a", cas=written.cas)
    vbucket.delete(b"a", cas=again.cas)
    assert vbucket.get(b"a") is None


def test_add_replace_and_delete_semantics(store: Store) -> None:
    vbucket = make(store)
    with pytest.raises(KeyNotFoundError):
        vbucket.replace(b"a", b"x")
    with pytest.raises(KeyNotFoundError):
        vbucket.delete(b"a")
    vbucket.add(b"a", b"1")
    with pytest.raises(KeyExistsError):
        vbucket.add(b"a", b"2")
    vbucket.replace(b"a", b"3")
    got = vbucket.get(b"a")
    assert got is not None
    assert got.value == b"3"
    assert got.rev_seqno == 2
    vbucket.delete(b"a")
    vbucket.add(b"a", b"4")  # a deleted key can be added again
    assert vbucket.high_seqno == 4


def test_tombstones_reach_the_store_with_the_clock_delete_time(store: Store) -> None:
    clock = FakeClock(1_700_000_123.0)
    vbucket = make(store, clock)
    vbucket.set(b"a", b"1")
    deleted = vbucket.delete(b"a")
    vbucket.flush()
    record = store.get(VB, b"a")
    assert record is not None
    assert record.deleted
    assert record.seqno == deleted.seqno
    assert record.delete_time == 1_700_000_123
    assert record.rev_seqno == 2


def test_writes_need_an_active_vbucket_and_replicas_take_streamed_items(store: Store) -> None:
    vbucket = make(store, state=VBucketState.REPLICA)
    with pytest.raises(NotMyVbucketError):
        vbucket.set(b"a", b"1")
    with pytest.raises(NotMyVbucketError):
        vbucket.delete(b"a")
    with pytest.raises(InvalidArgumentsError, match="outside the snapshot"):
        vbucket.queue_replicated(Item(7, b"a", Op.MUTATION, b"no-marker-yet", cas=999))
    vbucket.replica_snapshot(1, 7)  # the active's marker comes first
    vbucket.queue_replicated(Item(7, b"a", Op.MUTATION, b"from-active", cas=999))
    assert vbucket.high_seqno == 7
    got = vbucket.get(b"a")
    assert got is not None
    assert (got.value, got.cas) == (b"from-active", 999)
    vbucket.set_state(VBucketState.DEAD)
    with pytest.raises(NotMyVbucketError):
        vbucket.get(b"a")


def test_promotion_to_active_adds_a_persisted_failover_entry(store: Store) -> None:
    vbucket = make(store, state=VBucketState.REPLICA)
    vbucket.replica_snapshot(1, 2)
    vbucket.queue_replicated(Item(1, b"a", Op.MUTATION, b"1", cas=5))
    vbucket.queue_replicated(Item(2, b"b", Op.MUTATION, b"2", cas=6))
    old_uuid = vbucket.vb_uuid
    vbucket.set_state(VBucketState.ACTIVE)
    assert len(vbucket.failover_log) == 2
    assert vbucket.failover_log.latest[1] == 2
    assert vbucket.vb_uuid != old_uuid
    meta = store.vbucket_meta(VB)
    assert meta is not None
    assert meta.state == "active"
    assert meta.failover_log == vbucket.failover_log.entries
    result = vbucket.set(b"c", b"3")
    assert result.seqno == 3
    assert result.cas > 6  # the hybrid clock stays above CAS values it has seen
    vbucket.set_state(VBucketState.ACTIVE)  # no change, no new entry
    assert len(vbucket.failover_log) == 2


def test_memory_full_refuses_the_write_and_changes_nothing(store: Store) -> None:
    one = item_size_bytes(Item(1, b"k00", Op.MUTATION, b"v" * 50, cas=1))
    vbucket = make(store, budget=MemoryBudget(20 * one))
    with pytest.raises(TemporaryFailureError) as refused:
        for n in range(100):
            vbucket.set(b"k%02d" % n, b"v" * 50)
    assert refused.value.retriable
    assert isinstance(refused.value, CheckpointMemoryFullError)
    assert refused.value.code == Status.ETMPFAIL  # the reply status, with no translation between
    high = vbucket.high_seqno
    assert 0 < high < 100
    assert vbucket.get(b"k%02d" % high) is None  # the refused write left no trace
    vbucket.flush()
    assert vbucket.set(b"again", b"v").seqno == high + 1  # no seqno was used up


def test_invalid_fields_are_refused_before_queueing(store: Store) -> None:
    vbucket = make(store)
    with pytest.raises(InvalidArgumentsError):
        vbucket.set(b"", b"v")
    with pytest.raises(InvalidArgumentsError):
        vbucket.set(b"k" * 300, b"v")
    with pytest.raises(InvalidArgumentsError):
        vbucket.set(b"k", b"v", datatype=0x80)
    with pytest.raises(InvalidArgumentsError):
        vbucket.set(b"k", b"v", flags=2**32)
    assert vbucket.high_seqno == 0
    vbucket.flush()  # nothing bad reached the flusher


def test_expired_documents_read_as_missing_and_queue_an_expiration(store: Store) -> None:
    clock = FakeClock(1000.0)
    vbucket = make(store, clock)
    vbucket.set(b"a", b"1", expiry=1500)
    assert vbucket.get(b"a") is not None
    clock.now = 1500.0
    assert vbucket.get(b"a") is None
    assert vbucket.high_seqno == 2
    vbucket.flush()
    record = store.get(VB, b"a")
    assert record is not None
    assert record.op is Op.EXPIRATION


def test_recovery_restores_state_seqnos_and_failover_log(tmp_path: Path) -> None:
    store = Store(tmp_path, durable=False)
    vbucket = make(store)
    for n in range(10):
        vbucket.set(b"k%d" % n, b"v%d" % n)
    last = vbucket.set(b"k0", b"newest")
    log = vbucket.failover_log.entries
    vbucket.close()
    store.close()
    store = Store(tmp_path, durable=False)
    recovered = make(store, FakeClock(0.0))  # a clock behind the old CAS values
    assert recovered.state is VBucketState.ACTIVE
    assert recovered.high_seqno == recovered.persisted_seqno == 11
    assert recovered.failover_log.entries == log  # clean shutdown: same branch
    got = recovered.get(b"k0")
    assert got is not None
    assert (got.value, got.cas) == (b"newest", last.cas)
    assert recovered.set(b"k1", b"x").cas > last.cas
    reader = recovered.stream("s", 0)
    keys = {event.key for event in reader if isinstance(event, Item)}
    assert keys == {b"k%d" % n for n in range(10)}
    assert reader.next() is CAUGHT_UP
    reader.close()
    store.close()


def test_recovery_after_an_unclean_shutdown_starts_a_new_branch(tmp_path: Path) -> None:
    store = Store(tmp_path, durable=False)
    vbucket = make(store)
    vbucket.set(b"a", b"1")
    vbucket.flush()
    vbucket.set(b"b", b"lost")  # acknowledged, never persisted
    old_uuid = vbucket.vb_uuid
    store.close()
    store = Store(tmp_path, durable=False)
    store.was_clean_shutdown = False  # as if the process had been killed
    recovered = make(store)
    assert recovered.high_seqno == 1
    assert recovered.vb_uuid != old_uuid
    assert recovered.failover_log.latest == (recovered.vb_uuid, 1)
    assert recovered.get(b"b") is None
    store.close()


def test_stream_sees_every_write(store: Store) -> None:
    vbucket = make(store)
    reader = vbucket.stream("s", 0)
    for n in range(20):
        vbucket.set(b"k%d" % (n % 4), b"v%d" % n)
    vbucket.delete(b"k0")
    latest: dict[bytes, Op] = {}
    for event in reader:
        if isinstance(event, Item):
            latest[event.key] = event.op
    assert latest == {
        b"k0": Op.DELETION,
        b"k1": Op.MUTATION,
        b"k2": Op.MUTATION,
        b"k3": Op.MUTATION,
    }


# -- replica vbuckets (issue 11) ---------------------------------------------------------------


def replicate(vbucket: VBucket, snap: tuple[int, int], *items: tuple[int, bytes, int]) -> None:
    """A marker and its items (seqno, key, rev_seqno), as a replica stream delivers them."""
    vbucket.replica_snapshot(*snap)
    for seqno, key, rev in items:
        vbucket.queue_replicated(
            Item(seqno, key, Op.MUTATION, b"v%d" % seqno, cas=1000 + seqno, rev_seqno=rev)
        )


def test_a_replica_persists_a_partly_received_snapshot_and_asks_for_the_rest(
    store: Store,
) -> None:
    vbucket = make(store, state=VBucketState.REPLICA)
    replicate(vbucket, (1, 2), (1, b"a", 1), (2, b"b", 1))
    assert vbucket.replica_request_range() == (2, 2, 2)  # a whole snapshot held
    replicate(vbucket, (3, 6), (3, b"c", 1), (4, b"d", 1))
    assert vbucket.replica_request_range() == (4, 3, 6)  # inside [3, 6]
    vbucket.flush()
    meta = store.vbucket_meta(VB)
    assert meta is not None and (meta.high_seqno, meta.snap_start, meta.snap_end) == (4, 3, 6)
    vbucket.release()
    reopened = make(store, state=VBucketState.REPLICA)  # a restart: the range comes from disk
    assert reopened.replica_request_range() == (4, 3, 6)
    with pytest.raises(InvalidArgumentsError, match="outside the snapshot"):
        reopened.queue_replicated(Item(5, b"e", Op.MUTATION, b"x", cas=1))  # marker first


def test_a_replica_rolls_back_exactly_when_the_discarded_items_are_first_versions(
    store: Store,
) -> None:
    vbucket = make(store, state=VBucketState.REPLICA)
    replicate(vbucket, (1, 4), (1, b"a", 1), (2, b"b", 1), (3, b"c", 1), (4, b"d", 1))
    assert vbucket.rollback(2) == 2
    assert (vbucket.high_seqno, vbucket.persisted_seqno) == (2, 2)
    assert vbucket.get(b"b") is not None and vbucket.get(b"c") is None
    replicate(vbucket, (3, 3), (3, b"z", 1))  # it takes the new branch from there
    assert vbucket.get(b"z") is not None


def test_a_replica_that_cannot_rebuild_the_rollback_point_rolls_back_to_zero(
    store: Store,
) -> None:
    vbucket = make(store, state=VBucketState.REPLICA)
    replicate(vbucket, (1, 3), (1, b"a", 1), (2, b"b", 1), (3, b"a", 2))  # a's 2nd version
    assert vbucket.rollback(2) == 0  # a@1 is gone from the store: no silent gap, a rebuild
    assert vbucket.high_seqno == 0
    assert vbucket.get(b"a") is None and vbucket.get(b"b") is None
    replicate(vbucket, (1, 1), (1, b"a", 1))


def test_a_replica_takes_its_actives_failover_log_and_only_a_replica_does(store: Store) -> None:
    vbucket = make(store, state=VBucketState.REPLICA)
    vbucket.adopt_failover_log([(77, 10), (55, 0)])
    assert vbucket.vb_uuid == 77
    meta = store.vbucket_meta(VB)
    assert meta is not None and meta.failover_log == [(77, 10), (55, 0)]
    vbucket.set_state(VBucketState.ACTIVE)
    with pytest.raises(NotMyVbucketError):
        vbucket.adopt_failover_log([(1, 0)])
    with pytest.raises(NotMyVbucketError):
        vbucket.rollback(0)
