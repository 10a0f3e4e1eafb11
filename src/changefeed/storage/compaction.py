"""Removing records from one vbucket in place: tombstone purge and rollback truncation.

Contract: each function works inside a write transaction the caller owns, on one vbucket, and
removes a record together with its `by_key` entry, after checking that the entry points at the
record (both sides of the index agree, or CorruptRecordError). The caller updates the vbucket's
metadata (purge seqno, high seqno, item count) from what the function returns, in the same
transaction, so a crash keeps either all of a purge or rollback or none of it.

`purge_tombstones_chunk` is the bounded form: it looks at most at `records_max` records from a
start seqno and says where the next chunk resumes, so a caller can purge a large vbucket in many
short transactions (one writer at a time; server/compactor.py runs them between flushes).

Not here: choosing which vbuckets to compact, the clock, committing. Purge does not reclaim
file space: LMDB reuses freed pages for later writes, and the file never shrinks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from changefeed import limits
from changefeed.storage.errors import CorruptRecordError
from changefeed.storage.keys import (
    COLLECTION_MARKER,
    SEQNO_KEY,
    VB_KEY,
    collection_of,
    decode_by_key_value,
)
from changefeed.storage.record import (
    DELETION_EXTRAS_SIZE,
    MUTATION_EXTRAS_SIZE,
    TAG_MUTATION,
    Op,
    Record,
    decode_record,
)

_STORED_PREFIX: Final = 12  # record.py: tag, datatype, key_len, cas before the body

if TYPE_CHECKING:
    import lmdb


def purge_tombstones(
    txn: lmdb.Transaction[bytes],
    by_seqno: lmdb._Database,
    by_key: lmdb._Database,
    vb: int,
    delete_time_max: float,
) -> tuple[int, int]:
    """Remove every tombstone of `vb` whose delete_time <= `delete_time_max`.

    Returns:
        (highest seqno removed or 0 if none, number of tombstones removed).

    Raises:
        CorruptRecordError: a tombstone does not decode, or its by_key entry disagrees.
    """
    chunk = purge_tombstones_chunk(txn, by_seqno, by_key, vb, delete_time_max)
    assert chunk.next_seqno is None, chunk
    return chunk.seqno_purged_max, chunk.purged


@dataclasses.dataclass(frozen=True, slots=True)
class PurgeChunk:
    """What one bounded purge did in one vbucket.

    Attributes:
        purged: tombstones removed.
        seqno_purged_max: highest seqno removed; 0 if none.
        visited: records looked at (mutations and tombstones).
        next_seqno: first seqno the next chunk must look at; None when this chunk reached the
            end of the vbucket or passed `seqno_max`.
        dropped: records of dropped collections removed (not counted in `purged`; they do not
            raise the purge seqno: a consumer learns of them from the collection's drop event).
        dropped_live: of those, live documents (the vbucket's item count falls by this).
    """

    purged: int
    seqno_purged_max: int
    visited: int
    next_seqno: int | None
    dropped: int = 0
    dropped_live: int = 0


def purge_tombstones_chunk(
    txn: lmdb.Transaction[bytes],
    by_seqno: lmdb._Database,
    by_key: lmdb._Database,
    vb: int,
    delete_time_max: float,
    *,
    start_seqno: int = 0,
    seqno_max: int = limits.SEQNO_MAX,
    records_max: int | None = None,
    dropped: Callable[[int], bool] | None = None,
) -> PurgeChunk:
    """Remove the tombstones of `vb` with delete_time <= `delete_time_max` and seqno in
    `start_seqno..seqno_max`, looking at no more than `records_max` records (None: no bound).
    With `dropped`, also every record (document or tombstone) in that range whose collection
    `dropped(collection id)` says was dropped (keys.py: a marked key): a dropped collection's
    documents go lazily, a chunk at a time, like tombstones.

    Raises:
        CorruptRecordError: a tombstone does not decode, or its by_key entry disagrees.
    """
    assert 0 <= start_seqno <= limits.SEQNO_MAX, start_seqno
    assert 0 <= seqno_max <= limits.SEQNO_MAX, seqno_max
    assert records_max is None or records_max > 0, records_max
    prefix = VB_KEY.pack(vb)
    cursor = txn.cursor(db=by_seqno)
    cursor.set_range(SEQNO_KEY.pack(vb, start_seqno))
    seqno_purged_max = 0
    purged = 0
    visited = 0
    gone = gone_live = 0
    while (key := cursor.key()) and key[:2] == prefix:  # bounded by the vbucket's records
        seqno = SEQNO_KEY.unpack(key)[1]
        if seqno > seqno_max:
            break
        if visited == records_max:
            return PurgeChunk(purged, seqno_purged_max, visited, seqno, gone, gone_live)
        visited += 1
        data = cursor.value()
        if dropped is not None and _in_dropped(data, dropped):
            record = decode_record(vb, seqno, data)
            _delete_by_key_entry(txn, by_key, record)
            deleted = cursor.delete()  # and moves to the next record
            assert deleted, (vb, seqno)
            gone += 1
            gone_live += record.op is Op.MUTATION
            continue
        if data[:1] == bytes((TAG_MUTATION,)):
            cursor.next()
            continue
        record = decode_record(vb, seqno, data)  # raises on an unknown tag, too
        if record.delete_time > delete_time_max:
            cursor.next()
            continue
        _delete_by_key_entry(txn, by_key, record)
        deleted = cursor.delete()  # and moves to the next record
        assert deleted, (vb, seqno)
        assert seqno > seqno_purged_max, (seqno, seqno_purged_max)
        seqno_purged_max = seqno
        purged += 1
    assert purged + gone <= visited, (purged, gone, visited)
    return PurgeChunk(purged, seqno_purged_max, visited, None, gone, gone_live)


def _in_dropped(data: bytes, dropped: Callable[[int], bool]) -> bool:
    """Whether a stored record's key is in a collection `dropped` names (cheap: the key's
    first byte says whether it names a collection at all)."""
    extras = MUTATION_EXTRAS_SIZE if data[0] == TAG_MUTATION else DELETION_EXTRAS_SIZE
    at = _STORED_PREFIX + extras
    if len(data) <= at or data[at] != COLLECTION_MARKER:
        return False
    key_len = int.from_bytes(data[2:4], "big")
    return dropped(collection_of(bytes(data[at : at + key_len])))


def discard_after(
    txn: lmdb.Transaction[bytes],
    by_seqno: lmdb._Database,
    by_key: lmdb._Database,
    vb: int,
    seqno: int,
) -> tuple[int, int]:
    """Remove every record of `vb` with a seqno above `seqno` (a rollback's truncation).

    Older versions of the removed keys are not kept (a key has one version in the store), so
    the keys simply disappear.

    Returns:
        (records removed, of which live mutations).

    Raises:
        CorruptRecordError: a record does not decode, or its by_key entry disagrees.
    """
    assert 0 <= seqno <= limits.SEQNO_MAX, seqno
    if seqno == limits.SEQNO_MAX:
        return 0, 0
    cursor = txn.cursor(db=by_seqno)
    cursor.set_range(SEQNO_KEY.pack(vb, seqno + 1))
    removed = 0
    removed_live = 0
    while (key := cursor.key()) and key[:2] == VB_KEY.pack(vb):
        record_seqno = SEQNO_KEY.unpack(key)[1]
        assert record_seqno > seqno, (record_seqno, seqno)
        record = decode_record(vb, record_seqno, cursor.value())
        _delete_by_key_entry(txn, by_key, record)
        deleted = cursor.delete()
        assert deleted, (vb, record_seqno)
        removed += 1
        removed_live += not record.deleted
    return removed, removed_live


def _delete_by_key_entry(
    txn: lmdb.Transaction[bytes], by_key: lmdb._Database, record: Record
) -> None:
    by_key_key = VB_KEY.pack(record.vb) + record.key
    entry = txn.get(by_key_key, db=by_key)
    if entry is None:
        raise CorruptRecordError(record.vb, record.seqno, "record has no by_key entry")
    seqno, op = decode_by_key_value(record.vb, entry)
    if (seqno, op) != (record.seqno, record.op):
        reason = f"by_key entry says seqno {seqno} op {op}, record has op {record.op}"
        raise CorruptRecordError(record.vb, record.seqno, reason)
    deleted = txn.delete(by_key_key, db=by_key)
    assert deleted, record
