"""Reading only some keys' records of one vbucket, in seqno order, inside one read transaction.

Contract: a `KeyedBodyScan` is a `BodyScan` (body_scan.py: `read`, `next_record`, `done`,
`close`, `last_seqno`) over the records of `vb` with start_seqno <= seqno <= end_seqno whose
keys lie in the given by_key ranges — one collection's keys (keys.collection_key_ranges) — plus
the range's last record whatever its key. It finds their seqnos in the by_key index (one entry
per key, its newest version: what by_seqno holds), sorts them, and reads each record by seqno,
so the records of other keys are never read: the cost follows what is wanted, not the range.

Why the last record: a stream filtered to a collection must still reach the end of the disk
snapshot; the producer skips that record if it is not wanted and sends a SEQNO_ADVANCED to it
(producer/collection_stream.py), as it does over a full scan.

Memory: the seqnos are found when the scan opens, one int per wanted key of the vbucket in
the range (a vbucket holds 1/1024 of a bucket by default: 1M documents of a collection in a
1024-vbucket bucket are ~1,000 ints a scan); the records are read run by run.

Not here: choosing the ranges (the producer's filter), framing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import lmdb

from changefeed import limits
from changefeed.storage.errors import StorageError
from changefeed.storage.keys import SEQNO_KEY, VB_KEY, decode_by_key_value
from changefeed.storage.record import Record, decode_record

KeyRanges = Sequence[tuple[bytes, bytes | None]]


class KeyedBodyScan:
    """The records of `vb` in [start_seqno, end_seqno] with keys in `key_ranges`, and the
    range's last record, read forward in runs. Built by `Store.scan_keyed_bodies`, which opens
    `txn`; the scan aborts it when done or closed."""

    def __init__(
        self,
        txn: lmdb.Transaction[bytes],
        by_seqno: lmdb._Database,
        by_key: lmdb._Database,
        vb: int,
        start_seqno: int,
        end_seqno: int,
        key_ranges: KeyRanges,
    ) -> None:
        assert start_seqno >= 0, start_seqno
        self.vb = vb
        self.end_seqno = end_seqno
        self.last_seqno = start_seqno - 1
        self._txn: lmdb.Transaction[bytes] | None = txn
        self._by_seqno = by_seqno
        self._seqnos: list[int] = []
        self._next = 0
        try:
            self._seqnos = self._find(by_seqno, by_key, start_seqno, end_seqno, key_ranges)
        except lmdb.Error as error:
            self.close()
            raise StorageError(f"keyed scan of vb {vb} failed: {error}") from error
        if not self._seqnos:
            self.close()

    def __repr__(self) -> str:
        state = "done" if self.done else f"after {self.last_seqno}"
        return f"KeyedBodyScan(vb={self.vb}, {len(self._seqnos)} records, {state})"

    @property
    def done(self) -> bool:
        return self._txn is None

    def _find(
        self,
        by_seqno: lmdb._Database,
        by_key: lmdb._Database,
        start_seqno: int,
        end_seqno: int,
        key_ranges: KeyRanges,
    ) -> list[int]:
        assert self._txn is not None
        vb = self.vb
        prefix = VB_KEY.pack(vb)
        found: set[int] = set()
        cursor = self._txn.cursor(db=by_key)
        for first, end in key_ranges:  # bounded by the ranges' keys
            high = prefix + end if end is not None else VB_KEY.pack(vb + 1)
            if not cursor.set_range(prefix + first):
                continue
            for key, value in cursor:
                if key >= high:
                    break
                seqno = decode_by_key_value(vb, value)[0]
                if start_seqno <= seqno <= end_seqno:
                    found.add(seqno)
        last = self._txn.cursor(db=by_seqno)
        if end_seqno < limits.SEQNO_MAX and last.set_range(SEQNO_KEY.pack(vb, end_seqno + 1)):
            moved = last.prev()
        else:
            moved = last.last()
        if moved:
            at_vb, seqno = SEQNO_KEY.unpack(last.key())
            if at_vb == vb and start_seqno <= seqno <= end_seqno:
                found.add(seqno)
        return sorted(found)

    def read(self, records_max: int, bytes_max: int) -> list[bytes]:
        """The next run: at most `records_max` records, no more once they hold `bytes_max`
        bytes (one record larger than that comes alone); empty once exhausted.

        Raises:
            StorageError: LMDB failed (or the store was closed during the scan).
        """
        assert records_max > 0, records_max
        assert bytes_max > 0, bytes_max
        txn = self._txn
        if txn is None:
            return []
        records: list[bytes] = []
        size = 0
        stop = min(len(self._seqnos), self._next + records_max)
        try:
            for seqno in self._seqnos[self._next : stop]:  # bounded by records_max
                data = txn.get(SEQNO_KEY.pack(self.vb, seqno), db=self._by_seqno)
                assert data is not None, (self.vb, seqno)  # by_key points at by_seqno's key
                records.append(data)
                size += len(data)
                self._next += 1
                if size >= bytes_max:
                    break
        except lmdb.Error as error:
            self.close()
            raise StorageError(f"keyed scan of vb {self.vb} failed: {error}") from error
        if records:
            first, last = self._seqnos[self._next - len(records)], self._seqnos[self._next - 1]
            assert self.last_seqno < first <= last <= self.end_seqno, (self, first, last)
            self.last_seqno = last
        if self._next == len(self._seqnos):
            self.close()
        return records

    def next_record(self) -> Record | None:
        """The next record, decoded and checked; None once exhausted.

        Raises:
            CorruptRecordError: the record does not decode.
            StorageError: LMDB failed.
        """
        runs = self.read(1, 1)
        if not runs:
            return None
        seqno = self.last_seqno
        return decode_record(self.vb, seqno, runs[0])

    def seqnos_left(self) -> int:
        """Records not yet handed out (tests, stats)."""
        return len(self._seqnos) - self._next

    def close(self) -> None:
        """Abort the read transaction (frees its reader slot); idempotent."""
        txn, self._txn = self._txn, None
        if txn is not None:
            with contextlib.suppress(lmdb.Error):
                txn.abort()
