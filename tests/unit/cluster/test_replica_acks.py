"""What a replica acknowledges (DCP_SEQNO_ACKNOWLEDGED: received and persisted seqno per
vbucket), on a real bucket behind a recording link: every vbucket that moved is acknowledged
in the tick after it moved, all of them in one write, in stream order; the persisted seqno
never runs ahead of what the vbucket has flushed (an active counts persistToMajority on it)
and neither seqno goes back; a vbucket that did not move is not acknowledged again; a new
link is told everything afresh (its active may have restarted and know nothing)."""

from __future__ import annotations

from pathlib import Path

from changefeed.cluster.replica_stream import FeedOptions, ReplicaFeed
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp import (
    SeqnoAcknowledged,
    decode_seqno_acknowledged,
    encode_failover_log,
)
from changefeed.protocol.dcp_items import Mutation, encode_mutation
from changefeed.protocol.frame import encode_frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.snapshot_marker import MarkerFlag, SnapshotMarker, encode_snapshot_marker
from changefeed.server.bucket import Bucket
from changefeed.vbmap import NodeAddress
from support.replica_feed import replica_bucket

from .test_replica_feed_sync_columns import RecordingLink


def acks_in(data: bytes) -> list[SeqnoAcknowledged]:
    return [
        decode_seqno_acknowledged(frame)
        for _, frame in decode_batch(data).controls
        if frame.opcode == Opcode.DCP_SEQNO_ACKNOWLEDGED
    ]


def ack_writes(link: RecordingLink, since: int) -> list[list[tuple[int, int, int | None]]]:
    """The acks of each write the feed made since `since`, as (vb, received, persisted)."""
    writes = [acks_in(data) for data in link.sent[since:] if data not in (b"pause", b"resume")]
    return [[(a.vbucket, a.received, a.persisted) for a in acks] for acks in writes if acks]


def open_streams(feed: ReplicaFeed, link: RecordingLink) -> None:
    """A new link: every vbucket requested and its stream accepted by the active."""
    first = link._opaque + 1
    feed.attach(link)
    feed.request_all()
    answers = [
        encode_frame(Magic.RESPONSE, Opcode.DCP_STREAM_REQ, opaque=first + vb,
                     value=encode_failover_log([(0xABC + vb, 0)]))
        for vb in range(2)
    ]  # fmt: skip
    feed.on_push(decode_batch(b"".join(answers)))
    assert feed.failure is None, feed.failure


def push(feed: ReplicaFeed, vb: int, first: int, last: int) -> None:
    frames = [encode_snapshot_marker(SnapshotMarker(vb, 1, first, last, MarkerFlag.MEMORY))]
    frames += [
        encode_mutation(Mutation(vb, 1, s, b"k%d" % s, b"v", 100 + s, 1, 0, 0))
        for s in range(first, last + 1)
    ]
    feed.on_push(decode_batch(b"".join(frames)))
    assert feed.failure is None, feed.failure


def feed_on(bucket: Bucket) -> tuple[ReplicaFeed, RecordingLink]:
    feed = ReplicaFeed(bucket, NodeAddress("active", "127.0.0.1", 1), {0, 1}, FeedOptions("me"))
    link = RecordingLink()
    open_streams(feed, link)
    return feed, link


def test_every_vbucket_that_moved_is_acknowledged_in_one_write(tmp_path: Path) -> None:
    with replica_bucket(tmp_path) as bucket:
        feed, link = feed_on(bucket)
        mark = len(link.sent)
        push(feed, 0, 1, 3)
        push(feed, 1, 1, 2)
        feed.tick()
        assert ack_writes(link, mark) == [[(0, 3, 0), (1, 2, 0)]]  # received, none persisted
        mark = len(link.sent)
        bucket.vbucket(0).flush()
        feed.tick()
        assert ack_writes(link, mark) == [[(0, 3, 3)]]  # only vb 0 moved
        mark = len(link.sent)
        feed.tick()
        assert ack_writes(link, mark) == []  # nothing moved
        push(feed, 0, 4, 4)
        bucket.vbucket(1).flush()
        feed.tick()
        assert ack_writes(link, mark) == [[(0, 4, 3), (1, 2, 2)]]


def test_a_new_link_is_told_every_vbucket_afresh(tmp_path: Path) -> None:
    """A review's find: the feed remembered what it acknowledged on the link before, so a new
    link (its active restarted, or the last ack was lost as the old one closed) heard nothing
    of a vbucket until it moved again, and a persistToMajority write there timed out."""
    with replica_bucket(tmp_path) as bucket:
        feed, _ = feed_on(bucket)
        push(feed, 0, 1, 2)
        push(feed, 1, 1, 2)
        for vb in range(2):
            bucket.vbucket(vb).flush()
        feed.tick()
        feed.detach()
        again = RecordingLink()
        open_streams(feed, again)
        feed.tick()
        assert ack_writes(again, 0) == [[(0, 2, 2), (1, 2, 2)]]
