"""Queued items: what a checkpoint holds and what a cursor yields.

Contract: an `Item` is one mutation, deletion or expiration of one key at one seqno, exactly the
fields the store keeps for it (storage `WriteBatch.set` / `.delete`), so the flusher writes it and a
reader sends it without looking anything up. Items are shared by every checkpoint, cursor and
backfill queue that holds them and are never changed after they are built.

Meta items (`DUMMY`, `CHECKPOINT_START`) only mark positions inside a checkpoint; they are never
yielded to a reader (seed mutation-manager.md, "Dummy item" / "Start Snapshot item").

Not here: seqno allocation (the vbucket's), memory accounting (memory.py).
"""

from __future__ import annotations

import dataclasses
from typing import Final

from changefeed.storage import Op, Record


# Not frozen on purpose: a frozen slotted dataclass builds through object.__setattr__ and measured
# 1.3 us per item against 0.22 us here (Python 3.11), on the path every write takes. Nothing
# assigns to an Item after construction; `_check_invariants` would catch a reordered seqno.
@dataclasses.dataclass(slots=True, eq=True, repr=False)
class Item:
    """One change of one key, as queued by the vbucket.

    Attributes:
        seqno: the vbucket's seqno for this change (> 0, increasing per vbucket).
        key: document key.
        op: MUTATION, DELETION or EXPIRATION (storage `Op`).
        value: document value (a tombstone may carry xattrs here, else b"").
        cas: document CAS.
        flags, expiry: document flags and expiration (mutations; 0 for tombstones).
        datatype: dcp-wire.md §1.4 datatype bits.
        rev_seqno: revision number of the document.
        delete_time: seconds since the epoch when deleted (tombstones; 0 for mutations).
    """

    seqno: int
    key: bytes
    op: Op
    value: bytes
    cas: int
    flags: int = 0
    expiry: int = 0
    datatype: int = 0
    rev_seqno: int = 1
    delete_time: int = 0

    @property
    def deleted(self) -> bool:
        """True for a tombstone (deletion or expiration)."""
        return self.op is not Op.MUTATION

    def __repr__(self) -> str:
        value = self.value[:32] + (b"..." if len(self.value) > 32 else b"")
        return (
            f"Item(seqno={self.seqno}, key={self.key[:64]!r}, op={self.op.name}, value={value!r})"
        )

    @classmethod
    def from_record(cls, record: Record) -> Item:
        """Build the item a disk backfill yields for a stored `record` (same fields)."""
        item = cls(
            record.seqno,
            record.key,
            record.op,
            record.value,
            record.cas,
            record.flags,
            record.expiry,
            record.datatype,
            record.rev_seqno,
            record.delete_time,
        )
        assert item.seqno == record.seqno, (item.seqno, record.seqno)
        return item


class MetaItem:
    """A position marker inside a checkpoint; cursors step over it and never yield it."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"MetaItem({self.name})"


# Index 0 of every checkpoint: lets a cursor sit "at the front" having read nothing of it
# (ep-engine advances a cursor before dereferencing it, dcp-wire.md §10).
DUMMY: Final = MetaItem("dummy")
# Index 1 once the first item arrives: where a cursor announces the checkpoint's snapshot.
CHECKPOINT_START: Final = MetaItem("checkpoint_start")
