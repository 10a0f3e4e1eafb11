"""Expiry pager: expired documents become EXPIRATIONs without a read, on the bucket's clock, in
bounded passes that resume where they stopped; rewritten keys and non-active vbuckets are left."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.checkpoint import Item
from changefeed.server.bucket import Bucket
from changefeed.server.expiry_pager import ExpiryPager
from changefeed.storage import Op
from changefeed.vbucket_state import VBucketState
from support.buckets import ManualClock, open_bucket


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def bucket(tmp_path: Path, clock: ManualClock) -> Iterator[Bucket]:
    with open_bucket(tmp_path, clock, vbuckets=4, seed=7) as opened:
        yield opened


def expirations(bucket: Bucket, vb: int) -> list[bytes]:
    """Keys of the EXPIRATIONs a fresh reader of `vb` receives, in seqno order."""
    reader = bucket.vbucket(vb).stream(f"check-{vb}-{random.random()}", 0)
    try:
        return [e.key for e in reader if isinstance(e, Item) and e.op is Op.EXPIRATION]
    finally:
        reader.close()


def flush_all(bucket: Bucket) -> None:
    for vbucket in bucket.vbuckets.values():
        vbucket.flush()


def test_expired_documents_become_expirations_without_a_read(
    bucket: Bucket, clock: ManualClock
) -> None:
    expiry = int(clock.now) + 10
    for vb in range(4):
        vbucket = bucket.vbucket(vb)
        vbucket.set(b"ttl-%d" % vb, b"v", expiry=expiry)
        vbucket.set(b"keep-%d" % vb, b"v")
        vbucket.set(b"later-%d" % vb, b"v", expiry=expiry + 100)
    flush_all(bucket)
    pager = ExpiryPager(bucket, clock=clock, interval_s=0)

    async def scenario() -> None:
        done = await pager.run_pass()
        assert (done.expired, done.visited, done.vbuckets) == (0, 12, 4)  # not due yet
        clock.now += 10
        done = await pager.run_pass()
        assert (done.expired, done.visited) == (4, 12)
        flush_all(bucket)
        done = await pager.run_pass()  # the expirations are tombstones now: nothing to do
        assert done.expired == 0

    asyncio.run(scenario())
    for vb in range(4):
        assert expirations(bucket, vb) == [b"ttl-%d" % vb]
        assert bucket.vbucket(vb).get(b"keep-%d" % vb) is not None
        assert bucket.vbucket(vb).get(b"later-%d" % vb) is not None
    assert pager.counters == {
        "runs": 3,
        "expired": 4,
        "records_visited": 12 + 12 + 12,
        "failures": 0,
    }
    assert dict(pager.stats())["expiry_pager_expired"] == "4"


def test_a_rewritten_key_is_left_alone(bucket: Bucket, clock: ManualClock) -> None:
    vbucket = bucket.vbucket(2)
    vbucket.set(b"k", b"old", expiry=int(clock.now) + 1)
    vbucket.flush()
    vbucket.set(b"k", b"new")  # in memory only; the disk still has the expiring version
    clock.now += 5
    pager = ExpiryPager(bucket, clock=clock, interval_s=0)
    assert asyncio.run(pager.run_pass()).expired == 0
    document = vbucket.get(b"k")
    assert document is not None
    assert document.value == b"new"


def test_passes_are_bounded_and_resume(bucket: Bucket, clock: ManualClock) -> None:
    expiry = int(clock.now) + 1
    for vb in range(4):
        for i in range(10):
            bucket.vbucket(vb).set(b"k-%d-%d" % (vb, i), b"v", expiry=expiry)
    flush_all(bucket)
    clock.now += 2
    pager = ExpiryPager(bucket, clock=clock, interval_s=0, records_per_pass=15, chunk_records=4)

    async def scenario() -> list[tuple[int, int, int]]:
        return [
            (done.visited, done.expired, done.vbuckets)
            for done in [await pager.run_pass() for _ in range(3)]
        ]

    # 40 records, 15 a pass: vb 0 and half of vb 1; the rest of vb 1 and vb 2; vb 3, then the
    # sweep starts again at vb 0 (whose expired versions are still the ones on disk).
    assert asyncio.run(scenario()) == [(15, 15, 2), (15, 15, 2), (15, 10, 2)]
    for vb in range(4):
        assert len(expirations(bucket, vb)) == 10


def test_only_active_vbuckets(bucket: Bucket, clock: ManualClock) -> None:
    bucket.vbucket(3).set(b"k", b"v", expiry=int(clock.now) + 1)
    bucket.vbucket(3).flush()
    bucket.vbucket(3).set_state(VBucketState.REPLICA)
    clock.now += 2
    assert bucket.vbucket(3).expire_if_due(b"k") is False
    done = asyncio.run(ExpiryPager(bucket, clock=clock, interval_s=0).run_pass())
    assert (done.expired, done.vbuckets) == (0, 3)
    assert expirations(bucket, 3) == []


def test_the_schedule_runs_passes_until_stopped(bucket: Bucket, clock: ManualClock) -> None:
    bucket.vbucket(0).set(b"k", b"v", expiry=int(clock.now) + 1)
    bucket.vbucket(0).flush()
    clock.now += 2
    pager = ExpiryPager(bucket, clock=clock, interval_s=0.01)

    async def scenario() -> None:
        pager.start()
        for _ in range(500):
            if pager.counters["expired"]:
                break
            await asyncio.sleep(0.01)
        await pager.stop()

    asyncio.run(scenario())
    assert pager.counters["expired"] == 1
    assert expirations(bucket, 0) == [b"k"]


def test_no_pass_while_the_store_cannot_persist(bucket: Bucket, clock: ManualClock) -> None:
    bucket.vbucket(0).set(b"k", b"v", expiry=int(clock.now) + 1)
    bucket.vbucket(0).flush()
    clock.now += 2
    bucket.persistence.failed(OSError("disk full"))  # what the flush loop records
    pager = ExpiryPager(bucket, clock=clock, interval_s=0.01)

    async def scenario() -> None:
        pager.start()
        await asyncio.sleep(0.1)
        assert pager.counters["runs"] == 0
        bucket.persistence.succeeded()
        for _ in range(500):
            if pager.counters["expired"]:
                break
            await asyncio.sleep(0.01)
        await pager.stop()

    asyncio.run(scenario())
    assert pager.counters["expired"] == 1
