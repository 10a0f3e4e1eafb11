"""Queued items: what a checkpoint holds and what a cursor yields.

Contract: an `Item` is one mutation, deletion or expiration of one key at one seqno, exactly the
fields the store keeps for it (storage `WriteBatch.set` / `.delete`), so the flusher writes it and a
reader sends it without looking anything up. Items are shared by every checkpoint, cursor and
backfill queue that holds them and are never changed after they are built.

An item holds its DCP body, encoded once when it is built: extras | key | value, byte for byte
the body the store keeps for it (storage/record.py: mutation extras, or deletion V2 extras for a
tombstone). Every stream that sends the item frames that one body (producer/item_encoding.py);
the value is not kept a second time, `value` is the body's tail.

A `SyncItem` is a SyncWrite's item (a durable write, issue 12): a PREPARE holds the pending
document — body in its document's layout, op PREPARE, `doc_op` MUTATION or DELETION — that no
read or application stream sees; an ABORT ends one unseen. A commit is a plain `Item` of the
committed document at its own seqno. Both kinds go in a checkpoint's prepared namespace
(checkpoint.py): a prepare is never deduplicated.

Meta items (`DUMMY`, `CHECKPOINT_START`) only mark positions inside a checkpoint; they are never
yielded to a reader (seed mutation-manager.md, "Dummy item" / "Start Snapshot item").

Not here: seqno allocation (the vbucket's), memory accounting (memory.py).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Final

from changefeed.protocol.dcp_items import DELETION_V2_EXTRAS, MUTATION_EXTRAS
from changefeed.storage import Op, Record
from changefeed.storage.record import DELETION_EXTRAS_SIZE, MUTATION_EXTRAS_SIZE

_MUTATION: Final = Op.MUTATION
_ABORT: Final = Op.ABORT
_DELETION: Final = Op.DELETION
_PREPARE: Final = Op.PREPARE
_pack_mutation_extras: Final = MUTATION_EXTRAS.pack
_pack_tombstone_extras: Final = DELETION_V2_EXTRAS.pack  # record.py stores tombstones so
_new_item: Final = object.__new__  # an item whose slots the builder sets itself


class Item:
    """One change of one key, as queued by the vbucket.

    A plain slotted class, not a dataclass: built on every write, and a frozen slotted dataclass
    builds through object.__setattr__ (1.3 us per item against 0.22 us plain, Python 3.11).
    Nothing assigns to an Item after construction; `_check_invariants` would catch a reordered
    seqno.

    Args:
        seqno: the vbucket's seqno for this change (> 0, increasing per vbucket).
        key: document key.
        op: MUTATION, DELETION or EXPIRATION (storage `Op`).
        value: document value (a tombstone may carry xattrs here, else b"").
        cas: document CAS.
        flags, expiry: document flags and expiration (mutations; 0 for tombstones).
        datatype: dcp-wire.md §1.4 datatype bits.
        rev_seqno: revision number of the document.
        delete_time: seconds since the epoch when deleted (tombstones; 0 for mutations).

    Attributes:
        body: the DCP body, extras | key | value (see the module docstring).

    Raises:
        ValueError: an integer field does not fit its extras field.
    """

    __slots__ = (
        "body",
        "cas",
        "datatype",
        "delete_time",
        "expiry",
        "flags",
        "key",
        "op",
        "rev_seqno",
        "seqno",
    )

    def __init__(
        self,
        seqno: int,
        key: bytes,
        op: Op,
        value: bytes,
        cas: int,
        flags: int = 0,
        expiry: int = 0,
        datatype: int = 0,
        rev_seqno: int = 1,
        delete_time: int = 0,
    ) -> None:
        self.seqno = seqno
        self.key = key
        self.op = op
        self.cas = cas
        self.flags = flags
        self.expiry = expiry
        self.datatype = datatype
        self.rev_seqno = rev_seqno
        self.delete_time = delete_time
        # The extras of storage/record.py's layout (lock_time, nmeta, nru, unused: 0).
        try:
            if op is _MUTATION:
                extras = _pack_mutation_extras(seqno, rev_seqno, flags, expiry, 0, 0, 0)
            else:
                extras = _pack_tombstone_extras(seqno, rev_seqno, delete_time, 0)
        except struct.error as error:
            raise ValueError(f"item seqno {seqno}: a field does not fit: {error}") from None
        self.body = b"".join((extras, key, value))

    @property
    def value(self) -> bytes:
        """The document value: the body after extras and key (a copy of that tail)."""
        extras_size = MUTATION_EXTRAS_SIZE if self.op is _MUTATION else DELETION_EXTRAS_SIZE
        return self.body[extras_size + len(self.key) :]

    @property
    def extras_size(self) -> int:
        """Bytes of extras at the front of `body`: 31 (mutation) or 21 (tombstone)."""
        return MUTATION_EXTRAS_SIZE if self.op is _MUTATION else DELETION_EXTRAS_SIZE

    @property
    def deleted(self) -> bool:
        """True for a tombstone (deletion or expiration)."""
        return self.op is not _MUTATION

    def _fields(self) -> tuple[object, ...]:
        return (
            self.seqno,
            self.key,
            self.op,
            self.body,
            self.cas,
            self.flags,
            self.expiry,
            self.datatype,
            self.rev_seqno,
            self.delete_time,
        )

    def __eq__(self, other: object) -> bool:
        if type(other) is not Item:
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # equal by value and not immutable by force

    def __repr__(self) -> str:
        value = self.value
        shown = value[:32] + (b"..." if len(value) > 32 else b"")
        return (
            f"Item(seqno={self.seqno}, key={self.key[:64]!r}, op={self.op.name}, value={shown!r})"
        )

    @classmethod
    def of_body(
        cls,
        seqno: int,
        key: bytes,
        op: Op,
        body: bytes,
        cas: int,
        flags: int,
        expiry: int,
        datatype: int,
        rev_seqno: int,
        delete_time: int,
    ) -> Item:
        """The item whose DCP body is `body`, already encoded with these fields (a replica's
        received change: its frame's body is the stored layout). Nothing is encoded again;
        the caller vouches that `body` holds the fields (the frame decoder read them there)."""
        item = cls.__new__(cls)
        item.seqno = seqno
        item.key = key
        item.op = op
        item.body = body
        item.cas = cas
        item.flags = flags
        item.expiry = expiry
        item.datatype = datatype
        item.rev_seqno = rev_seqno
        item.delete_time = delete_time
        return item

    @classmethod
    def from_record(cls, record: Record) -> Item:
        """Build the item a disk backfill yields for a stored `record` (same fields, and the
        record's body itself: nothing is encoded again)."""
        item = cls.__new__(cls)
        item.seqno = record.seqno
        item.key = record.key
        item.op = record.op
        item.body = record.body
        item.cas = record.cas
        item.flags = record.flags
        item.expiry = record.expiry
        item.datatype = record.datatype
        item.rev_seqno = record.rev_seqno
        item.delete_time = record.delete_time
        assert item.seqno == record.seqno, (item.seqno, record.seqno)
        return item


class SyncItem(Item):
    """A PREPARE or ABORT of a SyncWrite (see the module docstring).

    Args:
        seqno, key, cas, flags, expiry, datatype, rev_seqno, delete_time: as `Item`'s, for
            the prepared document (an ABORT: its own seqno, the key, the prepare's CAS).
        op: PREPARE or ABORT.
        doc_op: the prepared document's op, MUTATION or DELETION (an ABORT: DELETION).
        value: the prepared document's value (an ABORT: b"").
        level: the durability level asked for (protocol DurabilityLevel; 0 on an ABORT).
        prepared_seqno: an ABORT's prepare (0 on a PREPARE).
    """

    __slots__ = ("doc_op", "level", "prepared_seqno")

    def __init__(
        self,
        seqno: int,
        key: bytes,
        op: Op,
        doc_op: Op,
        value: bytes,
        cas: int,
        flags: int = 0,
        expiry: int = 0,
        datatype: int = 0,
        rev_seqno: int = 1,
        delete_time: int = 0,
        *,
        level: int = 0,
        prepared_seqno: int = 0,
    ) -> None:
        assert op in (_PREPARE, _ABORT), op
        assert doc_op in (_MUTATION, _DELETION), doc_op
        super().__init__(
            seqno, key, doc_op, value, cas, flags, expiry, datatype, rev_seqno, delete_time
        )
        self.op = op
        self.doc_op = doc_op
        self.level = level
        self.prepared_seqno = prepared_seqno

    @property
    def value(self) -> bytes:
        return self.body[self.extras_size + len(self.key) :]

    @property
    def extras_size(self) -> int:
        return MUTATION_EXTRAS_SIZE if self.doc_op is _MUTATION else DELETION_EXTRAS_SIZE

    @property
    def deleted(self) -> bool:
        return self.doc_op is not _MUTATION

    def _fields(self) -> tuple[object, ...]:
        return (*super()._fields(), self.doc_op, self.level, self.prepared_seqno)

    def __eq__(self, other: object) -> bool:
        if type(other) is not SyncItem:
            return NotImplemented
        return self._fields() == other._fields()

    def committed(self, seqno: int) -> CommitItem:
        """The item that commits this prepare at `seqno`: the same document and CAS."""
        assert self.op is _PREPARE, self
        # The prepare's body is in its document's layout: only the extras (the seqno among
        # them) change; key and value are taken as they are, not sliced out and encoded again.
        doc_op, body, rev_seqno = self.doc_op, self.body, self.rev_seqno
        try:
            if doc_op is _MUTATION:
                extras = _pack_mutation_extras(seqno, rev_seqno, self.flags, self.expiry, 0, 0, 0)
            else:
                extras = _pack_tombstone_extras(seqno, rev_seqno, self.delete_time, 0)
        except struct.error as error:
            raise ValueError(f"item seqno {seqno}: a field does not fit: {error}") from None
        # The slots set here, not through `of_body`: one per commit on the active and on every
        # replica, so a classmethod call and its keyword passing are a share of its cost.
        item = _new_item(CommitItem)
        item.seqno = seqno
        item.key = self.key
        item.op = doc_op
        item.body = extras + body[len(extras) :]
        item.cas = self.cas
        item.flags = self.flags
        item.expiry = self.expiry
        item.datatype = self.datatype
        item.rev_seqno = rev_seqno
        item.delete_time = self.delete_time
        item.prepared_seqno = self.seqno
        return item

    @classmethod
    def prepares(
        cls,
        seqnos: Iterable[int],
        keys: Iterable[bytes],
        values: Iterable[bytes],
        cases: Iterable[int],
        flags: Iterable[int],
        expiries: Iterable[int],
        datatypes: Iterable[int],
        revs: Iterable[int],
        level: int,
    ) -> list[SyncItem]:
        """The PREPAREs of documents (not deletions) at `seqnos`, column i the fields of
        prepare i: each equal to `SyncItem(seqno, key, PREPARE, MUTATION, value, cas, flag,
        expiry, datatype, rev, level=level)`, built in one pass without its `__init__` chain
        (an active's run of durable SETs: vbucket `set_many(level=)`).

        Raises:
            ValueError: a field does not fit its extras field (as `Item`), or the columns'
                lengths differ.
        """
        items: list[SyncItem] = []
        append = items.append
        pack = _pack_mutation_extras
        new = _new_item
        for seqno, key, value, cas, flag, expiry, datatype, rev in zip(
            seqnos, keys, values, cases, flags, expiries, datatypes, revs, strict=True
        ):  # bounded by the caller's run
            try:
                extras = pack(seqno, rev, flag, expiry, 0, 0, 0)
            except struct.error as error:
                raise ValueError(f"item seqno {seqno}: a field does not fit: {error}") from None
            item = new(cls)
            item.seqno = seqno
            item.key = key
            item.op = _PREPARE
            item.body = b"".join((extras, key, value))
            item.cas = cas
            item.flags = flag
            item.expiry = expiry
            item.datatype = datatype
            item.rev_seqno = rev
            item.delete_time = 0
            item.doc_op = _MUTATION
            item.level = level
            item.prepared_seqno = 0
            append(item)
        return items


class CommitItem(Item):
    """A committed SyncWrite: the document at its commit seqno, a plain item to everyone but a
    replica stream that holds the prepare, which gets DCP_COMMIT (producer/item_encoding.py).
    `prepared_seqno`: the prepare it commits."""

    __slots__ = ("prepared_seqno",)
    prepared_seqno: int

    def __eq__(self, other: object) -> bool:
        if type(other) is not CommitItem:
            return NotImplemented
        return self._fields() == other._fields() and self.prepared_seqno == other.prepared_seqno


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
