"""`CollectionEncoder` for a stream that did not negotiate collections, from disk and from
memory, against a model: the default collection's changes (mutations and tombstones) with
their keys as the client wrote them, nothing of a named collection.

The records are built to trip the quick check of the default-collection fast path: 0xff where
the other tag's key would start (a mutation's expiry byte 1, a tombstone's key byte 10),
tombstones too short for the mutation key offset, and default-collection keys that start with
0xff (stored marked, with collection id 0), beside named-collection keys.
"""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import Item
from changefeed.producer.collection_stream import CollectionEncoder
from changefeed.producer.encoder import DcpEncoder
from changefeed.producer.item_encoding import ItemOptions
from changefeed.protocol.collections import StreamFilter
from changefeed.protocol.frame import decode_frame
from changefeed.protocol.opcode import Opcode
from changefeed.storage import Op
from changefeed.storage.keys import stored_key
from changefeed.storage.record import decode_record, encode_record

VB, OPAQUE = 5, 9
Change = tuple[bool, int, bytes, int]  # (deleted, collection, key as written, expiry)

changes = st.lists(
    st.tuples(
        st.booleans(),
        st.sampled_from([0, 0, 0, 8, 200]),
        st.one_of(
            st.binary(min_size=1, max_size=3),
            st.binary(min_size=11, max_size=14).map(lambda k: k[:10] + b"\xff" + k[11:]),
            st.binary(min_size=1, max_size=12).map(lambda k: b"\xff" + k),
        ),
        st.sampled_from([0, 0x00FF_0000, 0x7FFF_FFFF]),
    ),
    min_size=1,
    max_size=30,
)


def records_of(spec: list[Change]) -> list[bytes]:
    out = []
    for seqno, (deleted, cid, key, expiry) in enumerate(spec, start=1):
        op = Op.DELETION if deleted else Op.MUTATION
        value = b"" if deleted else b"v%d" % seqno
        out.append(
            encode_record(op, seqno, stored_key(cid, key), value, cas=seqno,
                          expiry=0 if deleted else expiry)
        )  # fmt: skip
    return out


def sent(frames: bytes) -> list[tuple[bool, int, bytes]]:
    out = []
    pos = 0
    while pos < len(frames):
        (bodylen,) = struct.unpack_from(">I", frames, pos + 8)
        frame = decode_frame(frames, pos, 24 + bodylen)
        pos += 24 + bodylen
        assert frame.opcode in (Opcode.DCP_MUTATION, Opcode.DCP_DELETION), frame
        (seqno,) = struct.unpack_from(">Q", frame.extras)
        out.append((frame.opcode == Opcode.DCP_DELETION, seqno, frame.key))
    return out


@settings(deadline=None, max_examples=200)
@given(spec=changes, budget=st.integers(1, 300), from_disk=st.booleans())
def test_a_plain_stream_gets_the_default_collection_as_written(
    spec: list[Change], budget: int, from_disk: bool
) -> None:
    records = records_of(spec)
    items = [Item.from_record(decode_record(VB, i, r)) for i, r in enumerate(records, start=1)]
    encoder = CollectionEncoder(
        DcpEncoder(VB, OPAQUE, ItemOptions()), aware=False, stream_filter=StreamFilter(),
        manifest=None, opaque=OPAQUE,
    )  # fmt: skip
    out: list[bytes] = []
    at = 0
    while at < len(records):  # bounded: every call consumes at least one
        if from_disk:
            count, _ = encoder.stored(out, records[at:], budget)
        else:
            count, _ = encoder.items(out, items[at:], budget)
        assert 0 < count <= len(records) - at
        at += count
    expected = [
        (deleted, seqno, key)
        for seqno, (deleted, cid, key, _) in enumerate(spec, start=1)
        if cid == 0
    ]
    assert sent(b"".join(out)) == expected
