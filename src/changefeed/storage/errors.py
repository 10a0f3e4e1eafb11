"""Errors raised by the durable store.

Contract: every failure of the storage engine reaches callers as a `StorageError` (or a subclass);
no `lmdb.Error` and no `struct.error` escapes `changefeed.storage`. An error that a setting can
cure names that setting (py-lmdb's habit: `MapFullError` names `map_size`).

Not here: caller misuse (a seqno that does not increase, an unknown vbucket, a batch used after
its block ended) is a bug in the caller and raises `ValueError` or `RuntimeError`, never a
`StorageError`, so that callers do not retry their own bugs.
"""

from __future__ import annotations


class StorageError(Exception):
    """The storage engine failed; the last batch was not committed.

    Attributes:
        retriable: True when retrying the same call later may succeed without any change.
    """

    retriable = False


class StorageFullError(StorageError):
    """The LMDB map is full; the batch that hit the limit was aborted, nothing was written.

    The store keeps serving reads. Reopen it with a larger `map_size_bytes` (the Store argument,
    default `limits.STORAGE_MAP_SIZE_BYTES_DEFAULT`), or compact to reuse freed pages.
    """

    def __init__(self, map_size_bytes: int) -> None:
        super().__init__(
            f"storage is full at map_size_bytes={map_size_bytes}: raise Store(map_size_bytes=...) "
            "(default limits.STORAGE_MAP_SIZE_BYTES_DEFAULT) or compact"
        )
        self.map_size_bytes = map_size_bytes


class CorruptRecordError(StorageError):
    """Stored bytes do not have the layout this version writes.

    Attributes:
        vb: the vbucket whose data is corrupt.
        seqno: the seqno of the corrupt record, or None when the corrupt bytes are an index entry
            or vbucket metadata rather than a record.
        reason: what check failed, for the log.
    """

    def __init__(self, vb: int, seqno: int | None, reason: str) -> None:
        where = f"vb {vb}" if seqno is None else f"vb {vb} seqno {seqno}"
        super().__init__(f"corrupt stored data at {where}: {reason}")
        self.vb = vb
        self.seqno = seqno
        self.reason = reason
