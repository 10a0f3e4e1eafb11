"""Memory accounting and recovery: marks, TMPFAIL, which cursors are dropped and in what order.

The long stalled-reader runs (100k items by default, 1M under -m slow) are in test_quota.py.
"""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from changefeed.checkpoint import (
    DROPPED,
    ITEM_OVERHEAD_BYTES,
    CheckpointManager,
    CheckpointMemoryFullError,
    CursorKind,
    Item,
    MemoryBudget,
    item_size_bytes,
)
from changefeed.storage import Op

from .helpers import item, queue_all, seqnos

ONE = item_size_bytes(item(1, "k00001", b"x" * 100))


def items(first: int, last: int) -> list[Item]:
    return [item(s, f"k{s:05d}", b"x" * 100) for s in range(first, last + 1)]


def test_item_size_is_key_plus_value_plus_the_named_overhead() -> None:
    one = item(1, "key", b"v" * 100)
    assert item_size_bytes(one) == 3 + 100 + ITEM_OVERHEAD_BYTES


def test_budget_marks_follow_the_percentages() -> None:
    budget = MemoryBudget(1000, upper_mark_percent=90, lower_mark_percent=60)
    assert (budget.upper_mark_bytes, budget.lower_mark_bytes) == (900, 600)
    budget.charge(901)
    assert budget.over_upper_mark
    budget.charge(-901)
    assert budget.used_bytes == 0
    with pytest.raises(AssertionError):
        MemoryBudget(1000, upper_mark_percent=50, lower_mark_percent=60)


def realistic(first: int, last: int) -> list[Item]:
    """Items as the network delivers them: distinct value objects, 64-bit CAS values."""
    return [
        Item(s, b"k%05d" % s, Op.MUTATION, b"%0100d" % s, cas=(1 << 62) + s)
        for s in range(first, last + 1)
    ]


def test_overhead_constant_is_close_to_what_python_really_allocates() -> None:
    """ITEM_OVERHEAD_BYTES claims what an item costs beyond key and value; measure it."""
    count = 20_000
    manager = CheckpointManager(0, persistence=False, budget=MemoryBudget(10**10))
    manager.register_cursor("keeper", 0)  # keeps everything in memory
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        batch = realistic(1, count)
        queue_all_fast(manager, batch)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    list_slots_bytes = 8 * len(batch)  # the test's own list of the items, not the checkpoint's
    measured = (after - before - list_slots_bytes) / count
    accounted = manager.memory_bytes / count
    print(f"measured {measured:.0f} B/item, accounted {accounted:.0f} B/item")
    assert 0.85 * accounted <= measured <= 1.15 * accounted, (measured, accounted)


def queue_all_fast(manager: CheckpointManager, batch: list[Item]) -> None:
    for one in batch:
        manager.queue(one)


def test_write_is_refused_when_only_the_persistence_cursor_holds_memory() -> None:
    budget = MemoryBudget(10 * ONE)
    manager = CheckpointManager(0, budget=budget)
    queue_all(manager, items(1, 10))
    with pytest.raises(CheckpointMemoryFullError):
        manager.queue(items(11, 11)[0])
    manager._check_invariants()
    assert manager.high_seqno == 10  # nothing changed
    assert budget.used_bytes <= budget.quota_bytes
    assert manager.persistence_cursor is not None
    assert manager.persistence_cursor.attached  # never dropped
    assert seqnos(manager.iter_events(manager.persistence_cursor)) == list(range(1, 11))


def test_recovery_drops_a_stalled_droppable_reader_and_frees_down_to_the_lower_mark() -> None:
    budget = MemoryBudget(100 * ONE)
    manager = CheckpointManager(0, budget=budget, persistence=False, checkpoint_max_bytes=10 * ONE)
    stalled = manager.register_cursor("stalled", 0).cursor
    for one in items(1, 95):
        manager.queue(one)
        manager._check_invariants()
        assert budget.used_bytes <= budget.quota_bytes
    assert budget.recoveries >= 1
    assert manager.next_event(stalled) is DROPPED
    assert manager.stats["cursors_dropped"] == 1
    assert budget.used_bytes <= budget.upper_mark_bytes


def test_recovery_never_drops_persistence_and_drops_streams_only_behind_it() -> None:
    budget = MemoryBudget(40 * ONE)
    manager = CheckpointManager(0, budget=budget, checkpoint_max_bytes=5 * ONE)
    persistence = manager.persistence_cursor
    assert persistence is not None
    behind = manager.register_cursor("behind", 0).cursor
    queue_all(manager, items(1, 20))
    list(manager.iter_events(persistence))  # persistence catches up; "behind" stays at the front
    ahead = manager.register_cursor("ahead", 20).cursor  # in the open checkpoint with persistence
    queue_all(manager, items(21, 60))
    assert not behind.attached  # dropped: it sat in checkpoints older than persistence
    assert ahead.attached  # not older than the persistence cursor's checkpoint
    assert persistence.attached
    assert budget.used_bytes <= budget.quota_bytes


def test_replica_cursors_are_dropped_only_when_configured() -> None:
    for droppable in (False, True):
        budget = MemoryBudget(30 * ONE)
        manager = CheckpointManager(
            0,
            budget=budget,
            persistence=False,
            replica_cursors_droppable=droppable,
            checkpoint_max_bytes=5 * ONE,
        )
        replica = manager.register_cursor("replica", 0, kind=CursorKind.REPLICA).cursor
        assert replica.droppable == droppable
        try:
            queue_all(manager, items(1, 60))
        except CheckpointMemoryFullError:
            assert not droppable  # the undroppable replica holds everything
        assert replica.attached != droppable


def test_the_reader_in_the_oldest_checkpoint_goes_first_and_recovery_stops_at_the_mark() -> None:
    budget = MemoryBudget(100 * ONE)
    manager = CheckpointManager(0, budget=budget, persistence=False, checkpoint_max_bytes=10 * ONE)
    oldest = manager.register_cursor("oldest", 0).cursor
    queue_all(manager, items(1, 50))
    newer = manager.register_cursor("newer", 45).cursor  # in the last closed checkpoint
    queue_all(manager, items(51, 95))
    assert not oldest.attached
    assert newer.attached  # dropping "oldest" alone reached the lower mark
    assert seqnos(manager.iter_events(newer)) == list(range(46, 96))


def test_shared_budget_recovers_from_the_largest_manager_first() -> None:
    budget = MemoryBudget(100 * ONE)
    big = CheckpointManager(1, budget=budget, persistence=False, checkpoint_max_bytes=10 * ONE)
    small = CheckpointManager(2, budget=budget, persistence=False, checkpoint_max_bytes=10 * ONE)
    big_reader = big.register_cursor("reader", 0).cursor
    small_reader = small.register_cursor("reader", 0).cursor
    queue_all(small, items(1, 20))
    queue_all(big, items(1, 75))
    big._check_invariants()
    small._check_invariants()
    assert not big_reader.attached
    assert small_reader.attached
    assert budget.used_bytes == big.memory_bytes + small.memory_bytes
