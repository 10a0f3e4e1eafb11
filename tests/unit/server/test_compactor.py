"""Compactor: purges by age on the bucket's clock, never what memory or the flusher still holds,
in chunks that let the loop run, only on active vbuckets; its counters reach STAT."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.checkpoint import Item
from changefeed.protocol.errors import NotMyVbucketError, TemporaryFailureError
from changefeed.protocol.status import Status
from changefeed.server.bucket import Bucket
from changefeed.server.compactor import Compactor, answer_compact_db
from changefeed.vbucket_state import VBucketState
from support.buckets import ManualClock, open_bucket

DAY_S = 24 * 3600.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def bucket(tmp_path: Path, clock: ManualClock) -> Iterator[Bucket]:
    with open_bucket(tmp_path, clock, vbuckets=2, seed=5) as opened:
        yield opened


def write_and_delete(bucket: Bucket, vb: int, keys: list[bytes]) -> None:
    vbucket = bucket.vbucket(vb)
    for key in keys:
        vbucket.set(key, b"v")
    for key in keys:
        vbucket.delete(key)


def compactor_of(bucket: Bucket, clock: ManualClock, **kwargs: object) -> Compactor:
    values: dict[str, object] = {"clock": clock, "interval_s": 0, "purge_age_s": 3 * DAY_S}
    values.update(kwargs)
    return Compactor(bucket, **values)  # type: ignore[arg-type]


def keep_high_seqno_live(bucket: Bucket, vb: int) -> None:
    """A live write after the deletes: the record at the high seqno is never purged, so a
    test that wants every tombstone purgeable ends with one."""
    bucket.vbucket(vb).set(b"keeper-%d" % bucket.vbucket(vb).high_seqno, b"v")


def test_the_record_at_the_high_seqno_is_never_purged(bucket: Bucket, clock: ManualClock) -> None:
    """Else a disk snapshot would end at a seqno no reader receives, and a replica (or any
    consumer) would hold it as partial for ever: kv_engine keeps that record too."""
    write_and_delete(bucket, 0, [b"a", b"b"])  # seqnos 1..4; 4 is b's tombstone
    bucket.vbucket(0).flush()
    compactor = compactor_of(bucket, clock, purge_age_s=0)

    async def scenario() -> None:
        result = await compactor.compact_vbucket(0, delete_time_max=math.inf)
        assert (result.purged, result.purge_seqno) == (1, 3)

    asyncio.run(scenario())
    assert bucket.store.get(0, b"b") is not None  # the tombstone at the high seqno stays
    assert [r.seqno for r in bucket.store.scan(0, 0, 99)] == [4]


def test_purges_by_age_on_the_bucket_clock(bucket: Bucket, clock: ManualClock) -> None:
    write_and_delete(bucket, 0, [b"old-1", b"old-2"])
    bucket.vbucket(0).flush()
    clock.now += 2 * DAY_S
    write_and_delete(bucket, 0, [b"new"])
    keep_high_seqno_live(bucket, 0)
    bucket.vbucket(0).flush()
    clock.now += 1.5 * DAY_S  # old: 3.5 days; new: 1.5 days
    compactor = compactor_of(bucket, clock)

    async def scenario() -> None:
        done = await compactor.run_once()
        assert [(r.vb, r.purged) for r in done] == [(0, 2), (1, 0)]
        assert bucket.store.get(0, b"old-1") is None
        assert bucket.store.get(0, b"new") is not None  # a tombstone, too young
        assert bucket.vbucket(0).purge_seqno == 4  # old-2's delete (seqnos: set, set, del, del)
        clock.now += 2 * DAY_S
        assert (await compactor.run_once())[0].purged == 1

    asyncio.run(scenario())
    assert bucket.vbucket(0).purge_seqno == 6
    assert compactor.counters["runs"] == 2
    assert compactor.counters["tombstones_purged"] == 3
    bucket.store._check_invariants()


def test_never_purges_what_is_unflushed_or_still_in_memory(
    bucket: Bucket, clock: ManualClock
) -> None:
    vbucket = bucket.vbucket(0)
    write_and_delete(bucket, 0, [b"a", b"b"])  # seqnos 1..4, queued only
    keep_high_seqno_live(bucket, 0)  # seqno 5
    compactor = compactor_of(bucket, clock, purge_age_s=0)
    reader = vbucket.stream("lagging-reader", 0)  # a stream that has read nothing yet

    async def scenario() -> None:
        result = await compactor.compact_vbucket(0, delete_time_max=math.inf)
        assert (result.purged, result.purge_seqno) == (0, 0)  # nothing is on disk yet
        vbucket.flush()
        result = await compactor.compact_vbucket(0, delete_time_max=math.inf)
        assert (result.purged, result.purge_seqno) == (0, 0)  # the reader still needs memory
        assert [event.seqno for event in reader if isinstance(event, Item)] == [1, 3, 4, 5]
        reader.close()
        result = await compactor.compact_vbucket(0, delete_time_max=math.inf)
        assert (result.purged, result.purge_seqno) == (2, 4)

    asyncio.run(scenario())
    assert vbucket.manager.first_memory_seqno == 6  # the idle open checkpoint was let go
    bucket.store._check_invariants()


def test_an_unflushed_tombstone_is_not_purged(bucket: Bucket, clock: ManualClock) -> None:
    vbucket = bucket.vbucket(1)
    for key in (b"a", b"b", b"c"):
        vbucket.set(key, b"v")
    vbucket.delete(b"a")  # seqno 4
    keep_high_seqno_live(bucket, 1)  # seqno 5
    vbucket.flush()
    vbucket.delete(b"b")  # seqno 6: queued only
    keep_high_seqno_live(bucket, 1)  # seqno 7
    compactor = compactor_of(bucket, clock, purge_age_s=0)

    async def scenario() -> None:
        result = await compactor.compact_vbucket(1, delete_time_max=math.inf)
        assert (result.purged, result.purge_seqno) == (1, 4)
        assert bucket.store.get(1, b"b") is not None  # still the mutation on disk
        assert vbucket.get(b"b") is None  # and still deleted for readers
        vbucket.flush()
        result = await compactor.compact_vbucket(1, delete_time_max=math.inf)
        assert (result.purged, result.purge_seqno) == (1, 6)

    asyncio.run(scenario())
    assert bucket.store.get(1, b"b") is None
    assert vbucket.get(b"c") is not None
    bucket.store._check_invariants()


def test_chunks_let_the_loop_run(bucket: Bucket, clock: ManualClock) -> None:
    write_and_delete(bucket, 0, [b"k%02d" % i for i in range(20)])
    keep_high_seqno_live(bucket, 0)
    bucket.vbucket(0).flush()
    compactor = compactor_of(bucket, clock, purge_age_s=0, chunk_records=3)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def scenario() -> None:
        task = asyncio.create_task(ticker())
        result = await compactor.compact_vbucket(0, delete_time_max=math.inf)
        task.cancel()
        assert (result.purged, result.visited, result.chunks) == (20, 20, 7)  # sets deduplicated

    asyncio.run(scenario())
    assert ticks >= 6  # the loop ran between every two chunks


def test_only_active_vbuckets(bucket: Bucket, clock: ManualClock) -> None:
    write_and_delete(bucket, 1, [b"a"])
    bucket.vbucket(1).flush()
    bucket.vbucket(1).set_state(VBucketState.REPLICA)
    compactor = compactor_of(bucket, clock, purge_age_s=0)

    async def scenario() -> None:
        with pytest.raises(NotMyVbucketError):
            await compactor.compact_vbucket(1, delete_time_max=math.inf)
        with pytest.raises(NotMyVbucketError):
            compactor.request(7, delete_time_max=math.inf)
        assert [r.vb for r in await compactor.run_once()] == [0]

    asyncio.run(scenario())
    assert bucket.store.get(1, b"a") is not None


def test_compact_db_is_answered_when_done(bucket: Bucket, clock: ManualClock) -> None:
    from changefeed.protocol.frame import Frame
    from changefeed.protocol.kv import (
        CompactDb,
        decode_compaction_summary,
        encode_compact_db,
    )
    from changefeed.protocol.reader import FrameReader

    write_and_delete(bucket, 0, [b"a", b"b"])
    keep_high_seqno_live(bucket, 0)
    bucket.vbucket(0).flush()
    clock.now += 10
    compactor = compactor_of(bucket, clock, purge_age_s=3 * DAY_S)
    replies: list[tuple[int, bytes, int]] = []

    def frame_of(request: CompactDb) -> Frame:
        reader = FrameReader(1 << 20)
        reader.feed(encode_compact_db(request))
        frame = reader.next_frame()
        assert isinstance(frame, Frame)
        return frame

    def reply(status: int, value: bytes, datatype: int) -> None:
        replies.append((status, value, datatype))

    async def scenario() -> None:
        compactor.start()
        try:
            # purge_before_ts 0: the node's own age (3 days): nothing is that old.
            answer_compact_db(compactor, frame_of(CompactDb(0, 1)), reply)
            while len(replies) < 1:
                await asyncio.sleep(0)
            # Deleted before now - 5 s: both tombstones.
            ts = int(clock.now - 5)
            answer_compact_db(compactor, frame_of(CompactDb(0, 2, purge_before_ts=ts)), reply)
            while len(replies) < 2:
                await asyncio.sleep(0)
            with pytest.raises(NotMyVbucketError):
                answer_compact_db(compactor, frame_of(CompactDb(9, 3)), reply)
        finally:
            await compactor.stop()

    asyncio.run(scenario())
    (status1, value1, type1), (status2, value2, type2) = replies
    assert (status1, status2, type1, type2) == (Status.SUCCESS, Status.SUCCESS, 1, 1)
    assert decode_compaction_summary(value1).purged == 0
    summary = decode_compaction_summary(value2)
    assert (summary.vbucket, summary.purged, summary.purge_seqno, summary.visited) == (0, 2, 4, 2)
    assert compactor.counters["requests"] == 2
    stats = dict(compactor.stats())
    assert stats["compaction_tombstones_purged"] == "2"
    assert not compactor.started  # stopped: COMPACT_DB is now answered TMPFAIL
    with pytest.raises(TemporaryFailureError):
        answer_compact_db(compactor, frame_of(CompactDb(0, 4)), reply)
    with pytest.raises(TemporaryFailureError):
        answer_compact_db(None, frame_of(CompactDb(0, 5)), reply)
