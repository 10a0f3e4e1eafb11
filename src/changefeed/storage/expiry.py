"""Finding expired documents in one vbucket: a bounded scan of `by_seqno` with a resume point.

Contract: `find_expired` reads, inside a read transaction the caller owns, at most `records_max`
records of one vbucket in seqno order from `start_seqno`, and returns the keys of the mutations
among them whose expiry is set and at or below `expiry_max`, and where the next scan resumes
(None once the vbucket's end was reached). Only a record's fixed head is unpacked to test its
expiry; a record that is due is decoded whole, so a corrupt record is never acted on.

A scan from a resume point still sees every key: the store keeps one version per key, and a key
written again moves to a seqno above every resume point handed out before, so a sweep from 0 to
the end visits every key present at its start (and some twice).

Not here: the clock, deciding to expire (the vbucket re-checks memory first:
`VBucket.expire_if_due`), the pager's schedule (server/expiry_pager.py). Nothing is written.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Final

from changefeed import limits
from changefeed.storage.keys import SEQNO_KEY, VB_KEY
from changefeed.storage.record import MUTATION_HEAD, TAG_MUTATION, decode_record

if TYPE_CHECKING:
    import lmdb

_EXPIRY_FIELD: Final = 7  # index of `expiration` in MUTATION_HEAD's fields (record.py layout)


@dataclasses.dataclass(frozen=True, slots=True)
class ExpiryScan:
    """What one bounded scan found.

    Attributes:
        keys: keys of live mutations whose expiry is due, in seqno order.
        visited: records looked at (at most the scan's `records_max`).
        next_seqno: where the next scan of the vbucket starts; None when this one reached the
            vbucket's end (the next sweep starts again at 0).
    """

    keys: list[bytes]
    visited: int
    next_seqno: int | None


def find_expired(
    txn: lmdb.Transaction[bytes],
    by_seqno: lmdb._Database,
    vb: int,
    *,
    start_seqno: int,
    records_max: int,
    expiry_max: int,
) -> ExpiryScan:
    """Keys of mutations of `vb` with 0 < expiry <= `expiry_max`, among the next records.

    Raises:
        CorruptRecordError: a due record does not decode.
    """
    assert 0 <= start_seqno <= limits.SEQNO_MAX, start_seqno
    assert records_max > 0, records_max
    prefix = VB_KEY.pack(vb)
    unpack_key = SEQNO_KEY.unpack
    unpack_head = MUTATION_HEAD.unpack_from
    head_size = MUTATION_HEAD.size
    keys: list[bytes] = []
    visited = 0
    cursor = txn.cursor(db=by_seqno)
    if not cursor.set_range(SEQNO_KEY.pack(vb, start_seqno)):
        return ExpiryScan(keys, visited, None)
    for key, data in cursor.iternext():  # bounded by records_max
        if key[:2] != prefix:
            return ExpiryScan(keys, visited, None)
        seqno = unpack_key(key)[1]
        if visited == records_max:
            return ExpiryScan(keys, visited, seqno)
        visited += 1
        if not data or data[0] != TAG_MUTATION:
            continue  # a tombstone has no expiry
        if len(data) < head_size:
            decode_record(vb, seqno, data)  # raises CorruptRecordError: the head is cut short
        expiry = unpack_head(data)[_EXPIRY_FIELD]
        if 0 < expiry <= expiry_max:
            record = decode_record(vb, seqno, data)  # raises on a corrupt record
            assert record.expiry == expiry, (record, expiry)
            keys.append(record.key)
    return ExpiryScan(keys, visited, None)
