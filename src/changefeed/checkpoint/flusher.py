"""The flusher: drains the persistence cursor into the store, one group commit per batch.

Contract: `flush_batch()` reads up to `batch_bytes_max` accounted bytes of items through the
persistence cursor and writes them in one `store.write_batch()` transaction (or, with `stage`,
into a transaction the caller shares between vbuckets and commits), together with the
snapshot range (snap_start, snap_end) of the checkpoint the last item came from. Only after the
commit does the persisted seqno advance and do the checkpoints the batch read become freeable:
while a batch is written a BACKUP cursor holds the persistence cursor's old position (ep-engine's
backup pcursor, dcp-wire.md §10), and if the write fails the persistence cursor is put back there,
so a failed batch loses nothing and is written again by the next call. A reader that must backfill
therefore always finds on disk every item memory has freed.

`wait_persisted(seqno)` lets a writer await durability (persisted-on-active durability);
`flush()` drains synchronously for shutdown. The loop that calls `flush_batch()` is the
bucket's (server/bucket.py), one task for all vbuckets of a node.

Not here: the vbucket's metadata besides the snapshot range (vbucket.py sets state and the
failover log). The LMDB commit runs on the caller's thread (with `durable=True` it fsyncs).
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import Final, cast

from changefeed import limits
from changefeed.checkpoint.checkpoint import SYNC_OPS
from changefeed.checkpoint.cursor import Cursor
from changefeed.checkpoint.item import CommitItem, Item, SyncItem
from changefeed.checkpoint.manager import CheckpointManager, ColumnSlice, ItemRun
from changefeed.checkpoint.memory import item_size_bytes
from changefeed.checkpoint.snapshot import CursorSignal, SnapshotStart
from changefeed.storage import Op, Store, WriteBatch

BACKUP_CURSOR_NAME: Final = "persistence-backup"
_RUN_ITEMS_MAX: Final = 4096  # items taken from the persistence cursor per call
_PLAIN: Final = {Item}  # a batch of only these is written by one put_bodies call
_body_of: Final = operator.attrgetter("body")
_key_of: Final = operator.attrgetter("key")
_ABORT: Final = Op.ABORT
_PREPARE: Final = Op.PREPARE


@dataclasses.dataclass(slots=True)
class StagedFlush:
    """A batch put into a write batch that is not committed yet (`Flusher.stage`)."""

    backup: Cursor
    snapshot_before: SnapshotStart | None
    # The batch's items and, for runs queued as columns, column slices of them (read as such:
    # `CheckpointManager.next_flush_run`), in seqno order
    pieces: list[Item | ColumnSlice]
    kept_before: frozenset[bytes] = frozenset()  # Flusher.kept_prepares, to undo
    count: int = 0  # items in `pieces`, each of a column slice's counted


class Flusher:
    """Writes what the persistence cursor reads into the store.

    Args:
        manager: a checkpoint manager with a persistence cursor.
        store: where to write; the vbucket must exist there (`set_vbucket_meta` with a state).
        batch_bytes_max: accounted bytes per transaction (at least one item is always taken).
    """

    def __init__(
        self,
        manager: CheckpointManager,
        store: Store,
        *,
        batch_bytes_max: int = limits.FLUSH_BATCH_BYTES_MAX,
    ) -> None:
        assert manager.persistence_cursor is not None, manager
        assert batch_bytes_max > 0, batch_bytes_max
        assert store.vbucket_meta(manager.vb) is not None, manager.vb
        self._manager = manager
        self._store = store
        self._batch_bytes_max = batch_bytes_max
        self._written_seqno = store.high_seqno(manager.vb)  # last seqno committed
        self._persisted_seqno = self._written_seqno  # what may be promised durable
        # replacing seqno -> lowest seqno it replaced before that was written: the replaced
        # writes are durable only once their replacement is (see _on_replace).
        self._obligations: dict[int, int] = {}
        manager.replace_listeners.append(self._on_replace)
        self._snapshot: SnapshotStart | None = None
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._waiter_ids = itertools.count()
        self.stats = {"batches": 0, "items": 0, "failed_batches": 0}
        # Keys whose SyncWrite prepare the store keeps (put_prepare): the next committed
        # change, or an abort, of such a key ends it there.
        self.kept_prepares: set[bytes] = {record.key for _, record in store.prepares(manager.vb)}

    @property
    def vb(self) -> int:
        """The vbucket this flusher writes."""
        return self._manager.vb

    @property
    def persisted_seqno(self) -> int:
        """Seqno of the last item committed to the store."""
        return self._persisted_seqno

    def _on_replace(self, replaced_seqno: int, replacing_seqno: int) -> None:
        """Deduplication dropped ``replaced_seqno`` for ``replacing_seqno``.

        If the dropped item was not written yet, its write lives on only in the replacing item:
        until that is written, the persisted seqno must stay below ``replaced_seqno``, or a
        writer waiting for it would be told "durable" while neither version is on disk.
        """
        if replaced_seqno <= self._written_seqno:
            return
        owed = min(replaced_seqno, self._obligations.pop(replaced_seqno, replaced_seqno))
        current = self._obligations.get(replacing_seqno, owed)
        self._obligations[replacing_seqno] = min(current, owed)  # O(1): hot keys stay cheap

    def _advance_persisted(self) -> None:
        written = self._written_seqno
        self._obligations = {new: old for new, old in self._obligations.items() if new > written}
        limit = min((old - 1 for old in self._obligations.values()), default=written)
        self._persisted_seqno = max(self._persisted_seqno, min(written, limit))
        assert self._persisted_seqno <= written, (self._persisted_seqno, written)

    @property
    def pending(self) -> bool:
        """True if the persistence cursor has items not yet written."""
        return self._manager.has_next(self._cursor())

    def flush_batch(self) -> int:
        """Write one batch in its own transaction; return how many items it wrote (0 when
        nothing was pending).

        Raises:
            StorageError, StorageFullError: the commit failed; the batch will be retried.
        """
        if not self._manager.has_next(self._cursor()):
            return 0  # no empty transaction
        pending = None
        try:
            with self._store.write_batch() as batch:
                pending = self.stage(batch)
        except BaseException:
            self.staged_failed(pending)  # the commit failed (stage undoes its own failures)
            raise
        return self.staged_committed(pending)

    def stage(
        self, batch: WriteBatch, runs: list[tuple[int, Sequence[Item]]] | None = None
    ) -> StagedFlush | None:
        """Put one batch of items into `batch`, an open write batch the caller commits — so a
        flush round writes every vbucket in one transaction (one fsync, not one per vbucket).

        With `runs`, a run of plain items (the usual case) is appended there instead, for the
        caller to put with every other vbucket's (`WriteBatch.put_runs`) before it commits.

        After the commit call `staged_committed`; if the commit fails, `staged_failed`
        (the persistence cursor goes back and the items are written again later).
        """
        cursor = self._cursor()
        if not self._manager.has_next(cursor):
            return None
        backup = self._manager.clone_cursor(cursor, BACKUP_CURSOR_NAME)
        staged = StagedFlush(backup, self._snapshot, [], frozenset(self.kept_prepares))
        try:
            staged.pieces, staged.count = self._read_batch(cursor)
            if staged.pieces:
                self._write(batch, staged.pieces, runs)
        except BaseException:
            self.staged_failed(staged)
            raise
        return staged

    def staged_committed(self, staged: StagedFlush | None) -> int:
        """The transaction holding `staged` committed: the items are durable."""
        if staged is None:
            return 0
        self._manager.remove_cursor(staged.backup)
        pieces = staged.pieces
        if pieces:
            last = _last_seqno(pieces[-1])
            assert last > self._written_seqno, (last, self._written_seqno)
            self._written_seqno = last
            self._advance_persisted()
            self.stats["batches"] += 1
            self.stats["items"] += staged.count
        self._resolve_waiters()
        return staged.count

    def staged_failed(self, staged: StagedFlush | None) -> None:
        """The transaction holding `staged` did not commit: read the items again next time."""
        if staged is None:
            return
        self.stats["failed_batches"] += 1
        self.kept_prepares = set(staged.kept_before)
        self._manager.move_cursor(self._cursor(), staged.backup)
        self._snapshot = staged.snapshot_before
        self._manager.remove_cursor(staged.backup)

    def flush(self) -> int:
        """Write batches until nothing is pending; return the items written."""
        total = 0
        while True:  # bounded: each round writes >= 1 item or stops; nothing queues meanwhile
            written = self.flush_batch()
            if written == 0:
                return total
            total += written

    async def wait_persisted(self, seqno: int, timeout_s: float) -> bool:
        """Wait until `seqno` is persisted, at most `timeout_s` seconds.

        Returns:
            True once persisted_seqno >= seqno, False on timeout.
        """
        assert seqno <= self._manager.high_seqno, (seqno, self._manager.high_seqno)
        if seqno <= self._persisted_seqno:
            return True
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (seqno, next(self._waiter_ids), future)
        heapq.heappush(self._waiters, entry)
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            if entry in self._waiters:  # O(waiters): timeouts are rare, the heap stays bounded
                self._waiters.remove(entry)
                heapq.heapify(self._waiters)
            return seqno <= self._persisted_seqno
        return True

    def _cursor(self) -> Cursor:
        cursor = self._manager.persistence_cursor
        assert cursor is not None, self._manager
        return cursor

    def _read_batch(self, cursor: Cursor) -> tuple[list[Item | ColumnSlice], int]:
        """The batch's items (and column slices) and how many items they are."""
        pieces: list[Item | ColumnSlice] = []
        batch_bytes = 0
        count = 0
        while batch_bytes < self._batch_bytes_max:  # bounded by the batch size
            room = self._batch_bytes_max - batch_bytes
            got = self._manager.next_flush_run(cursor, _RUN_ITEMS_MAX, room)
            if isinstance(got, CursorSignal):
                assert got is CursorSignal.CAUGHT_UP, got  # never dropped
                break
            if isinstance(got, SnapshotStart):
                self._snapshot = got
                continue
            if isinstance(got, ItemRun):
                pieces += got.items
                batch_bytes += got.charged_bytes
                count += len(got.items)
            elif isinstance(got, ColumnSlice):
                pieces.append(got)
                batch_bytes += got.charged_bytes
                count += got.stop - got.start
            else:
                pieces.append(got)
                batch_bytes += item_size_bytes(got)
                count += 1
        return pieces, count

    def _write(
        self,
        batch: WriteBatch,
        pieces: list[Item | ColumnSlice],
        runs: list[tuple[int, Sequence[Item]]] | None = None,
    ) -> None:
        snapshot = self._snapshot
        assert snapshot is not None, pieces[0]
        last = _last_seqno(pieces[-1])
        assert snapshot.snap_start <= last <= snapshot.snap_end, (snapshot, last)
        types = set(map(type, pieces))
        if ColumnSlice not in types:
            completed = self._write_items(batch, cast("list[Item]", pieces), types, runs)
        else:  # in order, each put now: a later run in `runs` would go below them
            completed = 0
            for columns, group in itertools.groupby(pieces, _is_column_slice):
                if columns:
                    for piece in group:  # bounded by the batch
                        self._write_columns(batch, cast("ColumnSlice", piece))
                else:
                    items = cast("list[Item]", list(group))
                    done = self._write_items(batch, items, set(map(type, items)), None)
                    completed = max(completed, done)
        batch.set_vbucket_meta(
            self._manager.vb,
            snap_start=snapshot.snap_start,
            snap_end=snapshot.snap_end,
            high_completed_seqno=self._manager.completed_bound(completed) if completed else None,
        )

    def _write_columns(self, batch: WriteBatch, piece: ColumnSlice) -> None:
        """Put a column slice's mutations (`WriteBatch.put_columns`); a kept prepare of one
        of their keys ends, as after a plain item of the key."""
        run, start, stop = piece.run, piece.start, piece.stop
        keys = run.keys[start:stop]
        vb = self._manager.vb
        batch.put_columns(
            vb, run.seqnos[start:stop], keys, run.bodies[start:stop], run.cases[start:stop],
            run.datatypes[start:stop],
        )  # fmt: skip
        kept = self.kept_prepares
        if kept and not kept.isdisjoint(keys):
            for key in keys:  # bounded by the slice
                if key in kept:
                    batch.end_prepare(vb, key)  # overwritten after its abort or commit
                    kept.discard(key)

    def _write_items(
        self,
        batch: WriteBatch,
        items: list[Item],
        types: set[type],
        runs: list[tuple[int, Sequence[Item]]] | None,
    ) -> int:
        """Put `items` (`types`: theirs); returns the newest prepare they complete, or 0."""
        vb = self._manager.vb
        kept = self.kept_prepares
        completed = 0
        if not kept and types == _PLAIN:  # the common case, checked in C
            if runs is None:
                batch.put_bodies(vb, items)
            else:
                runs.append((vb, items))
            items = []
        start = 0
        count = len(items)
        while start < count:  # bounded: each stretch takes >= 1 item
            stop = _stretch_end(items, start)
            first = items[start]
            if first.op is _PREPARE:  # a stretch of prepares, kept out of by_seqno
                prepares = cast("list[SyncItem]", items[start:stop])
                batch.put_prepares(vb, prepares)
                kept.update(map(_key_of, prepares))
            elif first.op is _ABORT:  # one abort: its stretch is itself
                assert isinstance(first, SyncItem), first
                batch.end_prepare(vb, first.key, first.seqno)
                kept.discard(first.key)
                completed = max(completed, first.prepared_seqno)
            else:  # committed documents and plain changes: each DCP body as it was queued
                stretch = items[start:stop]
                batch.put_bodies(vb, stretch)
                for item in stretch:  # bounded by the stretch
                    if type(item) is CommitItem and item.prepared_seqno > completed:
                        completed = item.prepared_seqno
                    if kept and item.key in kept:
                        batch.end_prepare(vb, item.key)  # committed, or overwritten after an abort
                        kept.discard(item.key)
            start = stop
        return completed

    def _resolve_waiters(self) -> None:
        waiters = self._waiters
        while waiters and waiters[0][0] <= self._persisted_seqno:  # bounded by the waiters
            _, _, future = heapq.heappop(waiters)
            if not future.done():
                future.set_result(None)


def _last_seqno(piece: Item | ColumnSlice) -> int:
    return piece.last_seqno if isinstance(piece, ColumnSlice) else piece.seqno


def _is_column_slice(piece: Item | ColumnSlice) -> bool:
    return isinstance(piece, ColumnSlice)


def _stretch_end(items: list[Item], start: int) -> int:
    """Where the stretch of `items` that starts at `start` ends: prepares up to the next item
    that is not one, an abort alone, anything else up to the next prepare or abort."""
    op = items[start].op
    stop = start + 1
    count = len(items)
    if op is _PREPARE:
        while stop < count and items[stop].op is _PREPARE:  # bounded by the items
            stop += 1
    elif op is not _ABORT:
        while stop < count and items[stop].op not in SYNC_OPS:  # bounded by the items
            stop += 1
    return stop


@dataclasses.dataclass(slots=True)
class FlushRound:
    """One flush round staged into one write batch, not committed yet (`stage_round`).

    Attributes:
        batch: the write batch holding every staged vbucket's items; the caller commits it
            (`Store.commit_batch`: the node on its writer thread, the simulator at once).
        staged: each flusher with what it staged.
        cut_short: the round reached its byte bound; flushers left out wait for the next one.
    """

    batch: WriteBatch
    staged: list[tuple[Flusher, StagedFlush | None]]
    cut_short: bool = False

    def committed(self) -> tuple[int, list[int]]:
        """The batch committed: the items written, and the vbuckets whose persisted seqno may
        have moved (what the persisted listeners hear)."""
        written = sum(flusher.staged_committed(staged) for flusher, staged in self.staged)
        moved = [flusher.vb for flusher, staged in self.staged if staged is not None]
        return written, moved

    def failed(self) -> None:
        """The batch did not commit: every flusher reads its items again next round."""
        for flusher, staged in self.staged:
            flusher.staged_failed(staged)


def stage_round(store: Store, flushers: Iterable[Flusher], bytes_max: int) -> FlushRound | None:
    """Stage one flush round: every flusher with items pending, in the order given, into one
    write batch (one transaction, one fsync, instead of one per vbucket), until the round
    holds `bytes_max` stored bytes. Runs of plain items go in with one `put_runs` call after
    every flusher staged. Sans-IO: the caller commits the batch and then calls
    `FlushRound.committed` (or `failed`).

    Returns:
        The round, or None when nothing is pending (no empty transaction).

    Raises:
        StorageError: staging failed; the batch is aborted and every flusher put back.
    """
    pending = [flusher for flusher in flushers if flusher.pending]
    if not pending:
        return None
    batch = store.begin_batch()
    flush_round = FlushRound(batch, [])
    runs: list[tuple[int, Sequence[Item]]] = []  # put together, after every flusher staged
    run_bytes = 0
    try:
        for flusher in pending:
            if batch.stored_bytes + run_bytes >= bytes_max:
                flush_round.cut_short = True  # the rest go in the next round
                break
            flush_round.staged.append((flusher, flusher.stage(batch, runs)))
            if runs and runs[-1][0] == flusher.vb:
                run_bytes += sum(map(len, map(_body_of, runs[-1][1])))
        batch.put_runs(runs)
    except BaseException:
        store.abort_batch(batch)
        flush_round.failed()
        raise
    return flush_round
