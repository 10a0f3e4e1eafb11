"""What one application stream carries of the collections: a `StreamEncoder` around the
stream's `DcpEncoder` that filters, re-keys and turns system documents into system events.

Rules (kv_engine's, dcp-wire.md §6.1, §7.3, §7.12, §7.13):
- A connection that did not negotiate HELLO Collections gets the default collection only, its
  keys as stored (no prefix), and no system events: exactly what it got before collections.
- A collections connection gets every key with its LEB128 collection id in front (0x00 for
  the default collection), the system events of the collections (and scopes) it streams, and,
  when the changes at the end of what it was sent were all filtered out, a DCP_SEQNO_ADVANCED
  to the last of them, so its position still moves (a snapshot it cannot see the end of is
  completed).
- A stream-request filter (`StreamFilter`) narrows a collections stream to a set of collection
  ids or to one scope. A scope filter follows the collections of the scope as they come (the
  manifest's `scope_of`).

Replica streams are not wrapped: they carry everything as stored.

The default-collection fast path: a run with no marked key (storage/keys.py) on a connection
without collections goes to the inner encoder untouched, so a bucket without named collections
streams exactly as before, and the check costs no Python call per change (`_any_marked`); from
memory and disk, DCP frames check each key's first byte in the framing's own pass
(`plain_items`, `plain_stored`).

The sparse path, for a filter naming collections (not the default one): the changes the
stream wants — keys starting with one of the wanted collections' stored prefixes, or the system
collection's — are found by C loops over the run (`bytes.startswith` with the prefixes, at the
key's offset in a stored record), and only those are looked at in Python; a skipped change
costs a few C-level comparisons, so the node's cost follows what it sends (issue 28's goal).
Other runs are taken item by item; consecutive kept items still go to the inner encoder
together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import attrgetter, itemgetter, ne
from typing import Final, Protocol, TypeVar

from changefeed.checkpoint import Item, SnapshotStart
from changefeed.producer.encoder import DcpEncoder, StreamEncoder
from changefeed.protocol.collections import (
    SYSTEM_COLLECTION,
    StreamFilter,
    SystemEvent,
    decode_system_event_doc,
    encode_leb128,
    encode_system_event,
)
from changefeed.protocol.dcp import StreamEndReason
from changefeed.protocol.dcp_items import SeqnoAdvanced, encode_seqno_advanced
from changefeed.storage.keys import COLLECTION_MARKER, collection_key_ranges, split_stored_key
from changefeed.storage.record import decode_record, stored_seqno

_MARKER: Final = COLLECTION_MARKER
_MARKER_BYTE: Final = bytes((COLLECTION_MARKER,))
T = TypeVar("T")
_TAG_MUTATION: Final = 0x11  # storage/record.py: a mutation's tag; others are tombstones
_KEY_OFFSET_MUTATION: Final = 12 + 31  # stored prefix + mutation extras
_KEY_OFFSET_TOMBSTONE: Final = 12 + 21
_AT_MUTATION_KEY: Final = itemgetter(_KEY_OFFSET_MUTATION)
_AT_TOMBSTONE_KEY: Final = itemgetter(_KEY_OFFSET_TOMBSTONE)
_KEY: Final = attrgetter("key")
_FIRST_BYTE: Final = itemgetter(0)  # keys are never empty (limits.py)


class CollectionView(Protocol):
    """What a stream needs of the manifest (server/manifest.py `ManifestStore`)."""

    def scope_of(self, collection_id: int) -> int | None:
        """The scope a collection is (or was) in; None if never seen."""
        ...


class VbEncoder(StreamEncoder, Protocol):
    """A stream's encoder that knows its vbucket (`DcpEncoder`, the shm publisher's rows)."""

    vb: int


class CollectionEncoder:
    """The `StreamEncoder` of an application stream (module docstring).

    Args:
        inner: the stream's encoder (DCP frames, or the shm publisher's rows).
        aware: the connection negotiated HELLO Collections (then `inner` sends DCP frames).
        stream_filter: what the stream asked for (only for `aware` connections).
        manifest: resolves a scope filter.
        opaque, stream_id: the stream's, for the system events and SEQNO_ADVANCED it adds.
    """

    def __init__(
        self,
        inner: VbEncoder,
        *,
        aware: bool,
        stream_filter: StreamFilter,
        manifest: CollectionView | None,
        opaque: int = 0,
        stream_id: int | None = None,
    ) -> None:
        assert aware or stream_filter.everything, stream_filter
        self.inner = inner
        self.opaque = opaque
        self.stream_id = stream_id
        self.aware = aware
        self.filter = stream_filter
        self.manifest = manifest
        self.event_bytes_min = inner.event_bytes_min
        self.skipped = 0  # changes not sent (filtered out), for stats and tests
        # A plain connection's DCP frames check the keys while framing (`plain_items`).
        self._plain = inner if not aware and isinstance(inner, DcpEncoder) else None
        # The sparse path's stored-key prefixes: the wanted collections' and the system one's
        # (None: the filter is not a set of named collections).
        wanted = stream_filter.collections
        self._prefixes: tuple[bytes, ...] | None = None
        if aware and wanted is not None and 0 not in wanted:
            self._prefixes = tuple(
                _MARKER_BYTE + encode_leb128(cid) for cid in sorted({*wanted, SYSTEM_COLLECTION})
            )

    # -- what is wanted ---------------------------------------------------------------------

    def _wants(self, cid: int) -> bool:
        if not self.aware:
            return cid == 0
        flt = self.filter
        if flt.collections is not None:
            return cid in flt.collections
        if flt.scope is not None:
            return self.manifest is not None and self.manifest.scope_of(cid) == flt.scope
        return True

    def _wants_event(self, event: SystemEvent, scope_id: int, cid: int | None) -> bool:
        flt = self.filter
        if flt.collections is not None:
            return cid is not None and cid in flt.collections
        if flt.scope is not None:
            return scope_id == flt.scope
        return True

    # -- StreamEncoder -----------------------------------------------------------------------

    def snapshot_marker(self, out: list[bytes], marker: SnapshotStart, purge_seqno: int) -> int:
        return self.inner.snapshot_marker(out, marker, purge_seqno)

    def stream_end(self, out: list[bytes], reason: StreamEndReason) -> int:
        return self.inner.stream_end(out, reason)

    def items(self, out: list[bytes], items: Sequence[Item], bytes_max: int) -> tuple[int, int]:
        if not self.aware:
            plain = self._plain
            if plain is not None:  # DCP frames: the check rides on the framing's pass
                sent = plain.plain_items(out, items, bytes_max)
                if sent is not None:
                    return sent
            elif _MARKER not in map(_FIRST_BYTE, map(_KEY, items)):
                return self.inner.items(out, items, bytes_max)
        vb = self.inner.vb
        aware = self.aware

        def keep(index: int, cid: int) -> Item:
            item = items[index]
            key = _wire_key(item.key, cid, aware)
            return item if key is item.key else _rekeyed(item, key)

        if self._prefixes is not None:
            picked = list(
                compress(
                    range(len(items)),
                    map(bytes.startswith, map(_KEY, items), repeat(self._prefixes)),
                )
            )
            return self._filtered(
                out,
                [_collection_of_key(items[i].key, vb) for i in picked],
                keep,
                self.inner.items,
                items.__getitem__,
                lambda i: items[i].seqno,
                bytes_max,
                picked=picked,
                length=len(items),
            )
        return self._filtered(
            out,
            [_collection_of_key(item.key, vb) for item in items],
            keep,
            self.inner.items,
            items.__getitem__,
            lambda i: items[i].seqno,
            bytes_max,
        )

    def stored(self, out: list[bytes], records: Sequence[bytes], bytes_max: int) -> tuple[int, int]:
        if not self.aware:
            plain = self._plain
            if plain is not None:  # DCP frames: the check rides on the framing's pass
                sent = plain.plain_stored(out, records, bytes_max)
                if sent is not None:
                    return sent
            # DCP frames: a record `plain_stored` does not take; the shm rows (no `_plain`):
            # the only check of the run's keys.
            if not _any_marked(records):
                return self.inner.stored(out, records, bytes_max)
        vb = self.inner.vb
        aware = self.aware

        def keep(index: int, cid: int) -> bytes:  # the stored record under its wire key
            return _restored(records[index], cid, aware)

        def event_item(index: int) -> Item:  # decoded (and checked): a system event
            record = records[index]
            return Item.from_record(decode_record(vb, stored_seqno(record), record))

        if self._prefixes is not None:
            picked = _picked_records(records, self._prefixes)
            return self._filtered(
                out,
                [_collection_of_stored(records[i], vb) for i in picked],
                keep,
                self.inner.stored,
                event_item,
                lambda i: stored_seqno(records[i]),
                bytes_max,
                picked=picked,
                length=len(records),
            )
        return self._filtered(
            out,
            [_collection_of_stored(record, vb) for record in records],
            keep,
            self.inner.stored,
            event_item,
            lambda i: stored_seqno(records[i]),
            bytes_max,
        )

    # -- inside ------------------------------------------------------------------------------

    def _filtered(
        self,
        out: list[bytes],
        cids: list[int],
        keep: Callable[[int, int], T],
        send: Callable[[list[bytes], list[T], int], tuple[int, int]],
        event_item: Callable[[int], Item],
        seqno_of: Callable[[int], int],
        bytes_max: int,
        *,
        picked: list[int] | None = None,
        length: int = 0,
    ) -> tuple[int, int]:
        """Send what is wanted of a run whose changes are in collections `cids`, within
        `bytes_max` (at least one change consumed). A change is re-keyed (`keep`) only when it
        is sent, and sent in runs (`send`: the inner encoder); a skipped one costs its
        collection id and, last in the run, its seqno.

        `picked` (the sparse path): the run has `length` changes, of which only those at the
        ascending indexes `picked` may be wanted (`cids` are theirs); the others are skipped
        a gap at a time, without looking at them.

        Returns:
            (changes consumed, bytes appended).
        """
        inner = self.inner
        written = 0
        consumed = 0
        kept: list[T] = []  # wanted changes not yet handed to the inner encoder
        kept_at: list[int] = []  # their indexes in the run
        last_skipped: int | None = None  # index of a trailing run of skipped changes

        def flush() -> bool:
            """Hand `kept` over; False when the budget ended part-way."""
            nonlocal written, consumed
            if not kept:
                return True
            count, nbytes = send(out, kept, max(1, bytes_max - written))
            written += nbytes
            consumed = kept_at[count - 1] + 1
            done = count == len(kept)
            kept.clear()
            kept_at.clear()
            return done

        wants = self._wants
        aware = self.aware
        indexes = picked if picked is not None else range(len(cids))
        gap_from = 0  # sparse: the first index not yet looked at
        for index, cid in zip(indexes, cids, strict=True):  # bounded by the run
            if index > gap_from:  # sparse: changes gap_from..index-1 are all skipped
                if kept and not flush():
                    return consumed, written
                last_skipped = index - 1
                self.skipped += index - gap_from
                consumed = index
                if written >= bytes_max:
                    break
            gap_from = index + 1
            if cid == SYSTEM_COLLECTION:
                if not flush():
                    return consumed, written
                frame = self._event_frame(event_item(index)) if aware else None
                if frame is None:
                    last_skipped = index
                    self.skipped += 1
                else:
                    out.append(frame)
                    written += len(frame)
                    last_skipped = None
                consumed = index + 1
            elif wants(cid):
                kept.append(keep(index, cid))
                kept_at.append(index)
                last_skipped = None
            else:
                if kept and not flush():
                    return consumed, written
                last_skipped = index
                self.skipped += 1
                consumed = index + 1
            if written >= bytes_max:
                break
        else:
            if picked is not None and length > gap_from:  # sparse: a trailing gap
                if kept and not flush():
                    return consumed, written
                last_skipped = length - 1
                self.skipped += length - gap_from
                consumed = length
        if not flush():
            return consumed, written
        if last_skipped is not None and aware:
            frame = encode_seqno_advanced(
                SeqnoAdvanced(inner.vb, self.opaque, seqno_of(last_skipped), self.stream_id)
            )
            out.append(frame)
            written += len(frame)
        assert consumed > 0, consumed
        return consumed, written

    def _event_frame(self, item: Item) -> bytes | None:
        if item.deleted:
            return None
        inner = self.inner
        message = decode_system_event_doc(
            item.value, vbucket=inner.vb, opaque=self.opaque, seqno=item.seqno
        )
        if not self._wants_event(message.event, message.scope_id, message.collection_id):
            return None
        return encode_system_event(message, stream_id=self.stream_id)


def _collection_of_stored(record: bytes, vb: int) -> int:
    """The collection id of a stored record's key, read in place (no record decoded); an id
    below 128 is one byte after the marker (the common case, read without a decoder)."""
    offset = _KEY_OFFSET_MUTATION if record[0] == _TAG_MUTATION else _KEY_OFFSET_TOMBSTONE
    if len(record) <= offset + 1 or record[offset] != _MARKER:
        return 0
    first = record[offset + 1]
    if first < 0x80:
        return first
    return split_stored_key(record[offset : offset + 6], vb)[0]


def _wire_key(stored: bytes, cid: int, aware: bool) -> bytes:
    """The key a client sees for a stored key of collection `cid` (storage/keys.py): with
    collections its LEB128 id in front (the stored form minus the marker), else the bare key
    (only the default collection's reach such a client). `stored` itself when unchanged."""
    marked = stored[:1] == _MARKER_BYTE
    if aware:
        if cid:
            return stored[1:]
        return b"\x00" + (stored[2:] if marked else stored)
    return stored[2:] if marked else stored


def _restored(record: bytes, cid: int, aware: bool) -> bytes:
    """A stored record (record.py) whose key is the wire key, its body otherwise the same."""
    offset = _KEY_OFFSET_MUTATION if record[0] == _TAG_MUTATION else _KEY_OFFSET_TOMBSTONE
    key_len = int.from_bytes(record[2:4], "big")
    stored = record[offset : offset + key_len]
    key = _wire_key(stored, cid, aware)
    if key is stored:
        return record
    return b"".join(
        (record[:2], len(key).to_bytes(2, "big"), record[4:offset], key, record[offset + key_len :])
    )


def backfill_key_ranges(stream_filter: StreamFilter) -> list[tuple[bytes, bytes | None]] | None:
    """The stored-key ranges a collections stream's backfill needs to read (storage
    keyed_scan.py): the wanted collections' and the system collection's (its events), when the
    filter names collections other than the default one (whose keys are not one range:
    storage/keys.py); None otherwise (read everything)."""
    wanted = stream_filter.collections
    if wanted is None or 0 in wanted:
        return None
    return [
        span for cid in sorted({*wanted, SYSTEM_COLLECTION}) for span in collection_key_ranges(cid)
    ]


def _picked_records(records: Sequence[bytes], prefixes: tuple[bytes, ...]) -> list[int]:
    """Indexes of the stored records whose key starts with one of `prefixes`: C loops over the
    run (a mutation's key at its offset for every record, then the few tombstones again at
    theirs), no Python step per record."""
    hits = list(map(bytes.startswith, records, repeat(prefixes), repeat(_KEY_OFFSET_MUTATION)))
    tombstones = map(ne, map(_FIRST_BYTE, records), repeat(_TAG_MUTATION))
    for index in compress(range(len(records)), tombstones):
        hits[index] = records[index].startswith(prefixes, _KEY_OFFSET_TOMBSTONE)
    return list(compress(range(len(records)), hits))


def _collection_of_key(key: bytes, vb: int) -> int:
    """`_collection_of_stored` for a key."""
    if key[0] != _MARKER:
        return 0
    first = key[1]
    if first < 0x80:
        return first
    return split_stored_key(key, vb)[0]


def _any_marked(records: Sequence[bytes]) -> bool:
    """Whether any stored record's key names a collection, without a Python call per record
    (a stream from disk pays this on every run): the marker is looked for at both key offsets
    of every record in C loops, and only a hit (or a record too short for one offset) is
    checked record by record. A hit at the offset of the other tag's key (a mutation's
    expiration byte 1, a tombstone's key byte 10) is such a false alarm."""
    try:
        if _MARKER not in map(_AT_MUTATION_KEY, records) and _MARKER not in map(
            _AT_TOMBSTONE_KEY, records
        ):
            return False
    except IndexError:
        pass
    return any(map(_marked, records))


def _marked(record: bytes) -> bool:
    """True if a stored record's key names a collection (storage/keys.py), without decoding."""
    offset = _KEY_OFFSET_MUTATION if record[0] == _TAG_MUTATION else _KEY_OFFSET_TOMBSTONE
    return len(record) > offset and record[offset] == _MARKER


def _rekeyed(item: Item, key: bytes) -> Item:
    """`item` under another key: its body's extras and value around the new key (nothing
    encoded again)."""
    extras = item.extras_size
    body = item.body
    return Item.of_body(
        item.seqno,
        key,
        item.op,
        b"".join((body[:extras], key, body[extras + len(item.key) :])),
        item.cas,
        item.flags,
        item.expiry,
        item.datatype,
        item.rev_seqno,
        item.delete_time,
    )
