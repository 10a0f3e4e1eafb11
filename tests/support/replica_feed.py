"""What the replica feed's twin tests share (tests/unit/cluster/test_replica_feed_sync_*.py):
a bucket of two replica vbuckets, checkpoint memory refused once at a chosen sync item, and
the vbuckets' state to compare between the twins."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from changefeed.checkpoint import CheckpointMemoryFullError, Item, SyncItem
from changefeed.server.bucket import Bucket
from changefeed.vbucket import VBucket
from changefeed.vbucket_state import VBucketState
from support.buckets import ManualClock, open_bucket

VBUCKETS = 2


@contextlib.contextmanager
def replica_bucket(root: Path) -> Iterator[Bucket]:
    """A real bucket on `root` whose two vbuckets are replicas (what a feed writes to)."""
    with open_bucket(root, ManualClock(), vbuckets=VBUCKETS, seed=3) as bucket:
        for vb in range(VBUCKETS):
            bucket.vbucket(vb).set_state(VBucketState.REPLICA)
        yield bucket


def refuse_memory_once(vbucket: VBucket, at: int) -> None:
    """Checkpoint memory runs out once for `vbucket`, at its `at`-th sync item (prepare,
    commit or abort; 1-based). Counted by item, not by call: the feed may give the same items
    one at a time (`queue_replicated`, `replica_commit`) or as runs (`queue_replicated_prepares`,
    `replica_commit_many`) and split runs where the other twin does not (a DCP_NOOP between
    two prepares ends a run of columns, not one of frames), and the refusal must hit the same
    item either way. A run is taken up to the refused item; one item alone raises."""
    real_one, real_prepares = vbucket.queue_replicated, vbucket.queue_replicated_prepares
    real_commit, real_commits = vbucket.replica_commit, vbucket.replica_commit_many
    seen = [0]

    def room(count: int) -> int:
        """How many of the next `count` sync items fit."""
        before = seen[0]
        seen[0] += count
        return at - 1 - before if before < at <= before + count else count

    def one(item: Item) -> None:
        if isinstance(item, SyncItem) and not room(1):
            raise CheckpointMemoryFullError("full")
        real_one(item)

    def prepares(prepares: Sequence[SyncItem]) -> int:
        fits = room(len(prepares))
        return real_prepares(prepares[:fits]) if fits else 0

    def commit(key: bytes, prepared_seqno: int, commit_seqno: int) -> None:
        if not room(1):
            raise CheckpointMemoryFullError("full")
        real_commit(key, prepared_seqno, commit_seqno)

    def commits(commits: Sequence[tuple[bytes, int, int]]) -> int:
        fits = room(len(commits))
        return real_commits(commits[:fits]) if fits else 0

    vbucket.queue_replicated = one  # type: ignore[method-assign]
    vbucket.queue_replicated_prepares = prepares  # type: ignore[method-assign]
    vbucket.replica_commit = commit  # type: ignore[method-assign]
    vbucket.replica_commit_many = commits  # type: ignore[method-assign]


def state(bucket: Bucket, keys: int) -> list[tuple[object, ...]]:
    """Per vbucket: high and persisted seqno, pending prepares (every field) and documents
    k0..k{keys-1} on disk (every field), after a flush."""
    out: list[tuple[object, ...]] = []
    for vb in range(VBUCKETS):
        vbucket = bucket.vbucket(vb)
        pending = vbucket.pending_prepares
        vbucket.flush()
        docs = [vbucket.get(b"k%d" % n) for n in range(keys)]
        out.append((vbucket.high_seqno, vbucket.persisted_seqno, pending, docs))
    return out
