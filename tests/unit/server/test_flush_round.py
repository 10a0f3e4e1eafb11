"""One flush round writes every vbucket with queued items in one transaction (one commit, one
fsync), and a commit that fails leaves every vbucket's items queued for the next round."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from changefeed.server import bucket as bucket_module
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


def run_flush_loop(bucket: Bucket, steps: object) -> None:
    """Run the bucket's flush loop while `steps` (a coroutine function of the bucket) runs."""

    async def main() -> None:
        bucket.start()
        try:
            await steps(bucket)  # type: ignore[operator]
        finally:
            assert bucket._flush_task is not None
            bucket._flush_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await bucket._flush_task

    asyncio.run(main())


def test_rounds_under_load_wait_the_gap_unless_a_writer_waits_for_persistence(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a round the flusher gathers for FLUSH_IDLE_S (back-to-back rounds were a few
    items per vbucket each); an OBSERVE_SEQNO below the high seqno cuts the gap short."""
    monkeypatch.setattr(bucket_module, "FLUSH_IDLE_S", 30.0)  # longer than the test runs
    monkeypatch.setattr(bucket_module, "FLUSH_GATHER_S", 30.0)  # after a small round too
    vbucket = bucket.vbucket(0)

    async def steps(bucket: Bucket) -> None:
        bucket._hurry.set()  # the first round, at once
        vbucket.set(b"first", b"v")
        await wait_until(lambda: vbucket.persisted_seqno == 1)
        vbucket.set(b"second", b"v")  # the loop now waits out its 30 s gap
        await asyncio.sleep(0.3)
        assert vbucket.persisted_seqno == 1
        observed = bucket.observe_seqno(0, vbucket.vb_uuid)
        assert (observed.persisted_seqno, observed.current_seqno) == (1, 2)
        await wait_until(lambda: vbucket.persisted_seqno == 2)

    run_flush_loop(bucket, steps)


def test_a_small_round_gathers_longer_and_a_large_one_does_not(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round of fewer than SMALL_ROUND_ITEMS waits FLUSH_GATHER_S before the next (small
    windows paid a round each); after a larger one the gap is FLUSH_IDLE_S again."""
    monkeypatch.setattr(bucket_module, "SMALL_ROUND_ITEMS", 3)
    monkeypatch.setattr(bucket_module, "FLUSH_GATHER_S", 30.0)  # longer than the test runs
    monkeypatch.setattr(bucket_module, "FLUSH_IDLE_S", 0.01)
    vbucket = bucket.vbucket(0)

    async def steps(bucket: Bucket) -> None:
        bucket._hurry.set()  # the first round, at once: one item, a small round
        vbucket.set(b"a", b"v")
        await wait_until(lambda: vbucket.persisted_seqno == 1)
        for key in (b"b", b"c", b"d"):
            vbucket.set(key, b"v")
        await asyncio.sleep(0.3)
        assert vbucket.persisted_seqno == 1  # gathering after the small round
        bucket.hurry_flush()  # a writer waits: the round of three goes now
        await wait_until(lambda: vbucket.persisted_seqno == 4)
        vbucket.set(b"e", b"v")  # after a round of three: the short gap
        await wait_until(lambda: vbucket.persisted_seqno == 5)

    run_flush_loop(bucket, steps)


def test_the_gap_stays_short_while_a_prepare_is_pending(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pending SyncWrite prepare keeps the short gap after a small round: a replica holding
    one is persisted for a persistToMajority write, with no writer there to hurry it."""
    monkeypatch.setattr(bucket_module, "SMALL_ROUND_ITEMS", 100)
    monkeypatch.setattr(bucket_module, "FLUSH_GATHER_S", 30.0)  # longer than the test runs
    monkeypatch.setattr(bucket_module, "FLUSH_IDLE_S", 0.01)
    vbucket = bucket.vbucket(0)

    async def steps(bucket: Bucket) -> None:
        bucket._hurry.set()
        vbucket.set(b"p", b"v", level=1)  # a prepare nobody commits here
        await wait_until(lambda: vbucket.persisted_seqno == 1)
        vbucket.set(b"x", b"v")  # no hurry: the short gap
        await wait_until(lambda: vbucket.persisted_seqno == 2)

    run_flush_loop(bucket, steps)


def test_a_prepare_queued_during_the_gap_ends_it(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepare that arrives while the flusher gathers after a small round of plain writes is
    persisted without waiting out the gap: on a replica nothing else hurries the round, and a
    persistToMajority write waits for it (the gap used to be decided once, before it began)."""
    monkeypatch.setattr(bucket_module, "SMALL_ROUND_ITEMS", 100)
    monkeypatch.setattr(bucket_module, "FLUSH_GATHER_S", 30.0)  # longer than the test runs
    vbucket = bucket.vbucket(0)

    async def steps(bucket: Bucket) -> None:
        bucket.hurry_flush()
        vbucket.set(b"x", b"v")  # a plain write: the round after it gathers 30 s
        await wait_until(lambda: vbucket.persisted_seqno == 1)
        await asyncio.sleep(0.05)  # inside the gap
        vbucket.set(b"p", b"v", level=1)  # a prepare nobody commits here, nobody hurries
        await wait_until(lambda: vbucket.persisted_seqno == 2)

    run_flush_loop(bucket, steps)


async def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("prepare_at", range(4))
def test_a_prepare_among_plain_writes_of_the_same_step_ends_the_gap(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch, prepare_at: int
) -> None:
    """The gap looks once per loop step at every vbucket queued to in it (not once per
    write, not only the last one written to): a prepare on any vbucket, queued first in a
    step and followed by plain writes on every vbucket, ends it; the plain writes alone, in
    the steps before, do not."""
    monkeypatch.setattr(bucket_module, "SMALL_ROUND_ITEMS", 100)
    monkeypatch.setattr(bucket_module, "FLUSH_GATHER_S", 30.0)  # longer than the test runs
    vbuckets = [bucket.vbucket(vb) for vb in sorted(bucket.vbuckets)]
    assert len(vbuckets) == 4

    async def steps(bucket: Bucket) -> None:
        bucket.hurry_flush()
        vbuckets[0].set(b"x", b"v")  # a plain write: the round after it gathers 30 s
        await wait_until(lambda: vbuckets[0].persisted_seqno == 1)
        for step in range(3):  # plain writes in steps of their own: still gathering
            for vbucket in vbuckets:
                vbucket.set(b"plain%d" % step, b"v")
            await asyncio.sleep(0.05)
        assert [vbucket.persisted_seqno for vbucket in vbuckets] == [1, 0, 0, 0]
        # A prepare nobody commits or hurries, then plain writes behind it in the same step.
        vbuckets[prepare_at].set(b"p", b"v", level=1)
        for vbucket in vbuckets:
            vbucket.set(b"late", b"v")
        final = [(4 if i == 0 else 3) + (i == prepare_at) + 1 for i in range(4)]
        await wait_until(lambda: [vbucket.persisted_seqno for vbucket in vbuckets] == final)

    run_flush_loop(bucket, steps)
