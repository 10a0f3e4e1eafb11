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

Not here: the list of checkpoints, cursors, memory quota (manager.py, cursor.py, memory.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

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

Slot = Item | MetaItem | None

_FIRST_ITEM_INDEX = 2  # after DUMMY and CHECKPOINT_START
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
        items = self.items
        assert items[0] is DUMMY, items[:1]
        assert len(items) == 1 or items[1] is CHECKPOINT_START, items[:2]
        live = self.live_items()
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

    def _punch_hole(self, index: int, replacing_seqno: int) -> int:
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
