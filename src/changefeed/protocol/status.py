"""Response status codes of the memcached binary protocol (dcp-wire.md §1.5).

Only the names; what a client does about a status (retry, give up, roll back) lives in
``errors.py`` so that retry logic reads class attributes, not numbers.
"""

from __future__ import annotations

from enum import IntEnum


class Status(IntEnum):
    """A u16 status in a response header (the vbucket field of a request)."""

    SUCCESS = 0x00
    KEY_ENOENT = 0x01
    KEY_EEXISTS = 0x02
    E2BIG = 0x03
    EINVAL = 0x04
    NOT_STORED = 0x05
    DELTA_BADVAL = 0x06
    NOT_MY_VBUCKET = 0x07
    NO_BUCKET = 0x08
    LOCKED = 0x09
    DCP_STREAM_NOT_FOUND = 0x0A
    OPAQUE_NO_MATCH = 0x0B
    AUTH_STALE = 0x1F
    AUTH_ERROR = 0x20
    AUTH_CONTINUE = 0x21
    ERANGE = 0x22
    ROLLBACK = 0x23
    EACCESS = 0x24
    NOT_INITIALIZED = 0x25
    BUCKET_PAUSED = 0x50
    UNKNOWN_FRAME_INFO = 0x80
    UNKNOWN_COMMAND = 0x81
    ENOMEM = 0x82
    NOT_SUPPORTED = 0x83
    EINTERNAL = 0x84
    EBUSY = 0x85
    ETMPFAIL = 0x86
    XATTR_EINVAL = 0x87
    UNKNOWN_COLLECTION = 0x88
    UNKNOWN_SCOPE = 0x8C
    DCP_STREAM_ID_INVALID = 0x8D
    DURABILITY_INVALID_LEVEL = 0xA0
    DURABILITY_IMPOSSIBLE = 0xA1
    SYNC_WRITE_IN_PROGRESS = 0xA2
    SYNC_WRITE_AMBIGUOUS = 0xA3

    @classmethod
    def name_of(cls, code: int) -> str:
        """Return the status name, or ``0x..`` for a code this module does not know."""
        try:
            return cls(code).name
        except ValueError:
            return f"0x{code:04x}"
