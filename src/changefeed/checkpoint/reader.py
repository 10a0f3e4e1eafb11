"""The one object a stream reads through: memory when it can, disk when it must.

Contract (seed mutation-manager.md, figure 6 and "Using the Mutation Manager"): a `StreamReader`
yields every change after its start seqno as snapshot starts and items: seqnos strictly increase,
each item lies inside the snapshot announced before it, and after reading to the end the reader's
view of every key equals the vbucket's latest state. It hides where items come from: when memory
no longer holds what it needs (at start, or after memory recovery dropped its cursor) it runs a
disk backfill to the store's high seqno (a replica's reader: to where memory begins, since
memory and not the store holds pending SyncWrite prepares), then re-registers in memory after
that seqno; it repeats this until it reads from memory. Disk snapshots carry MARKER_FLAG_DISK,
memory ones MARKER_FLAG_MEMORY (| MARKER_FLAG_CHECKPOINT for whole checkpoints).

A disk snapshot's range may end past its last record: prepares and aborts are not records. Once
such a backfill is read, `last_seqno` is the range's end, though no item carried it.

Markers start at the first seqno that can follow (a DCP producer puts the requested start seqno
in the first marker of a stream itself, dcp-wire.md §7.2).

A stream reads the same events in runs (`read_runs`): markers alone, the items of a snapshot in
memory as a list of the checkpoint's own items, and a disk snapshot's records as `StoredRun`s of
stored DCP bodies, never decoded (backfill.py). `next`, `read` and iteration hand out items one
by one, records from disk decoded.

Not here: wire encoding, stream end, flow control (producer/). The manager must have a
persistence cursor and the store must be the one its flusher writes: what memory freed must be
on disk (asserted).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from changefeed import limits
from changefeed.checkpoint.backfill import Backfill, StoredRun
from changefeed.checkpoint.cursor import Cursor, CursorKind, Event
from changefeed.checkpoint.item import Item
from changefeed.checkpoint.manager import CheckpointManager, ItemRun
from changefeed.checkpoint.snapshot import CAUGHT_UP, DROPPED, CursorSignal, SnapshotStart
from changefeed.storage import Store
from changefeed.storage.keyed_scan import KeyRanges

# What `StreamReader.read_runs` hands out: a snapshot start, a run of items from memory (one
# snapshot's, in seqno order) or a run of stored records from a disk backfill.
Run = SnapshotStart | list[Item] | StoredRun


class StreamReader:
    """Reads one vbucket's changes after `start_seqno`, from memory or disk as needed.

    Args:
        manager: the vbucket's checkpoint manager.
        store: the store its flusher writes.
        name: cursor name, unique per manager.
        start_seqno: the last seqno the reader already has (0 for everything).
        kind: STREAM (droppable) or REPLICA (droppable if the manager says so).
        droppable: overrides the kind's default droppability (None keeps it).
        backfill_bytes_max: bound of each backfill queue.
        end_seqno: the reader stops caring after this seqno; disk snapshots end there.
    """

    def __init__(
        self,
        manager: CheckpointManager,
        store: Store,
        *,
        name: str,
        start_seqno: int,
        kind: CursorKind = CursorKind.STREAM,
        droppable: bool | None = None,
        backfill_bytes_max: int = limits.BACKFILL_QUEUE_BYTES_MAX,
        end_seqno: int | None = None,
    ) -> None:
        assert kind in (CursorKind.STREAM, CursorKind.REPLICA), kind
        assert 0 <= start_seqno <= manager.high_seqno, (start_seqno, manager.high_seqno)
        self._manager = manager
        self._store = store
        self._name = name
        self._kind = kind
        self._droppable = droppable
        self._backfill_bytes_max = backfill_bytes_max
        # A stream that ends at end_seqno needs no disk snapshot past it: without this bound,
        # every bounded stream (a Spark micro-batch) would read the whole rest of the vbucket.
        self._end_seqno = end_seqno
        self._position = start_seqno  # the reader has everything up to here (last item or end)
        self._snapshot: SnapshotStart | None = None
        self._backfill: Backfill | None = None
        self._key_ranges: KeyRanges | None = None  # `narrow`
        self._closed = False
        self.stats = {"backfills": 0, "backfill_items": 0, "registrations": 0, "drops": 0}
        self._cursor: Cursor = self._register()

    def __repr__(self) -> str:
        source = "memory" if self.from_memory else "disk"
        return f"StreamReader({self._name!r}, vb={self._manager.vb}, {source}, at {self._position})"

    @property
    def last_seqno(self) -> int:
        """Seqno of the last item read, or the end of the last complete disk snapshot."""
        return self._position

    @property
    def snapshot(self) -> SnapshotStart | None:
        """The snapshot being read (last marker yielded)."""
        return self._snapshot

    @property
    def from_memory(self) -> bool:
        """True when reading in-memory checkpoints (no backfill running, cursor attached)."""
        return self._backfill is None and self._cursor.attached

    @property
    def has_next(self) -> bool:
        """True if `next()` has work: a disk backfill to run or a memory event ready.

        During a backfill it is True even if, once the backfill ends, memory has nothing yet.
        """
        if self._closed:
            return False
        if self._backfill is not None or not self._cursor.attached:
            return True
        return self._manager.has_next(self._cursor)

    def next(self) -> Event | Literal[CursorSignal.CAUGHT_UP]:
        """The next snapshot start or item, or CAUGHT_UP (then `await wait(...)`)."""
        assert not self._closed, self
        while True:  # bounded: a backfill ends, or memory moved on and the next backfill is later
            backfill = self._backfill
            if backfill is not None:
                event = backfill.next()
                if event is not None:
                    return self._track(event)
                self._finish_backfill(backfill)
                continue
            event_or_signal = self._manager.next_event(self._cursor)
            if event_or_signal is DROPPED:
                self.stats["drops"] += 1
                self._cursor = self._register()
                continue
            if event_or_signal is CAUGHT_UP:
                return CAUGHT_UP
            assert not isinstance(event_or_signal, CursorSignal), event_or_signal
            return self._track(event_or_signal)

    def read(self, limit: int) -> list[Event]:
        """A run of up to `limit` events available now (disk and memory); fewer when caught up.

        Events one by one, records from disk decoded into items; a stream reads `read_runs`.
        """
        assert limit > 0, limit
        events: list[Event] = []
        while len(events) < limit:  # bounded by limit
            event = self.next()
            if event is CAUGHT_UP:
                break
            assert not isinstance(event, CursorSignal), event
            events.append(event)
        return events

    def read_runs(self, events_max: int, bytes_max: int) -> list[Run]:
        """What `read(events_max)` would return, with the items of each snapshot in runs.

        The hot path of a stream: items from memory come as lists (the checkpoint's own `Item`s,
        each list inside one snapshot), records from disk as `StoredRun`s of stored bodies that
        are never decoded. Markers and items count one event each against `events_max`. Disk
        runs stop once they hold `bytes_max` bytes (plus one record): what is read from disk is
        a copy, and a throttled stream must not read further ahead than it can send. Memory
        items are shared, not copied, and are bounded by the count alone.
        """
        assert events_max > 0, events_max
        assert bytes_max > 0, bytes_max
        assert not self._closed, self
        runs: list[Run] = []
        room = events_max
        while room > 0:  # bounded: each round hands out >= 1 event, switches source, or stops
            backfill = self._backfill
            if backfill is not None:
                run = backfill.read_run(room, bytes_max)
                if run is None:
                    self._finish_backfill(backfill)
                    continue
                runs.append(self._track_run(run))
                room -= 1 if isinstance(run, SnapshotStart) else len(run)
                if isinstance(run, StoredRun):
                    bytes_max -= sum(map(len, run.records))
                    if bytes_max <= 0:
                        break  # as much as the caller can send has been read from disk
                continue
            got = self._manager.next_run(self._cursor, room)
            if isinstance(got, ItemRun):
                room -= len(got.items)
                runs.append(self._track_run(got.items))
            elif isinstance(got, SnapshotStart):
                room -= 1
                runs.append(self._track_run(got))
            elif isinstance(got, Item):  # one item after a hole
                room -= 1
                runs.append(self._track_run([got]))
            elif got is DROPPED:
                self.stats["drops"] += 1
                self._cursor = self._register()
            else:
                assert got is CAUGHT_UP, got
                break
        return runs

    def __iter__(self) -> Iterator[Event]:
        """Iterate what is available now (disk and memory); stops when caught up."""
        while True:  # bounded by the items queued and stored
            event = self.next()
            if event is CAUGHT_UP:
                return
            assert not isinstance(event, CursorSignal), event
            yield event

    async def wait(self, timeout_s: float) -> bool:
        """Wait until `next()` may return an event, at most `timeout_s` seconds.

        Returns:
            True if there is (or may be) something to read, False on timeout.
        """
        if self.has_next:
            return True
        return await self._manager.wakeup.wait(timeout_s)

    def close(self) -> None:
        """Stop reading: close any backfill scan and unregister the cursor; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._backfill is not None:
            self._backfill.close()
            self._backfill = None
        if self._cursor.attached:
            self._manager.remove_cursor(self._cursor)

    def retain(self) -> None:
        """Stop reading but leave the cursor where it is, droppable: a reader coming back under
        the same name (a replica reconnecting) resumes from memory while the checkpoints it
        needs are still there, and memory recovery may drop it when memory is short (the
        reader then backfills from disk). Idempotent; `close` after it does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._backfill is not None:
            self._backfill.close()
            self._backfill = None
            if self._cursor.attached:  # it pins a checkpoint for a backfill nobody will finish
                self._manager.remove_cursor(self._cursor)
            return
        self._cursor.droppable = True

    def _register(self) -> Cursor:
        """Register at the position; start a backfill if needed (see the module doc)."""
        self.stats["registrations"] += 1
        registration = self._manager.register_cursor(
            self._name, self._position, kind=self._kind, droppable=self._droppable
        )
        if registration.needs_backfill:
            assert registration.backfill_start == self._position + 1, registration
            assert registration.backfill_end is not None, registration
            stored_high = self._store.high_seqno(self._manager.vb)
            # What memory freed was flushed first (persistence cursor), so the store has it.
            assert stored_high >= registration.backfill_end, (stored_high, registration)
            backfill_end = stored_high
            if self._kind is CursorKind.REPLICA:
                # Memory holds every pending SyncWrite prepare (`retain_from`) and the store
                # none: a replica reads from where memory begins, else it skips them.
                backfill_end = registration.backfill_end
            if self._end_seqno is not None:
                backfill_end = max(self._position + 1, min(backfill_end, self._end_seqno))
            self._backfill = Backfill(
                self._store,
                self._manager.vb,
                self._position + 1,
                backfill_end,
                bytes_max=self._backfill_bytes_max,
                key_ranges=self._key_ranges,
            )
            self.stats["backfills"] += 1
        return registration.cursor

    def narrow(self, key_ranges: KeyRanges) -> None:
        """Read from disk only the records of these stored-key ranges (and each disk
        snapshot's last record): for a stream that sends nothing else (a collections filter,
        producer/collection_stream.py), so its backfill does not read what it would skip.
        Memory is read as before. Call before anything is read."""
        assert self._snapshot is None, "narrow before reading"
        self._key_ranges = key_ranges
        backfill = self._backfill
        if backfill is not None:
            self._backfill = Backfill(
                self._store,
                self._manager.vb,
                backfill.start_seqno,
                backfill.end_seqno,
                bytes_max=self._backfill_bytes_max,
                key_ranges=key_ranges,
            )
            backfill.close()

    def _finish_backfill(self, backfill: Backfill) -> None:
        assert backfill.complete, backfill
        self.stats["backfill_items"] += backfill.disk_cursor.items_read
        backfill.close()
        self._backfill = None
        assert self._position <= backfill.end_seqno, (self._position, backfill.end_seqno)
        self._position = backfill.end_seqno  # consistent at the disk snapshot's end
        self._cursor = self._register()

    def _track_run(self, run: Run) -> Run:
        """`_track` for a run: the manager and the scan checked each item's order, so check the
        run's ends against the snapshot and the position (pair of those checks, STYLE.md §3)."""
        if isinstance(run, SnapshotStart):
            self._track(run)
            return run
        if isinstance(run, StoredRun):
            first, last = run.first_seqno, run.last_seqno
        else:
            first, last = run[0].seqno, run[-1].seqno
        snapshot = self._snapshot
        assert snapshot is not None, run
        assert snapshot.snap_start <= first <= last <= snapshot.snap_end, (snapshot, run)
        assert first > self._position, (run, self._position)
        self._position = last
        return run

    def _track(self, event: Event) -> Event:
        """Check what the reader hands out (pair of the cursor's own asserts, STYLE.md §3)."""
        if isinstance(event, SnapshotStart):
            assert event.snap_start > self._position, (event, self._position)
            self._snapshot = event
            return event
        assert isinstance(event, Item), event
        snapshot = self._snapshot
        assert snapshot is not None, event
        assert snapshot.snap_start <= event.seqno <= snapshot.snap_end, (snapshot, event)
        assert event.seqno > self._position, (event, self._position)
        self._position = event.seqno
        return event
