"""Disk backfill: a reader's catch-up from the store, in runs of stored bodies or item by item.

Contract (seed mutation-manager.md, "On-Disk Behavior", figure 6): a `Backfill` is one disk
snapshot [start_seqno, end_seqno] for one reader. It yields a `SnapshotStart` with the Disk flag,
then the stored records of the range in seqno order (the store keeps only each key's newest
version, so the range is deduplicated by storage, dcp-wire.md §10), then reports itself complete.
The records come one of two ways from one `DiskCursor` over one `store.scan_bodies` (one LMDB
snapshot, taken when the backfill is created, its reader slot freed when the backfill completes
or is closed):

- `read_run`: a `StoredRun` of records as the store holds them, the DCP body of each included,
  read in one call inside the scan's transaction and neither decoded nor copied again: a stream
  frames them as they are (producer/item_encoding.py). A run holds what the caller's byte
  budget can send (plus one record), so a throttled stream reads no further ahead than that.
- `next`: one `Item` at a time, each record decoded and checked, through a `BackfillQueue` the
  disk cursor fills until it holds `bytes_max` accounted bytes (plus one item).

Not here: deciding the range (manager's registration, reader.py), switching to memory, framing.
"""

from __future__ import annotations

import collections

from changefeed import limits
from changefeed.checkpoint.item import Item
from changefeed.checkpoint.memory import item_size_bytes
from changefeed.checkpoint.snapshot import MARKER_FLAG_DISK, SnapshotStart
from changefeed.storage import Store
from changefeed.storage.body_scan import BodyScan
from changefeed.storage.keyed_scan import KeyedBodyScan, KeyRanges
from changefeed.storage.record import stored_seqno


class StoredRun:
    """Records read from disk in one call, in seqno order, in their stored form (storage
    record.py: a 12-byte prefix with tag, datatype, key length and CAS, then the DCP body).

    Attributes:
        records: the stored records, never empty.
        first_seqno, last_seqno: seqnos of the first and last record.
    """

    __slots__ = ("first_seqno", "last_seqno", "records")

    def __init__(self, records: list[bytes]) -> None:
        assert records, "a run holds at least one record"
        self.records = records
        self.first_seqno = stored_seqno(records[0])
        self.last_seqno = stored_seqno(records[-1])
        assert self.first_seqno <= self.last_seqno, (self.first_seqno, self.last_seqno)

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        return f"StoredRun({len(self.records)} records, {self.first_seqno}..{self.last_seqno})"

    def seqno(self, index: int) -> int:
        """Seqno of the record at `index`."""
        return stored_seqno(self.records[index])


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
    """Position of a backfill in the store: a paused `store.scan_bodies` over the range."""

    def __init__(
        self,
        store: Store,
        vb: int,
        start_seqno: int,
        end_seqno: int,
        key_ranges: KeyRanges | None = None,
    ) -> None:
        assert 0 < start_seqno <= end_seqno, (start_seqno, end_seqno)
        # key_ranges: only those keys' records and the range's last (storage/keyed_scan.py).
        self._scan: BodyScan | KeyedBodyScan | None = (
            store.scan_bodies(vb, start_seqno, end_seqno)
            if key_ranges is None
            else store.scan_keyed_bodies(vb, start_seqno, end_seqno, key_ranges)
        )
        self.end_seqno = end_seqno
        self.last_seqno = start_seqno - 1
        self.items_read = 0

    @property
    def done(self) -> bool:
        """True once the scan reached the end of the range (or was closed)."""
        return self._scan is None

    def fill(self, queue: BackfillQueue) -> None:
        """Move records into `queue`, decoded, until it is full or the range is exhausted."""
        scan = self._scan
        while scan is not None and not queue.full:  # bounded by the range and the queue
            record = scan.next_record()
            if record is None:
                self.close()
                return
            assert self.last_seqno < record.seqno <= self.end_seqno, (self.last_seqno, record)
            self.last_seqno = record.seqno
            self.items_read += 1
            queue.push(Item.from_record(record))

    def read_run(self, records_max: int, bytes_max: int) -> StoredRun | None:
        """The next run of at most `records_max` stored records, no more once they hold
        `bytes_max` bytes (at least one); None once the range is exhausted."""
        scan = self._scan
        if scan is None:
            return None
        records = scan.read(records_max, bytes_max)
        if not records:
            self.close()
            return None
        run = StoredRun(records)
        # Pair of the scan's own check (STYLE.md §3): runs follow each other inside the range.
        assert self.last_seqno < run.first_seqno, (self.last_seqno, run)
        assert run.last_seqno <= self.end_seqno, (run, self.end_seqno)
        self.last_seqno = run.last_seqno
        self.items_read += len(records)
        if scan.done:
            self.close()
        return run

    def close(self) -> None:
        """Close the scan (frees its LMDB reader slot); idempotent."""
        scan, self._scan = self._scan, None
        if scan is not None:
            scan.close()


class Backfill:
    """One disk snapshot for one reader: its marker, then its items, then complete.

    Args:
        store, vb: where to read.
        start_seqno, end_seqno: inclusive range; the marker announces exactly this range.
        bytes_max: bound of the backfill queue.
        key_ranges: read only the records of these stored-key ranges and the range's last
            (a stream filtered to collections: storage/keyed_scan.py); None: every record.
    """

    def __init__(
        self,
        store: Store,
        vb: int,
        start_seqno: int,
        end_seqno: int,
        *,
        bytes_max: int = limits.BACKFILL_QUEUE_BYTES_MAX,
        key_ranges: KeyRanges | None = None,
    ) -> None:
        self.marker = SnapshotStart(
            start_seqno,
            end_seqno,
            MARKER_FLAG_DISK,
            store.last_seqno(vb, end_seqno),
            min(store.high_completed_seqno(vb), end_seqno),
        )
        self.queue = BackfillQueue(bytes_max)
        self.disk_cursor = DiskCursor(store, vb, start_seqno, end_seqno, key_ranges)
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

    def read_run(
        self, events_max: int, bytes_max: int
    ) -> SnapshotStart | list[Item] | StoredRun | None:
        """The marker first; then runs of at most `events_max` records holding about
        `bytes_max` bytes (one record more at most); None once complete.

        Items `next` already decoded into the queue come first, as a list of items.
        """
        assert events_max > 0, events_max
        if not self._marker_sent:
            self._marker_sent = True
            return self.marker
        queue = self.queue
        if queue:
            items: list[Item] = []
            while len(items) < events_max and (item := queue.pop()) is not None:  # bounded
                items.append(item)
            return items
        run = self.disk_cursor.read_run(events_max, bytes_max)
        if run is not None:
            assert self.start_seqno <= run.first_seqno, (self.marker, run)
            assert run.last_seqno <= self.end_seqno, (self.marker, run)
        return run

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
