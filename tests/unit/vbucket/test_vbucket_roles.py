"""The roles a vbucket's states give it (`vbucket.roles`): each state's role takes what the
state takes and refuses the rest with NOT_MY_VBUCKET naming the state; every transition swaps
in a new role, locks leave with the active role, and pending prepares pass from role to role."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from changefeed.checkpoint import Item, SyncItem
from changefeed.protocol.errors import NotMyVbucketError
from changefeed.storage import Op, Store
from changefeed.vbucket import VBucket
from changefeed.vbucket.active import ActiveRole
from changefeed.vbucket.dead import DeadRole
from changefeed.vbucket.replica import ReplicaRole
from changefeed.vbucket.roles import ROLE_OF
from changefeed.vbucket_state import VBucketState

VB = 2
MAJORITY = 1

WRITES: dict[str, Callable[[VBucket], Any]] = {
    "set": lambda v: v.set(b"k", b"v"),
    "add": lambda v: v.add(b"n", b"v"),
    "delete": lambda v: v.delete(b"k"),
    "touch": lambda v: v.touch(b"k", 0),
    "get_locked": lambda v: v.get_locked(b"k", 5.0),
    "commit": lambda v: v.commit(b"k"),
}
REPLICATED: dict[str, Callable[[VBucket], Any]] = {
    "replica_snapshot": lambda v: v.replica_snapshot(v.high_seqno + 1, v.high_seqno + 1),
    "queue_replicated": lambda v: v.queue_replicated(
        Item(v.high_seqno + 1, b"r", Op.MUTATION, b"v", cas=7)
    ),
    "adopt_failover_log": lambda v: v.adopt_failover_log([(1, 0)]),
    "rollback": lambda v: v.rollback(0),
}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(tmp_path, map_size_bytes=64 << 20, durable=False)
    yield opened
    opened.close()


def make(store: Store, state: VBucketState) -> VBucket:
    vbucket = VBucket(store, VB, state=VBucketState.ACTIVE, rng=random.Random(5))
    vbucket.set(b"k", b"v0")
    if state is not VBucketState.ACTIVE:
        vbucket.set_state(state)
    return vbucket


def test_each_state_has_a_role() -> None:
    assert {
        VBucketState.ACTIVE: ActiveRole,
        VBucketState.REPLICA: ReplicaRole,
        VBucketState.PENDING: ReplicaRole,
        VBucketState.DEAD: DeadRole,
    } == ROLE_OF


@pytest.mark.parametrize("state", [VBucketState.REPLICA, VBucketState.PENDING, VBucketState.DEAD])
@pytest.mark.parametrize("name", sorted(WRITES))
def test_only_the_active_role_writes(store: Store, state: VBucketState, name: str) -> None:
    vbucket = make(store, state)
    with pytest.raises(NotMyVbucketError, match=f"vb {VB} is {state.value}, not active"):
        WRITES[name](vbucket)
    refused = vbucket.set_many([b"a", b"b"], [b"1", b"2"], [0, 0], [0, 0], [0, 0])
    assert sorted(refused.errors) == [0, 1] and list(refused.seqnos) == [0, 0]


@pytest.mark.parametrize("state", [VBucketState.ACTIVE, VBucketState.DEAD])
@pytest.mark.parametrize("name", sorted(REPLICATED))
def test_only_the_replica_role_takes_replicated_changes(
    store: Store, state: VBucketState, name: str
) -> None:
    vbucket = make(store, state)
    with pytest.raises(NotMyVbucketError, match=f"is {state.value}, not a replica"):
        REPLICATED[name](vbucket)


@pytest.mark.parametrize("state", [VBucketState.REPLICA, VBucketState.PENDING])
def test_a_replica_or_pending_copy_takes_replicated_changes_and_serves_reads(
    store: Store, state: VBucketState
) -> None:
    vbucket = make(store, state)
    for name in ("replica_snapshot", "queue_replicated"):
        REPLICATED[name](vbucket)
    document = vbucket.get(b"r")
    assert document is not None and document.value == b"v"


def test_a_dead_copy_refuses_reads(store: Store) -> None:
    vbucket = make(store, VBucketState.DEAD)
    with pytest.raises(NotMyVbucketError, match=f"vb {VB} is dead"):
        vbucket.get(b"k")
    with pytest.raises(NotMyVbucketError, match=f"vb {VB} is dead"):
        vbucket.get_meta(b"k")
    assert not vbucket.expire_if_due(b"k")


@pytest.mark.parametrize("new", [VBucketState.REPLICA, VBucketState.PENDING, VBucketState.DEAD])
def test_leaving_active_retires_the_role_and_its_locks(store: Store, new: VBucketState) -> None:
    vbucket = make(store, VBucketState.ACTIVE)
    vbucket.get_locked(b"k", 30.0)
    old = vbucket.role
    assert old.locks_held == 1
    vbucket.set_state(new)
    assert vbucket.role is not old and type(vbucket.role) is ROLE_OF[new]
    assert vbucket.role.locks_held == 0
    vbucket.set_state(VBucketState.ACTIVE)  # back: the document is not locked any more
    assert vbucket.set(b"k", b"v1").seqno > 0


def test_prepares_pass_from_the_replica_role_to_the_active_role_which_commits_them(
    store: Store,
) -> None:
    vbucket = make(store, VBucketState.REPLICA)
    seqno = vbucket.high_seqno + 1
    vbucket.replica_snapshot(seqno, seqno)
    prepare = SyncItem(seqno, b"p", Op.PREPARE, Op.MUTATION, b"pv", 9, level=MAJORITY)
    vbucket.queue_replicated(prepare)
    assert [p.key for p in vbucket.pending_prepares] == [b"p"]
    vbucket.set_state(VBucketState.DEAD)  # a dead copy keeps what the store keeps
    assert [p.key for p in vbucket.pending_prepares] == [b"p"]
    vbucket.set_state(VBucketState.ACTIVE)
    assert vbucket.pending_prepares == []
    document = vbucket.get(b"p")
    assert document is not None and (document.value, document.cas) == (b"pv", 9)
