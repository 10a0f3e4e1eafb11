"""Disk backfill: a reader's catch-up from the store, through a queue capped in bytes.

Contract (seed mutation-manager.md, "On-Disk Behavior", figure 6): a `Backfill` is one disk
snapshot [start_seqno, end_seqno] for one reader. It yields a `SnapshotStart` with the Disk flag,
then the stored records of the range as `Item`s in seqno order (the store keeps only each key's
newest version, so the range is deduplicated by storage, dcp-wire.md §10), then reports itself
complete. A `DiskCursor` over `store.scan` fills a `BackfillQueue` and pauses once the queue holds
`bytes_max` accounted bytes, so a slow reader never makes a backfill hold more than that (plus
one item) in memory. The scan is opened when the backfill is created: it reads one LMDB snapshot
taken then, and is closed (its reader slot freed) when the backfill completes or is closed.

Not here: deciding the range (manager's registration, reader.py), switching to memory.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from changefeed import limits
from changefeed.checkpoint.item import Item
from changefeed.checkpoint.memory import item_size_bytes
from changefeed.checkpoint.snapshot import MARKER_FLAG_DISK, SnapshotStart
from changefeed.storage import Record, Store


class BackfillQueue:
    """FIFO of items read from disk, bounded by accounted bytes (limits.BACKFILL_QUEUE_BYTES_MAX).

    An item is accepted while the queue is under its bound, so one item larger than the bound
    still passes (alone): a backfill always makes progress.
    """

    def __init__(self, bytes_max: int = limits.BACKFILL_QUEUE_BYTES_MAX) -> None:
        assert bytes_max > 0, bytes_max
        self.bytes_max = bytes_max
        self.bytes = 0
        self._items: collections.deque[Item] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        """True when the disk cursor must pause."""
        return self.bytes >= self.bytes_max

    def push(self, item: Item) -> None:
        """Append an item read from disk; the queue must not be full."""
        assert not self.full, (self.bytes, self.bytes_max)
        assert not self._items or self._items[-1].seqno < item.seqno, (self._items[-1], item)
        self._items.append(item)
        self.bytes += item_size_bytes(item)

    def pop(self) -> Item | None:
        """The oldest queued item, or None when empty."""
        if not self._items:
            return None
        item = self._items.popleft()
        self.bytes -= item_size_bytes(item)
        assert self.bytes >= 0, self.bytes
        return item


class DiskCursor:
    """Position of a backfill in the store: a paused `store.scan` over the range."""

    def __init__(self, store: Store, vb: int, start_seqno: int, end_seqno: int) -> None:
        assert 0 < start_seqno <= end_seqno, (start_seqno, end_seqno)
        self._records: Iterator[Record] | None = store.scan(vb, start_seqno, end_seqno)
        self.end_seqno = end_seqno
        self.last_seqno = start_seqno - 1
        self.items_read = 0

    @property
    def done(self) -> bool:
        """True once the scan reached the end of the range (or was closed)."""
        return self._records is None

    def fill(self, queue: BackfillQueue) -> None:
        """Move records into `queue` until it is full or the range is exhausted."""
        records = self._records
        while records is not None and not queue.full:  # bounded by the range and the queue
            record = next(records, None)
            if record is None:
                self.close()
                return
            assert self.last_seqno < record.seqno <= self.end_seqno, (self.last_seqno, record)
            self.last_seqno = record.seqno
            self.items_read += 1
            queue.push(Item.from_record(record))

    def close(self) -> None:
        """Close the scan (frees its LMDB reader slot); idempotent."""
        records, self._records = self._records, None
        close = getattr(records, "close", None)  # store.scan returns a generator
        if close is not None:
            close()


class Backfill:
    """One disk snapshot for one reader: its marker, then its items, then complete.

    Args:
        store, vb: where to read.
        start_seqno, end_seqno: inclusive range; the marker announces exactly this range.
        bytes_max: bound of the backfill queue.
    """

    def __init__(
        self,
        store: Store,
        vb: int,
        start_seqno: int,
        end_seqno: int,
        *,
        bytes_max: int = limits.BACKFILL_QUEUE_BYTES_MAX,
    ) -> None:
        self.marker = SnapshotStart(start_seqno, end_seqno, MARKER_FLAG_DISK)
        self.queue = BackfillQueue(bytes_max)
        self.disk_cursor = DiskCursor(store, vb, start_seqno, end_seqno)
        self._marker_sent = False

    @property
    def start_seqno(self) -> int:
        """First seqno of the range."""
        return self.marker.snap_start

    @property
    def end_seqno(self) -> int:
        """Last seqno of the range: the reader is consistent there once complete."""
        return self.marker.snap_end

    @property
    def complete(self) -> bool:
        """True once every item of the range has been handed out."""
        return self._marker_sent and self.disk_cursor.done and not self.queue

    def next(self) -> SnapshotStart | Item | None:
        """The marker first, then items in seqno order; None once complete."""
        if not self._marker_sent:
            self._marker_sent = True
            return self.marker
        if not self.queue:
            self.disk_cursor.fill(self.queue)
        item = self.queue.pop()
        if item is not None:
            assert self.start_seqno <= item.seqno <= self.end_seqno, (self.marker, item)
        return item

    def close(self) -> None:
        """Abandon or finish: close the scan and drop what is queued."""
        self.disk_cursor.close()
        while self.queue.pop() is not None:  # bounded by the queue's bytes
            pass
