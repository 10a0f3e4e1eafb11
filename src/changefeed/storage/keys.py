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

Big-endian integers make byte order equal numeric order, so one `set_range` on (vb, start)
starts a seqno-ordered scan of one vbucket.

Not here: encoding of the record or of vbucket metadata, and any LMDB access.
"""

from __future__ import annotations

import struct
from typing import Final

from changefeed.storage.errors import CorruptRecordError

SEQNO_KEY: Final = struct.Struct(">HQ")  # vb, seqno
VB_KEY: Final = struct.Struct(">H")  # vb
BY_KEY_VALUE: Final = struct.Struct(">QB")  # seqno, op of the key's newest version

assert SEQNO_KEY.size == 10
assert VB_KEY.size == 2
assert BY_KEY_VALUE.size == 9

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
