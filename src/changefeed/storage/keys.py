"""Byte layouts of the LMDB keys and index values (everything except the record itself).

Contract: the named databases are keyed so that LMDB's byte order is the order we scan in.

    by_seqno key   0 vb u16 | 2 seqno u64                       (10 bytes, big-endian)
                   -> the stored record (see record.py)
    by_key key     0 vb u16 | 2 key bytes                      (2 + len(key) bytes)
                   -> 0 seqno u64 | 8 op u8                    (9 bytes)
    prepared key   0 vb u16 | 2 key bytes                      (as by_key)
                   -> 0 durability level u8 | 1 the prepare stored as its document (record.py)
    vbmeta key     0 vb u16                                    (2 bytes) -> JSON (see vbmeta.py)
    meta key       ASCII name                                  -> small ASCII value

A stored document key names its collection (`stored_key`): a default-collection key is stored
as is, as before collections existed, so a bucket that never had one reads and streams
unchanged; any other is COLLECTION_MARKER | LEB128 collection id | key. 0xff never begins a
UTF-8 key; a default-collection key that does begin with it is stored with the marker and id 0,
so the mapping stays one-to-one for any bytes.

Big-endian integers make byte order equal numeric order, so one `set_range` on (vb, start)
starts a seqno-ordered scan of one vbucket.

Not here: encoding of the record or of vbucket metadata, and any LMDB access.
"""

from __future__ import annotations

import operator
import struct
from typing import Final, NoReturn

from changefeed.protocol.collections import decode_leb128, encode_leb128
from changefeed.protocol.errors import ProtocolError
from changefeed.storage.errors import CorruptRecordError

SEQNO_KEY: Final = struct.Struct(">HQ")  # vb, seqno
VB_KEY: Final = struct.Struct(">H")  # vb
BY_KEY_VALUE: Final = struct.Struct(">QB")  # seqno, op of the key's newest version

assert SEQNO_KEY.size == 10
assert VB_KEY.size == 2
assert BY_KEY_VALUE.size == 9

COLLECTION_MARKER: Final = 0xFF
_MARKER_BYTE: Final = b"\xff"

# Keys of the `meta` database.
META_SHUTDOWN: Final = b"shutdown"
META_CLEAN: Final = b"clean"
META_UNCLEAN: Final = b"unclean"


def seqno_key(vb: int, seqno: int) -> bytes:
    """The by_seqno key of (vb, seqno)."""
    return SEQNO_KEY.pack(vb, seqno)


def by_key_key(vb: int, key: bytes) -> bytes:
    """The by_key key of (vb, key)."""
    return VB_KEY.pack(vb) + key


def decode_by_key_value(vb: int, data: bytes | memoryview) -> tuple[int, int]:
    """Decode a by_key value into (seqno, op).

    Raises:
        CorruptRecordError: the value is not 9 bytes.
    """
    if len(data) != BY_KEY_VALUE.size:
        raise CorruptRecordError(vb, None, f"by_key value has {len(data)} bytes, expected 9")
    seqno, op = BY_KEY_VALUE.unpack(data)
    return int(seqno), int(op)


def stored_key(collection_id: int, key: bytes) -> bytes:
    """The stored form of `key` in collection `collection_id` (module docstring)."""
    if collection_id == 0 and key[:1] != _MARKER_BYTE:
        return key
    return _MARKER_BYTE + encode_leb128(collection_id) + key


def split_stored_key(stored: bytes, vb: int = -1) -> tuple[int, bytes]:
    """(collection id, key) of a stored key; the inverse of `stored_key`.

    Raises:
        CorruptRecordError: a marked key whose collection id prefix is malformed.
    """
    if stored[:1] != _MARKER_BYTE:
        return 0, stored
    try:
        cid, used = decode_leb128(memoryview(stored)[1:])
    except ProtocolError as error:
        raise CorruptRecordError(vb, None, f"stored key {stored[:16].hex()}: {error}") from None
    return cid, stored[1 + used :]


def collection_of(stored: bytes) -> int:
    """The collection id of a stored key (0 unless it is marked)."""
    if stored[:1] != _MARKER_BYTE:
        return 0
    return split_stored_key(stored)[0]


def collection_key_ranges(collection_id: int) -> tuple[tuple[bytes, bytes | None], ...]:
    """The stored-key ranges ``[first, end)`` (end None: to the last key) that hold exactly
    the keys of `collection_id`, in byte order: a named collection's keys share the prefix
    marker | LEB128 id, which is self-delimiting, so they are contiguous; the default
    collection's are every unmarked key plus the escaped ones (marker | 0x00). The by_key
    index is ordered so, which lets one collection be read without the others."""
    if collection_id == 0:
        return (b"", _MARKER_BYTE), (_MARKER_BYTE + b"\x00", _MARKER_BYTE + b"\x01")
    prefix = _MARKER_BYTE + encode_leb128(collection_id)
    assert prefix[-1] < 0x80, prefix  # the stop byte: one more is the next prefix, no carry
    return ((prefix, prefix[:-1] + bytes((prefix[-1] + 1,))),)


_first: Final = operator.itemgetter(0)
_second: Final = operator.itemgetter(1)
_vb_part: Final = operator.itemgetter(slice(0, VB_KEY.size))  # of a by_key key
_seqno_part: Final = operator.itemgetter(slice(0, 8))  # of a by_key value
assert BY_KEY_VALUE.format == ">QB", BY_KEY_VALUE.format  # seqno u64, then op u8
assert SEQNO_KEY.format == ">" + VB_KEY.format[1:] + "Q", (SEQNO_KEY.format, VB_KEY.format)


def seqno_keys_of_entries(
    entries: list[tuple[bytes, bytes]],
) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """The by_key keys and values of `entries` ((by_key key, value) pairs) and the by_seqno
    key each points at, cut from the bytes in C-level passes, not decoded and packed again:
    both are big-endian, so `SEQNO_KEY.pack(vb, seqno) == by_key_key[:2] + value[:8]`.

    Only the entries before the first malformed one (a value not 9 bytes) are returned: a
    caller names the first bad entry in order, one of those, else `refuse_malformed` of
    `entries[len(keys)]`.
    """
    keys = list(map(_first, entries))
    values = list(map(_second, entries))
    if values and set(map(len, values)) != {BY_KEY_VALUE.size}:
        good = next(n for n, value in enumerate(values) if len(value) != BY_KEY_VALUE.size)
        del keys[good:], values[good:]
    return keys, values, list(map(operator.add, map(_vb_part, keys), map(_seqno_part, values)))


def refuse_malformed(entry: tuple[bytes, bytes]) -> NoReturn:
    """Raise CorruptRecordError naming the vbucket of `entry`, whose value is not 9 bytes."""
    key, value = entry
    decode_by_key_value(VB_KEY.unpack_from(key)[0], value)
    raise AssertionError(f"a well-formed by_key value {value!r}")  # decode_by_key_value raised
