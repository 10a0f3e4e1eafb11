"""Framing runs of items and stored records as DCP data messages, for one stream's options.

What is framed is a body already encoded: a checkpoint `Item` carries its DCP body (extras | key |
value, checkpoint/item.py) and a record read from disk is its stored form (storage/record.py: a
12-byte prefix ending with the CAS, then the same body). An `ItemFramer` turns a run of either into
one bytes object, the frames joined once, and says how many it framed and how many bytes.

Fast path: a stream without a stream-id or NoValue, on items whose stored body is the one sent.
That is every mutation, and every tombstone on a connection with IncludeDeleteTimes (deletion V2,
the stored extras) unless it asked for the expiry opcode. There each item costs one
``struct.pack`` of its header, and nothing else is built per item: the frames are the header
and the shared body. A stored record needs only the header's first 16 bytes, since its prefix
ends with the CAS right before the body: the frame is that front and ``record[4:]``.

A connection without collections must not get a named collection's key as stored
(collection_stream.py): `plain_items` and `plain_stored` are the fast path with that check in the
same pass, the key's first byte looked up into the header's datatype (out of range for the
collection marker, so the pack fails and the caller takes its per-collection path). A check of
its own before framing was the first touch of every checkpoint item of a run: cache misses that
cost more than the check.

Fallback, item by item, for everything else: a tombstone whose extras the connection wants in
another layout (deletion V1 without IncludeDeleteTimes, DCP_EXPIRATION with the expiry opcode,
dcp-wire.md §7.4-7.5), NoValue (the body without its value, datatype 0) and stream-ids (the
framing extras go between the header and the body). A run on the fallback still frames each
item or record that has a fast-path entry as the fast path does (one rewritten tombstone does
not decode its whole disk run); a stored record without one is decoded and checked first
(`decode_record`), so a damaged record raises instead of being sent.

SyncWrite items (a PREPARE or ABORT, checkpoint/item.py `SyncItem`) have no fast-path entry, so a
run holding one takes the fallback: a replica stream (`sync_writes`) gets DCP_PREPARE / DCP_ABORT,
any other stream nothing — the item counts as framed with 0 bytes, so the stream moves past its
seqno and still reaches its snapshot's end. A commit (`CommitItem`) is the committed document,
framed as a mutation or deletion for every stream — and as DCP_COMMIT for a replica stream
only when this stream sent the prepare. A replica may be past a prepare's seqno without
holding it (a disk snapshot skips prepares, and a committed prepare's checkpoint may be freed
before the commit is persisted), so nothing else proves it holds one; a replica that does
hold it ends it on the document as on any later committed change of the key.

Not here: flow control and snapshot markers (encoder.py), what a stream sends (stream.py).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from changefeed.checkpoint.item import CommitItem, Item, SyncItem
from changefeed.protocol.dcp_items import (
    ABORT_EXTRAS,
    DELETION_V1_EXTRAS,
    DELETION_V2_EXTRAS,
    ENDING_PREFIX,
    EXPIRATION_EXTRAS,
    HEADER_FRONT,
    MUTATION_EXTRAS,
    PREPARE_EXTRAS,
    PREPARE_PREFIX,
    Abort,
    Commit,
    Prepare,
    deletion_v1_body,
    encode_abort,
    encode_commit,
    encode_item_body,
    encode_prepare,
    expiration_body,
)
from changefeed.protocol.frame import HEADER
from changefeed.protocol.opcode import DATATYPE_MASK, Magic, Opcode
from changefeed.storage import Op
from changefeed.storage.keys import COLLECTION_MARKER
from changefeed.storage.record import (
    EXTRAS_SIZE_BY_OP,
    OP_BY_TAG,
    STORED_BODY_OFFSET,
    STORED_CAS_OFFSET,
    STORED_HEAD,
    decode_record,
    stored_seqno,
)

# Plain ints and bound methods: an enum attribute lookup costs ~90 ns on 3.11, more than a third
# of a fast-path item.
_MAGIC_REQUEST: Final = int(Magic.REQUEST)
_OP_DCP_MUTATION: Final = int(Opcode.DCP_MUTATION)
_OP_DCP_DELETION: Final = int(Opcode.DCP_DELETION)
_OP_DCP_EXPIRATION: Final = int(Opcode.DCP_EXPIRATION)
_MUTATION: Final = Op.MUTATION
_EXPIRATION: Final = Op.EXPIRATION
_SYNC_OPS: Final = frozenset((Op.PREPARE, Op.ABORT))
_ABORT: Final = Op.ABORT
_OP_DCP_PREPARE: Final = int(Opcode.DCP_PREPARE)
_OP_DCP_COMMIT: Final = int(Opcode.DCP_COMMIT)
_OP_DCP_ABORT: Final = int(Opcode.DCP_ABORT)
_pack_prepare: Final = PREPARE_PREFIX.pack
_pack_ending: Final = ENDING_PREFIX.pack
_PREPARE_EXTRAS_SIZE: Final = PREPARE_EXTRAS.size
_ENDING_EXTRAS_SIZE: Final = ABORT_EXTRAS.size
_MUTATION_EXTRAS_SIZE: Final = MUTATION_EXTRAS.size  # a prepare's body: its document's layout
_TOMBSTONE_EXTRAS_SIZE: Final = DELETION_V2_EXTRAS.size
_KEY_LEN_MAX: Final = 0xFFFF  # the classic header's key length
assert EXTRAS_SIZE_BY_OP[Op.MUTATION] == _MUTATION_EXTRAS_SIZE
assert EXTRAS_SIZE_BY_OP[Op.DELETION] == _TOMBSTONE_EXTRAS_SIZE
_HEADER_SIZE: Final = HEADER.size
_FRONT_SIZE: Final = HEADER_FRONT.size
_pack_header: Final = HEADER.pack
# Added to a header's datatype by a key's first byte in `ItemFramer.plain_items` and
# `plain_stored`: 256 (out of the field's range: the pack fails) for the collection marker
# (storage/keys.py) only, 0 for every other byte.
_MARKED_BY_FIRST_BYTE: Final = tuple(256 if byte == COLLECTION_MARKER else 0 for byte in range(256))
# Where a stored record's key begins, by tag (0 for an unknown tag, which has no fast path).
_KEY_OFFSET_BY_TAG: Final = tuple(
    STORED_BODY_OFFSET + EXTRAS_SIZE_BY_OP[OP_BY_TAG[tag]] if tag in OP_BY_TAG else 0
    for tag in range(256)
)
_pack_front: Final = HEADER_FRONT.pack
_unpack_stored_head: Final = STORED_HEAD.unpack_from
assert STORED_CAS_OFFSET + _HEADER_SIZE - _FRONT_SIZE == STORED_BODY_OFFSET  # cas: 8 bytes

# An opcode and extras size per op, or None where the body must be rewritten (the fallback).
_Table = tuple[int | None, ...]


@dataclass(frozen=True, slots=True)
class ItemOptions:
    """Per-connection choices (DCP_OPEN flags and controls)."""

    delete_times: bool = False  # IncludeDeleteTimes: deletion V2 extras
    expiry_opcode: bool = False  # enable_expiry_opcode (only with delete_times)
    no_value: bool = False  # NoValue: strip values
    sync_writes: bool = False  # a replica stream: PREPARE and ABORT are sent


class ItemFramer:
    """Frames runs of items and stored records for one stream.

    Args:
        vb, opaque: the stream's vbucket and opaque (every frame's header).
        options: the connection's options.
        stream_id: the stream-id frame info to add, if stream-ids are on.
    """

    def __init__(
        self,
        vb: int,
        opaque: int,
        options: ItemOptions,
        stream_id: int | None = None,
    ) -> None:
        self.vb = vb
        self.opaque = opaque
        self.options = options
        self.stream_id = stream_id
        # key -> seqno of the prepare this stream sent and has not sent the end of yet.
        self._prepares_sent: dict[bytes, int] = {}
        # Fast-path tables indexed by op (items) and by stored tag (records); None if no fast path.
        self._opcode_by_op: _Table | None = None
        self._extras_by_op: _Table | None = None
        self._opcode_by_tag: _Table | None = None
        self._extras_by_tag: _Table | None = None
        if stream_id is None and not options.no_value:
            (
                self._opcode_by_op,
                self._extras_by_op,
                self._opcode_by_tag,
                self._extras_by_tag,
            ) = _fast_tables(options)

    def items(self, items: Sequence[Item], bytes_max: int) -> tuple[bytes, int, int]:
        """Frame items from the front of `items` until `bytes_max` bytes (at least one item).

        Returns:
            (the frames joined, items framed, bytes of the frames).
        """
        assert items, "a run holds at least one item"
        opcodes, extras = self._opcode_by_op, self._extras_by_op
        if self.options.sync_writes:
            if any(type(item) is CommitItem for item in items):
                opcodes = None  # a replica stream may frame commits as DCP_COMMIT
            elif self._prepares_sent:
                sent = self._prepares_sent
                for item in items:  # a later change of a key ends its prepare
                    sent.pop(item.key, None)
        if opcodes is not None and extras is not None:
            vb, opaque = self.vb, self.opaque
            try:
                heads = [
                    _pack_header(
                        _MAGIC_REQUEST,
                        opcodes[item.op],
                        len(item.key),
                        extras[item.op],
                        item.datatype,
                        vb,
                        len(item.body),
                        opaque,
                        item.cas,
                    )
                    for item in items
                ]
            except struct.error:  # an item whose body is rewritten (None in the tables)
                return self._items_one_by_one(items, bytes_max)
            return _joined(heads, [item.body for item in items], bytes_max)
        return self._items_one_by_one(items, bytes_max)

    # `plain_items` and `plain_stored` repeat the fast-path comprehensions of `items` and
    # `stored` with the marker lookup added, on purpose: folded into one comprehension taking
    # a marker table (all zeros for `items` / `stored`), the lookup costs every replica and
    # collections stream that needs no check. Measured (timeit, thread CPU, runs of 64
    # mutations, folded and copies alternating 9 rounds, load ~12): replica `items` 274 -> 300
    # ns per item (+9.6 %), replica `stored` 299 -> 326 (+9.1 %); the plain streams within
    # noise (284 -> 266, 328 -> 327).
    def plain_items(self, items: Sequence[Item], bytes_max: int) -> tuple[bytes, int, int] | None:
        """`items` for a stream that must not send a key as stored when it names a collection
        (a connection without collections: producer/collection_stream.py): None, and nothing
        framed, if a key of the run begins with the collection marker.

        The check rides on the fast path's one pass (the key's first byte makes the header's
        datatype out of range), so a run is not read twice: a pass of its own, before, was
        the first touch of every item (~11 % of a memory stream's node CPU, cache misses).

        Returns:
            (the frames joined, items framed, bytes of the frames) as `items`, or None if a
            key of the run begins with the collection marker.
        """
        assert items, "a run holds at least one item"
        assert not self.options.sync_writes, "a replica stream sends keys as stored"
        opcodes, extras = self._opcode_by_op, self._extras_by_op
        if opcodes is not None and extras is not None:
            vb, opaque = self.vb, self.opaque
            marked = _MARKED_BY_FIRST_BYTE
            try:
                heads = [
                    _pack_header(
                        _MAGIC_REQUEST,
                        opcodes[item.op],
                        len(item.key),
                        extras[item.op],
                        item.datatype | marked[item.key[0]],
                        vb,
                        len(item.body),
                        opaque,
                        item.cas,
                    )
                    for item in items
                ]
            except struct.error:  # a marked key, or an item whose body is rewritten
                heads = None
            if heads is not None:
                return _joined(heads, [item.body for item in items], bytes_max)
        if any(item.key[0] == COLLECTION_MARKER for item in items):
            return None
        return self._items_one_by_one(items, bytes_max)

    def stored(self, records: Sequence[bytes], bytes_max: int) -> tuple[bytes, int, int]:
        """Frame stored records (storage/record.py) like `items`, without decoding them.

        Returns:
            (the frames joined, records framed, bytes of the frames).
        """
        assert records, "a run holds at least one record"
        opcodes, extras = self._opcode_by_tag, self._extras_by_tag
        if opcodes is not None and extras is not None:
            vb, opaque = self.vb, self.opaque
            try:
                fronts = [
                    _pack_front(
                        _MAGIC_REQUEST,
                        opcodes[tag],
                        key_len,
                        extras[tag],
                        datatype,
                        vb,
                        len(record) - STORED_BODY_OFFSET,
                        opaque,
                    )
                    for record in records
                    for tag, datatype, key_len in (_unpack_stored_head(record),)
                ]
            except struct.error:  # a record whose body is rewritten, or an unknown tag
                return self._stored_one_by_one(records, bytes_max)
            # A header's last field is the CAS, which the stored prefix ends with (record.py).
            tails = [record[STORED_CAS_OFFSET:] for record in records]
            return _joined(fronts, tails, bytes_max)
        return self._stored_one_by_one(records, bytes_max)

    def plain_stored(
        self, records: Sequence[bytes], bytes_max: int
    ) -> tuple[bytes, int, int] | None:
        """`stored` on the fast path with `plain_items`' check of each key's first byte (at the
        key's offset for the record's tag) in the same pass; None, and nothing framed, when a
        key begins with the collection marker or a record needs another path: the caller then
        checks and frames the run as it would without this.

        Returns:
            (the frames joined, records framed, bytes of the frames) as `stored`, or None if a
            key begins with the collection marker or a record is not on the fast path (its body
            rewritten for this stream, an unknown tag, too short to hold its key's first byte).
        """
        assert records, "a run holds at least one record"
        opcodes, extras = self._opcode_by_tag, self._extras_by_tag
        if opcodes is None or extras is None:
            return None
        vb, opaque = self.vb, self.opaque
        marked, key_at = _MARKED_BY_FIRST_BYTE, _KEY_OFFSET_BY_TAG
        try:
            fronts = [
                _pack_front(
                    _MAGIC_REQUEST,
                    opcodes[tag],
                    key_len,
                    extras[tag],
                    datatype | marked[record[key_at[tag]]],
                    vb,
                    len(record) - STORED_BODY_OFFSET,
                    opaque,
                )
                for record in records
                for tag, datatype, key_len in (_unpack_stored_head(record),)
            ]
        except (struct.error, IndexError):  # marked, rewritten, unknown tag or too short
            return None
        tails = [record[STORED_CAS_OFFSET:] for record in records]
        return _joined(fronts, tails, bytes_max)

    def frame(self, op: Op, key_len: int, datatype: int, cas: int, body: bytes) -> list[bytes]:
        """The pieces of one item's frame (the fallback; `encode_item` joins them).

        Args:
            op, key_len, datatype, cas: the item's.
            body: its stored body: mutation extras or deletion V2 extras, then key and value.
        """
        options = self.options
        if options.no_value:
            body = body[: EXTRAS_SIZE_BY_OP[op] + key_len]
            datatype = 0
        if op is _MUTATION:
            opcode, extras_len = _OP_DCP_MUTATION, MUTATION_EXTRAS.size
        elif op is _EXPIRATION and options.expiry_opcode and options.delete_times:
            opcode, extras_len = _OP_DCP_EXPIRATION, EXPIRATION_EXTRAS.size
            body = expiration_body(body)
        elif options.delete_times:
            opcode, extras_len = _OP_DCP_DELETION, DELETION_V2_EXTRAS.size
        else:
            opcode, extras_len = _OP_DCP_DELETION, DELETION_V1_EXTRAS.size
            body = deletion_v1_body(body)
        pieces = encode_item_body(
            opcode,
            vbucket=self.vb,
            opaque=self.opaque,
            cas=cas,
            datatype=datatype,
            extras_len=extras_len,
            key_len=key_len,
            body=body,
            stream_id=self.stream_id,
        )
        return [bytes(piece) for piece in pieces]

    def _items_one_by_one(self, items: Sequence[Item], bytes_max: int) -> tuple[bytes, int, int]:
        parts: list[bytes] = []
        written = 0
        count = 0
        sync_writes = self.options.sync_writes
        opcodes, extras = self._opcode_by_op, self._extras_by_op
        for item in items:  # bounded by the run
            if item.op in _SYNC_OPS or (sync_writes and type(item) is CommitItem):
                pieces = self._sync_frame(item) if sync_writes else []
            else:
                if self._prepares_sent:
                    self._prepares_sent.pop(item.key, None)
                op = item.op
                if opcodes is not None and extras is not None and opcodes[op] is not None:
                    # The fast path's frame (items()): a replica run holding a commit comes
                    # here whole, and its plain items need no more than a header.
                    body = item.body
                    head = _pack_header(
                        _MAGIC_REQUEST, opcodes[op], len(item.key), extras[op], item.datatype,
                        self.vb, len(body), self.opaque, item.cas,
                    )  # fmt: skip
                    pieces = [head, body]
                else:
                    pieces = self.frame(op, len(item.key), item.datatype, item.cas, item.body)
            parts += pieces
            written += sum(map(len, pieces))
            count += 1
            if written >= bytes_max:
                break
        return b"".join(parts), count, written

    def _sync_frame(self, item: Item) -> list[bytes]:
        """A sync item's frame for a replica stream: header and extras in one `struct` pack
        (`PREPARE_PREFIX`, `ENDING_PREFIX`) in front of the item's own key and value, byte for
        byte what `encode_prepare` / `encode_commit` / `encode_abort` build (tested)."""
        if self.stream_id is not None:
            raise ValueError("stream-ids and sync writes do not combine (dcp-wire.md §8)")
        key = item.key
        key_len = len(key)
        if key_len > _KEY_LEN_MAX or item.datatype & ~DATATYPE_MASK:
            return self._sync_frame_encoded(item)  # the encoders raise, naming the field
        if type(item) is CommitItem:
            sent = self._prepares_sent.pop(key, None)
            if sent == item.prepared_seqno:  # both seqnos packed before: they fit
                head = _pack_ending(
                    _MAGIC_REQUEST, _OP_DCP_COMMIT, key_len, _ENDING_EXTRAS_SIZE, 0, self.vb,
                    _ENDING_EXTRAS_SIZE + key_len, self.opaque, 0, item.prepared_seqno,
                    item.seqno,
                )  # fmt: skip
                return [head, key]
            return self.frame(item.op, key_len, item.datatype, item.cas, item.body)
        assert isinstance(item, SyncItem), item
        if item.op is _ABORT:
            try:
                head = _pack_ending(
                    _MAGIC_REQUEST, _OP_DCP_ABORT, key_len, _ENDING_EXTRAS_SIZE, 0, self.vb,
                    _ENDING_EXTRAS_SIZE + key_len, self.opaque, 0, item.prepared_seqno,
                    item.seqno,
                )  # fmt: skip
            except struct.error:  # prepared_seqno out of range: the encoder says so
                return self._sync_frame_encoded(item)
            self._prepares_sent.pop(key, None)
            return [head, key]
        # The prepare's body is its document's: extras (31 or 21 bytes) | key | value; the
        # frame carries the prepare's extras (31 bytes) instead, then the same key and value.
        deleted = item.doc_op is not _MUTATION
        tail = item.body[_TOMBSTONE_EXTRAS_SIZE if deleted else _MUTATION_EXTRAS_SIZE :]
        try:
            head = _pack_prepare(
                _MAGIC_REQUEST, _OP_DCP_PREPARE, key_len, _PREPARE_EXTRAS_SIZE, item.datatype,
                self.vb, _PREPARE_EXTRAS_SIZE + len(tail), self.opaque, item.cas, item.seqno,
                item.rev_seqno, item.flags, item.delete_time if deleted else item.expiry, 0, 0,
                deleted, item.level,
            )  # fmt: skip
        except struct.error:
            return self._sync_frame_encoded(item)  # a field out of range: the encoder says which
        self._prepares_sent[key] = item.seqno
        return [head, tail]

    def _sync_frame_encoded(self, item: Item) -> list[bytes]:
        """`_sync_frame` through the message encoders (the reference; they raise ValueError
        on a field they cannot encode, which is our bug, not the peer's)."""
        if isinstance(item, CommitItem):
            sent = self._prepares_sent.pop(item.key, None)
            if sent == item.prepared_seqno:
                commit = Commit(self.vb, self.opaque, item.key, item.prepared_seqno, item.seqno)
                return [encode_commit(commit)]
            return self.frame(item.op, len(item.key), item.datatype, item.cas, item.body)
        assert isinstance(item, SyncItem), item
        if item.op is Op.ABORT:
            self._prepares_sent.pop(item.key, None)
            abort = Abort(self.vb, self.opaque, item.key, item.prepared_seqno, item.seqno)
            return [encode_abort(abort)]
        prepare = Prepare(
            self.vb, self.opaque, item.seqno, item.key, item.value, item.cas, item.rev_seqno,
            item.flags, item.expiry, item.deleted, item.level, item.datatype, item.delete_time,
        )  # fmt: skip
        self._prepares_sent[item.key] = item.seqno
        return [encode_prepare(prepare)]

    def _stored_one_by_one(
        self, records: Sequence[bytes], bytes_max: int
    ) -> tuple[bytes, int, int]:
        parts: list[bytes] = []
        written = 0
        count = 0
        opcodes, extras = self._opcode_by_tag, self._extras_by_tag
        vb, opaque = self.vb, self.opaque
        for data in records:  # bounded by the run
            pieces: list[bytes] | None = None
            if opcodes is not None and extras is not None:
                # A record `stored` frames on the fast path gets the same frame here: one
                # tombstone rewritten for this stream (deletion V1) must not send the 63 other
                # records of its run through `decode_record` (~10x the fast path's cost each).
                try:
                    tag, datatype, key_len = _unpack_stored_head(data)
                    pieces = [
                        _pack_front(
                            _MAGIC_REQUEST, opcodes[tag], key_len, extras[tag], datatype, vb,
                            len(data) - STORED_BODY_OFFSET, opaque,
                        ),
                        data[STORED_CAS_OFFSET:],
                    ]  # fmt: skip
                except struct.error:  # rewritten for this stream, an unknown tag, too short
                    pieces = None
            if pieces is None:
                # Decoded and checked: the fallback is also where a damaged record is caught.
                record = decode_record(vb, stored_seqno(data), data)
                pieces = self.frame(
                    record.op, len(record.key), record.datatype, record.cas, record.body
                )
            parts += pieces
            written += sum(map(len, pieces))
            count += 1
            if written >= bytes_max:
                break
        return b"".join(parts), count, written


def encode_item(
    item: Item, vb: int, opaque: int, options: ItemOptions, stream_id: int | None = None
) -> bytes:
    """One item's frame, on its own (tests and the per-item peer of bench/bench_stream.py)."""
    framer = ItemFramer(vb, opaque, options, stream_id)
    return b"".join(framer.frame(item.op, len(item.key), item.datatype, item.cas, item.body))


@functools.cache
def _fast_tables(options: ItemOptions) -> tuple[_Table, _Table, _Table, _Table]:
    """Opcode and extras size of each op, then of each stored tag, whose stored body is sent as
    is with `options` (None for the others)."""
    opcodes: dict[int, int] = {Op.MUTATION: _OP_DCP_MUTATION}
    extras: dict[int, int] = {Op.MUTATION: MUTATION_EXTRAS.size}
    if options.delete_times:  # the stored tombstone extras are deletion V2's (record.py)
        tombstones = (Op.DELETION,) if options.expiry_opcode else (Op.DELETION, Op.EXPIRATION)
        for op in tombstones:
            opcodes[op] = _OP_DCP_DELETION
            extras[op] = DELETION_V2_EXTRAS.size
    assert all(EXTRAS_SIZE_BY_OP[Op(op)] == size for op, size in extras.items()), extras
    ops = range(max(Op) + 1)
    tags = [OP_BY_TAG.get(tag, 0) for tag in range(256)]  # 0: no op (an unknown tag)
    return (
        tuple(opcodes.get(op) for op in ops),
        tuple(extras.get(op) for op in ops),
        tuple(opcodes.get(op) for op in tags),
        tuple(extras.get(op) for op in tags),
    )


def _joined(heads: list[bytes], tails: list[bytes], bytes_max: int) -> tuple[bytes, int, int]:
    """Frames head + tail from the front until `bytes_max` bytes (at least one), joined once."""
    count = len(heads)
    head_size = len(heads[0])  # the same for every frame of a run
    written = head_size * count + sum(map(len, tails))
    if written - head_size - len(tails[-1]) >= bytes_max:  # the budget ends before the last
        written = count = 0
        while written < bytes_max:  # bounded: the whole run holds more than bytes_max
            written += head_size + len(tails[count])
            count += 1
        del heads[count:], tails[count:]
    parts = heads + tails
    parts[::2] = heads
    parts[1::2] = tails
    return b"".join(parts), count, written
