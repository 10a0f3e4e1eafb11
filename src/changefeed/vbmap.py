"""Which vbucket a key belongs to.

Couchbase hashes a key with CRC32 and keeps 15 bits of the upper half; we do the same so that a
Couchbase-style client computes the same vbucket (ARCHITECTURE.md, vocabulary).
"""

from __future__ import annotations

import zlib


def vbucket_for_key(key: bytes, vbuckets: int) -> int:
    """Return the vbucket id of ``key`` in a bucket of ``vbuckets`` partitions.

    Args:
        key: the document key, as bytes.
        vbuckets: number of vbuckets in the bucket (>= 1).
    """
    assert vbuckets >= 1, vbuckets
    vb = ((zlib.crc32(key) >> 16) & 0x7FFF) % vbuckets
    assert 0 <= vb < vbuckets, (vb, vbuckets)
    return vb
