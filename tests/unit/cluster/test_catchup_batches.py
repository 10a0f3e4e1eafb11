"""A catch-up's stream as the replica's socket hands it over: snapshots of a few items each,
interleaved over vbuckets, cut at any byte into reads. However the reads fall (a batch holding
many markers and vbucket runs, a run of tombstones, a frame split across two reads), every
vbucket holds the active's items in order, byte for byte, and its store the same after a flush.
The feed reads a batch's columns once per batch (`replica_stream._BatchView`); this checks that
nothing of one run leaks into another."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import Item
from changefeed.cluster.replica_stream import FeedOptions, ReplicaFeed
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp_items import (
    Deletion,
    Expiration,
    Mutation,
    encode_deletion,
    encode_expiration,
    encode_mutation,
)
from changefeed.protocol.snapshot_marker import MarkerFlag, SnapshotMarker, encode_snapshot_marker
from changefeed.server.bucket import Bucket
from changefeed.storage import Op
from changefeed.vbmap import NodeAddress
from changefeed.vbucket_state import VBucketState
from support.buckets import ManualClock, open_bucket

VBUCKETS = 3
OPS = st.sampled_from([Op.MUTATION] * 6 + [Op.DELETION, Op.EXPIRATION])
# Per vbucket: its snapshots, each in pieces the active sends in turns (a marker before the
# first piece only), so that a run between two markers may hold several vbuckets' items.
SNAPSHOTS = st.lists(
    st.lists(st.lists(OPS, min_size=1, max_size=4), min_size=1, max_size=3),
    min_size=1,
    max_size=4,
)


def item_of(vb: int, seqno: int, op: Op) -> Item:
    key = b"vb%d-key-%d" % (vb, seqno)
    if op is Op.MUTATION:
        value = b"v%d" % seqno * (seqno % 7 + 1)
        datatype = seqno % 2  # raw or JSON: the column path must keep each item's
        return Item(
            seqno, key, op, value, 1000 + seqno, seqno * 3, seqno % 5, datatype, seqno % 3 + 1
        )
    return Item(seqno, key, op, b"", 1000 + seqno, rev_seqno=seqno % 4 + 1, delete_time=seqno)


def frame_of(vb: int, one: Item) -> bytes:
    if one.op is Op.MUTATION:
        mutation = Mutation(
            vb, 1, one.seqno, one.key, one.value, one.cas, one.rev_seqno, one.flags, one.expiry,
            datatype=one.datatype,
        )  # fmt: skip
        return encode_mutation(mutation)
    if one.op is Op.DELETION:
        deletion = Deletion(vb, 1, one.seqno, one.key, one.cas, one.rev_seqno, one.delete_time)
        return encode_deletion(deletion)
    expiration = Expiration(vb, 1, one.seqno, one.key, one.cas, one.rev_seqno, one.delete_time)
    return encode_expiration(expiration)


def stream_of(plan: list[list[list[list[Op]]]]) -> tuple[bytes, dict[int, list[Item]]]:
    """The active's stream: round robin over the vbuckets, one piece of a snapshot a turn,
    its marker (announcing the whole snapshot) before its first piece."""
    frames: list[bytes] = []
    sent: dict[int, list[Item]] = {vb: [] for vb in range(VBUCKETS)}
    turns = [
        [(s, p) for s, pieces in enumerate(snaps) for p in range(len(pieces))] for snaps in plan
    ]
    for turn in range(max(map(len, turns))):  # bounded by the plan
        for vb, snapshots in enumerate(plan):
            if turn >= len(turns[vb]):
                continue
            snap, piece = turns[vb][turn]
            start = len(sent[vb]) + 1
            if piece == 0:
                size = sum(map(len, snapshots[snap]))
                marker = SnapshotMarker(vb, 1, start, start + size - 1, MarkerFlag.MEMORY)
                frames.append(encode_snapshot_marker(marker))
            items = [item_of(vb, start + i, op) for i, op in enumerate(snapshots[snap][piece])]
            frames += [frame_of(vb, one) for one in items]
            sent[vb] += items
    return b"".join(frames), sent


@contextmanager
def fresh_bucket(path: Path) -> Iterator[Bucket]:
    with open_bucket(path, ManualClock(), vbuckets=VBUCKETS, seed=3) as opened:
        for vb in range(VBUCKETS):
            opened.vbucket(vb).set_state(VBucketState.REPLICA)
        yield opened


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    plan=st.lists(SNAPSHOTS, min_size=VBUCKETS, max_size=VBUCKETS),
    cuts=st.lists(st.integers(1, 4000), max_size=12),
    vectorise=st.booleans(),
)
def test_reads_cut_anywhere_leave_every_vbucket_equal_to_the_active(
    tmp_path_factory: pytest.TempPathFactory,
    plan: list[list[list[Op]]],
    cuts: list[int],
    vectorise: bool,
) -> None:
    data, sent = stream_of(plan)
    reads, at = [], 0
    for cut in sorted(set(cuts)):
        if at < cut < len(data):
            reads.append(data[at:cut])
            at = cut
    reads.append(data[at:])
    with fresh_bucket(tmp_path_factory.mktemp("catchup")) as bucket:
        feed = ReplicaFeed(
            bucket, NodeAddress("active", "127.0.0.1", 1), set(range(VBUCKETS)),
            FeedOptions(node_name="me"),
        )  # fmt: skip
        buffer, start = bytearray(), 0
        for read in reads:  # as consumer.connection does: decode what is whole, keep the rest
            buffer += read
            batch = decode_batch(buffer, start, vectorise=vectorise)
            start += batch.consumed
            feed.on_push(batch)
            assert feed.failure is None, feed.failure
        assert start == len(buffer), (start, len(buffer))
        assert feed.stats.items == sum(map(len, sent.values()))
        for vb in range(VBUCKETS):
            manager = bucket.vbucket(vb).manager
            held = [one for checkpoint in manager.checkpoints() for one in checkpoint.live_items()]
            assert held == sent[vb], vb
        for vb in range(VBUCKETS):
            bucket.vbucket(vb).flush()
            for one in sent[vb]:
                stored = bucket.store.get(vb, one.key)
                assert stored is not None, (vb, one.key)
                got = (stored.seqno, stored.op, stored.cas, stored.datatype, stored.body)
                assert got == (one.seqno, one.op, one.cas, one.datatype, one.body), (vb, one.seqno)
