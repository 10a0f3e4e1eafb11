"""What a crashed copy's disk vouches for (rules.copy_holds_its_branch, judged as NodeAgent
does at start), on the real store and vbucket.

A kill is modelled by closing the store with writes queued but not flushed and reopening it
marked unclean: the queued writes are gone, as after kill -9. The failure these guard: the
recovery of a crashed active starts a new branch at the persisted end and drops the entries
above it, so the recovered log no longer shows that the branch began past what the disk
kept, and the copy was vouched for although it lacked what it acknowledged as a replica."""

from __future__ import annotations

import random
from pathlib import Path

from changefeed.checkpoint import Item
from changefeed.cluster.rules import copy_holds_its_branch, recovered_state
from changefeed.storage import Op, Store
from changefeed.vbucket import VBucket
from changefeed.vbucket_state import VBucketState


def _open(path: Path, *, killed: bool) -> tuple[Store, VBucket, bool]:
    """Open the store and vbucket 0 as a restarted node does, and judge the copy."""
    store = Store(path, durable=False)
    if killed:
        store.was_clean_shutdown = False
    vbucket = VBucket(
        store, 0, state=VBucketState.ACTIVE, clock=lambda: 1.7e9, rng=random.Random(1)
    )
    clean = store.was_clean_shutdown
    holds = copy_holds_its_branch(vbucket.state, clean, bool(vbucket.failover_log.dropped_above))
    return store, vbucket, holds


def _promoted_with_unflushed_acks(path: Path) -> None:
    """A replica that acknowledged seqnos 2..3 from memory is promoted at 3, then killed
    before flushing them (ACTIVE and its branch entry at 3 are persisted at once)."""
    store, vbucket, _ = _open(path, killed=False)
    vbucket.set(b"a", b"1")
    vbucket.flush()
    vbucket.set_state(VBucketState.REPLICA)
    vbucket.replica_snapshot(2, 3)
    vbucket.queue_replicated(Item(2, b"b", Op.MUTATION, b"acked", cas=10))
    vbucket.queue_replicated(Item(3, b"c", Op.MUTATION, b"acked", cas=11))
    vbucket.set_state(VBucketState.ACTIVE)
    assert vbucket.failover_log.latest[1] == 3
    store.close()


def test_an_active_killed_before_its_branch_start_was_persisted_is_not_vouched_for(
    tmp_path: Path,
) -> None:
    _promoted_with_unflushed_acks(tmp_path)
    store, vbucket, holds = _open(tmp_path, killed=True)
    assert vbucket.state is VBucketState.ACTIVE and vbucket.high_seqno == 1
    assert not holds, vbucket.failover_log.entries
    store.close()


def test_a_crash_loop_before_any_map_is_not_vouched_for(tmp_path: Path) -> None:
    """The second start stores its recovered state before registering (recovered_state)
    and is killed, or stopped cleanly, before any map: the third start must not take the
    copy, which still lacks 2..3 (it stored PENDING, which the third start vouched for)."""
    for killed in (True, False):
        path = tmp_path / str(killed)
        _promoted_with_unflushed_acks(path)
        store, vbucket, holds = _open(path, killed=True)
        assert not holds
        vbucket.set_state(recovered_state(vbucket.state, holds_branch=holds))
        store.close()
        store, vbucket, holds = _open(path, killed=killed)
        assert vbucket.state is VBucketState.REPLICA and vbucket.high_seqno == 1
        assert not holds, vbucket.failover_log.entries
        store.close()


def test_a_vouched_copy_waits_pending_and_stays_vouched_for(tmp_path: Path) -> None:
    """A clean stop while active, then a start that stores PENDING (no map yet) and stops
    cleanly again (a whole cluster restarted twice while etcd is away): still vouched for."""
    store, vbucket, _ = _open(tmp_path, killed=False)
    vbucket.set(b"a", b"1")
    vbucket.flush()
    store.close()
    for _ in range(2):
        store, vbucket, holds = _open(tmp_path, killed=False)
        assert holds, vbucket.state
        vbucket.set_state(recovered_state(vbucket.state, holds_branch=holds))
        assert vbucket.state is VBucketState.PENDING
        store.close()


def test_an_active_whose_branch_start_was_persisted_is_vouched_for(tmp_path: Path) -> None:
    """Promoted at 3 after flushing what it acknowledged; its own writes 4..5 acknowledged
    only once persisted; killed: its disk holds its whole branch, crashed or stopped."""
    store, vbucket, _ = _open(tmp_path, killed=False)
    vbucket.set(b"a", b"1")
    vbucket.flush()
    vbucket.set_state(VBucketState.REPLICA)
    vbucket.replica_snapshot(2, 3)
    vbucket.queue_replicated(Item(2, b"b", Op.MUTATION, b"acked", cas=10))
    vbucket.queue_replicated(Item(3, b"c", Op.MUTATION, b"acked", cas=11))
    vbucket.flush()
    vbucket.set_state(VBucketState.ACTIVE)
    vbucket.set(b"d", b"4")
    vbucket.set(b"e", b"5")
    vbucket.flush()
    vbucket.set(b"f", b"unacknowledged")  # queued, never persisted: lost, never acked durably
    store.close()
    store, vbucket, holds = _open(tmp_path, killed=True)
    assert vbucket.high_seqno == 5
    assert holds, vbucket.failover_log.entries
    store.close()
    store, vbucket, holds = _open(tmp_path, killed=False)  # the crash's branch, stopped clean
    assert vbucket.state is VBucketState.ACTIVE and holds
    store.close()
