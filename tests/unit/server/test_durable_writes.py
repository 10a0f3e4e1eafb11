"""`sync_writes.DurableWrites`, the sans-IO decisions on waiting durable writes, driven directly
(no event loop): a real vbucket on a real store, a real `ReplicationTracker` on a manual clock.
The node's `SyncWriteMonitor` and the cluster simulator are its two shells."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.protocol.errors import (
    DurabilityImpossibleError,
    StatusError,
    SyncWriteAmbiguousError,
)
from changefeed.protocol.frame_info import DurabilityLevel
from changefeed.protocol.kv import MutationResult
from changefeed.server.replication import ReplicationTracker
from changefeed.server.sync_writes import DurableWrites, Waiter
from changefeed.storage import Store
from changefeed.vbucket import VBucket
from changefeed.vbucket_state import VBucketState

VB = 0
REPLICAS = ["r1", "r2"]  # a chain of three: a majority is two copies


@pytest.fixture
def vbucket(tmp_path: Path) -> Iterator[VBucket]:
    store = Store(tmp_path, map_size_bytes=64 << 20, durable=False)
    yield VBucket(store, VB, rng=random.Random(3))
    store.close()


def decisions_of(vbucket: VBucket) -> tuple[DurableWrites, ReplicationTracker]:
    tracker = ReplicationTracker(lambda vb: vbucket.high_seqno, lag_max_s=10.0, clock=lambda: 0.0)
    for replica in REPLICAS:
        tracker.stream_opened(VB, replica, 0)
    decisions = DurableWrites(lambda vb: vbucket, replicas_of=lambda vb: REPLICAS,
                              replication=tracker)  # fmt: skip
    return decisions, tracker


def wait_for(
    decisions: DurableWrites, vbucket: VBucket, key: bytes, level: DurabilityLevel
) -> tuple[Waiter, list[MutationResult | StatusError]]:
    answers: list[MutationResult | StatusError] = []
    prepared = vbucket.set(key, b"v", level=int(level))
    waiter = Waiter(VB, key, prepared.seqno, level, answers.append)
    decisions.add(waiter)
    return waiter, answers


def test_a_write_commits_once_the_active_persisted_and_a_majority_received(
    vbucket: VBucket,
) -> None:
    decisions, tracker = decisions_of(vbucket)
    waiter, answers = wait_for(decisions, vbucket, b"k", DurabilityLevel.MAJORITY)
    tracker.acknowledged(VB, "r1", waiter.seqno, 0)
    assert answers == [] and decisions.waiting_on(VB) == 1  # the active has not persisted
    vbucket.flush()
    decisions.on_persisted([VB])
    assert len(answers) == 1 and isinstance(answers[0], MutationResult)
    assert answers[0].seqno == waiter.seqno + 1  # the commit's own seqno
    assert decisions.waiting_on(VB) == 0 and decisions.stats.committed == 1
    assert vbucket.pending_prepares == []


def test_persist_to_majority_waits_for_a_replica_to_persist(vbucket: VBucket) -> None:
    decisions, tracker = decisions_of(vbucket)
    waiter, answers = wait_for(decisions, vbucket, b"k", DurabilityLevel.PERSIST_TO_MAJORITY)
    vbucket.flush()
    tracker.acknowledged(VB, "r1", waiter.seqno, waiter.seqno - 1)  # received, not persisted
    decisions.on_persisted([VB])
    assert answers == []
    tracker.acknowledged(VB, "r1", waiter.seqno, waiter.seqno)
    decisions.on_progress(VB)
    assert len(answers) == 1 and isinstance(answers[0], MutationResult)


def test_a_timeout_aborts_the_prepare_and_answers_ambiguous_once(vbucket: VBucket) -> None:
    decisions, _ = decisions_of(vbucket)
    waiter, answers = wait_for(decisions, vbucket, b"k", DurabilityLevel.MAJORITY)
    assert decisions.expire(waiter)
    assert len(answers) == 1 and isinstance(answers[0], SyncWriteAmbiguousError)
    assert vbucket.pending_prepares == [] and decisions.stats.aborted == 1
    assert decisions.expire(waiter)  # a second timer firing changes nothing
    assert len(answers) == 1 and decisions.stats.aborted == 1


def test_a_vbucket_that_stops_being_active_answers_its_waiters_in_the_call(
    vbucket: VBucket,
) -> None:
    decisions, _ = decisions_of(vbucket)
    _, first = wait_for(decisions, vbucket, b"a", DurabilityLevel.MAJORITY)
    _, second = wait_for(decisions, vbucket, b"b", DurabilityLevel.PERSIST_TO_MAJORITY)
    vbucket.set_state(VBucketState.REPLICA)
    assert decisions.on_state_changed(VB) == 2
    for answers in (first, second):
        assert len(answers) == 1 and isinstance(answers[0], SyncWriteAmbiguousError)
    assert decisions.waiting_on(VB) == 0
    assert [p.key for p in vbucket.pending_prepares] == [b"a", b"b"]  # kept for a promotion


def test_a_write_is_impossible_without_a_reachable_majority(vbucket: VBucket) -> None:
    decisions, tracker = decisions_of(vbucket)
    decisions.check_possible(VB)
    tracker.stream_closed(VB, "r1")
    decisions.check_possible(VB)  # the active and r2: two of three
    tracker.stream_closed(VB, "r2")
    with pytest.raises(DurabilityImpossibleError, match="1 of 3 copies reachable"):
        decisions.check_possible(VB)
    assert decisions.stats.impossible == 1
