"""cluster/replica_stream.py's apply path on a real bucket, fed decoded DCP batches (no
network): items land in their own vbucket even when checkpoint memory fills in the middle of
a run that mixes vbuckets, and nothing is applied twice or out of order."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.checkpoint import CheckpointMemoryFullError, Item
from changefeed.cluster.replica_stream import FeedOptions, ReplicaFeed
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp_items import (
    Abort,
    Commit,
    Mutation,
    Prepare,
    encode_abort,
    encode_commit,
    encode_mutation,
    encode_prepare,
)
from changefeed.protocol.snapshot_marker import MarkerFlag, SnapshotMarker, encode_snapshot_marker
from changefeed.server.bucket import Bucket
from changefeed.vbmap import NodeAddress
from changefeed.vbucket import VBucket
from changefeed.vbucket_state import VBucketState
from support.buckets import ManualClock, open_bucket


@pytest.fixture
def bucket(tmp_path: Path) -> Iterator[Bucket]:
    with open_bucket(tmp_path, ManualClock(), vbuckets=2, seed=3) as opened:
        for vb in range(2):
            opened.vbucket(vb).set_state(VBucketState.REPLICA)
        yield opened


def feed_of(bucket: Bucket) -> ReplicaFeed:
    source = NodeAddress("active", "127.0.0.1", 1)
    return ReplicaFeed(bucket, source, {0, 1}, FeedOptions(node_name="me"))


def run_of(*frames: bytes) -> bytes:
    return b"".join(frames)


def marker(vb: int, start: int, end: int) -> bytes:
    return encode_snapshot_marker(SnapshotMarker(vb, 1, start, end, MarkerFlag.MEMORY))


def mutation(vb: int, seqno: int) -> bytes:
    key = b"vb%d-%d" % (vb, seqno)
    return encode_mutation(Mutation(vb, 1, seqno, key, b"value", cas=100 + seqno))


def memory_full_once(target: VBucket) -> None:
    """The next item `target` is given is refused for memory; the ones after are taken."""
    real = target.queue_replicated
    refused = [True]

    def full_once(item: Item) -> None:
        if refused[0]:
            refused[0] = False
            raise CheckpointMemoryFullError("full")
        real(item)

    target.queue_replicated = full_once  # type: ignore[method-assign]


def test_memory_full_mid_run_keeps_each_item_in_its_own_vbucket(bucket: Bucket) -> None:
    feed = feed_of(bucket)
    buffer = run_of(
        marker(0, 1, 3),
        marker(1, 1, 3),
        mutation(0, 1),
        mutation(1, 1),  # memory fills here, for vb 1 ...
        mutation(0, 2),  # ... so these wait, in order, each for its own vbucket
        mutation(1, 2),
        mutation(0, 3),
        mutation(1, 3),
    )
    target = bucket.vbucket(1)
    memory_full_once(target)
    feed._on_push(decode_batch(buffer))
    assert bucket.vbucket(0).high_seqno == 1  # vb 0's later items wait behind the backlog
    feed._drain_backlog()  # the session loop's next tick: memory is back
    for vb in range(2):
        vbucket = bucket.vbucket(vb)
        assert vbucket.high_seqno == 3
        for seqno in (1, 2, 3):
            got = vbucket.get(b"vb%d-%d" % (vb, seqno))
            assert got is not None and (got.seqno, got.cas) == (seqno, 100 + seqno)
        assert vbucket.get(b"vb%d-1" % (1 - vb)) is None  # nothing of the other vbucket


def test_sync_write_frames_are_taken_in_wire_order_behind_a_backlog(bucket: Bucket) -> None:
    """DCP_PREPARE, DCP_COMMIT and DCP_ABORT wait behind items held for memory like any item:
    a commit must find its prepare taken first."""
    feed = feed_of(bucket)
    buffer = run_of(
        marker(0, 1, 6),
        mutation(0, 1),  # memory is full for this one: everything after waits
        encode_prepare(Prepare(0, 1, 2, b"p", b"prepared", 7, 1, 0, 0, False, 1)),
        encode_commit(Commit(0, 1, b"p", 2, 3)),
        encode_prepare(Prepare(0, 1, 4, b"q", b"never", 8, 1, 0, 0, False, 1)),
        encode_abort(Abort(0, 1, b"q", 4, 5)),
        mutation(0, 6),
    )
    target = bucket.vbucket(0)
    memory_full_once(target)
    feed._on_push(decode_batch(buffer))
    assert target.high_seqno == 0 and feed._failure is None
    feed._drain_backlog()
    assert feed._failure is None
    assert target.high_seqno == 6 and target.pending_prepares == []
    committed = target.get(b"p")
    assert committed is not None and (committed.value, committed.cas, committed.seqno) == (
        b"prepared",
        7,
        3,
    )
    assert target.get(b"q") is None  # aborted: never visible
