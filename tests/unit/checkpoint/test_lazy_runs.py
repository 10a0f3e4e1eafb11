"""Lazy column runs (`Checkpoint.add_columns`, `CheckpointManager.queue_columns`): the exact
bounds of a take, the readers that must build them, how many lazy runs a flusher's read looks
at (a bisection, not a scan: the flush of R runs must not be O(R^2)), the short runs queued
as items, and the manager invariants around prepares (a review's findings, issue 29 sixth
round).
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import SupportsIndex, overload

from changefeed.checkpoint import (
    CAUGHT_UP,
    Checkpoint,
    CheckpointManager,
    CursorKind,
    Flusher,
    Item,
    MemoryBudget,
    SyncItem,
    item_size_bytes,
)
from changefeed.checkpoint.columns import LazyRun
from changefeed.checkpoint.manager import COLUMNS_MIN_ITEMS, ColumnSlice, ItemRun
from changefeed.storage import Op

from .helpers import VB, open_store
from .replicated import columns_of


def built(first: int, count: int) -> list[Item]:
    """`count` mutations of new keys from seqno `first`, every metadata field set."""
    return [
        Item(s, b"k%05d" % s, Op.MUTATION, b"v" * 9, 5 + s, s, s, s % 8, s)
        for s in range(first, first + count)
    ]


def lazy_manager() -> CheckpointManager:
    """A manager that queues every column run lazily, however short."""
    return CheckpointManager(VB, budget=MemoryBudget(10**9), columns_min_items=1)


def test_add_columns_stops_where_the_checkpoint_is_full() -> None:
    """add_run's rule for add_columns: through the item whose charge reaches full_bytes
    exactly (not the one after), and at least one."""
    items = built(1, 10)
    run = columns_of(items)
    size = item_size_bytes(items[0])
    checkpoint = Checkpoint(1, snap_start=1, created_s=0.0)
    assert checkpoint.add_columns(run, 0, 3 * size) == (3, 3 * size)
    assert checkpoint.add_columns(run, 3, 3 * size + 1) == (4, size)  # at least one
    assert checkpoint.add_columns(run, 4, 6 * size + 1) == (7, 3 * size)
    checkpoint.check_invariants()


def test_find_many_builds_the_lazy_items_it_finds() -> None:
    """A replica promoted keeps its checkpoints: the active's set_many looks keys up with
    find_many, which must build the lazy items it finds."""
    items = built(1, 6)
    manager = lazy_manager()
    manager.queue_columns(columns_of(items))
    assert manager.open_checkpoint.lazy
    assert manager.find_many([o.key for o in items[::2]] + [b"nope"]) == [*items[::2], None]


def test_a_stream_run_reads_lazy_items_as_items() -> None:
    """next_run with no byte bound (a stream's read_runs): the lazy items come built, with
    the built ones after them."""
    items = built(1, 6)
    manager = lazy_manager()
    cursor = manager.register_cursor("s", 0, kind=CursorKind.STREAM).cursor
    manager.queue(items[0])
    manager.close_open_checkpoint()  # the stream's checkpoint: one built item
    manager.queue_columns(columns_of(items[1:3]))
    manager.queue(items[3])  # built, after a lazy run, in the same checkpoint
    got: list[Item] = []
    while (run := manager.next_run(cursor, 100)) is not CAUGHT_UP:
        if isinstance(run, ItemRun):
            got += run.items
    assert got == items[:4], got


def test_a_flush_read_of_lazy_items_takes_at_most_items_max() -> None:
    """next_flush_run's item bound over lazy slots, with a byte bound that does not cut."""
    manager = lazy_manager()
    lead = built(1, 1)[0]  # the flusher's checkpoint takes one item, as `queue` leaves it
    manager.queue(lead)
    manager.queue_columns(columns_of(built(2, 10)))
    cursor = manager.persistence_cursor
    assert cursor is not None
    manager.next_event(cursor)  # the snapshot marker
    assert manager.next_flush_run(cursor, 2, 10**9) == ItemRun([lead], item_size_bytes(lead))
    manager.next_event(cursor)  # the lazy run's checkpoint's marker
    for start in (0, 2, 4):
        read = manager.next_flush_run(cursor, 2, 10**9)
        assert isinstance(read, ColumnSlice), read
        assert (read.start, read.stop) == (start, start + 2)


class _CountingRuns(list[LazyRun]):
    """A checkpoint's `lazy` list counting the runs its readers look at."""

    looked = 0

    @overload
    def __getitem__(self, at: SupportsIndex) -> LazyRun: ...
    @overload
    def __getitem__(self, at: slice) -> list[LazyRun]: ...
    def __getitem__(self, at: SupportsIndex | slice) -> LazyRun | list[LazyRun]:
        got = super().__getitem__(at)
        _CountingRuns.looked += len(got) if isinstance(at, slice) else 1
        return got

    def __iter__(self) -> Iterator[LazyRun]:
        for lazy in super().__iter__():  # counts the runs a loop looks at before it stops
            _CountingRuns.looked += 1
            yield lazy


def test_a_flush_of_many_lazy_runs_looks_at_few_runs_per_read() -> None:
    """The flush of a checkpoint of R lazy runs of one item, each after a built one, reads
    it 2R times; each read must find its run (lazy_run) or the next one (lazy_from) by
    bisection (O(log R) runs looked at), not by a scan of all R."""
    runs = 512
    directory = pathlib.Path(tempfile.mkdtemp(prefix="lazy-runs-"))
    try:
        store = open_store(directory)
        manager = lazy_manager()
        flusher = Flusher(manager, store)
        items = built(1, 2 * runs)
        for item, lazy in zip(items[::2], items[1::2], strict=True):
            manager.queue(item)  # a built item between lazy runs: next_run asks lazy_from
            manager.queue_columns(columns_of([lazy]))
        for checkpoint in manager.checkpoints():  # the first closed: the flusher's cursor in it
            checkpoint.lazy = _CountingRuns(checkpoint.lazy)
        assert sum(len(checkpoint.lazy) for checkpoint in manager.checkpoints()) == runs
        _CountingRuns.looked = 0
        assert flusher.flush() == 2 * runs
        # 2 bisections of <= 10 probes and a run or two per read; a scan: runs/2 a read
        assert _CountingRuns.looked <= 2 * runs * 32, _CountingRuns.looked
        assert store.high_seqno(VB) == 2 * runs
        store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_short_runs_are_queued_as_items() -> None:
    """A run shorter than COLUMNS_MIN_ITEMS is built and queued (no lazy slot); one that
    long is queued lazily."""
    manager = CheckpointManager(VB, budget=MemoryBudget(10**9))
    manager.queue(built(1, 1)[0])  # then the runs go to a checkpoint the flusher is not in
    manager.close_open_checkpoint()
    short = built(2, COLUMNS_MIN_ITEMS - 1)
    assert manager.queue_columns(columns_of(short)) == len(short)
    assert not manager.open_checkpoint.lazy
    assert manager.open_checkpoint.live_items() == short
    long = built(COLUMNS_MIN_ITEMS + 1, COLUMNS_MIN_ITEMS)
    assert manager.queue_columns(columns_of(long)) == len(long)
    assert [lazy.stop - lazy.start for lazy in manager.open_checkpoint.lazy] == [len(long)]
    manager._check_invariants()


def _prepare(seqno: int, key: bytes = b"k") -> SyncItem:
    return SyncItem(seqno, key, Op.PREPARE, Op.MUTATION, b"p", 10 + seqno, level=1)


def test_closed_cursorless_neighbours_holding_prepares_keep_the_invariants() -> None:
    """Collapse never merges checkpoints holding prepares, so closed cursorless neighbours
    with prepares are a valid state (the invariant check refused it)."""
    directory = pathlib.Path(tempfile.mkdtemp(prefix="lazy-runs-"))
    try:
        store = open_store(directory)
        manager = CheckpointManager(VB, budget=MemoryBudget(10**9))
        flusher = Flusher(manager, store)
        manager.register_cursor("r", 0, kind=CursorKind.STREAM)  # pins the first checkpoint
        for seqno in range(1, 5):  # each prepare of the key closes the checkpoint before
            manager.queue_prepares([_prepare(seqno)])
            flusher.flush()
        states = [(c.is_open, c.cursor_count > 0) for c in manager.checkpoints()]
        assert states[1:3] == [(False, False), (False, False)], states
        manager._check_invariants()
        store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_closed_cursorless_head_kept_by_retain_from_keeps_the_invariants() -> None:
    """retain_from keeps the checkpoints from a pending prepare's: a closed head no cursor
    is in is valid then (the invariant check refused it)."""
    directory = pathlib.Path(tempfile.mkdtemp(prefix="lazy-runs-"))
    try:
        store = open_store(directory)
        manager = CheckpointManager(VB, budget=MemoryBudget(10**9))
        flusher = Flusher(manager, store)
        manager.queue_prepares([_prepare(1)])
        manager.retain_from(1)
        manager.queue(Item(2, b"a", Op.MUTATION, b"v", 12))
        manager.close_open_checkpoint()
        flusher.flush()
        head = manager.checkpoints()[0]
        assert (head.is_open, head.cursor_count, head.snap_start) == (False, 0, 1), head
        manager._check_invariants()
        store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_lazy_from_and_lazy_run_over_segments_and_gaps() -> None:
    """lazy_from/lazy_run against a scan of the segments: lazy runs with built items
    between them (a bisection must land on the right segment, before, inside and after)."""
    manager = lazy_manager()
    seqno = 1
    for length in (3, 1, 4, 2):
        manager.queue(Item(seqno, b"b%05d" % seqno, Op.MUTATION, b"x", seqno))  # a built gap
        manager.queue_columns(columns_of(built(seqno + 1, length)))
        seqno += length + 1
    checkpoint = manager.open_checkpoint
    segments = [(lazy.first, lazy.end) for lazy in checkpoint.lazy]
    for index in range(len(checkpoint.items) + 2):
        after = [max(first, index) for first, end in segments if end > index]
        assert checkpoint.lazy_from(index) == min(after, default=None), index
        inside = [first for first, end in segments if first <= index < end]
        got = checkpoint.lazy_run(index, 100, 10**9)
        assert (got is not None) == bool(inside), index
        if got is not None:
            lazy = next(lazy for lazy in checkpoint.lazy if lazy.first == inside[0])
            assert got[:3] == (lazy.run, lazy.start + index - lazy.first, lazy.stop), index
