"""The durable store: one LMDB environment holding every vbucket's records and metadata.

Contract:
- Layout: named databases `by_seqno` ((vb, seqno) -> record), `by_key` ((vb, key) -> seqno, op),
  `vbmeta` (vb -> metadata) and `meta` (the clean-shutdown flag); byte layouts in keys.py,
  record.py and vbmeta.py. A key has one record: its newest version (a mutation or a
  tombstone). Older versions are not kept.
- Writes go through `with store.write_batch() as batch:`, one LMDB write transaction per batch
  (group commit). The block's normal end commits; an exception aborts the whole batch. After a
  `kill -9` at any point the store holds exactly the batches committed before it (durable or
  not); after power loss, see `durable` on `Store`.
- Per vbucket, written seqnos strictly increase; `high_seqno` moves with the records in the same
  transaction. Compaction purges old tombstones and raises `purge_seqno` (whole, `compact`, or
  in bounded chunks, `compact_chunk`); `rollback` truncates.
- One process, one `Store` per environment, one writer at a time. A batch may be filled on one
  thread and committed on another (`begin_batch` / `commit_batch`: the node's flusher commits
  off its event loop, since LMDB's commit and fsync release the GIL); a writer that comes
  meanwhile waits for that commit. Reads (`get`, `scan`) see the last committed batch and may
  run while a batch is filled or committed. The metadata getters answer from an in-memory
  copy that changes only after a commit.

Not here: seqno allocation, dedup, the failover log's meaning, vbucket state transitions. Those
live above (vbucket.py, checkpoint/, failover.py); storage stores what it is given.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Final, TypeAlias

import lmdb

from changefeed import limits
from changefeed.storage import batch as _batch
from changefeed.storage import expiry as _expiry
from changefeed.storage.body_scan import BodyScan
from changefeed.storage.compaction import (
    PurgeChunk,
    discard_after,
    purge_tombstones,
    purge_tombstones_chunk,
)
from changefeed.storage.data_file import DamagedStoreError, check_data_file, mark_created, set_aside
from changefeed.storage.errors import CorruptRecordError, StorageError, StorageFullError
from changefeed.storage.keyed_scan import KeyedBodyScan, KeyRanges
from changefeed.storage.keys import (
    META_CLEAN,
    META_SHUTDOWN,
    META_UNCLEAN,
    SEQNO_KEY,
    VB_KEY,
    decode_by_key_value,
)
from changefeed.storage.lookup import records_of_hits
from changefeed.storage.record import PREFIX, Record, decode_record
from changefeed.storage.vbmeta import VbState, VBucketMeta, decode_vbstate, encode_vbstate

_DATABASES: Final = (b"by_seqno", b"by_key", b"vbmeta", b"meta", b"prepared")
# A writer waits this long for another thread's commit (one fsync, normally milliseconds).
WRITER_WAIT_S: Final = 120.0
_SEQNO_IN_BODY: Final = struct.Struct(">Q")  # both extras layouts start with by_seqno
SHUTDOWN_TOKEN_FILE: Final = "clean-shutdown"  # written after a clean close, beside data.mdb


class Store:
    """Records and vbucket metadata of one bucket on one node, in one LMDB environment.

    Args:
        path: directory of the environment; created if missing.
        map_size_bytes: the most the environment may ever hold (LMDB's map size; address space
            only, the file grows as needed). Exceeding it raises StorageFullError.
        start_fresh: when the data file is damaged (missing, empty, truncated: data_file.py),
            move it aside and start an empty store instead of raising DamagedStoreError.
        durable: whether each commit is flushed to disk before `write_batch` returns.
            True: every commit fsyncs. A committed batch survives `kill -9` and power loss
            (full ACID). Costs one fsync per batch, so group writes into batches.
            False: commits are not flushed (LMDB `sync=False, metasync=False`). A committed
            batch survives `kill -9` of the process (the OS page cache holds it), but power
            loss or an OS crash may lose the last batches (no D) and, unless the filesystem
            keeps write order, corrupt the environment (no C). `close()` flushes.

    Attributes:
        was_clean_shutdown: read at open: True iff the previous process that opened this
            environment called `close()` (or it is new), and the data file is the one it
            closed (a copied or restored directory reads as unclean). Open durably records
            "unclean" until `close()` records "clean" again.

    Raises:
        DamagedStoreError: the data file lost data (missing, empty or truncated while the store
            held data); never opened, so LMDB cannot SIGBUS on it.
        StorageError: the environment cannot be opened (permissions, another open copy in
            this process, a different LMDB version).
        CorruptRecordError: stored vbucket metadata is corrupt.
    """

    WriteBatch: TypeAlias = _batch.WriteBatch  # also exported as changefeed.storage.WriteBatch

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size_bytes: int = limits.STORAGE_MAP_SIZE_BYTES_DEFAULT,
        durable: bool = True,
        start_fresh: bool = False,
    ) -> None:
        if map_size_bytes <= 0:
            raise ValueError(f"map_size_bytes {map_size_bytes} must be positive")
        self._map_size_bytes = map_size_bytes
        self._path = os.fspath(path)
        self._batch_open = False  # a `write_batch` block is running (nesting is a bug)
        # Held from a batch's start to the end of its commit, by whichever thread commits.
        self._writer = threading.Lock()
        self._closed = True
        self.set_aside_to: Path | None = None
        try:
            check_data_file(Path(path))
        except DamagedStoreError:
            if not start_fresh:
                raise
            self.set_aside_to = set_aside(Path(path))
        token_matches = self._shutdown_token_matches()
        with _translated_errors(map_size_bytes):
            self._env = lmdb.open(
                os.fspath(path),
                map_size=map_size_bytes,
                subdir=True,
                max_dbs=len(_DATABASES),
                sync=durable,
                metasync=durable,
                max_readers=limits.STORAGE_READERS_MAX,
            )
        try:
            self.was_clean_shutdown = self._open_databases(token_matches)
            self._rows = self._load_rows()
            mark_created(Path(path))
        except BaseException:
            self._env.close()
            raise
        self._closed = False

    def _open_databases(self, token_matches: bool) -> bool:
        """Open the named databases, record "unclean" durably, return the previous flag."""
        with _translated_errors(self._map_size_bytes):
            self._env.reader_check()  # frees reader slots of processes that died
            with self._env.begin(write=True) as txn:
                self._by_seqno = self._env.open_db(b"by_seqno", txn=txn)
                self._by_key = self._env.open_db(b"by_key", txn=txn)
                self._vbmeta = self._env.open_db(b"vbmeta", txn=txn)
                self._meta = self._env.open_db(b"meta", txn=txn)
                self._prepared = self._env.open_db(b"prepared", txn=txn)
                flag = txn.get(META_SHUTDOWN, db=self._meta)
                txn.put(META_SHUTDOWN, META_UNCLEAN, db=self._meta)
            self._env.sync(True)
        if flag is None:
            return True  # a new environment
        if flag not in (META_CLEAN, META_UNCLEAN):
            raise StorageError(f"meta database holds shutdown flag {flag!r}")
        return flag == META_CLEAN and token_matches

    def _shutdown_token_matches(self) -> bool:
        """Before opening: is the data file the very file a clean ``close()`` left, untouched?

        A copied or restored directory (a backup put back) is not that store cleanly stopped,
        so its vbuckets must start a new history branch (vbucket.py). The data file's inode and
        ctime cannot be carried along by a copy.
        """
        token_path = os.path.join(self._path, SHUTDOWN_TOKEN_FILE)
        try:
            with open(token_path) as handle:
                token = handle.read()
            os.unlink(token_path)  # used once: any later open must prove itself again
            return token == self._data_file_token()
        except FileNotFoundError:
            return False

    def _data_file_token(self) -> str:
        info = os.stat(os.path.join(self._path, "data.mdb"))
        return f"{info.st_ino}:{info.st_ctime_ns}:{info.st_size}"

    def _write_shutdown_token(self) -> None:
        """After the environment is closed: name the data file as it is now (atomically)."""
        token_path = os.path.join(self._path, SHUTDOWN_TOKEN_FILE)
        temporary = token_path + ".tmp"
        with open(temporary, "w") as handle:
            handle.write(self._data_file_token())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, token_path)

    def _load_rows(self) -> dict[int, VbState]:
        rows: dict[int, VbState] = {}
        with _translated_errors(self._map_size_bytes), self._env.begin(db=self._vbmeta) as txn:
            for key, data in txn.cursor():
                if len(key) != VB_KEY.size:
                    raise StorageError(f"vbmeta database holds key {key!r}")
                vb = VB_KEY.unpack(key)[0]
                rows[vb] = decode_vbstate(vb, data)
        return rows

    # --- context manager and close ------------------------------------------------------------

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self, *, clean: bool = True) -> None:
        """Flush to disk and close, recording a clean shutdown unless `clean` is False; later
        calls do nothing.

        Pass `clean=False` when writes the caller acknowledged could not be persisted: the next
        open then reports an unclean shutdown, as after a crash. Scans still open become
        unusable. Other methods raise StorageError afterwards.

        Raises:
            RuntimeError: a write batch is open.
            StorageError: the clean flag could not be written (the environment is closed
                anyway; the next open reports an unclean shutdown).
        """
        if self._closed:
            return
        if self._batch_open:
            raise RuntimeError("close() inside a write batch: end the batch first")
        with self._writing():  # after a commit still running on another thread
            self._close(clean)

    def _close(self, clean: bool) -> None:
        self._closed = True
        try:
            with _translated_errors(self._map_size_bytes):
                if clean:
                    with self._env.begin(write=True) as txn:
                        txn.put(META_SHUTDOWN, META_CLEAN, db=self._meta)
                self._env.sync(True)
        finally:
            self._env.close()
        if clean:
            with contextlib.suppress(OSError):  # without the token the next open reads unclean
                self._write_shutdown_token()

    # --- writes -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def write_batch(self) -> Iterator[_batch.WriteBatch]:
        """Collect writes in a batch; commit them all when the block ends normally.

        Durable once the block has ended: against `kill -9` always, against power loss when
        the store is `durable`. An exception out of the block (including one from the batch's
        own methods) discards every write of the batch.

        Raises:
            RuntimeError: another batch is open (one writer at a time).
            StorageFullError: the map is full; nothing of the batch was written.
            StorageError: LMDB failed; nothing of the batch was written.
        """
        batch = self.begin_batch()
        self._batch_open = True
        try:
            try:
                yield batch
            except BaseException:
                self.abort_batch(batch)
                raise
            self.commit_batch(batch)
        finally:
            self._batch_open = False

    def begin_batch(self) -> _batch.WriteBatch:
        """Start a batch to commit with `commit_batch` (on any thread) or drop with
        `abort_batch`; waits while another thread commits one. Exactly one of the two must
        follow, or no other write can start.

        Raises:
            RuntimeError: a `write_batch` block is open on this store (nesting is a bug).
            StorageError: the store is closed, or a writer held it for WRITER_WAIT_S.
        """
        self._require_open()
        if self._batch_open:
            raise RuntimeError("a write batch is already open on this store")
        self._acquire_writer()
        if self._closed:
            self._writer.release()
            raise StorageError("the store is closed")
        return _batch.WriteBatch(self._rows)

    def commit_batch(self, batch: _batch.WriteBatch) -> None:
        """Apply `batch` in one write transaction and commit it (fsync when durable).

        Raises:
            StorageFullError: the map is full; nothing of the batch was written.
            StorageError: LMDB failed; nothing of the batch was written.
        """
        try:
            with _translated_errors(self._map_size_bytes), self._env.begin(write=True) as txn:
                rows = batch.apply(txn, self._by_seqno, self._by_key, self._vbmeta, self._prepared)
            self._rows.update(rows)
        finally:
            batch.close()
            self._writer.release()

    def abort_batch(self, batch: _batch.WriteBatch) -> None:
        """Drop `batch` unwritten."""
        batch.close()
        self._writer.release()

    def _acquire_writer(self) -> None:
        if not self._writer.acquire(timeout=WRITER_WAIT_S):
            raise StorageError(f"the store's writer was busy for {WRITER_WAIT_S:.0f} s")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Hold the writer (compaction, rollback, close) after any commit in flight."""
        self._acquire_writer()
        try:
            yield
        finally:
            self._writer.release()

    def compact(
        self,
        *,
        tombstone_age_s: float,
        now: float | None = None,
        vbuckets: Iterable[int] | None = None,
    ) -> dict[int, int]:
        """Purge tombstones with delete_time <= now - tombstone_age_s; raise purge seqnos.

        Each vbucket is purged in its own transaction, so a crash keeps whole vbuckets' purges.
        A vbucket's purge_seqno becomes max(purge_seqno, highest seqno purged) and is durable
        with the purge.

        Args:
            tombstone_age_s: how long a tombstone is kept after its delete_time (>= 0).
            now: seconds since the epoch; time.time() when None (tests pass a fake clock).
            vbuckets: which vbuckets; all when None.

        Returns:
            vb -> purge seqno after compaction, for every vbucket compacted.

        Raises:
            ValueError: tombstone_age_s < 0, or an unknown vbucket.
            RuntimeError: a write batch is open.
            StorageError, CorruptRecordError: as for a batch.
        """
        self._require_writable()
        if not tombstone_age_s >= 0:
            raise ValueError(f"tombstone_age_s {tombstone_age_s} must be >= 0")
        delete_time_max = (time.time() if now is None else now) - tombstone_age_s
        targets = sorted(self._rows) if vbuckets is None else sorted(set(vbuckets))
        for vb in targets:
            self._known_row(vb)
        purge_seqnos: dict[int, int] = {}
        for vb in targets:
            with self._writing():  # the row as a commit in flight leaves it
                row = self._rows[vb].copy()
                with _translated_errors(self._map_size_bytes), self._env.begin(write=True) as txn:
                    purged_max, purged = purge_tombstones(
                        txn, self._by_seqno, self._by_key, vb, delete_time_max
                    )
                    row.purge_seqno = max(row.purge_seqno, purged_max)
                    if purged:
                        txn.put(VB_KEY.pack(vb), encode_vbstate(row), db=self._vbmeta)
                self._rows[vb] = row
            purge_seqnos[vb] = row.purge_seqno
        return purge_seqnos

    def compact_chunk(
        self,
        vb: int,
        *,
        delete_time_max: float,
        start_seqno: int = 0,
        seqno_max: int = limits.SEQNO_MAX,
        records_max: int = limits.COMPACTION_CHUNK_RECORDS_MAX,
        dropped: Callable[[int], bool] | None = None,
    ) -> PurgeChunk:
        """One bounded step of compacting `vb`, in one write transaction.

        Purges the tombstones with delete_time <= `delete_time_max` and a seqno in
        `start_seqno..seqno_max` among at most `records_max` records, and raises the
        vbucket's purge_seqno to the highest seqno purged in the same transaction: after a
        crash either both or neither are on disk. Durable like a batch once it returns. Call
        again from `next_seqno` of the answer until it is None. With `dropped`, the records of
        the collections it names go too (compaction.py `purge_tombstones_chunk`), and the
        item count falls by their live documents.

        Raises:
            ValueError: unknown vbucket, a seqno outside 0..SEQNO_MAX, records_max < 1.
            RuntimeError: a write batch is open (one writer at a time).
            StorageError, CorruptRecordError: as for a batch; nothing of the chunk was written.
        """
        self._require_writable()
        self._known_row(vb)
        if not (0 <= start_seqno <= limits.SEQNO_MAX and 0 <= seqno_max <= limits.SEQNO_MAX):
            raise ValueError(f"range {start_seqno}..{seqno_max} outside 0..SEQNO_MAX")
        if records_max < 1:
            raise ValueError(f"records_max {records_max} must be at least 1")
        with self._writing():  # the row as a commit in flight leaves it
            row = self._known_row(vb).copy()
            chunk = self._purge_chunk(
                vb, row, delete_time_max, start_seqno, seqno_max, records_max, dropped
            )
            self._rows[vb] = row
        assert row.purge_seqno >= chunk.seqno_purged_max, (row, chunk)
        assert chunk.visited <= records_max, (chunk, records_max)
        return chunk

    def _purge_chunk(
        self,
        vb: int,
        row: VbState,
        delete_time_max: float,
        start_seqno: int,
        seqno_max: int,
        records_max: int,
        dropped: Callable[[int], bool] | None = None,
    ) -> PurgeChunk:
        with _translated_errors(self._map_size_bytes), self._env.begin(write=True) as txn:
            chunk = purge_tombstones_chunk(
                txn,
                self._by_seqno,
                self._by_key,
                vb,
                delete_time_max,
                start_seqno=start_seqno,
                seqno_max=seqno_max,
                records_max=records_max,
                dropped=dropped,
            )
            if chunk.purged or chunk.dropped:
                row.purge_seqno = max(row.purge_seqno, chunk.seqno_purged_max)
                row.item_count -= chunk.dropped_live
                txn.put(VB_KEY.pack(vb), encode_vbstate(row), db=self._vbmeta)
        return chunk

    def rollback(self, vb: int, seqno: int) -> int:
        """Discard every record of `vb` with a seqno above a point at or below `seqno` (a
        replica rolling back); return that point.

        The store keeps one version per key, so a discarded record cannot fall back to an
        older version of its key. A discarded record that is a key's first version (rev_seqno
        1) had nothing older, and cutting at `seqno` is exact. If any discarded record had
        older versions, the state at `seqno` cannot be rebuilt here and the vbucket is
        discarded whole (point 0): the replica then rebuilds from its active, as kv_engine
        does when it cannot roll back to the requested point — never a silent gap. When
        records were above the point, the vbucket's high_seqno becomes the point, its snapshot
        range (point, point) and its purge_seqno at most the point; otherwise nothing changes.
        Durable like a batch.

        Raises:
            ValueError: unknown vbucket, or seqno outside 0..SEQNO_MAX.
            RuntimeError: a write batch is open.
            StorageError, CorruptRecordError: as for a batch.
        """
        self._require_writable()
        self._known_row(vb)
        if not 0 <= seqno <= limits.SEQNO_MAX:
            raise ValueError(f"rollback seqno {seqno} outside 0..SEQNO_MAX")
        with self._writing():  # the row as a commit in flight leaves it
            row = self._known_row(vb).copy()
            if seqno >= row.high_seqno:
                return seqno
            with _translated_errors(self._map_size_bytes), self._env.begin(write=True) as txn:
                point = 0 if _has_older_versions(txn, self._by_seqno, vb, seqno) else seqno
                _, removed_live = discard_after(txn, self._by_seqno, self._by_key, vb, point)
                row.high_seqno = point
                row.purge_seqno = min(row.purge_seqno, point)
                row.high_completed_seqno = min(row.high_completed_seqno, point)
                row.snap_start = row.snap_end = point
                row.item_count -= removed_live
                for key, seqno_of_prepare in _prepared_seqnos(txn, self._prepared, vb):
                    if seqno_of_prepare > point:
                        txn.delete(key, db=self._prepared)
                txn.put(VB_KEY.pack(vb), encode_vbstate(row), db=self._vbmeta)
            self._rows[vb] = row
        return point

    # --- reads ----------------------------------------------------------------------------------

    def prepares(self, vb: int) -> list[tuple[int, Record]]:
        """The SyncWrite prepares of `vb` kept pending (WriteBatch.put_prepare): (durability
        level, the prepare as its document's record), in seqno order. A restarted node takes
        them up again: nothing acknowledged as durable may be forgotten.

        Raises:
            ValueError: vb outside 0..VBUCKETS_MAX-1.
            CorruptRecordError: a kept prepare does not decode.
        """
        self._require_open()
        _check_vb(vb)
        found: list[tuple[int, Record]] = []
        with _translated_errors(self._map_size_bytes), self._env.begin() as txn:
            for key, seqno in _prepared_seqnos(txn, self._prepared, vb):
                kept = txn.get(key, db=self._prepared)
                assert kept is not None, key
                found.append((kept[0], decode_record(vb, seqno, bytes(kept[1:]))))
        found.sort(key=lambda pair: pair[1].seqno)
        return found

    def get(self, vb: int, key: bytes) -> Record | None:
        """The newest version of `key` in `vb`, tombstones included (check `.deleted`).

        Returns None when the key was never written, was purged, was rolled back, or is not a
        storable key (empty or over limits.STORED_KEY_SIZE_MAX bytes).

        Raises:
            ValueError: vb outside 0..VBUCKETS_MAX-1.
            CorruptRecordError: the record or its index entry does not decode.
        """
        self._require_open()
        _check_vb(vb)
        if not 0 < len(key) <= limits.STORED_KEY_SIZE_MAX:
            return None
        # Every write looks its key up here: an inline try costs less than the context manager.
        try:
            with self._env.begin() as txn:
                return self._get_in(txn, vb, key)
        except lmdb.Error as error:
            with _translated_errors(self._map_size_bytes):
                raise error

    def get_many(self, vb: int, keys: Iterable[bytes]) -> dict[bytes, Record | None]:
        """`get` of many keys of `vb` in one read transaction (a received batch of writes
        looks up its keys at once): every key maps to its record or None."""
        return self.get_many_across({vb: list(keys)})[vb]

    def get_many_across(
        self, wanted: Mapping[int, Sequence[bytes]]
    ) -> dict[int, dict[bytes, Record | None]]:
        """`get_many` of several vbuckets' keys in one read transaction and one C-level
        lookup: a received batch of writes spans every vbucket, ~16 keys each, and a
        transaction and a lookup per vbucket cost more than the keys. Every wanted key of
        every wanted vbucket maps to its record or None."""
        self._require_open()
        found: dict[int, dict[bytes, Record | None]] = {}
        by_key_keys: list[bytes] = []
        key_size_max = limits.STORED_KEY_SIZE_MAX
        for vb, keys in wanted.items():
            _check_vb(vb)
            found[vb] = dict.fromkeys(keys)
            prefix = VB_KEY.pack(vb)
            by_key_keys += [prefix + key for key in keys if 0 < len(key) <= key_size_max]
        if not by_key_keys:
            return found
        try:
            with self._env.begin() as txn:
                hits = txn.cursor(db=self._by_key).getmulti(by_key_keys)
                if hits:  # updates only: a new key costs nothing more
                    for vb, key, record in records_of_hits(txn, self._by_seqno, hits):
                        found[vb][key] = record
        except lmdb.Error as error:
            with _translated_errors(self._map_size_bytes):
                raise error
        return found

    def _get_in(self, txn: lmdb.Transaction, vb: int, key: bytes) -> Record | None:
        entry = txn.get(VB_KEY.pack(vb) + key, db=self._by_key)
        if entry is None:
            return None
        seqno, op = decode_by_key_value(vb, entry)
        data = txn.get(SEQNO_KEY.pack(vb, seqno), db=self._by_seqno)
        if data is None:
            raise CorruptRecordError(vb, seqno, f"by_key entry of {key!r} has no record")
        assert isinstance(data, bytes), type(data)  # the environment does not use buffers
        record = decode_record(vb, seqno, data)
        if record.key != key or record.op != op:
            raise CorruptRecordError(vb, seqno, f"by_key entry of {key!r} disagrees with record")
        return record

    def _scan_snapshot(self, vb: int, start_seqno: int, end_seqno: int) -> lmdb.Transaction[bytes]:
        """The read transaction a scan of vb's seqnos start..end holds, after the checks every
        scan shares (open store, vb and seqnos in range; see `scan` for what it raises)."""
        self._require_open()
        _check_vb(vb)
        if not (0 <= start_seqno <= limits.SEQNO_MAX and 0 <= end_seqno <= limits.SEQNO_MAX):
            raise ValueError(f"scan range {start_seqno}..{end_seqno} outside 0..SEQNO_MAX")
        with _translated_errors(self._map_size_bytes):
            return self._env.begin()

    def scan(self, vb: int, start_seqno: int, end_seqno: int) -> Iterator[Record]:
        """Records of `vb` with start_seqno <= seqno <= end_seqno, in seqno order.

        Only each key's newest version exists, so a key written again after end_seqno is not
        in the range at all. Tombstones are included. The scan reads one LMDB snapshot taken
        when `scan` is called: later commits are not seen. The snapshot holds a reader slot
        (limits.STORAGE_READERS_MAX) and keeps pages it sees from reuse until the iterator is
        exhausted or closed, so close long-paused scans (`iterator.close()`).

        Raises:
            ValueError: vb outside 0..VBUCKETS_MAX-1, a seqno outside 0..SEQNO_MAX.
            CorruptRecordError: (while iterating) a record does not decode.
            StorageError: no reader slot is free, or the store was closed during the scan.
        """
        txn = self._scan_snapshot(vb, start_seqno, end_seqno)
        return _scan(txn, self._by_seqno, vb, start_seqno, end_seqno)

    def scan_bodies(self, vb: int, start_seqno: int, end_seqno: int) -> BodyScan:
        """The records `scan` would yield, read in runs of stored bytes (body_scan.py).

        Same range, snapshot and reader-slot rules as `scan`: one read transaction taken now,
        held until the scan reaches the end of the range or is closed (`BodyScan.close`).
        Records are not decoded (`BodyScan.read`) unless asked one by one (`next_record`).

        Raises:
            ValueError: vb outside 0..VBUCKETS_MAX-1, a seqno outside 0..SEQNO_MAX.
            StorageError: no reader slot is free, or LMDB failed.
        """
        txn = self._scan_snapshot(vb, start_seqno, end_seqno)
        return BodyScan(txn, self._by_seqno, vb, start_seqno, end_seqno)

    def find_expired(
        self, vb: int, *, start_seqno: int, records_max: int, expiry_max: int
    ) -> _expiry.ExpiryScan:
        """Keys of live mutations of `vb` with 0 < expiry <= `expiry_max` among the next
        `records_max` records from `start_seqno` (one read snapshot; expiry.py).

        Raises:
            ValueError: vb outside 0..VBUCKETS_MAX-1, a seqno outside 0..SEQNO_MAX,
                records_max < 1.
            CorruptRecordError: a due record does not decode.
        """
        self._require_open()
        _check_vb(vb)
        if not 0 <= start_seqno <= limits.SEQNO_MAX:
            raise ValueError(f"start_seqno {start_seqno} outside 0..SEQNO_MAX")
        if records_max < 1:
            raise ValueError(f"records_max {records_max} must be at least 1")
        with _translated_errors(self._map_size_bytes), self._env.begin() as txn:
            return _expiry.find_expired(
                txn,
                self._by_seqno,
                vb,
                start_seqno=start_seqno,
                records_max=records_max,
                expiry_max=expiry_max,
            )

    def vbucket_meta(self, vb: int) -> VBucketMeta | None:
        """The vbucket's committed metadata, or None if it was never created."""
        self._require_open()
        row = self._rows.get(vb)
        return None if row is None else row.public()

    def vbuckets(self) -> list[int]:
        """The vbuckets that have metadata, in ascending order."""
        self._require_open()
        return sorted(self._rows)

    def last_seqno(self, vb: int, at_most: int) -> int:
        """Seqno of the newest record of `vb` at or below `at_most` (0 if none): a disk
        snapshot's max visible seqno (prepares and aborts are never records)."""
        self._require_open()
        _check_vb(vb)
        with _translated_errors(self._map_size_bytes), self._env.begin() as txn:
            cursor = txn.cursor(db=self._by_seqno)
            after = SEQNO_KEY.pack(vb, at_most + 1) if at_most < limits.SEQNO_MAX else None
            found = cursor.set_range(after) if after is not None else cursor.last()
            if found and after is not None:
                found = cursor.prev()
            elif not found:
                found = cursor.last()
            if not found:
                return 0
            key_vb, seqno = SEQNO_KEY.unpack(cursor.key())
            return int(seqno) if key_vb == vb else 0

    def high_completed_seqno(self, vb: int) -> int:
        """The newest SyncWrite prepare known completed in `vb`'s persisted state; 0 if none."""
        self._require_open()
        row = self._rows.get(vb)
        return 0 if row is None else row.high_completed_seqno

    def high_seqno(self, vb: int) -> int:
        """Highest seqno written to `vb` (the rollback point after a rollback); 0 if unknown."""
        self._require_open()
        row = self._rows.get(vb)
        return 0 if row is None else row.high_seqno

    def purge_seqno(self, vb: int) -> int:
        """Highest seqno of a tombstone compaction removed from `vb`; 0 if none or unknown."""
        self._require_open()
        row = self._rows.get(vb)
        return 0 if row is None else row.purge_seqno

    def item_count(self, vb: int) -> int:
        """Keys of `vb` whose newest version is a mutation (tombstones not counted)."""
        self._require_open()
        row = self._rows.get(vb)
        return 0 if row is None else row.item_count

    def scan_keyed_bodies(
        self, vb: int, start_seqno: int, end_seqno: int, key_ranges: KeyRanges
    ) -> KeyedBodyScan:
        """What `scan_bodies` would read, but only the records whose keys lie in `key_ranges`
        (one collection's: keys.collection_key_ranges) and the range's last record; the other
        records are not read (keyed_scan.py). Same snapshot and reader-slot rules.

        Raises:
            ValueError: vb outside 0..VBUCKETS_MAX-1, a seqno outside 0..SEQNO_MAX.
            StorageError: no reader slot is free, or LMDB failed.
        """
        txn = self._scan_snapshot(vb, start_seqno, end_seqno)
        return KeyedBodyScan(
            txn, self._by_seqno, self._by_key, vb, start_seqno, end_seqno, key_ranges
        )

    def key_range_seqnos(self, vb: int, first: bytes, end: bytes | None) -> list[int]:
        """The seqno of every stored key of `vb` in ``[first, end)`` (end None: to the last
        key), tombstones included, in key order, from one read snapshot: what one
        collection's keys (keys.collection_key_ranges) hold, without reading the others.

        Raises:
            ValueError: vb outside 0..VBUCKETS_MAX-1.
            CorruptRecordError: an index value does not decode.
        """
        self._require_open()
        _check_vb(vb)
        low = VB_KEY.pack(vb) + first
        high = VB_KEY.pack(vb) + end if end is not None else VB_KEY.pack(vb + 1)
        seqnos: list[int] = []
        with _translated_errors(self._map_size_bytes), self._env.begin() as txn:
            cursor = txn.cursor(db=self._by_key)
            if not cursor.set_range(low):
                return seqnos
            for key, value in cursor:  # bounded by the range
                if key >= high:
                    break
                seqnos.append(decode_by_key_value(vb, value)[0])
        return seqnos

    # --- checks ---------------------------------------------------------------------------------

    def _check_invariants(self) -> None:
        """Walk everything (O(n)): both indexes agree, counters match, the cache matches disk.

        Raises AssertionError or CorruptRecordError; tests call it after every change.
        """
        self._require_open()
        with self._env.begin() as txn:
            assert txn.get(META_SHUTDOWN, db=self._meta) == META_UNCLEAN
            on_disk = {
                VB_KEY.unpack(key)[0]: decode_vbstate(VB_KEY.unpack(key)[0], data)
                for key, data in txn.cursor(db=self._vbmeta)
            }
            assert on_disk == self._rows, (on_disk, self._rows)
            records = 0
            for key, data in txn.cursor(db=self._by_seqno):
                vb, seqno = SEQNO_KEY.unpack(key)
                assert vb in self._rows, (vb, seqno)
                record = decode_record(vb, seqno, data)
                entry = txn.get(VB_KEY.pack(vb) + record.key, db=self._by_key)
                assert entry is not None, record
                assert decode_by_key_value(vb, entry) == (seqno, record.op), (entry, record)
                assert seqno <= self._rows[vb].high_seqno, (record, self._rows[vb])
                records += 1
            assert txn.stat(self._by_key)["entries"] == records, records
            for vb, row in self._rows.items():
                live = sum(not record.deleted for record in _scan_all(txn, self._by_seqno, vb))
                assert live == row.item_count, (vb, live, row)

    # --- helpers --------------------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._closed:
            raise StorageError("the store is closed")

    def _require_writable(self) -> None:
        self._require_open()
        if self._batch_open:
            raise RuntimeError("compact() and rollback() cannot run inside a write batch")

    def _known_row(self, vb: int) -> VbState:
        row = self._rows.get(vb)
        if row is None:
            raise ValueError(f"vb {vb!r} has no metadata in this store")
        return row


def _prepared_seqnos(
    txn: lmdb.Transaction[bytes], prepared: lmdb._Database, vb: int
) -> list[tuple[bytes, int]]:
    """(prepared key, seqno of the prepare) of every kept prepare of `vb`."""
    prefix = VB_KEY.pack(vb)
    found: list[tuple[bytes, int]] = []
    cursor = txn.cursor(db=prepared)
    if not cursor.set_range(prefix):
        return found
    for key, kept in cursor:  # bounded by the vbucket's pending prepares
        if not key.startswith(prefix):
            break
        if len(kept) < 1 + PREFIX.size + 8:
            raise CorruptRecordError(vb, None, f"kept prepare of {len(kept)} bytes")
        found.append((bytes(key), _SEQNO_IN_BODY.unpack_from(kept, 1 + PREFIX.size)[0]))
    return found


def _check_vb(vb: int) -> None:
    if not 0 <= vb < limits.VBUCKETS_MAX:
        raise ValueError(f"vb {vb} outside 0..{limits.VBUCKETS_MAX - 1}")


def _scan_all(txn: lmdb.Transaction[bytes], by_seqno: lmdb._Database, vb: int) -> list[Record]:
    cursor = txn.cursor(db=by_seqno)
    records = []
    if cursor.set_range(SEQNO_KEY.pack(vb, 0)):
        for key, data in cursor.iternext():
            key_vb, seqno = SEQNO_KEY.unpack(key)
            if key_vb != vb:
                break
            records.append(decode_record(vb, seqno, data))
    return records


def _has_older_versions(
    txn: lmdb.Transaction[bytes], by_seqno: lmdb._Database, vb: int, seqno: int
) -> bool:
    """True if a record of `vb` above `seqno` is not its key's first version (rollback)."""
    cursor = txn.cursor(db=by_seqno)
    if not cursor.set_range(SEQNO_KEY.pack(vb, seqno + 1)):
        return False
    for key, data in cursor.iternext():
        key_vb, record_seqno = SEQNO_KEY.unpack(key)
        if key_vb != vb:
            return False
        if decode_record(vb, record_seqno, data).rev_seqno > 1:
            return True
    return False


def _scan(
    txn: lmdb.Transaction[bytes],
    by_seqno: lmdb._Database,
    vb: int,
    start_seqno: int,
    end_seqno: int,
) -> Iterator[Record]:
    """The body of Store.scan: owns `txn` and aborts it when done, abandoned or failed.

    Reads bytes, not `buffers=True` memoryviews: measured, py-lmdb builds a memoryview slower
    than it copies a 150-byte value (5.6M vs 8.0M items/s bare), and the record needs its body
    as bytes anyway, so the copy out of the map is the one copy a record costs.
    """
    unpack_key = SEQNO_KEY.unpack
    decode = decode_record
    seqno_last = -1
    try:
        cursor = txn.cursor(db=by_seqno)
        if start_seqno > end_seqno or not cursor.set_range(SEQNO_KEY.pack(vb, start_seqno)):
            return
        for key, data in cursor.iternext():
            key_vb, seqno = unpack_key(key)
            if key_vb != vb or seqno > end_seqno:
                return
            assert seqno > seqno_last, (vb, seqno, seqno_last)
            seqno_last = seqno
            yield decode(vb, seqno, data)
    except lmdb.Error as error:
        raise StorageError(f"scan of vb {vb} failed: {error}") from error
    finally:
        with contextlib.suppress(lmdb.Error):
            txn.abort()


@contextlib.contextmanager
def _translated_errors(map_size_bytes: int) -> Iterator[None]:
    """Turn lmdb errors into StorageError subclasses that name the setting to change."""
    try:
        yield
    except lmdb.MapFullError:
        raise StorageFullError(map_size_bytes) from None
    except lmdb.ReadersFullError as error:
        raise StorageError(
            f"all LMDB reader slots are in use: close scans or raise "
            f"limits.STORAGE_READERS_MAX ({limits.STORAGE_READERS_MAX}): {error}"
        ) from error
    except lmdb.Error as error:
        raise StorageError(f"LMDB failed: {error}") from error
