"""The older versions a write batch replaces, dropped from `by_seqno` when the batch applies.

Contract: `drop_replaced` takes the `by_key` entries (key, value) the batch's keys already
had, deletes each one's record from `by_seqno` inside the batch's write transaction, and
counts per vbucket how many of them were mutations (the item count they take away). An
update-heavy flush replaces every key it writes, so the work is C-level passes (`map`,
`Counter`) rather than a loop: the by_seqno key of an entry is cut from the bytes — its
by_key key's vb prefix, then the value's seqno field (keys.py: both big-endian, so
`SEQNO_KEY.pack(vb, seqno) == by_key_key[:2] + value[:8]`) — not decoded and packed again.

Raises CorruptRecordError naming the vbucket (and seqno) of a malformed entry or of one that
points at a missing record; the caller's transaction then aborts, as on any error.

Not here: reading the entries (batch.py's getmulti), writing the new versions.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections import Counter
from typing import TYPE_CHECKING, Final

from changefeed.storage.errors import CorruptRecordError
from changefeed.storage.keys import SEQNO_KEY, VB_KEY, refuse_malformed, seqno_keys_of_entries
from changefeed.storage.record import Op

if TYPE_CHECKING:
    import lmdb

_vb_part: Final = operator.itemgetter(slice(0, VB_KEY.size))  # of a by_key key
_op_part: Final = operator.itemgetter(8)  # of a by_key value (keys.py: BY_KEY_VALUE)


def drop_replaced(
    txn: lmdb.Transaction[bytes], by_seqno: lmdb._Database, found: list[tuple[bytes, bytes]]
) -> dict[int, int]:
    """Delete the record each of `found` (by_key key, its committed value) points at.

    Returns:
        vb -> how many of the deleted records were mutations (vbuckets with none left out).

    Raises:
        CorruptRecordError: a value is not 9 bytes, or points at a missing record (the
            first such entry in order).
    """
    keys, values, old_keys = seqno_keys_of_entries(found)
    deleted = list(map(functools.partial(txn.delete, db=by_seqno), old_keys))
    if not all(deleted):
        vb, seqno = SEQNO_KEY.unpack(old_keys[deleted.index(False)])
        raise CorruptRecordError(vb, seqno, "by_key points at a missing record")
    if len(keys) < len(found):
        refuse_malformed(found[len(keys)])
    is_mutation = map(operator.eq, map(_op_part, values), itertools.repeat(Op.MUTATION))
    mutations = Counter(map(_vb_part, itertools.compress(keys, is_mutation)))
    return {VB_KEY.unpack(prefix)[0]: count for prefix, count in mutations.items()}
