"""cluster/replica_stream.py's apply path on a real bucket, fed decoded DCP batches (no
network): items land in their own vbucket even when checkpoint memory fills in the middle of
a run that mixes vbuckets, and nothing is applied twice or out of order."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from changefeed import limits
from changefeed.checkpoint import CheckpointMemoryFullError, Item, SyncItem
from changefeed.cluster import replica_stream
from changefeed.cluster.replica_stream import FeedOptions, ReplicaFeed
from changefeed.consumer.connection import CloseReason, ConnectionClosedError
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp_items import (
    Abort,
    Commit,
    Deletion,
    Expiration,
    Mutation,
    Prepare,
    encode_abort,
    encode_commit,
    encode_deletion,
    encode_expiration,
    encode_mutation,
    encode_prepare,
)
from changefeed.protocol.errors import InvalidArgumentsError
from changefeed.protocol.snapshot_marker import MarkerFlag, SnapshotMarker, encode_snapshot_marker
from changefeed.server.bucket import Bucket
from changefeed.storage import Op
from changefeed.vbmap import NodeAddress
from changefeed.vbucket import ReplicatedColumns, VBucket
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
    """The next item `target` is given is refused for memory (alone or first of a run: the
    feed queues runs, and items held back one by one); the ones after are taken."""
    real, real_run = target.queue_replicated, target.queue_replicated_run
    real_columns = target.queue_replicated_columns
    refused = [True]

    def full_once(item: Item) -> None:
        if refused[0]:
            refused[0] = False
            raise CheckpointMemoryFullError("full")
        real(item)

    def run_full_once(items: Sequence[Item]) -> int:
        if refused[0]:
            refused[0] = False
            raise CheckpointMemoryFullError("full")
        return real_run(items)

    def columns_full_once(run: ReplicatedColumns) -> int:
        if refused[0]:
            refused[0] = False
            raise CheckpointMemoryFullError("full")
        return real_columns(run)

    target.queue_replicated = full_once  # type: ignore[method-assign]
    target.queue_replicated_run = run_full_once  # type: ignore[method-assign]
    target.queue_replicated_columns = columns_full_once  # type: ignore[method-assign]


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
    feed.on_push(decode_batch(buffer))
    assert bucket.vbucket(0).high_seqno == 1  # vb 0's later items wait behind the backlog
    feed.tick()  # the session loop's next tick: memory is back
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
    feed.on_push(decode_batch(buffer))
    assert target.high_seqno == 0 and feed.failure is None
    feed.tick()
    assert feed.failure is None
    assert target.high_seqno == 6 and target.pending_prepares == []
    committed = target.get(b"p")
    assert committed is not None and (committed.value, committed.cas, committed.seqno) == (
        b"prepared",
        7,
        3,
    )
    assert target.get(b"q") is None  # aborted: never visible


@pytest.mark.parametrize("vectorise", [True, False])
def test_replicated_items_equal_the_actives_byte_for_byte(bucket: Bucket, vectorise: bool) -> None:
    """A mutation's item takes its frame body as is (no re-encoding): every field and the body
    equal what the active built, for both decoders; tombstones are encoded again, equally."""
    active = [
        Item(1, b"plain", Op.MUTATION, b"v" * 40, 101),
        Item(2, b"fields", Op.MUTATION, b'{"a":1}', 102, 0xDEADBEEF, 1_900_000_000, 1, 9),
        Item(3, b"gone", Op.DELETION, b"", 103, rev_seqno=4, delete_time=1_800_000_000),
        Item(4, b"expired", Op.EXPIRATION, b"", 104, rev_seqno=2, delete_time=1_800_000_001),
        Item(5, b"plain", Op.MUTATION, b"again", 105, rev_seqno=2),
    ]
    frames = [marker(0, 1, 5)]
    for one in active:
        if one.op is Op.MUTATION:
            frames.append(
                encode_mutation(
                    Mutation(0, 1, one.seqno, one.key, one.value, one.cas, one.rev_seqno,
                             one.flags, one.expiry, datatype=one.datatype)
                )
            )  # fmt: skip
        elif one.op is Op.DELETION:
            frames.append(
                encode_deletion(
                    Deletion(0, 1, one.seqno, one.key, one.cas, one.rev_seqno, one.delete_time)
                )
            )
        else:
            frames.append(
                encode_expiration(
                    Expiration(0, 1, one.seqno, one.key, one.cas, one.rev_seqno, one.delete_time)
                )
            )
    feed = feed_of(bucket)
    feed.on_push(decode_batch(run_of(*frames), vectorise=vectorise))
    assert feed.failure is None
    manager = bucket.vbucket(0).manager
    held = [one for checkpoint in manager.checkpoints() for one in checkpoint.live_items()]
    # Seqno 1 went alone into the checkpoint the flusher waits in (as `queue` leaves it), so
    # seqno 5 of the same key does not replace it.
    assert held == active
    assert [type(one) for one in held] == [Item] * 5
    bucket.vbucket(0).flush()
    stored = bucket.store.get(0, b"fields")
    assert stored is not None and stored.body == active[1].body


def test_a_bad_run_is_refused_whole(bucket: Bucket) -> None:
    """queue_replicated_run checks the run before queuing any of it: the error names the
    problem and the vbucket holds what it held."""
    target = bucket.vbucket(0)
    target.replica_snapshot(1, 10)

    def run(*items: Item) -> None:
        with pytest.raises(InvalidArgumentsError) as raised:
            target.queue_replicated_run(list(items))
        assert target.high_seqno == 0 and target.manager.high_seqno == 0, raised.value
        raise raised.value

    good = Item(1, b"a", Op.MUTATION, b"v", 1)
    with pytest.raises(InvalidArgumentsError, match="does not follow"):
        run(good, Item(1, b"b", Op.MUTATION, b"v", 2))
    with pytest.raises(InvalidArgumentsError, match="cas 0"):
        run(good, Item(2, b"b", Op.MUTATION, b"v", 0))
    with pytest.raises(InvalidArgumentsError, match="key length"):
        run(good, Item(2, b"k" * (limits.STORED_KEY_SIZE_MAX + 1), Op.MUTATION, b"v", 2))
    with pytest.raises(InvalidArgumentsError, match="outside the snapshot"):
        run(good, Item(11, b"b", Op.MUTATION, b"v", 2))
    body = bytes(31) + b"b" + bytes(limits.VALUE_SIZE_MAX + 1)
    too_big = Item.of_body(2, b"b", Op.MUTATION, body, 2, 0, 0, 0, 1, 0)
    with pytest.raises(InvalidArgumentsError, match="over"):
        run(good, too_big)
    assert target.queue_replicated_run([good, Item(2, b"b", Op.MUTATION, b"v", 2)]) == 2
    assert target.high_seqno == 2


def test_a_run_ends_the_pending_prepare_of_its_key(bucket: Bucket) -> None:
    """A disk backfill sends a committed document instead of DCP_COMMIT: the run that holds
    it ends the replica's pending prepare of that key, and only of that key."""
    target = bucket.vbucket(0)
    target.replica_snapshot(1, 4)
    for seqno, key in ((1, b"p"), (2, b"q")):
        target.queue_replicated(
            SyncItem(seqno, key, Op.PREPARE, Op.MUTATION, b"x", 10 + seqno, level=1)
        )
    assert target.queue_replicated_run([Item(3, b"p", Op.MUTATION, b"done", 13)]) == 1
    assert [prepare.key for prepare in target.pending_prepares] == [b"q"]


class _FakeConn:
    """What a replica session uses of its Connection once open: opaques, pushes, close."""

    def __init__(self) -> None:
        self.on_push: object = None
        self.on_close: Callable[[ConnectionClosedError], None] | None = None
        self.opaque = 0

    def next_opaque(self) -> int:
        self.opaque += 1
        return self.opaque

    def send(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    async def close(self) -> None:
        pass


def test_a_session_cancelled_as_its_connection_closes_reports_nothing(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node stops (the feed is cancelled) in the loop iteration in which the active
    closed the connection: the error the close left for the session is not reported as
    'Future exception was never retrieved' (it was, in a cluster's stop log)."""
    fake = _FakeConn()

    async def connect(*args: object, **kwargs: object) -> _FakeConn:
        return fake

    async def open_session(*args: object, **kwargs: object) -> None:
        return None

    monkeypatch.setattr(replica_stream, "connect", connect)
    monkeypatch.setattr(replica_stream, "open_session", open_session)
    reported: list[dict[str, object]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, c: reported.append(c))
        session = asyncio.ensure_future(feed_of(bucket)._connected())
        for _ in range(5):
            await asyncio.sleep(0)  # the session waits on its connection now
        assert fake.on_close is not None
        fake.on_close(ConnectionClosedError(CloseReason.EOF))
        session.cancel()
        with pytest.raises(asyncio.CancelledError):
            await session
        del session
        fake.on_close = None  # as the closed connection is dropped
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    assert reported == [], [c.get("message") for c in reported]


class _Link:
    """A FeedLink that records what the feed sends."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.opaque = 0
        self.paused = False

    def next_opaque(self) -> int:
        self.opaque += 1
        return self.opaque

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


def test_a_link_silent_past_the_limit_is_given_up_and_a_talking_one_is_kept(
    bucket: Bucket,
) -> None:
    """A partition's silent drops leave the replica's connection open and quiet forever (seen
    on test hosts: a healed replica stayed behind for good); the active's noops mean a live
    link is never silent for three noop intervals."""
    clock = ManualClock(0.0)
    options = FeedOptions(node_name="me", noop_interval_s=5.0)
    feed = ReplicaFeed(bucket, NodeAddress("a", "h", 1), {0}, options, clock=clock)
    feed.attach(_Link())
    clock.now = 14.0
    feed.tick()
    assert feed.failure is None
    feed.on_push(decode_batch(marker(0, 1, 1) + mutation(0, 1)))  # something arrived
    clock.now = 28.0
    feed.tick()
    assert feed.failure is None, "heard from 14 s to 28 s"
    clock.now = 29.5
    feed.tick()
    assert isinstance(feed.failure, TimeoutError)
    feed.attach(_Link())  # dialled again: a fresh start
    assert feed.failure is None
