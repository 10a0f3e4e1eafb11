"""Durable writes right after a vbucket becomes active: its map's replicas are still opening
their streams. A write then used to be refused DURABILITY_IMPOSSIBLE ("1 of 3 copies
reachable"), which SDKs do not retry: a durable write just after a failover or a cluster start
failed (tests/cluster/test_fencing.py and test_etcd_tls.py met it under load). Within
CONNECT_GRACE_S of the activation a replica that has not opened a stream since counts as
reachable; the commit still needs its ack."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.protocol.errors import DurabilityImpossibleError
from changefeed.server.context import change_vbucket_state
from changefeed.server.replication import CONNECT_GRACE_S, ReplicationTracker
from changefeed.server.sync_writes import DurableWrites
from changefeed.storage import Store
from changefeed.vbucket import VBucket
from changefeed.vbucket_state import VBucketState

VB = 0
REPLICAS = ["r1", "r2"]  # a chain of three: a majority is two copies


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def vbucket(tmp_path: Path) -> Iterator[VBucket]:
    store = Store(tmp_path, map_size_bytes=64 << 20, durable=False)
    vbucket = VBucket(store, VB, rng=random.Random(3))
    vbucket.set_state(VBucketState.REPLICA)
    yield vbucket
    store.close()


def promoted(vbucket: VBucket, clock: Clock) -> tuple[DurableWrites, ReplicationTracker]:
    tracker = ReplicationTracker(lambda vb: vbucket.high_seqno, lag_max_s=10.0, clock=clock)
    decisions = DurableWrites(
        lambda vb: vbucket, replicas_of=lambda vb: REPLICAS, replication=tracker
    )
    change_vbucket_state(
        vbucket, VBucketState.ACTIVE, waiters=None, end_streams=lambda: None, replication=tracker
    )
    return decisions, tracker


def test_replicas_still_connecting_after_a_promotion_count_as_reachable(vbucket: VBucket) -> None:
    clock = Clock()
    decisions, tracker = promoted(vbucket, clock)
    decisions.check_possible(VB)  # no stream yet: both still connecting
    clock.now += CONNECT_GRACE_S
    with pytest.raises(DurabilityImpossibleError, match="1 of 3 copies reachable"):
        decisions.check_possible(VB)  # the grace is over: not connected is unreachable
    tracker.stream_opened(VB, "r1", 0)
    decisions.check_possible(VB)  # one replica and the active: a majority


def test_a_replica_that_opened_and_closed_since_the_promotion_is_not_reachable(
    vbucket: VBucket,
) -> None:
    clock = Clock()
    decisions, tracker = promoted(vbucket, clock)
    for replica in REPLICAS:
        tracker.stream_opened(VB, replica, 0)
        tracker.stream_closed(VB, replica)
    with pytest.raises(DurabilityImpossibleError):
        decisions.check_possible(VB)


def test_a_vbucket_that_stops_being_active_loses_its_grace(vbucket: VBucket) -> None:
    clock = Clock()
    _, tracker = promoted(vbucket, clock)
    assert tracker.reachable(VB, "r1")
    change_vbucket_state(
        vbucket, VBucketState.REPLICA, waiters=None, end_streams=lambda: None, replication=tracker
    )
    assert not tracker.reachable(VB, "r1")
