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
    NOT_LOCKED = 0x0E  # UNLOCK of a document that is not locked (kv_engine 7.6)
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
    # A collections stream request's manifest uid is above the node's (it has not applied the
    # manifest yet): retry later (kv_engine collections_manifest_is_ahead).
    COLLECTIONS_MANIFEST_IS_AHEAD = 0x8B
    UNKNOWN_SCOPE = 0x8C
    DCP_STREAM_ID_INVALID = 0x8D
    DURABILITY_INVALID_LEVEL = 0xA0
    DURABILITY_IMPOSSIBLE = 0xA1
    SYNC_WRITE_IN_PROGRESS = 0xA2
    SYNC_WRITE_AMBIGUOUS = 0xA3
    # Sub-document statuses (kv_engine docs/SubDocument.md): per path in a multi-path
    # response, or the whole response's.
    SUBDOC_PATH_ENOENT = 0xC0
    SUBDOC_PATH_MISMATCH = 0xC1
    SUBDOC_PATH_EINVAL = 0xC2
    SUBDOC_PATH_E2BIG = 0xC3
    SUBDOC_DOC_E2DEEP = 0xC4
    SUBDOC_VALUE_CANTINSERT = 0xC5
    SUBDOC_DOC_NOTJSON = 0xC6
    SUBDOC_NUM_ERANGE = 0xC7
    SUBDOC_DELTA_EINVAL = 0xC8
    SUBDOC_PATH_EEXISTS = 0xC9
    SUBDOC_VALUE_ETOODEEP = 0xCA
    SUBDOC_INVALID_COMBO = 0xCB
    SUBDOC_MULTI_PATH_FAILURE = 0xCC
    SUBDOC_SUCCESS_DELETED = 0xCD
    SUBDOC_XATTR_INVALID_FLAG_COMBO = 0xCE
    SUBDOC_XATTR_INVALID_KEY_COMBO = 0xCF
    SUBDOC_XATTR_UNKNOWN_MACRO = 0xD0
    SUBDOC_XATTR_UNKNOWN_VATTR = 0xD1
    SUBDOC_XATTR_CANT_MODIFY_VATTR = 0xD2
    SUBDOC_MULTI_PATH_FAILURE_DELETED = 0xD3
    SUBDOC_INVALID_XATTR_ORDER = 0xD4

    @classmethod
    def name_of(cls, code: int) -> str:
        """Return the status name, or ``0x..`` for a code this module does not know."""
        try:
            return cls(code).name
        except ValueError:
            return f"0x{code:04x}"
