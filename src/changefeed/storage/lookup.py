"""The records of keys found in `by_key`, read with one LMDB lookup (`Store.get_many_across`).

Contract: `records_of_hits` takes the (by_key key, value) pairs a `getmulti` of `by_key`
found and returns (vb, key, record) for each, in the same order, reading every record with one
`getmulti` of `by_seqno` instead of two `get`s per key (the by_key entry again, then the
record): a received window of overwrites looks up every key it writes, and the per-key
lookups were half of the active's cost per overwrite. The by_seqno key of an entry is cut from
the bytes (keys.py: `SEQNO_KEY.pack(vb, seqno) == by_key_key[:2] + value[:8]`).

Raises CorruptRecordError, naming the vbucket and seqno, as `Store.get` does: an entry that is
not 9 bytes, points at a missing record, or disagrees with it (key or op).

Not here: the by_key lookup, the read transaction, what a caller does with the records.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Final

from changefeed.storage.errors import CorruptRecordError
from changefeed.storage.keys import SEQNO_KEY, VB_KEY, refuse_malformed, seqno_keys_of_entries
from changefeed.storage.record import Record, decode_record

if TYPE_CHECKING:
    import lmdb

_first: Final = operator.itemgetter(0)
_OP_AT: Final = 8  # of a by_key value (keys.py: BY_KEY_VALUE, seqno u64 then op u8)


def records_of_hits(
    txn: lmdb.Transaction[bytes], by_seqno: lmdb._Database, hits: list[tuple[bytes, bytes]]
) -> list[tuple[int, bytes, Record]]:
    """(vb, key, record) of each of `hits` (by_key key, its value), in order.

    Raises:
        CorruptRecordError: an entry is not 9 bytes, points at a missing record, or names
            another key or op than its record (the first such entry in order, as `Store.get`
            one key at a time names it).
    """
    keys, values, seqno_keys = seqno_keys_of_entries(hits)
    stored = txn.cursor(db=by_seqno).getmulti(seqno_keys)
    missing = len(seqno_keys)
    if len(stored) != len(seqno_keys):  # getmulti leaves out what it did not find
        present = set(map(_first, stored))
        missing = next(n for n, seqno_key in enumerate(seqno_keys) if seqno_key not in present)
    found = []
    unpack = SEQNO_KEY.unpack
    head = zip(keys[:missing], values[:missing], stored[:missing], strict=True)
    for by_key_key, value, (seqno_key, data) in head:
        vb, seqno = unpack(seqno_key)
        key = by_key_key[VB_KEY.size :]
        record = decode_record(vb, seqno, data)
        if record.key != key or record.op != value[_OP_AT]:
            raise CorruptRecordError(vb, seqno, f"by_key entry of {key!r} disagrees with record")
        found.append((vb, key, record))
    if missing < len(seqno_keys):
        vb, seqno = SEQNO_KEY.unpack(seqno_keys[missing])
        key = keys[missing][VB_KEY.size :]
        raise CorruptRecordError(vb, seqno, f"by_key entry of {key!r} has no record")
    if len(keys) < len(hits):
        refuse_malformed(hits[len(keys)])
    return found
