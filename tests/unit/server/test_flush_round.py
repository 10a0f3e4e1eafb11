"""One flush round writes every vbucket with queued items in one transaction (one commit, one
fsync), and a commit that fails leaves every vbucket's items queued for the next round."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.server.bucket import Bucket
from changefeed.storage import StorageError, WriteBatch
from support.buckets import ManualClock, open_bucket


@pytest.fixture
def bucket(tmp_path: Path) -> Iterator[Bucket]:
    with open_bucket(tmp_path, ManualClock(), vbuckets=4, seed=3) as opened:
        yield opened


def count_commits(bucket: Bucket, fail_first: bool = False) -> list[int]:
    """Count the store's commits (the first one fails if asked); they run on the writer
    thread, as in the node."""
    commits = [0]
    original = bucket.store.commit_batch
    failing = [fail_first]

    def counted(batch: WriteBatch) -> None:
        if failing[0]:
            failing[0] = False
            bucket.store.abort_batch(batch)
            raise StorageError("injected commit failure")
        original(batch)
        commits[0] += 1

    bucket.store.commit_batch = counted  # type: ignore[method-assign]
    return commits


def flush_round(bucket: Bucket) -> int:
    return asyncio.run(bucket._flush_round())


def test_a_round_is_one_commit_for_every_vbucket(bucket: Bucket) -> None:
    for vb in range(4):
        for n in range(5):
            bucket.vbucket(vb).set(b"k%d-%d" % (vb, n), b"v")
    commits = count_commits(bucket)
    assert flush_round(bucket) == 20
    assert commits == [1]
    assert all(bucket.vbucket(vb).persisted_seqno == 5 for vb in range(4))
    assert flush_round(bucket) == 0 and commits == [1]  # an empty round commits nothing


def test_a_failed_round_loses_nothing(bucket: Bucket) -> None:
    for vb in range(4):
        bucket.vbucket(vb).set(b"k%d" % vb, b"v")
    count_commits(bucket, fail_first=True)
    with pytest.raises(StorageError):
        flush_round(bucket)
    assert all(bucket.vbucket(vb).persisted_seqno == 0 for vb in range(4))
    assert flush_round(bucket) == 4
    assert all(bucket.vbucket(vb).persisted_seqno == 1 for vb in range(4))
    assert all(bucket.store.get(vb, b"k%d" % vb) is not None for vb in range(4))


def gate_commits(bucket: Bucket) -> tuple[threading.Event, threading.Event]:
    """Hold every commit on the writer thread until `release` is set; `entered` tells that
    one is being held."""
    entered, release = threading.Event(), threading.Event()
    original = bucket.store.commit_batch

    def held(batch: WriteBatch) -> None:
        entered.set()
        assert release.wait(30), "the test never released the commit"
        original(batch)

    bucket.store.commit_batch = held  # type: ignore[method-assign]
    return entered, release


def test_requests_are_served_while_a_round_commits(bucket: Bucket) -> None:
    """The commit (and its fsync) runs off the event loop: writes, reads and their
    lookups in the store go on meanwhile, and land in the next round."""
    for vb in range(4):
        bucket.vbucket(vb).set(b"before-%d" % vb, b"v")
    entered, release = gate_commits(bucket)

    async def scenario() -> None:
        round_task = asyncio.get_running_loop().create_task(bucket._flush_round())
        while not entered.is_set():
            await asyncio.sleep(0.001)
        bucket.vbucket(0).set(b"during", b"w")  # looks the key up in the store meanwhile
        assert bucket.get(0, b"during").value == b"w"
        assert bucket.get(1, b"before-1").value == b"v"
        assert not round_task.done()
        release.set()
        assert await round_task == 4
        assert bucket.vbucket(0).persisted_seqno == 1
        assert await bucket._flush_round() == 1

    asyncio.run(scenario())
    assert bucket.store.get(0, b"during") is not None
    assert all(
        bucket.vbucket(vb).persisted_seqno == bucket.vbucket(vb).high_seqno for vb in range(4)
    )


def test_a_round_cancelled_mid_commit_settles_its_items(bucket: Bucket) -> None:
    """close() cancels the flusher while the writer thread commits: the round waits for the
    commit and accounts for it, so nothing is written twice or counted unpersisted."""
    for vb in range(4):
        bucket.vbucket(vb).set(b"k%d" % vb, b"v")
    entered, release = gate_commits(bucket)

    async def scenario() -> None:
        round_task = asyncio.get_running_loop().create_task(bucket._flush_round())
        while not entered.is_set():
            await asyncio.sleep(0.001)
        round_task.cancel()
        threading.Timer(0.1, release.set).start()
        with pytest.raises(asyncio.CancelledError):
            await round_task

    asyncio.run(scenario())
    assert all(bucket.vbucket(vb).persisted_seqno == 1 for vb in range(4))
    assert all(bucket.vbucket(vb).flusher.flush() == 0 for vb in range(4))  # nothing left
