"""The flusher's batches that mix items and column slices (a replica's run queued as columns,
`CheckpointManager.next_flush_run`): what `Flusher._write` does between the two forms.

Each case is written twice, once with the run queued as columns (the lazy path) and once as
the same items (`queue_run`), and the stores must agree record for record, metadata included;
the high completed seqno is also checked against its expected value, since both forms could
drop it alike. The flush-round case goes through `stage_round`, the node's path, where plain
items are put after every vbucket staged (`WriteBatch.put_runs`) and so must not be when a
column slice of the same vbucket follows them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from changefeed.checkpoint import CheckpointManager, Flusher, Item, MemoryBudget, SyncItem
from changefeed.checkpoint.flusher import stage_round
from changefeed.storage import Op, Record, Store, VBucketMeta

from .helpers import open_store
from .replicated import columns_of

LEVEL_MAJORITY = 1
LEVEL_PERSIST_TO_MAJORITY = 3


def mutations(first: int, count: int) -> list[Item]:
    """`count` mutations of new keys from seqno `first`, every field non-zero."""
    return [
        Item(s, b"k%d" % s, Op.MUTATION, b"v" * s, 5 + s, flags=s, expiry=100 + s, rev_seqno=s)
        for s in range(first, first + count)
    ]


def manager_of(vb: int = 0) -> CheckpointManager:
    """One big checkpoint; every run of at least one item queued as columns."""
    return CheckpointManager(
        vb, budget=MemoryBudget(10**9), checkpoint_max_bytes=10**9, columns_min_items=1
    )


def queue(manager: CheckpointManager, built: list[Item], lazy: bool) -> None:
    if lazy:
        assert manager.queue_columns(columns_of(built)) == len(built)
        assert manager.open_checkpoint.lazy
    else:
        assert manager.queue_run(built) == len(built)


class Stored(NamedTuple):
    """Everything the flusher writes of a vbucket."""

    records: list[Record]  # every field compared
    meta: VBucketMeta | None
    high_completed: int
    prepares: list[tuple[int, Record]]


def stored(store: Store, vb: int = 0) -> Stored:
    records = list(store.scan(vb, 0, store.high_seqno(vb)))
    return Stored(
        records, store.vbucket_meta(vb), store.high_completed_seqno(vb), store.prepares(vb)
    )


def twins(tmp_path: Path, fill: Callable[[CheckpointManager, Flusher, bool], None]) -> Stored:
    """`fill` run with the run queued as columns and as items: the stores must agree."""
    results = []
    for lazy in (True, False):
        store = open_store(tmp_path / ("lazy" if lazy else "items"))
        manager = manager_of()
        flusher = Flusher(manager, store, batch_bytes_max=10**9)
        fill(manager, flusher, lazy)
        results.append(stored(store))
        store.close()
    assert results[0] == results[1]
    return results[0]


def test_a_commit_then_a_column_slice_in_one_batch_sets_the_high_completed_seqno(
    tmp_path: Path,
) -> None:
    """Found by review: with the mixed branch's `completed` never taken from the item group,
    the commit's prepare was not recorded completed."""

    def fill(manager: CheckpointManager, flusher: Flusher, lazy: bool) -> None:
        prepare = SyncItem(1, b"p", Op.PREPARE, Op.MUTATION, b"x", 50, level=LEVEL_MAJORITY)
        manager.queue_prepares([prepare])
        assert flusher.flush() == 1
        manager.queue(prepare.committed(2))
        queue(manager, mutations(3, 10), lazy)
        assert flusher.flush_batch() == 11  # the commit and the run, one batch

    got = twins(tmp_path, fill)
    assert got.high_completed == 1
    assert got.prepares == []
    assert [r.seqno for r in got.records] == list(range(2, 13))


@pytest.mark.parametrize("abort", [False, True])
def test_prepares_completed_out_of_order_around_a_column_slice(tmp_path: Path, abort: bool) -> None:
    """Durable writes of different levels complete out of order: the majority prepare (2) is
    committed before the persist-to-majority one (1). In one batch, commit 2, a column run,
    then the commit (or the abort) of 1: the high completed seqno is the newest prepare
    completed in the batch (2), not the last item group's (1)."""

    def fill(manager: CheckpointManager, flusher: Flusher, lazy: bool) -> None:
        slow = SyncItem(
            1, b"slow", Op.PREPARE, Op.MUTATION, b"x", 50, level=LEVEL_PERSIST_TO_MAJORITY
        )
        fast = SyncItem(2, b"fast", Op.PREPARE, Op.MUTATION, b"y", 51, level=LEVEL_MAJORITY)
        manager.queue_prepares([slow, fast])
        assert flusher.flush() == 2
        manager.queue(fast.committed(3))
        queue(manager, mutations(4, 10), lazy)
        if abort:
            manager.queue(SyncItem(14, b"slow", Op.ABORT, Op.DELETION, b"", 50, prepared_seqno=1))
        else:
            manager.queue(slow.committed(14))
        assert flusher.flush_batch() == 12  # commit, run, commit or abort: one batch

    got = twins(tmp_path, fill)
    assert got.high_completed == 2
    assert got.prepares == []
    written = [*range(3, 14)] if abort else [*range(3, 15)]
    assert [r.seqno for r in got.records] == written


def test_a_flush_round_with_an_item_then_a_column_run_in_each_vbucket(tmp_path: Path) -> None:
    """Found by review (only the simulator caught it): in a flush round, an item group that a
    column slice follows is put at once, not left for the round's `put_runs` (which would put
    it after the slice, below the vbucket's high seqno)."""
    rounds = []
    for lazy in (True, False):
        store = Store(tmp_path / str(lazy), map_size_bytes=64 * 1024 * 1024, durable=False)
        with store.write_batch() as batch:
            for vb in (0, 1):
                batch.set_vbucket_meta(vb, state="replica")
        flushers = []
        for vb in (0, 1):
            manager = manager_of(vb)
            flushers.append(Flusher(manager, store, batch_bytes_max=10**9))
            manager.queue(Item(1, b"t", Op.DELETION, b"", 9, delete_time=1))  # an item first
            queue(manager, mutations(2, 10), lazy)
        flush_round = stage_round(store, flushers, 10**9)
        assert flush_round is not None
        store.commit_batch(flush_round.batch)
        assert flush_round.committed() == (22, [0, 1])
        assert not any(flusher.pending for flusher in flushers)
        for vb in (0, 1):
            assert [r.seqno for r in store.scan(vb, 0, 20)] == list(range(1, 12))
            assert flushers[vb].persisted_seqno == 11
        rounds.append([stored(store, vb) for vb in (0, 1)])
        store.close()
    assert rounds[0] == rounds[1]
