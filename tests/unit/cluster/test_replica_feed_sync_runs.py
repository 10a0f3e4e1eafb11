"""The replica feed takes consecutive DCP_PREPAREs / DCP_COMMITs of a vbucket as one run: the
vbuckets end as a feed given each frame alone leaves them (hypothesis: random durable writes
over two vbuckets, commits and aborts in any order, checkpoint memory refused at one sync item,
often part of the way through a run), and a run with a bad commit queues what is before it and
fails the feed."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
from support.replica_feed import refuse_memory_once, replica_bucket, state

SNAPSHOT_END = 1000
KEYS = 4


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


script_of = st.lists(
    st.tuples(
        st.integers(0, 1), st.integers(0, KEYS - 1), st.sampled_from(["prepare", "commit", "abort"])
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=30,
    derandomize=True,  # CI runs the same examples each time (a failure here is a bug to keep)
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(script_of, st.integers(0, 12))
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
        assert state(runs_bucket, KEYS) == state(single_bucket, KEYS)


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
