"""The replica feed takes consecutive DCP_PREPAREs / DCP_COMMITs of a vbucket as one run: the
vbuckets end as a feed given each frame alone leaves them (hypothesis: random durable writes
over two vbuckets, commits and aborts in any order, checkpoint memory refused part of the way
through a run), and a run with a bad commit queues what is before it and fails the feed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import CheckpointMemoryFullError, SyncItem
from changefeed.cluster.replica_stream import FeedOptions, ReplicaFeed
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp_items import (
    Abort,
    Commit,
    Prepare,
    encode_abort,
    encode_commit,
    encode_prepare,
)
from changefeed.protocol.errors import InvalidArgumentsError
from changefeed.protocol.snapshot_marker import MarkerFlag, SnapshotMarker, encode_snapshot_marker
from changefeed.server.bucket import Bucket
from changefeed.vbmap import NodeAddress
from changefeed.vbucket import VBucket
from changefeed.vbucket_state import VBucketState
from support.buckets import ManualClock, open_bucket

SNAPSHOT_END = 1000


@contextlib.contextmanager
def replica_bucket(root: Path) -> Iterator[Bucket]:
    with open_bucket(root, ManualClock(), vbuckets=2, seed=3) as bucket:
        for vb in range(2):
            bucket.vbucket(vb).set_state(VBucketState.REPLICA)
        yield bucket


def feed_of(bucket: Bucket) -> ReplicaFeed:
    return ReplicaFeed(
        bucket, NodeAddress("active", "127.0.0.1", 1), {0, 1}, FeedOptions(node_name="me")
    )


def frames_of(script: list[tuple[int, int, str]]) -> list[bytes]:
    """An active's stream for `script` (vb, key, what: prepare / commit / abort of the key's
    pending prepare, if any): a marker per vbucket first, seqnos rising per vbucket."""
    frames = [
        encode_snapshot_marker(SnapshotMarker(vb, 1, 1, SNAPSHOT_END, MarkerFlag.MEMORY))
        for vb in range(2)
    ]
    seqnos = [0, 0]
    pending: dict[tuple[int, bytes], int] = {}
    for vb, key_number, what in script:
        key = b"k%d" % key_number
        seqnos[vb] += 1
        seqno = seqnos[vb]
        prepared = pending.pop((vb, key), None)
        if prepared is None or what == "prepare":
            value = b"v%d-%d" % (vb, seqno)
            prepare = Prepare(vb, 1, seqno, key, value, 100 + seqno, 1, 0, 0, False, 1)
            frames.append(encode_prepare(prepare))
            pending[(vb, key)] = seqno
        elif what == "commit":
            frames.append(encode_commit(Commit(vb, 1, key, prepared, seqno)))
        else:
            frames.append(encode_abort(Abort(vb, 1, key, prepared, seqno)))
    return frames


def refuse_memory_once(vbucket: VBucket, after: int) -> None:
    """The `after`-th run given to `vbucket` (counting both kinds) gets checkpoint memory for
    its first item only; nothing else changes."""
    real_prepares, real_commits = vbucket.queue_replicated_prepares, vbucket.replica_commit_many
    calls = [0]

    def prepares(items: Sequence[SyncItem]) -> int:
        calls[0] += 1
        return real_prepares(items[:1] if calls[0] == after else items)

    def commits(runs: Sequence[tuple[bytes, int, int]]) -> int:
        calls[0] += 1
        if calls[0] == after:
            raise CheckpointMemoryFullError("full")
        return real_commits(runs)

    vbucket.queue_replicated_prepares = prepares  # type: ignore[method-assign]
    vbucket.replica_commit_many = commits  # type: ignore[method-assign]


def state(bucket: Bucket) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for vb in range(2):
        vbucket = bucket.vbucket(vb)
        pending = [(p.key, p.seqno, p.value) for p in vbucket.pending_prepares]
        vbucket.flush()
        docs = [vbucket.get(b"k%d" % n) for n in range(4)]
        seen = [(d.seqno, d.value, d.cas) if d is not None else None for d in docs]
        out.append((vbucket.high_seqno, pending, seen))
    return out


script_of = st.lists(
    st.tuples(
        st.integers(0, 1), st.integers(0, 3), st.sampled_from(["prepare", "commit", "abort"])
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script_of, st.integers(0, 6))
def test_runs_leave_what_single_frames_leave(
    tmp_path_factory: pytest.TempPathFactory, script: list[tuple[int, int, str]], full_at: int
) -> None:
    frames = frames_of(script)
    root = tmp_path_factory.mktemp("feed")
    (root / "runs").mkdir()
    (root / "single").mkdir()
    with (
        replica_bucket(root / "runs") as runs_bucket,
        replica_bucket(root / "single") as single_bucket,
    ):
        runs = feed_of(runs_bucket)
        if full_at:
            refuse_memory_once(runs_bucket.vbucket(0), full_at)
        runs.on_push(decode_batch(b"".join(frames)))
        runs.tick()  # the session loop's next tick: the held-back items go in
        single = feed_of(single_bucket)
        for frame in frames:
            single.on_push(decode_batch(frame))
        assert runs.failure is None and single.failure is None
        assert runs.stats.items == single.stats.items == len(frames) - 2
        assert state(runs_bucket) == state(single_bucket)


def test_a_bad_commit_in_a_run_fails_the_feed_after_the_ones_before_it(tmp_path: Path) -> None:
    with replica_bucket(tmp_path) as bucket:
        frames = frames_of([(0, 0, "prepare"), (0, 1, "prepare"), (0, 2, "prepare")])
        frames += [
            encode_commit(Commit(0, 1, b"k0", 1, 4)),
            encode_commit(Commit(0, 1, b"k1", 3, 5)),  # not the prepare the replica holds
            encode_commit(Commit(0, 1, b"k2", 3, 6)),
        ]
        feed = feed_of(bucket)
        feed.on_push(decode_batch(b"".join(frames)))
        assert isinstance(feed.failure, InvalidArgumentsError)
        assert "prepared at 3, pending here: 2" in str(feed.failure)
        vbucket = bucket.vbucket(0)
        assert vbucket.high_seqno == 4
        assert [p.key for p in vbucket.pending_prepares] == [b"k1", b"k2"]
