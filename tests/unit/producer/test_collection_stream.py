"""`CollectionEncoder` against a model: for random runs of documents in several collections and
system events, any budget and any split into calls, what a stream sends is exactly the model's —
the default collection's keys as stored for a client without collections; the wanted
collections' keys behind their LEB128 id, their events, and a SEQNO_ADVANCED after a trailing
run of skipped changes for a client with them — each change consumed once, from memory and from
disk alike."""

from __future__ import annotations

import struct

from hypothesis import example, given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import Item
from changefeed.producer.collection_stream import CollectionEncoder
from changefeed.producer.encoder import DcpEncoder
from changefeed.producer.item_encoding import ItemOptions
from changefeed.protocol.collections import (
    SYSTEM_COLLECTION,
    StreamFilter,
    SystemEvent,
    SystemEventMessage,
    decode_system_event,
    encode_leb128,
    encode_system_event_doc,
    system_event_key,
)
from changefeed.protocol.frame import decode_frame
from changefeed.protocol.opcode import Opcode
from changefeed.storage import Op
from changefeed.storage.keys import stored_key
from changefeed.storage.record import encode_record

VB, OPAQUE = 3, 77
SCOPES = {0: 0, 8: 8, 9: 8, 10: 11, 300: 11}  # collection -> scope (300: a 2-byte id)


class Manifest:
    def scope_of(self, collection_id: int) -> int | None:
        return SCOPES.get(collection_id)


def make_items(spec: list[tuple[int, int]]) -> list[Item]:
    """(collection or -1 for an event of collection 9, key number) -> items, seqnos 1.."""
    items = []
    for seqno, (cid, n) in enumerate(spec, start=1):
        if cid < 0:
            event = SystemEventMessage(0, 0, 0, SystemEvent.BEGIN_COLLECTION, 5, 8, 9, b"c9")
            key = stored_key(SYSTEM_COLLECTION, system_event_key(event.event, seqno))
            items.append(Item(seqno, key, Op.MUTATION, encode_system_event_doc(event), cas=seqno))
        elif n % 4 == 3:  # a tombstone: its key sits elsewhere in a stored record
            key = stored_key(cid, b"k%d" % n)
            items.append(Item(seqno, key, Op.DELETION, b"", cas=seqno))
        else:
            key = stored_key(cid, b"k%d" % n)
            items.append(Item(seqno, key, Op.MUTATION, b"v%d" % seqno, cas=seqno))
    return items


def model(
    items: list[Item], spec: list[tuple[int, int]], aware: bool, flt: StreamFilter
) -> list[tuple[str, int, bytes]]:
    out: list[tuple[str, int, bytes]] = []
    trailing: int | None = None
    for item, (cid, n) in zip(items, spec, strict=True):
        if cid < 0:
            wanted = aware and (
                flt.everything
                or (flt.collections is not None and 9 in flt.collections)
                or flt.scope == 8
            )
            if wanted:
                out.append(("event", item.seqno, b""))
                trailing = None
            else:
                trailing = item.seqno
            continue
        if not aware:
            wanted = cid == 0
        elif flt.collections is not None:
            wanted = cid in flt.collections
        elif flt.scope is not None:
            wanted = SCOPES[cid] == flt.scope
        else:
            wanted = True
        if wanted:
            key = (encode_leb128(cid) if aware else b"") + b"k%d" % n
            out.append(("change", item.seqno, key))
            trailing = None
        else:
            trailing = item.seqno
    return out, trailing  # type: ignore[return-value]


def sent(frames: bytes) -> list[tuple[str, int, bytes]]:
    out = []
    pos = 0
    while pos < len(frames):
        (bodylen,) = struct.unpack_from(">I", frames, pos + 8)
        frame = decode_frame(frames, pos, 24 + bodylen)
        pos += 24 + bodylen
        assert (frame.vbucket, frame.opaque) == (VB, OPAQUE)
        if frame.opcode in (Opcode.DCP_MUTATION, Opcode.DCP_DELETION):
            (seqno,) = struct.unpack_from(">Q", frame.extras)
            out.append(("change", seqno, frame.key))
        elif frame.opcode == Opcode.DCP_SYSTEM_EVENT:
            out.append(("event", decode_system_event(frame).seqno, b""))
        else:
            assert frame.opcode == Opcode.DCP_SEQNO_ADVANCED, frame
            out.append(("advanced", struct.unpack(">Q", frame.extras)[0], b""))
    return out


FILTERS = st.one_of(
    st.just(StreamFilter()),
    st.builds(
        StreamFilter, collections=st.frozensets(st.sampled_from([0, 8, 9, 10, 300]), min_size=1)
    ),
    st.builds(StreamFilter, scope=st.sampled_from([0, 8, 11])),
)


@settings(deadline=None, max_examples=150)
@example(  # the sparse path from disk: a wanted tombstone, gaps, a 2-byte id, a tiny budget
    spec=[(8, 3), (0, 1), (300, 7), (9, 2), (300, 1), (-1, 0), (10, 3), (0, 2)],
    aware=True,
    flt=StreamFilter(collections=frozenset({8, 300})),
    budget=1,
    from_disk=True,
)
@given(
    spec=st.lists(
        st.tuples(st.sampled_from([-1, 0, 0, 8, 9, 10, 300]), st.integers(0, 20)),
        min_size=1,
        max_size=40,
    ),
    aware=st.booleans(),
    flt=FILTERS,
    budget=st.integers(1, 400),
    from_disk=st.booleans(),
)
def test_what_a_stream_sends_is_the_models(
    spec: list[tuple[int, int]], aware: bool, flt: StreamFilter, budget: int, from_disk: bool
) -> None:
    if not aware:
        flt = StreamFilter()
    items = make_items(spec)
    inner = DcpEncoder(VB, OPAQUE, ItemOptions())
    encoder = CollectionEncoder(
        inner, aware=aware, stream_filter=flt, manifest=Manifest(), opaque=OPAQUE
    )
    records = [encode_record(i.op, i.seqno, i.key, i.value, cas=i.cas) for i in items]
    out: list[bytes] = []
    at = 0
    while at < len(items):  # bounded: every call consumes at least one
        before = sum(map(len, out))
        if from_disk:
            count, written = encoder.stored(out, records[at:], budget)
        else:
            count, written = encoder.items(out, items[at:], budget)
        assert written == sum(map(len, out)) - before  # what flow control counts
        assert 0 < count <= len(items) - at
        at += count
    frames = sent(b"".join(out))
    expected, trailing = model(items, spec, aware, flt)
    assert [f for f in frames if f[0] != "advanced"] == expected
    seqnos = [s for _, s, _ in frames]
    assert seqnos == sorted(seqnos)
    advanced = [s for kind, s, _ in frames if kind == "advanced"]
    if not aware:
        assert not advanced  # only collection clients know SEQNO_ADVANCED
    elif trailing is not None:
        assert frames[-1] == ("advanced", trailing, b"")  # the position reaches the end
