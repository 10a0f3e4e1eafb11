"""One checkpoint: a deduplicated run of items that becomes one in-memory DCP snapshot.

Contract (seed mutation-manager.md, dcp-wire.md §10): a checkpoint holds each key at most once.
Its item list starts with `DUMMY` (index 0) and, once the first item arrives, `CHECKPOINT_START`
(index 1); items follow in seqno order. Queuing a key already present replaces the older item by a
hole (`None`) and appends the new one, so every position a cursor holds stays valid: a cursor on
the replaced item's slot neither re-reads it nor skips anything after it. Holes are squeezed out
only while no cursor is inside (`compact`). [snap_start, snap_end] covers every seqno queued here,
including deduplicated ones.

SyncWrite items (PREPARE, ABORT: checkpoint/item.py `SyncItem`) live in a second namespace,
`prepared_index`: they never replace anything and are never replaced (a replica must receive
every prepare), and reads do not find them. The manager starts a new checkpoint rather than
put a key twice in that namespace, and never collapses a checkpoint holding them.

Only the open checkpoint takes items (`add`); a closed one changes only by `absorb` (collapse),
which the manager runs only on checkpoints no cursor is in.

A run of new keys received as columns (`add_columns`, a replica catching up) takes its slots
and key-index entries at once but leaves each slot `LAZY` (checkpoint/columns.py): the `Item`s
are built by `settle`, which every read of a slot runs first (`live_items`, `position_after`,
a deduplication, the manager's readers and lookups), for all of the checkpoint's lazy runs.

Not here: the list of checkpoints, cursors, memory quota (manager.py, cursor.py, memory.py).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Final

from changefeed.checkpoint.columns import LAZY, ColumnRun, Lazy, LazyRun, charged_prefix, items_of
from changefeed.checkpoint.item import (
    CHECKPOINT_START,
    DUMMY,
    CommitItem,
    Item,
    MetaItem,
    SyncItem,
)
from changefeed.checkpoint.memory import (
    MUTATION_BODY_OVERHEAD_BYTES,
    TOMBSTONE_BODY_OVERHEAD_BYTES,
    item_size_bytes,
)
from changefeed.storage import Op

Slot = Item | MetaItem | Lazy | None

_FIRST_ITEM_INDEX = 2  # after DUMMY and CHECKPOINT_START
_first_of: Final = operator.attrgetter("first")
SYNC_OPS: Final = frozenset((Op.PREPARE, Op.ABORT))
_ABORT: Final = Op.ABORT
_PREPARE: Final = Op.PREPARE
_MUTATION: Final = Op.MUTATION


class Checkpoint:
    """A node of the manager's doubly linked checkpoint list.

    Attributes:
        id: increasing per manager; list order equals id order.
        items: DUMMY, CHECKPOINT_START, then items and holes (None) in seqno order.
        key_index: key -> index in `items` of the live item with that key.
        prepared_index: the same for SyncWrite PREPARE/ABORT items (never deduplicated).
        visible_end: seqno of the newest item a reader sees (not a PREPARE/ABORT), here or,
            when this checkpoint has none, before it (the manager sets it at creation).
        high_completed: the newest prepare this checkpoint commits or aborts, or 0.
        snap_start, snap_end: snapshot range (snap_end = snap_start - 1 while empty).
        marker_end: on a replica, the end of the active's snapshot this checkpoint mirrors.
        is_open: True for the newest checkpoint, the only one that takes items.
        cursor_count: cursors positioned inside.
        memory_bytes: accounted bytes of the live items.
        live_count, hole_count: live items and holes in `items`.
        lazy: the column runs whose items are not built yet (`LazyRun`), oldest first,
            so in index order (a compaction settles them first).
        prev, next: neighbours in the manager's list.
        created_s: clock reading at creation (for stats: checkpoint age).
    """

    __slots__ = (
        "created_s",
        "cursor_count",
        "high_completed",
        "hole_count",
        "id",
        "is_open",
        "items",
        "key_index",
        "lazy",
        "live_count",
        "marker_end",
        "memory_bytes",
        "next",
        "on_replace",
        "prepared_index",
        "prev",
        "snap_end",
        "snap_start",
        "visible_end",
    )

    def __init__(self, checkpoint_id: int, *, snap_start: int, created_s: float) -> None:
        assert checkpoint_id >= 0, checkpoint_id
        assert snap_start >= 1, snap_start
        self.id = checkpoint_id
        self.items: list[Slot] = [DUMMY]
        self.key_index: dict[bytes, int] = {}
        self.prepared_index: dict[bytes, int] = {}
        self.lazy: list[LazyRun] = []
        self.visible_end = 0
        self.high_completed = 0
        self.snap_start = snap_start
        self.snap_end = snap_start - 1
        # A replica's checkpoint mirrors a snapshot of its active: the marker's end, which the
        # items may not reach yet (0 on an active, where snap_end is the whole truth).
        self.marker_end = 0
        self.is_open = True
        self.cursor_count = 0
        self.memory_bytes = 0
        self.live_count = 0
        self.hole_count = 0
        self.prev: Checkpoint | None = None
        self.next: Checkpoint | None = None
        self.created_s = created_s
        # Told (replaced seqno, replacing seqno) on every deduplication: the flusher must not
        # call the replaced seqno persisted before the item replacing it is.
        self.on_replace: Callable[[int, int], None] | None = None

    def __repr__(self) -> str:
        state = "open" if self.is_open else "closed"
        return (
            f"Checkpoint(id={self.id}, {state}, [{self.snap_start}, {self.snap_end}], "
            f"items={self.live_count}, cursors={self.cursor_count}, bytes={self.memory_bytes})"
        )

    @property
    def has_items(self) -> bool:
        """True once an item has been queued here (dedup never brings the count back to 0)."""
        return self.live_count > 0

    @property
    def first_seqno(self) -> int:
        """Seqno of the oldest live item (the checkpoint must have items)."""
        self.settle()
        for slot in self.items[_FIRST_ITEM_INDEX:]:
            if isinstance(slot, Item):
                return slot.seqno
        raise AssertionError(f"{self!r} has no items")

    def add(self, item: Item, size_bytes: int) -> int:
        """Queue `item`, replacing an older item with the same key.

        Returns:
            The change in accounted bytes (negative when the replaced item was larger).
        """
        assert self.is_open, self
        assert item.seqno > self.snap_end, (item.seqno, self.snap_end)
        items = self.items
        if len(items) == 1:
            items.append(CHECKPOINT_START)
        delta = size_bytes
        if item.op in SYNC_OPS:
            assert item.key not in self.prepared_index, (item, self)  # the manager's rule
            items.append(item)
            self.prepared_index[item.key] = len(items) - 1
            if item.op is _ABORT:
                assert isinstance(item, SyncItem), item
                self.high_completed = max(self.high_completed, item.prepared_seqno)
        else:
            self.visible_end = item.seqno
            if type(item) is CommitItem:
                self.high_completed = max(self.high_completed, item.prepared_seqno)
            old_index = self.key_index.get(item.key)
            if old_index is not None:
                delta -= self._punch_hole(old_index, item.seqno)
            items.append(item)
            self.key_index[item.key] = len(items) - 1
        self.live_count += 1
        self.snap_end = item.seqno
        self.memory_bytes += delta
        self._maybe_compact()
        return delta

    def add_run(
        self, items: Sequence[Item], start: int, full_bytes: int, *, commits: bool = False
    ) -> tuple[int, int]:
        """`add` for `items[start:]` in order — plain items (type `Item`: no SyncWrite ones;
        with `commits`, every one a `CommitItem`), seqnos rising — until this checkpoint holds
        `full_bytes` (at least one is added).

        Returns:
            (index in `items` of the first item not added, change in accounted bytes).
        """
        assert self.is_open, self
        assert start < len(items), (start, len(items))
        assert items[start].seqno > self.snap_end, (items[start].seqno, self.snap_end)
        slots = self.items
        if len(slots) == 1:
            slots.append(CHECKPOINT_START)
        key_index = self.key_index
        memory_bytes = self.memory_bytes
        delta = 0
        stop = start
        count = len(items)
        while stop < count:  # bounded by the run; one item per round
            item = items[stop]
            stop += 1
            assert type(item) is (CommitItem if commits else Item), item
            size = len(item.body) + (
                MUTATION_BODY_OVERHEAD_BYTES
                if item.op is _MUTATION
                else TOMBSTONE_BODY_OVERHEAD_BYTES
            )  # item_size_bytes, inline
            old_index = key_index.get(item.key)
            if old_index is not None:
                size -= self._punch_hole(old_index, item.seqno)
            slots.append(item)
            key_index[item.key] = len(slots) - 1
            delta += size
            if memory_bytes + delta >= full_bytes:
                break
        added = stop - start
        last = items[stop - 1].seqno
        assert last > self.snap_end, (last, self.snap_end)
        self.live_count += added
        self.snap_end = self.visible_end = last
        if commits:  # each commit completes its prepare (as `add` counts one)
            run = items[start:stop]
            prepared = max(item.prepared_seqno for item in run if isinstance(item, CommitItem))
            self.high_completed = max(self.high_completed, prepared)
        self.memory_bytes = memory_bytes + delta
        self._maybe_compact()
        return stop, delta

    def add_columns(self, run: ColumnRun, start: int, full_bytes: int) -> tuple[int, int] | None:
        """`add_run` for the mutations `run[start:]` given as columns, when the ones it takes
        (until this checkpoint holds `full_bytes`, at least one) have keys new here and
        distinct: their slots are `LAZY` until `settle`, their key-index entries one
        `dict.update`, their charges `item_size_bytes`' from the body lengths. None (nothing
        added) when a key repeats: the caller builds the items and goes through `add_run`.

        Returns:
            (index in `run` of the first item not added, change in accounted bytes), or None.
        """
        assert self.is_open, self
        seqnos = run.seqnos
        assert start < len(seqnos), (start, len(seqnos))
        assert seqnos[start] > self.snap_end, (seqnos[start], self.snap_end)
        # add_run's stop: the items past it are not reached (when they are, the caller asks
        # again)
        taken, delta = charged_prefix(run, start, len(seqnos), full_bytes - self.memory_bytes)
        stop = start + taken
        keys = run.keys[start:stop]
        key_index = self.key_index
        if len(set(keys)) != taken or not key_index.keys().isdisjoint(keys):
            return None
        slots = self.items
        if len(slots) == 1:
            slots.append(CHECKPOINT_START)
        first = len(slots)
        slots.extend(itertools.repeat(LAZY, taken))
        key_index.update(zip(keys, range(first, first + taken), strict=True))
        self.lazy.append(LazyRun(first, run, start, stop))
        self.live_count += taken
        self.snap_end = self.visible_end = seqnos[stop - 1]
        self.memory_bytes += delta
        self._maybe_compact()  # as add_run: holes punched while a cursor was inside
        return stop, delta

    def lazy_run(
        self, index: int, items_max: int, bytes_max: int
    ) -> tuple[ColumnRun, int, int, int] | None:
        """The flusher's read of lazy slots from `index`
        (`CheckpointManager.next_flush_run`): the items of the lazy run holding that slot,
        from it, up to `items_max` and up to the one whose charge reaches `bytes_max`
        (`next_run`'s rule), as (run, start, stop, charged bytes) in the run's positions,
        with no item built; None: `index` is not a lazy slot. O(log runs): a bisection
        (a flush of a checkpoint of R lazy runs reads it R times)."""
        lazy = self._lazy_at(index)
        if lazy is None or index >= lazy.end:
            return None
        at = lazy.start + index - lazy.first
        taken, charged = charged_prefix(lazy.run, at, min(lazy.stop, at + items_max), bytes_max)
        return lazy.run, at, at + taken, charged

    def lazy_from(self, index: int) -> int | None:
        """The first lazy slot at or after `index`, or None. O(log runs), as `lazy_run`."""
        lazy = self._lazy_at(index)
        if lazy is not None and index < lazy.end:
            return index
        after = bisect.bisect_right(self.lazy, index, key=_first_of)  # the first starting past
        return self.lazy[after].first if after < len(self.lazy) else None

    def _lazy_at(self, index: int) -> LazyRun | None:
        """The last lazy run starting at or before `index` (the runs lie in index order)."""
        at = bisect.bisect_right(self.lazy, index, key=_first_of) - 1
        return self.lazy[at] if at >= 0 else None

    def settle(self) -> None:
        """Build the items of every lazy run here (`add_columns`), each into its slots."""
        if not self.lazy:
            return
        slots = self.items
        for first, run, start, stop in self.lazy:  # bounded by the runs added
            slots[first : first + stop - start] = items_of(run, start, stop)
        self.lazy = []

    def add_prepares(
        self, items: Sequence[SyncItem], start: int, full_bytes: int
    ) -> tuple[int, int]:
        """`add` for the prepares `items[start:]` in order (seqnos rising) until this
        checkpoint holds `full_bytes`, or until the next prepare's key already has a prepare
        here (the manager closes the checkpoint then, as `queue` does: that namespace holds a
        key once). At least one is added; the first's key must not have a prepare here.

        Returns:
            (index in `items` of the first item not added, change in accounted bytes).
        """
        assert self.is_open, self
        assert start < len(items), (start, len(items))
        assert items[start].seqno > self.snap_end, (items[start].seqno, self.snap_end)
        slots = self.items
        if len(slots) == 1:
            slots.append(CHECKPOINT_START)
        prepared_index = self.prepared_index
        memory_bytes = self.memory_bytes
        delta = 0
        stop = start
        count = len(items)
        while stop < count:  # bounded by the run; one item per round
            item = items[stop]
            if item.key in prepared_index:
                assert stop > start, (item, self)  # the manager's rule
                break
            assert item.op is _PREPARE, item
            stop += 1
            slots.append(item)
            prepared_index[item.key] = len(slots) - 1
            delta += item_size_bytes(item)
            if memory_bytes + delta >= full_bytes:
                break
        self.live_count += stop - start
        self.snap_end = items[stop - 1].seqno
        self.memory_bytes = memory_bytes + delta
        self._maybe_compact()
        return stop, delta

    def absorb(self, newer: Checkpoint) -> int:
        """Collapse the next checkpoint `newer` into this one, deduplicating across both.

        Both must be closed and cursorless (seed figures 4-5). `newer` is left empty.

        Returns:
            Accounted bytes freed by deduplication.
        """
        assert self.next is newer, (self, newer)
        assert not self.is_open, self
        assert not newer.is_open, newer
        assert self.cursor_count == 0, self
        assert newer.cursor_count == 0, newer
        assert newer.snap_start > self.snap_end, (self, newer)
        assert not self.prepared_index and not newer.prepared_index, (self, newer)
        self.settle()
        newer.settle()
        freed = 0
        items = self.items
        key_index = self.key_index
        for slot in newer.items[_FIRST_ITEM_INDEX:]:
            if not isinstance(slot, Item):
                continue
            old_index = key_index.get(slot.key)
            if old_index is not None:
                freed += self._punch_hole(old_index, slot.seqno)
            items.append(slot)
            key_index[slot.key] = len(items) - 1
            self.live_count += 1
        self.memory_bytes += newer.memory_bytes - freed
        self.snap_end = newer.snap_end
        self.marker_end = max(self.marker_end, newer.marker_end)
        self.visible_end = max(self.visible_end, newer.visible_end)
        self.high_completed = max(self.high_completed, newer.high_completed)
        newer.items = [DUMMY]
        newer.lazy = []
        newer.key_index = {}
        newer.memory_bytes = newer.live_count = newer.hole_count = 0
        self._maybe_compact()
        return freed

    def close(self) -> None:
        """Make the checkpoint immutable (it must hold items)."""
        assert self.is_open, self
        assert self.has_items, self
        self.is_open = False

    def position_after(self, seqno: int) -> int:
        """Index a cursor must hold to read exactly the items with seqno > `seqno` next.

        Binary search over a seqno-ordered list with holes: O(log n + longest run of holes).
        """
        assert self.has_items, self
        self.settle()
        items = self.items
        lo, hi = _FIRST_ITEM_INDEX, len(items)
        while lo < hi:  # bounded: hi - lo halves or lo passes mid each round
            mid = (lo + hi) // 2
            probe = mid
            while probe < hi and items[probe] is None:
                probe += 1
            slot = items[probe] if probe < hi else None
            if slot is None or (isinstance(slot, Item) and slot.seqno > seqno):
                hi = mid
            else:
                lo = probe + 1
        assert lo >= _FIRST_ITEM_INDEX, lo
        return lo - 1

    def live_items(self) -> list[Item]:
        """The live items in seqno order (O(n); for collapse, tests and stats)."""
        self.settle()
        return [slot for slot in self.items[_FIRST_ITEM_INDEX:] if isinstance(slot, Item)]

    def compact(self) -> None:
        """Squeeze out holes; only while no cursor holds a position here."""
        assert self.cursor_count == 0, self
        if self.hole_count == 0:
            return
        live = self.live_items()
        self.items = [DUMMY, CHECKPOINT_START, *live]
        self.key_index = {}
        self.prepared_index = {}
        for index, item in enumerate(live, _FIRST_ITEM_INDEX):
            (self.prepared_index if item.op in SYNC_OPS else self.key_index)[item.key] = index
        self.hole_count = 0
        indexed = len(self.key_index) + len(self.prepared_index)
        assert indexed == self.live_count, (indexed, self.live_count)

    def check_invariants(self) -> None:
        """O(n) walk of every fact this module promises; tests call it after each mutation."""
        items = self.slots_view()
        assert items[0] is DUMMY, items[:1]
        assert len(items) == 1 or items[1] is CHECKPOINT_START, items[:2]
        live = [slot for slot in items[_FIRST_ITEM_INDEX:] if isinstance(slot, Item)]
        assert len(live) == self.live_count, (len(live), self.live_count)
        meta_count = min(len(items), _FIRST_ITEM_INDEX)
        assert len(items) - meta_count == self.live_count + self.hole_count, self
        assert sum(1 for slot in items if slot is None) == self.hole_count, self
        indexed = len(self.key_index) + len(self.prepared_index)
        assert indexed == self.live_count, (indexed, self.live_count)
        for index_map, sync in ((self.key_index, False), (self.prepared_index, True)):
            for key, index in index_map.items():
                slot = items[index]
                assert isinstance(slot, Item), (key, index, slot)
                assert slot.key == key, (key, slot)
                assert (slot.op in SYNC_OPS) is sync, (key, slot)
        seqnos = [item.seqno for item in live]
        assert seqnos == sorted(set(seqnos)), seqnos
        if live:
            assert self.snap_start <= seqnos[0], (self.snap_start, seqnos[0])
            assert seqnos[-1] <= self.snap_end, (seqnos[-1], self.snap_end)
        assert self.memory_bytes == sum(item_size_bytes(item) for item in live), self
        if not self.is_open:
            assert self.has_items, self
        assert self.cursor_count >= 0, self

    def slots_view(self) -> list[Slot]:
        """`items` with each lazy run's items built aside (this checkpoint unchanged), its
        segments checked: every `LAZY` slot is in exactly one, and each lies on `LAZY`s."""
        view = list(self.items)
        for first, run, start, stop in self.lazy:
            assert 0 <= start < stop <= len(run.seqnos), (first, start, stop)
            end = first + stop - start
            assert all(slot is LAZY for slot in view[first:end]), (first, end)
            view[first:end] = items_of(run, start, stop)
        assert not any(slot is LAZY for slot in view), self
        return view

    def _punch_hole(self, index: int, replacing_seqno: int) -> int:
        self.settle()
        old = self.items[index]
        assert isinstance(old, Item), (index, old)
        assert old.seqno < replacing_seqno, (old.seqno, replacing_seqno)
        if self.on_replace is not None:
            self.on_replace(old.seqno, replacing_seqno)
        self.items[index] = None
        self.live_count -= 1
        self.hole_count += 1
        return item_size_bytes(old)

    def _maybe_compact(self) -> None:
        # Amortized O(1): a compaction costs O(live) and needs as many holes punched first.
        if self.cursor_count == 0 and self.hole_count > self.live_count + 16:
            self.compact()
