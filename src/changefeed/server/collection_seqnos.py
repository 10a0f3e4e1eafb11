"""GET_ALL_VB_SEQNOS of one collection: each vbucket's high seqno *of that collection*.

Wire (dcp-wire.md §7.16, kv_engine): extras of 8 bytes, a u32 vbucket-state filter (0: every
vbucket holding a copy) then a u32 collection id, only on a connection that negotiated HELLO
Collections (else EINVAL). The answer is the usual list of (vb u16, seqno u64), sorted by vb,
where the seqno is the newest change of that collection in that vbucket — a document, a
tombstone, or the collection's creation event (kv_engine starts a collection's high seqno at
its BeginCollection) — and 0 when the vbucket has none. A collection the manifest does not
hold is UNKNOWN_COLLECTION with the manifest uid, as every collections command answers.

How it is found, without a counter on the write path: the newest of (1) the by_key index over
the collection's key ranges (storage/keys.py `collection_key_ranges`: one collection's keys are
contiguous), (2) the items still in the vbucket's checkpoints (everything not yet persisted is
there), (3) its creation event document. Both reads are synchronous on the event loop, so no
item can move from memory to disk between them unseen. Cost: the collection's stored keys in
each vbucket plus the items in memory — a query for monitoring and stream planning, not for
every request. A tombstone compaction purged is no longer seen, so after a purge the answer
may be lower than kv_engine's (which keeps a persisted counter); it never exceeds the
vbucket's high seqno.
"""

from __future__ import annotations

import struct
from typing import Final

from changefeed.protocol.collections import SYSTEM_COLLECTION, SystemEvent, system_event_key
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import decode_vb_state_filter, encode_vb_seqnos
from changefeed.protocol.opcode import Feature
from changefeed.server.bucket import Bucket
from changefeed.server.collection_commands import UnknownCollectionAnswer
from changefeed.server.requester import Requester
from changefeed.storage.keys import collection_key_ranges, collection_of, stored_key
from changefeed.vbucket_state import STATE_BY_WIRE_VALUE

COLLECTION_EXTRAS: Final = struct.Struct(">II")  # vbucket-state filter, collection id
assert COLLECTION_EXTRAS.size == 8


def all_vb_seqnos_of_collection(c: Requester, f: Frame) -> None:
    """GET_ALL_VB_SEQNOS with 8 bytes of extras (module docstring).

    Raises:
        ProtocolError(EINVAL): not a collections connection, or a bad state filter.
        UnknownCollectionAnswer: a collection the manifest does not hold.
    """
    c.require_bucket()
    assert len(f.extras) == COLLECTION_EXTRAS.size, len(f.extras)
    if Feature.COLLECTIONS not in c.features:
        raise ProtocolError("GET_ALL_VB_SEQNOS with a collection id needs HELLO Collections")
    state = decode_vb_state_filter(f)
    cid = int(COLLECTION_EXTRAS.unpack(f.extras)[1])
    manifests = c.context.manifests
    if cid not in manifests.collection_ids():
        raise UnknownCollectionAnswer(manifests.uid)
    c.reply(f, value=encode_vb_seqnos(collection_high_seqnos(c.context.bucket, state, cid)))


def collection_high_seqnos(bucket: Bucket, state_filter: int, cid: int) -> list[tuple[int, int]]:
    """(vb, high seqno of collection `cid`) of every vbucket the filter selects, by vb (the
    state filter as GET_ALL_VB_SEQNOS reads it: 0 every copy, 1..4 one state)."""
    wanted = STATE_BY_WIRE_VALUE.get(state_filter)
    event_key = stored_key(SYSTEM_COLLECTION, system_event_key(SystemEvent.BEGIN_COLLECTION, cid))
    ranges = collection_key_ranges(cid)
    out: list[tuple[int, int]] = []
    for vb, vbucket in sorted(bucket.vbuckets.items()):  # bounded by the bucket's vbuckets
        if not (vbucket.state is wanted if wanted else vbucket.state.holds_copy):
            continue
        high = 0
        for first, end in ranges:
            high = max(high, *bucket.store.key_range_seqnos(vb, first, end), 0)
        event = bucket.store.get(vb, event_key) if cid else None
        if event is not None:
            high = max(high, event.seqno)
        for checkpoint in vbucket.manager.checkpoints():  # bounded by memory's items
            for item in checkpoint.live_items():
                key = item.key
                if key == event_key or collection_of(key) == cid:
                    high = max(high, item.seqno)
        assert high <= vbucket.high_seqno, (vb, cid, high, vbucket.high_seqno)
        out.append((vb, high))
    return out
