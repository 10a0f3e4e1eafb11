"""``Flusher``: group commits, the persisted seqno and its waiters, and no loss on a failed
commit (the backup cursor)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.checkpoint import CheckpointManager, Flusher, MemoryBudget, item_size_bytes
from changefeed.storage import Op, StorageError, Store, WriteBatch

from .helpers import VB, Model, item, open_store, store_view


class CountingStore(Store):
    """A store that counts commits and can be told to fail the next one."""

    commits = 0
    fail_next = False

    @contextlib.contextmanager
    def write_batch(self) -> Iterator[WriteBatch]:
        with super().write_batch() as batch:
            yield batch
            if self.fail_next:
                self.fail_next = False
                raise StorageError("injected commit failure")
        self.commits += 1


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CountingStore]:
    opened = open_store(tmp_path)
    opened.close()
    counting = CountingStore(tmp_path, map_size_bytes=256 * 1024 * 1024, durable=False)
    yield counting
    counting.close()


def fill(manager: CheckpointManager, model: Model, count: int, keys: int = 40) -> None:
    for _ in range(count):
        seqno = model.high_seqno + 1
        op = Op.DELETION if seqno % 5 == 0 else Op.MUTATION
        one = item(seqno, f"k{seqno % keys}", b"v%d" % seqno, op=op)
        manager.queue(one)
        model.append(one)


def test_flush_makes_the_store_equal_the_model(store: CountingStore) -> None:
    manager = CheckpointManager(VB)
    flusher = Flusher(manager, store)
    model = Model()
    fill(manager, model, 300)
    assert flusher.flush() > 0
    manager._check_invariants()
    assert store_view(store) == model.latest()
    assert flusher.persisted_seqno == 300
    assert store.high_seqno(VB) == 300
    meta = store.vbucket_meta(VB)
    assert meta is not None
    assert meta.snap_start <= 300 <= meta.snap_end
    assert not flusher.pending
    assert flusher.flush() == 0


def test_each_batch_is_one_commit_bounded_in_bytes(store: CountingStore) -> None:
    manager = CheckpointManager(VB)
    one = item_size_bytes(item(1, "k1", b"v1"))
    flusher = Flusher(manager, store, batch_bytes_max=10 * one)
    model = Model()
    fill(manager, model, 100, keys=1000)
    written = flusher.flush()
    assert written == 100
    assert store.commits == 10
    assert flusher.stats["batches"] == 10


def test_a_failed_commit_loses_nothing_and_is_retried(store: CountingStore) -> None:
    budget = MemoryBudget(10**9)
    manager = CheckpointManager(VB, budget=budget)
    flusher = Flusher(manager, store)
    model = Model()
    fill(manager, model, 50)
    memory_before = manager.memory_bytes
    live_before = sum(checkpoint.live_count for checkpoint in manager.checkpoints())
    store.fail_next = True
    with pytest.raises(StorageError):
        flusher.flush()
    manager._check_invariants()
    assert flusher.persisted_seqno == 0
    assert manager.memory_bytes == memory_before  # nothing was freed: it is not on disk
    assert manager.first_memory_seqno == 1
    assert flusher.stats["failed_batches"] == 1
    assert flusher.flush() == live_before  # the same deduplicated items, written once
    assert store_view(store) == model.latest()


def test_checkpoints_are_freed_only_after_the_commit(store: CountingStore) -> None:
    manager = CheckpointManager(VB)
    flusher = Flusher(manager, store)
    model = Model()
    fill(manager, model, 20)
    manager.close_open_checkpoint()
    seen_during_commit: list[int] = []
    original = store.write_batch

    @contextlib.contextmanager
    def watching() -> Iterator[WriteBatch]:
        seen_during_commit.append(manager.first_memory_seqno)
        with original() as batch:
            yield batch

    store.write_batch = watching  # type: ignore[method-assign]
    flusher.flush()
    assert seen_during_commit == [1]  # the backup cursor held the checkpoints while writing
    assert manager.first_memory_seqno == 21


def test_wait_persisted_resolves_in_seqno_order_and_times_out(store: CountingStore) -> None:
    manager = CheckpointManager(VB)
    flusher = Flusher(manager, store)
    model = Model()
    fill(manager, model, 10)

    async def scenario() -> list[bool]:
        waiters = [asyncio.ensure_future(flusher.wait_persisted(s, 5.0)) for s in (3, 10)]
        timed_out = await flusher.wait_persisted(10, 0.01)
        await asyncio.sleep(0)
        flusher.flush()
        done = await asyncio.gather(*waiters)
        already = await flusher.wait_persisted(7, 0.0)
        return [timed_out, *done, already]

    assert asyncio.run(scenario()) == [False, True, True, True]


def test_a_deduplicated_write_is_persisted_only_with_its_replacement(
    store: CountingStore,
) -> None:
    """K@2 is replaced by K@4 before the flusher wrote it: writing B@3 must not make seqno 2
    'persisted' (a writer waiting for K@2 would be told durable with no K on disk)."""
    manager = CheckpointManager(VB)
    flusher = Flusher(manager, store, batch_bytes_max=1)  # one item per batch
    for queued in (item(1, "a"), item(2, "k"), item(3, "b"), item(4, "k", b"new")):
        manager.queue(queued)
    assert flusher.flush_batch() == 1  # a@1
    assert flusher.persisted_seqno == 1
    assert flusher.flush_batch() == 1  # b@3: k@2's write now lives only in k@4
    assert flusher.persisted_seqno == 1
    assert store.get(VB, b"k") is None
    assert flusher.flush_batch() == 1  # k@4
    assert flusher.persisted_seqno == 4
    assert store.get(VB, b"k") is not None


def test_replacement_chains_carry_the_oldest_unwritten_seqno(store: CountingStore) -> None:
    manager = CheckpointManager(VB)
    flusher = Flusher(manager, store, batch_bytes_max=1)
    for queued in (item(1, "a"), item(2, "k"), item(3, "k"), item(4, "b"), item(5, "k")):
        manager.queue(queued)
    flusher.flush_batch()  # a@1
    flusher.flush_batch()  # b@4
    assert flusher.persisted_seqno == 1  # k@2 and k@3 live on only in k@5
    flusher.flush()
    assert flusher.persisted_seqno == 5
