"""Durable store: every vbucket's records by seqno and by key, and its metadata, in LMDB.

Contract: see store.py (the `Store`), record.py (the `Record` and its bytes), errors.py. This
layer sits below checkpoint/ and imports only changefeed.limits; it allocates no seqnos and
interprets neither vbucket states nor failover logs.
"""

from changefeed.storage.batch import WriteBatch
from changefeed.storage.errors import CorruptRecordError, StorageError, StorageFullError
from changefeed.storage.record import Op, Record
from changefeed.storage.store import Store
from changefeed.storage.vbmeta import VB_STATES, VBucketMeta

__all__ = [
    "VB_STATES",
    "CorruptRecordError",
    "Op",
    "Record",
    "StorageError",
    "StorageFullError",
    "Store",
    "VBucketMeta",
    "WriteBatch",
]
