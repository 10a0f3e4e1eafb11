"""The mutation manager of one vbucket: a list of checkpoints read through cursors.

Contract (seed mutation-manager.md, dcp-wire.md §10):
- Items are queued into the newest, open checkpoint with caller-given, increasing seqnos; a key is
  deduplicated inside a checkpoint. Older checkpoints are closed and never change under a reader.
- The open checkpoint is closed when a cursor has entered it and another item is queued (the item
  goes into a new open checkpoint), and when it reaches `checkpoint_max_bytes`. A cursor may read
  an open checkpoint: while a cursor is inside it no item can enter it, so what it reads is final.
  A cursor waiting in an empty open checkpoint reads the next item queued there (seed figure 3).
- A checkpoint no cursor needs any more (older than every cursor) is freed at once; a run of two
  or more closed checkpoints without cursors between others is collapsed into one with dedup
  (seed figures 4-5), attempted whenever a cursor leaves a checkpoint or one is closed.
- `register_cursor(name, seqno)` places a cursor to read every item after `seqno`, or, if memory
  no longer holds them, pins the oldest checkpoint and says which seqnos to backfill from disk.
- Memory is charged to a `MemoryBudget`; above its upper mark the budget closes open checkpoints,
  then drops droppable cursors from the oldest checkpoints (never the persistence cursor).

Not here: reading from disk (backfill.py, reader.py), writing to disk (flusher.py), seqno
allocation (vbucket.py). Item expel and SyncWrite/history checkpoints are not implemented.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final, NamedTuple, cast

from changefeed import limits
from changefeed.checkpoint.checkpoint import SYNC_OPS, Checkpoint
from changefeed.checkpoint.columns import LAZY, ColumnRun, items_of
from changefeed.checkpoint.cursor import Cursor, CursorKind, Event
from changefeed.checkpoint.item import CHECKPOINT_START, Item, SyncItem
from changefeed.checkpoint.memory import (
    ITEM_OVERHEAD_BYTES,
    MUTATION_BODY_OVERHEAD_BYTES,
    CheckpointMemoryFullError,
    MemoryBudget,
    item_size_bytes,
)
from changefeed.checkpoint.snapshot import (
    CAUGHT_UP,
    DROPPED,
    MARKER_FLAG_CHECKPOINT,
    MARKER_FLAG_MEMORY,
    CursorSignal,
    SnapshotStart,
)
from changefeed.checkpoint.wakeup import Wakeup
from changefeed.storage import Op

PERSISTENCE_CURSOR_NAME: Final = "persistence"
# Runs shorter than this are queued as items (`queue_columns`): queued and flushed, runs of 16
# cost 1.09x as columns, 24 1.00x, 32 0.92x, 64 0.70x (CPU per item; docs/benchmarks.md, issue
# 29 sixth round, fixreplicaA). The flusher's per-slice cost makes short lazy runs dear.
COLUMNS_MIN_ITEMS: Final = 24
_CHECKPOINT_FLAGS: Final = MARKER_FLAG_MEMORY | MARKER_FLAG_CHECKPOINT

_body_of: Final = operator.attrgetter("body")


@dataclasses.dataclass(frozen=True, slots=True)
class Registration:
    """The answer to `register_cursor`.

    Attributes:
        cursor: the registered cursor. Without backfill it yields every item after the requested
            seqno; with backfill it sits at the front of the oldest checkpoint (pinning it) and
            yields from `backfill_end + 1` once the caller has read the backfill range from disk.
        backfill_start, backfill_end: inclusive seqno range to read from disk first, or None.
    """

    cursor: Cursor
    backfill_start: int | None = None
    backfill_end: int | None = None

    def __post_init__(self) -> None:
        assert (self.backfill_start is None) == (self.backfill_end is None), self
        if self.backfill_start is not None and self.backfill_end is not None:
            assert 0 < self.backfill_start <= self.backfill_end, self

    @property
    def needs_backfill(self) -> bool:
        """True when the caller must read [backfill_start, backfill_end] from disk first."""
        return self.backfill_start is not None


_MUTATION: Final = Op.MUTATION


class ItemRun(NamedTuple):
    """Items a cursor read in one step (`CheckpointManager.next_run`) and what they are
    charged (`item_size_bytes`), so the caller need not add it up again."""

    items: list[Item]
    charged_bytes: int


class ColumnSlice(NamedTuple):
    """Items a cursor read in one step from a run queued as columns and not built
    (`Checkpoint.add_columns`): `run[start:stop]` and what they are charged; `last_seqno` is
    the last one's seqno. Only `next_flush_run` (the flusher's read) gives them."""

    run: ColumnRun
    start: int
    stop: int
    charged_bytes: int

    @property
    def last_seqno(self) -> int:
        """The seqno of the last item."""
        return self.run.seqnos[self.stop - 1]


class CheckpointManager:
    """Checkpoints and cursors of one vbucket.

    Args:
        vb: vbucket id (for messages and the budget's ordering).
        high_seqno: seqno of the last item already durable before this manager (recovery).
        budget: shared memory budget; a private default-sized one if None.
        checkpoint_max_bytes: the open checkpoint is closed once it holds this much.
        persistence: register the non-droppable persistence cursor at `high_seqno`.
        replica_cursors_droppable: let memory recovery drop REPLICA cursors too.
        clock: monotonic seconds, injected so tests replay (STYLE.md §3).
        columns_min_items: `queue_columns` queues shorter runs as items (tests set 1 to
            take every run through the lazy path).
    """

    def __init__(
        self,
        vb: int,
        *,
        high_seqno: int = 0,
        budget: MemoryBudget | None = None,
        checkpoint_max_bytes: int = limits.CHECKPOINT_MAX_BYTES_DEFAULT,
        persistence: bool = True,
        replica_cursors_droppable: bool = False,
        clock: Callable[[], float] = time.monotonic,
        wakeup: Wakeup | None = None,
        columns_min_items: int = COLUMNS_MIN_ITEMS,
    ) -> None:
        assert 0 <= vb < limits.VBUCKETS_MAX, vb
        assert columns_min_items >= 1, columns_min_items
        assert 0 <= high_seqno <= limits.SEQNO_MAX, high_seqno
        assert checkpoint_max_bytes > 0, checkpoint_max_bytes
        self._vb = vb
        self._high_seqno = high_seqno
        self._budget = budget if budget is not None else MemoryBudget()
        self._checkpoint_max_bytes = checkpoint_max_bytes
        self._replica_cursors_droppable = replica_cursors_droppable
        self._clock = clock
        self._columns_min_items = columns_min_items
        self._memory_bytes = 0
        # Checkpoints whose snapshot reaches this seqno are kept (`retain_from`).
        self._retain_seqno = limits.SEQNO_MAX + 1
        # The newest seqno a reader sees (not a SyncWrite prepare/abort): a checkpoint of
        # only those still announces the visible seqno before it.
        self._visible_high = high_seqno
        self._next_checkpoint_id = 1
        self._open = self._new_checkpoint()
        self._head = self._open
        self._cursors: dict[str, Cursor] = {}
        self.wakeup = wakeup if wakeup is not None else Wakeup()  # kept across a rollback
        # Called (replaced seqno, replacing seqno) when deduplication drops an item.
        self.replace_listeners: list[Callable[[int, int], None]] = []
        self.stats = {"cursors_dropped": 0, "checkpoints_collapsed": 0, "checkpoints_freed": 0}
        self._budget.attach(self)
        self.persistence_cursor: Cursor | None = None
        if persistence:
            registration = self.register_cursor(
                PERSISTENCE_CURSOR_NAME, high_seqno, kind=CursorKind.PERSISTENCE
            )
            assert not registration.needs_backfill, registration
            self.persistence_cursor = registration.cursor

    # -- read-only state ------------------------------------------------------------------------

    @property
    def vb(self) -> int:
        """The vbucket id."""
        return self._vb

    @property
    def high_seqno(self) -> int:
        """Seqno of the last item queued (or given at construction)."""
        return self._high_seqno

    @property
    def memory_bytes(self) -> int:
        """Accounted bytes of all items held."""
        return self._memory_bytes

    @property
    def budget(self) -> MemoryBudget:
        """The memory budget this manager charges."""
        return self._budget

    @property
    def first_memory_seqno(self) -> int:
        """Lowest seqno memory still covers: a reader at seqno >= this - 1 needs no disk."""
        return self._head.snap_start

    @property
    def open_checkpoint(self) -> Checkpoint:
        """The newest checkpoint (read-only use: stats and tests)."""
        return self._open

    def checkpoints(self) -> list[Checkpoint]:
        """All checkpoints, oldest first (read-only use: stats and tests)."""
        result = []
        checkpoint: Checkpoint | None = self._head
        while checkpoint is not None:
            result.append(checkpoint)
            checkpoint = checkpoint.next
        return result

    def cursor(self, name: str) -> Cursor | None:
        """The attached cursor called `name`, if any."""
        return self._cursors.get(name)

    def find(self, key: bytes) -> Item | None:
        """Newest queued version of `key` still in memory (O(checkpoints))."""
        checkpoint: Checkpoint | None = self._open
        while checkpoint is not None:
            index = checkpoint.key_index.get(key)
            if index is not None:
                checkpoint.settle()
                item = checkpoint.items[index]
                assert isinstance(item, Item), (key, index, item)
                return item
            checkpoint = checkpoint.prev
        return None

    def find_many(self, keys: Sequence[bytes]) -> list[Item | None]:
        """`find` of each of `keys`: one C-level pass over the keys per checkpoint (a run of
        new keys is found in none of them, and a vbucket holds a few checkpoints)."""
        found: list[Item | None] = [None] * len(keys)
        wanted: Sequence[int] = range(len(keys))  # positions in `keys` not found yet
        checkpoint: Checkpoint | None = self._open
        while checkpoint is not None and wanted:
            get = checkpoint.key_index.get
            if len(wanted) == len(keys):
                indexes = list(map(get, keys))
            else:
                indexes = list(map(get, map(keys.__getitem__, wanted)))
            if indexes.count(None) != len(indexes):
                checkpoint.settle()
                items = checkpoint.items
                still: list[int] = []
                for at, index in zip(wanted, indexes, strict=True):  # bounded by the keys
                    if index is None:
                        still.append(at)
                        continue
                    item = items[index]
                    assert isinstance(item, Item), (keys[at], index, item)
                    found[at] = item
                wanted = still
            checkpoint = checkpoint.prev
        return found

    # -- writing --------------------------------------------------------------------------------

    def queue(self, item: Item) -> None:
        """Queue `item` into the open checkpoint and wake waiting readers.

        Raises:
            CheckpointMemoryFullError: no room under the quota even after recovery; nothing
                was changed, the caller answers TMPFAIL.
        """
        assert item.seqno > self._high_seqno, (item.seqno, self._high_seqno)
        assert item.seqno <= limits.SEQNO_MAX, item.seqno
        size_bytes = item_size_bytes(item)
        self._budget.make_room(size_bytes)
        open_checkpoint = self._open
        if open_checkpoint.has_items and (
            open_checkpoint.cursor_count > 0
            or open_checkpoint.memory_bytes >= self._checkpoint_max_bytes
            or (item.op in SYNC_OPS and item.key in open_checkpoint.prepared_index)
        ):
            # A reader is inside, or it is full: it must not change any more. Or a second
            # prepare/abort of the key: that namespace holds a key once and never dedups.
            self._close_open()
            open_checkpoint = self._open
        delta_bytes = open_checkpoint.add(item, size_bytes)
        if item.op not in SYNC_OPS:
            self._visible_high = item.seqno
        self._charge(delta_bytes)
        self._high_seqno = item.seqno
        self.wakeup.notify()
        if self._budget.over_upper_mark:
            self._budget.recover()
        assert self._high_seqno == item.seqno, (self._high_seqno, item.seqno)

    def queue_run(self, items: Sequence[Item], *, commits: bool = False) -> int:
        """`queue` each of `items` in order — plain items (type `Item`), seqnos rising — with
        one budget check, one charge per checkpoint and one wakeup for the run: the hot path
        of a received batch of writes and of a replica's received run. With `commits`, every
        item is a `CommitItem` instead (an active's run of SyncWrite commits).

        A checkpoint a cursor has entered is closed first, as `queue` does; the run may then
        fill the open one (no cursor can have read into it meanwhile, so no marker already
        sent announces a shorter snapshot) and continues in the next.

        Returns:
            How many were queued: all, unless checkpoint memory ran out part of the way (the
            caller queues the rest later).

        Raises:
            CheckpointMemoryFullError: not even the first item fits; nothing was changed.
        """

        def add(checkpoint: Checkpoint, done: int, full_bytes: int) -> tuple[int, int]:
            return checkpoint.add_run(items, done, full_bytes, commits=commits)

        return self._queue_in_runs(
            len(items), lambda at: items[at].seqno, _bound_bytes(map(_body_of, items), len(items)),
            add, one_by_one=lambda: self._queue_while_room(items),
        )  # fmt: skip

    def queue_columns(self, run: ColumnRun) -> int:
        """`queue_run` of the plain mutations `run` (a replica's received run, as columns):
        where the open checkpoint does not hold their keys and they do not repeat, they are
        queued with no `Item` built (`Checkpoint.add_columns`: built when first read);
        elsewhere their items are built and queued as `queue_run` queues them. Same
        checkpoints, charges, snapshots and answers as `queue_run` of those items.

        A run shorter than `columns_min_items` is built and queued by `queue_run`: its
        bookkeeping (a lazy segment, then the flusher's slice) costs more than the items.

        Returns, Raises: as `queue_run`.
        """
        seqnos = run.seqnos
        count = len(seqnos)
        if count < self._columns_min_items:
            return self.queue_run(items_of(run, 0, count))
        built: list[Item] = []  # the run's items from `built_from` on, once a key repeats
        built_from = count

        def add(checkpoint: Checkpoint, done: int, full_bytes: int) -> tuple[int, int]:
            nonlocal built, built_from
            added = checkpoint.add_columns(run, done, full_bytes)
            if added is not None:
                return added
            if done < built_from:  # a key repeats: item by item, deduplicating (built once)
                built, built_from = items_of(run, done, count), done
            stop, delta = checkpoint.add_run(built, done - built_from, full_bytes)
            return built_from + stop, delta

        return self._queue_in_runs(
            count, seqnos.__getitem__, _bound_bytes(run.bodies, count), add,
            one_by_one=lambda: self._queue_while_room(items_of(run, 0, count)),
        )  # fmt: skip

    def queue_prepares(self, items: Sequence[SyncItem]) -> int:
        """`queue` each of the prepares `items` in order (seqnos rising) with one budget check,
        one charge per checkpoint and one wakeup: a replica's received run of DCP_PREPAREs.
        The open checkpoint is closed where `queue` would close it: a cursor inside, full,
        or a prepare of the key already in it.

        Returns:
            How many were queued (all, unless checkpoint memory ran out part of the way).

        Raises:
            CheckpointMemoryFullError: not even the first item fits; nothing was changed.
        """

        def add(checkpoint: Checkpoint, done: int, full_bytes: int) -> tuple[int, int]:
            return checkpoint.add_prepares(items, done, full_bytes)

        return self._queue_in_runs(
            len(items), lambda at: items[at].seqno, _bound_bytes(map(_body_of, items), len(items)),
            add, key_at=lambda at: items[at].key,
            one_by_one=lambda: self._queue_while_room(items),
        )  # fmt: skip

    def _queue_in_runs(
        self,
        count: int,
        seqno_at: Callable[[int], int],
        bound: int,
        add: Callable[[Checkpoint, int, int], tuple[int, int]],
        *,
        key_at: Callable[[int], bytes] | None = None,
        one_by_one: Callable[[], int],
    ) -> int:
        """`queue_run`, `queue_columns` and `queue_prepares` of a run of `count` items
        (`seqno_at(i)`: the i-th one's seqno; `bound`: the bytes they may be charged): one
        budget check, then `add(open checkpoint, first index left, bytes it may fill up to)`
        per checkpoint the run fills, one wakeup; `one_by_one()` (`queue` each in turn) when
        they might take the budget past its upper mark. With `key_at` the items are
        prepares, which close the open checkpoint when it holds their key's prepare already
        and are not visible (no `_visible_high`)."""
        if not count:
            return 0
        assert seqno_at(0) > self._high_seqno, (seqno_at(0), self._high_seqno)
        assert seqno_at(count - 1) <= limits.SEQNO_MAX, seqno_at(count - 1)
        budget = self._budget
        if budget.used_bytes + bound > budget.upper_mark_bytes:
            # Memory recovery may run inside the run: one at a time it runs where `queue` runs
            # it (before the item that does not fit, after one that passes the upper mark),
            # and what it closes and frees depends on when. Below the mark neither happens.
            return one_by_one()
        done = 0
        while done < count:  # bounded: each round adds >= 1 item
            open_checkpoint = self._open
            if open_checkpoint.has_items and (
                open_checkpoint.cursor_count > 0
                or open_checkpoint.memory_bytes >= self._checkpoint_max_bytes
                or (key_at is not None and key_at(done) in open_checkpoint.prepared_index)
            ):
                self._close_open()
                open_checkpoint = self._open
            full_bytes = self._checkpoint_max_bytes
            if open_checkpoint.cursor_count > 0:
                # Empty with a cursor waiting in it (a caught-up flusher): one item, then it
                # closes, as `queue` closes it before the second. Filling it instead kept the
                # run where no memory recovery could merge or free it: a window's SETs were
                # refused TMPFAIL where the same SETs one at a time were not.
                full_bytes = 0
            done, delta_bytes = add(open_checkpoint, done, full_bytes)
            self._charge(delta_bytes)
            self._high_seqno = seqno_at(done - 1)
            if key_at is None:  # a prepare is not visible
                # Before a checkpoint after this one is made: it starts past what is queued.
                self._visible_high = self._high_seqno
        self.wakeup.notify()
        assert not budget.over_upper_mark, (budget.used_bytes, bound)
        return count

    def _queue_while_room(self, items: Sequence[Item]) -> int:
        """Queue items one at a time until memory is full (memory is short: no hurry)."""
        for queued, item in enumerate(items):  # bounded by the run
            try:
                self.queue(item)
            except CheckpointMemoryFullError:
                if queued == 0:
                    raise
                return queued
        return len(items)

    def start_snapshot(self, snap_start: int, snap_end: int) -> None:
        """A replica received its active's snapshot marker [snap_start, snap_end]: the items
        that follow go into a checkpoint of their own, which reports that snapshot's end, so
        the flusher persists a range saying whether the replica holds the snapshot whole."""
        assert snap_start <= snap_end, (snap_start, snap_end)
        if snap_end <= self._high_seqno:
            return  # a marker for what is held already (a resumed snapshot's remainder ends it)
        if self._open.has_items:
            self._close_open()
        self._open.snap_start = max(self._open.snap_start, snap_start)
        self._open.snap_end = self._open.snap_start - 1
        self._open.marker_end = snap_end

    @property
    def snapshot_end(self) -> int:
        """The end of the snapshot being received (a replica), else the high seqno."""
        return max(self._high_seqno, self._open.marker_end)

    def retain_from(self, seqno: int | None) -> None:
        """Keep every checkpoint from the one holding `seqno` on in memory, cursors or not
        (None: stop). The vbucket keeps its oldest pending SyncWrite prepare here: a replica
        that must backfill from disk then still reads every pending prepare from memory,
        since the store keeps prepares out of the seqno index."""
        self._retain_seqno = limits.SEQNO_MAX + 1 if seqno is None else seqno
        self._free_unreferenced_head()

    def completed_bound(self, completed: int) -> int:
        """A high completed seqno safe to announce: `completed` (the newest prepare committed
        or aborted) but below the oldest prepare still pending, which may be older — durable
        writes complete out of order when their levels differ."""
        return max(0, min(completed, self._retain_seqno - 1))

    def close_open_checkpoint(self) -> None:
        """Close the open checkpoint if it holds items, so that it can be freed once read."""
        if self._open.has_items:
            self._close_open()

    # -- cursors --------------------------------------------------------------------------------

    def register_cursor(
        self,
        name: str,
        seqno: int,
        *,
        kind: CursorKind = CursorKind.STREAM,
        droppable: bool | None = None,
    ) -> Registration:
        """Register a cursor that reads every item with a seqno above `seqno`.

        A cursor already called `name` is replaced (it returns DROPPED afterwards). If memory
        no longer holds all items after `seqno`, the cursor pins the oldest checkpoint and the
        answer names the seqnos to read from disk first (seed figure 6).

        Args:
            name: unique per manager.
            seqno: the last seqno the reader has (0 for everything); at most `high_seqno`.
            kind: decides droppability (see `CursorKind`).
            droppable: overrides the kind's default for a STREAM or REPLICA cursor (a DCP
                connection that turned `supports_cursor_dropping` off or on).
        """
        assert 0 <= seqno <= self._high_seqno, (seqno, self._high_seqno)
        if droppable is None:
            droppable = kind is CursorKind.STREAM or (
                kind is CursorKind.REPLICA and self._replica_cursors_droppable
            )
        cursor = Cursor(name, kind, droppable=droppable, checkpoint=self._head, last_seqno=seqno)
        first_seqno = self.first_memory_seqno
        if seqno + 1 < first_seqno:
            self._attach(cursor, self._head, 0)
            registration = Registration(cursor, seqno + 1, first_seqno - 1)
        else:
            self._place(cursor, seqno)
            registration = Registration(cursor)
        old = self._cursors.get(name)
        self._cursors[name] = cursor
        if old is not None:
            self._detach(old)
        assert cursor.attached, cursor
        return registration

    def clone_cursor(self, source: Cursor, name: str) -> Cursor:
        """A non-droppable BACKUP cursor at `source`'s position (the flusher's safety copy)."""
        assert source.attached, source
        assert name not in self._cursors, name
        clone = Cursor(
            name,
            CursorKind.BACKUP,
            droppable=False,
            checkpoint=source.checkpoint,
            last_seqno=source.last_seqno,
        )
        clone.pending_marker = source.pending_marker
        self._attach(clone, source.checkpoint, source.index)
        self._cursors[name] = clone
        return clone

    def move_cursor(self, cursor: Cursor, to: Cursor) -> None:
        """Put `cursor` back at `to`'s position (the flusher undoing a failed batch)."""
        assert cursor.attached, cursor
        assert to.attached, to
        assert to.last_seqno <= cursor.last_seqno, (to, cursor)
        old_checkpoint = cursor.checkpoint
        self._attach(cursor, to.checkpoint, to.index)
        cursor.last_seqno = to.last_seqno
        cursor.pending_marker = to.pending_marker
        old_checkpoint.cursor_count -= 1
        if old_checkpoint.cursor_count == 0:
            self._release(old_checkpoint)

    def remove_cursor(self, cursor: Cursor) -> None:
        """Unregister `cursor` (a closed stream); freeing what only it held."""
        assert cursor.kind is not CursorKind.PERSISTENCE, cursor
        if cursor.attached:
            self._detach(cursor)

    def drop_cursor(self, cursor: Cursor) -> None:
        """Drop a droppable `cursor` as memory recovery would: its reader goes to disk."""
        assert cursor.droppable, cursor
        assert cursor.attached, cursor
        cursor.dropped = True
        self.stats["cursors_dropped"] += 1
        self._detach(cursor)
        self.wakeup.notify()  # a waiting reader must learn it now reads from disk

    def drop_cursors(self, target_bytes: int) -> None:
        """Memory recovery: drop droppable cursors from the oldest checkpoints, oldest first,
        until the budget is at or under `target_bytes` or only protected checkpoints are left.

        Only checkpoints older than the persistence cursor's are candidates (all but the open
        one without persistence), dcp-wire.md §10 "cursor dropping".
        """
        boundary = self._open
        if self.persistence_cursor is not None:
            boundary = self.persistence_cursor.checkpoint
        candidates = []
        checkpoint: Checkpoint | None = self._head
        while checkpoint is not None and checkpoint is not boundary:
            candidates.append(checkpoint)
            checkpoint = checkpoint.next
        by_checkpoint: dict[int, list[Cursor]] = {}
        for cursor in self._cursors.values():
            if cursor.droppable:
                by_checkpoint.setdefault(cursor.checkpoint.id, []).append(cursor)
        for checkpoint in candidates:
            if self._budget.used_bytes <= target_bytes:
                return
            for cursor in sorted(by_checkpoint.get(checkpoint.id, []), key=lambda c: c.name):
                self.drop_cursor(cursor)

    def collapse(self) -> None:
        """Collapse every run of closed, cursorless checkpoints (normally done on cursor moves)."""
        checkpoint: Checkpoint | None = self._head
        while checkpoint is not None:
            following = checkpoint.next
            if not checkpoint.is_open and checkpoint.cursor_count == 0:
                self._collapse_around(checkpoint)
                following = checkpoint.next
            checkpoint = following

    def close(self) -> None:
        """Detach every cursor and free all memory (vbucket deleted or node stopping)."""
        for cursor in list(self._cursors.values()):
            self._detach(cursor)
        self.persistence_cursor = None
        self._retain_seqno = limits.SEQNO_MAX + 1  # nothing is kept any more
        if self._open.has_items:
            self._close_open()
        self._free_unreferenced_head()
        self._charge(-self._open.memory_bytes)
        assert self._memory_bytes == 0, self._memory_bytes
        self._budget.detach(self)

    # -- cursor movement ------------------------------------------------------------------------

    def next_event(self, cursor: Cursor) -> Event | CursorSignal:
        """Move `cursor` on: the next snapshot start or item, or CAUGHT_UP, or DROPPED."""
        if not cursor.attached:
            return DROPPED
        marker = cursor.pending_marker
        if marker is not None:
            cursor.pending_marker = None
            return marker
        while True:  # bounded: each round enters a newer checkpoint, the list is finite
            checkpoint = cursor.checkpoint
            items = checkpoint.items
            index = cursor.index + 1
            count = len(items)
            while index < count:
                slot = items[index]
                if slot is None:
                    index += 1
                    continue
                if slot is LAZY:  # an item of a run queued as columns: build them now
                    checkpoint.settle()
                    slot = items[index]
                cursor.index = index
                if slot is CHECKPOINT_START:
                    return SnapshotStart(
                        checkpoint.snap_start,
                        max(checkpoint.snap_end, checkpoint.marker_end),
                        _CHECKPOINT_FLAGS,
                        checkpoint.visible_end,
                        self.completed_bound(checkpoint.high_completed),
                    )
                assert isinstance(slot, Item), slot
                assert slot.seqno > cursor.last_seqno, (cursor, slot)
                cursor.last_seqno = slot.seqno
                return slot
            cursor.index = count - 1
            if checkpoint.next is None:
                return CAUGHT_UP
            self._enter_next(cursor)

    def next_flush_run(
        self, cursor: Cursor, items_max: int, bytes_max: int
    ) -> Event | ItemRun | ColumnSlice | CursorSignal:
        """`next_run` for the flusher: items of a run queued as columns and not built yet
        (`Checkpoint.add_columns`) come as a `ColumnSlice` of that run, the same items
        `next_run` would give, and nothing builds them."""
        checkpoint = cursor.checkpoint
        if cursor.attached and cursor.pending_marker is None and checkpoint.lazy:
            lazy = checkpoint.lazy_run(cursor.index + 1, items_max, bytes_max)
            if lazy is not None:
                read = ColumnSlice(*lazy)
                assert read.run.seqnos[read.start] > cursor.last_seqno, (cursor, read.start)
                cursor.index += read.stop - read.start
                cursor.last_seqno = read.last_seqno
                return read
        return self.next_run(cursor, items_max, bytes_max)

    def next_run(
        self, cursor: Cursor, items_max: int, bytes_max: int | None = None
    ) -> Event | ItemRun | CursorSignal:
        """`next_event`, except that items following in the cursor's checkpoint come as one
        list: at most `items_max`, and no more once they are charged `bytes_max` bytes
        (`item_size_bytes`; None: no byte bound, and `charged_bytes` is 0 — a stream's items
        are shared, not copied). Lazy slots (`Checkpoint.add_columns`): bytes_max None ⇒ a
        stream, which settles them and reads items; bytes_max set ⇒ the flusher, cut before
        lazy slots (`next_flush_run` reads those as a `ColumnSlice`)."""
        assert items_max > 0 and (bytes_max is None or bytes_max > 0), (items_max, bytes_max)
        if not cursor.attached or cursor.pending_marker is not None:
            return self.next_event(cursor)
        checkpoint = cursor.checkpoint
        items = checkpoint.items
        lazy_from = checkpoint.lazy_from(cursor.index + 1) if checkpoint.lazy else None
        if lazy_from is not None:
            if bytes_max is None or lazy_from == cursor.index + 1:
                checkpoint.settle()  # a stream reads them as items
            else:  # the flusher: the items before the lazy ones (next_flush_run takes those)
                items_max = min(items_max, lazy_from - cursor.index - 1)
        index = cursor.index + 1
        first = items[index] if index < len(items) else None
        if not isinstance(first, Item):
            return self.next_event(cursor)  # a marker, a hole, or the next checkpoint
        assert first.seqno > cursor.last_seqno, (cursor, first)
        stop = min(len(items), index + items_max)
        if bytes_max is None:  # past CHECKPOINT_START a checkpoint holds items and holes only
            run = cast("list[Item]", [slot for slot in items[index:stop] if slot is not None])
            cursor.index = stop - 1
            cursor.last_seqno = run[-1].seqno
            return ItemRun(run, 0)
        run = []
        size = 0
        for slot in items[index:stop]:  # bounded by items_max; only items and holes here
            index += 1
            if slot is not None:
                assert isinstance(slot, Item), slot
                run.append(slot)
                size += (
                    len(slot.body) + MUTATION_BODY_OVERHEAD_BYTES
                    if slot.op is _MUTATION
                    else item_size_bytes(slot)
                )  # item_size_bytes, the common case inline
                if size >= bytes_max:
                    break
        cursor.index = index - 1
        cursor.last_seqno = run[-1].seqno
        return ItemRun(run, size)

    def has_next(self, cursor: Cursor) -> bool:
        """True if `next_event(cursor)` would return an event now (not when caught up/detached)."""
        if not cursor.attached:
            return False
        if cursor.pending_marker is not None:
            return True
        checkpoint = cursor.checkpoint
        items = checkpoint.items
        for index in range(cursor.index + 1, len(items)):
            if items[index] is not None:
                return True
        following = checkpoint.next
        return following is not None and following.has_items

    def read(self, cursor: Cursor, limit: int) -> list[Event]:
        """Up to `limit` events available to `cursor` now (fewer when caught up or dropped)."""
        assert limit > 0, limit
        events: list[Event] = []
        while len(events) < limit:  # bounded by limit
            event = self.next_event(cursor)
            if isinstance(event, CursorSignal):
                break
            events.append(event)
        return events

    def iter_events(self, cursor: Cursor) -> Iterator[Event]:
        """Iterate the events available to `cursor` now; stops when caught up or dropped."""
        while True:  # bounded by the items queued: each round consumes one slot
            event = self.next_event(cursor)
            if isinstance(event, CursorSignal):
                return
            yield event

    def _enter_next(self, cursor: Cursor) -> None:
        old = cursor.checkpoint
        following = old.next
        assert following is not None, cursor
        assert cursor.index == len(old.items) - 1, cursor
        old.cursor_count -= 1
        self._attach(cursor, following, 0)
        if old.cursor_count == 0:
            self._release(old)

    def _place(self, cursor: Cursor, seqno: int) -> None:
        checkpoint = self._head
        while checkpoint.snap_end <= seqno and checkpoint.next is not None:
            checkpoint = checkpoint.next
        if checkpoint.snap_end <= seqno:  # the reader has all of the open checkpoint
            assert checkpoint is self._open, checkpoint
            if checkpoint.has_items:
                self._close_open()
                checkpoint = self._open
            self._attach(cursor, checkpoint, 0)
        elif seqno < checkpoint.snap_start:
            self._attach(cursor, checkpoint, 0)
        else:  # mid-checkpoint: announce only what follows (dcp-wire.md §7.2, no Checkpoint flag)
            self._attach(cursor, checkpoint, checkpoint.position_after(seqno))
            cursor.pending_marker = SnapshotStart(
                seqno + 1,
                checkpoint.snap_end,
                MARKER_FLAG_MEMORY,
                checkpoint.visible_end,
                self.completed_bound(checkpoint.high_completed),
            )
        assert cursor.checkpoint is checkpoint, (cursor, checkpoint)

    def _attach(self, cursor: Cursor, checkpoint: Checkpoint, index: int) -> None:
        assert 0 <= index < len(checkpoint.items), (index, checkpoint)
        cursor.checkpoint = checkpoint
        cursor.index = index
        cursor.attached = True
        checkpoint.cursor_count += 1

    def _detach(self, cursor: Cursor) -> None:
        assert cursor.attached, cursor
        checkpoint = cursor.checkpoint
        cursor.attached = False
        cursor.pending_marker = None
        if self._cursors.get(cursor.name) is cursor:
            del self._cursors[cursor.name]
        if cursor is self.persistence_cursor:
            self.persistence_cursor = None
        checkpoint.cursor_count -= 1
        assert checkpoint.cursor_count >= 0, checkpoint
        if checkpoint.cursor_count == 0:
            self._release(checkpoint)

    # -- checkpoint list ------------------------------------------------------------------------

    def _new_checkpoint(self) -> Checkpoint:
        checkpoint = Checkpoint(
            self._next_checkpoint_id, snap_start=self._high_seqno + 1, created_s=self._clock()
        )
        self._next_checkpoint_id += 1
        checkpoint.on_replace = self._on_replace
        checkpoint.visible_end = self._visible_high
        return checkpoint

    def _on_replace(self, replaced_seqno: int, replacing_seqno: int) -> None:
        for listener in self.replace_listeners:
            listener(replaced_seqno, replacing_seqno)

    def _close_open(self) -> None:
        closed = self._open
        closed.close()
        fresh = self._new_checkpoint()
        if closed.marker_end > closed.snap_end:  # a replica's snapshot continues in `fresh`
            fresh.marker_end = closed.marker_end
        fresh.prev = closed
        closed.next = fresh
        self._open = fresh
        if closed.cursor_count > 0:
            self._advance_finished_cursors(closed)
        if closed.cursor_count == 0:
            self._release(closed)

    def _advance_finished_cursors(self, closed: Checkpoint) -> None:
        """Move cursors that have read all of `closed` into the fresh open checkpoint at once,
        so that a caught-up reader does not keep the checkpoint it finished alive (figure 2)."""
        last_index = len(closed.items) - 1
        for cursor in self._cursors.values():
            if (
                cursor.checkpoint is closed
                and cursor.index == last_index
                and cursor.pending_marker is None
            ):
                closed.cursor_count -= 1
                self._attach(cursor, self._open, 0)
        assert closed.cursor_count >= 0, closed

    def _release(self, checkpoint: Checkpoint) -> None:
        """`checkpoint` lost its last cursor or was closed: free or collapse what is unneeded."""
        assert checkpoint.cursor_count == 0, checkpoint
        self._free_unreferenced_head()
        linked = checkpoint is self._head or checkpoint.prev is not None
        if linked and not checkpoint.is_open:
            self._collapse_around(checkpoint)

    def _free_unreferenced_head(self) -> None:
        while (
            self._head is not self._open
            and self._head.cursor_count == 0
            and self._head.snap_end < self._retain_seqno
        ):
            freed = self._head
            following = freed.next
            assert following is not None, freed
            following.prev = None
            self._head = following
            self._charge(-freed.memory_bytes)
            freed.next = None
            freed.items = []  # a detached cursor may still refer to it; its memory goes now
            freed.lazy = []
            freed.key_index = {}
            freed.prepared_index = {}
            freed.memory_bytes = 0
            self.stats["checkpoints_freed"] += 1

    def _collapse_around(self, checkpoint: Checkpoint) -> None:
        """Merge the maximal run of closed cursorless checkpoints around `checkpoint`."""
        assert not checkpoint.is_open, checkpoint
        assert checkpoint.cursor_count == 0, checkpoint
        if checkpoint.prepared_index:
            return  # SyncWrite items are never deduplicated (checkpoint.py)
        first = checkpoint
        while (
            first.prev is not None
            and first.prev.cursor_count == 0
            and not first.prev.prepared_index
        ):
            first = first.prev
        # A cursorless head is freed before collapsing, unless it is retained (`retain_from`).
        assert first is not self._head or first.snap_end >= self._retain_seqno, first
        following = first.next
        while (
            following is not None
            and not following.is_open
            and following.cursor_count == 0
            and not following.prepared_index
        ):  # bounded by the list length
            freed_bytes = first.absorb(following)
            self._charge(-freed_bytes)
            first.next = following.next
            assert following.next is not None, following  # the open checkpoint follows
            following.next.prev = first
            following.prev = following.next = None
            self.stats["checkpoints_collapsed"] += 1
            following = first.next

    def _charge(self, delta_bytes: int) -> None:
        self._memory_bytes += delta_bytes
        self._budget.charge(delta_bytes)
        assert self._memory_bytes >= 0, (self._memory_bytes, delta_bytes)

    # -- invariants -----------------------------------------------------------------------------

    def _check_invariants(self) -> None:
        """O(n) walk of the list, every checkpoint and every cursor; tests call it often."""
        checkpoints = self.checkpoints()
        assert checkpoints[0] is self._head, checkpoints
        assert checkpoints[-1] is self._open, checkpoints
        assert self._head.prev is None, self._head
        for older, newer in itertools.pairwise(checkpoints):
            assert newer.prev is older, (older, newer)
            assert older.id < newer.id, (older, newer)
            assert older.snap_end < newer.snap_start, (older, newer)
            # Collapse merges closed cursorless neighbours, but never one holding prepares.
            assert not (
                older.cursor_count == 0
                and newer.cursor_count == 0
                and not newer.is_open
                and not older.prepared_index
                and not newer.prepared_index
            ), (older, newer)
        for checkpoint in checkpoints:
            checkpoint.check_invariants()
            assert checkpoint.is_open == (checkpoint is self._open), checkpoint
        if not self._head.is_open:
            # else it would have been freed, unless kept for a pending prepare (retain_from)
            assert self._head.cursor_count > 0 or self._head.snap_end >= self._retain_seqno, (
                self._head
            )
        assert self._open.snap_end <= self._high_seqno, (self._open, self._high_seqno)
        assert self._memory_bytes == sum(c.memory_bytes for c in checkpoints), self._memory_bytes
        assert self._budget.used_bytes >= self._memory_bytes, self._budget.used_bytes
        self._check_cursor_invariants(checkpoints)

    def _check_cursor_invariants(self, checkpoints: list[Checkpoint]) -> None:
        counts = {checkpoint.id: 0 for checkpoint in checkpoints}
        for name, cursor in self._cursors.items():
            assert cursor.name == name, (cursor, name)
            assert cursor.attached, cursor
            assert cursor.checkpoint.id in counts, cursor
            assert cursor.checkpoint is checkpoints[list(counts).index(cursor.checkpoint.id)]
            counts[cursor.checkpoint.id] += 1
            items = cursor.checkpoint.slots_view()  # lazy slots as the items they stand for
            assert cursor.index < len(items), cursor
            for index, slot in enumerate(items):
                if isinstance(slot, Item):
                    assert (slot.seqno <= cursor.last_seqno) == (index <= cursor.index), (
                        cursor,
                        slot,
                    )
        for checkpoint in checkpoints:
            assert checkpoint.cursor_count == counts[checkpoint.id], checkpoint
        if self.persistence_cursor is not None:
            assert self.persistence_cursor.attached, self.persistence_cursor
            assert not self.persistence_cursor.droppable, self.persistence_cursor
            assert self._cursors.get(PERSISTENCE_CURSOR_NAME) is self.persistence_cursor


def _bound_bytes(bodies: Iterable[bytes], count: int) -> int:
    """The most `count` items with these bodies can be charged (`make_room`'s ask)."""
    return sum(map(len, bodies)) + count * ITEM_OVERHEAD_BYTES
