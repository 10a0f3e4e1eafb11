"""A plain (non-collections) application stream checks its memory runs' keys for the collection
marker inside the framing's pass (`ItemFramer.plain_items`, through `CollectionEncoder.items`):
the same bytes, counts and bytes counted, call by call, as the check-before path that an inner
encoder without `plain_items` gets (the shm publisher's rows; here the same `DcpEncoder`
behind a wrapper).

Runs hold default-collection keys, named-collection keys (marked, storage/keys.py) and
default-collection keys that begin with 0xff (stored marked with id 0, sent as written; and
written with every other first byte), mutations, deletions and expirations, under every
connection option (tombstones take the framer's item-by-item path without IncludeDeleteTimes
or with the expiry opcode, every item with NoValue), cut by random budgets.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import Item, SnapshotStart
from changefeed.producer.collection_stream import CollectionEncoder
from changefeed.producer.encoder import DcpEncoder
from changefeed.producer.item_encoding import ItemFramer, ItemOptions
from changefeed.protocol.collections import StreamFilter
from changefeed.protocol.dcp import StreamEndReason
from changefeed.storage import Op
from changefeed.storage.keys import stored_key
from changefeed.storage.record import encode_record

VB, OPAQUE = 3, 77

OPTIONS = [
    ItemOptions(),
    ItemOptions(delete_times=True),
    ItemOptions(delete_times=True, expiry_opcode=True),
    ItemOptions(no_value=True),
]


class Wrapped:
    """A `DcpEncoder` under another type: `CollectionEncoder` checks keys before framing."""

    def __init__(self, inner: DcpEncoder) -> None:
        self.inner = inner
        self.vb = inner.vb
        self.event_bytes_min = inner.event_bytes_min

    def snapshot_marker(self, out: list[bytes], marker: SnapshotStart, purge_seqno: int) -> int:
        return self.inner.snapshot_marker(out, marker, purge_seqno)

    def items(self, out: list[bytes], items: Sequence[Item], bytes_max: int) -> tuple[int, int]:
        return self.inner.items(out, items, bytes_max)

    def stored(self, out: list[bytes], records: Sequence[bytes], bytes_max: int) -> tuple[int, int]:
        return self.inner.stored(out, records, bytes_max)

    def stream_end(self, out: list[bytes], reason: StreamEndReason) -> int:
        return self.inner.stream_end(out, reason)


changes = st.lists(
    st.tuples(
        st.sampled_from([Op.MUTATION, Op.MUTATION, Op.DELETION, Op.EXPIRATION]),
        st.sampled_from([0, 0, 0, 0, 8, 200]),
        st.one_of(
            st.binary(min_size=1, max_size=12),
            st.binary(min_size=1, max_size=12).map(lambda k: b"\xff" + k),
        ),
        st.integers(0, 120),
    ),
    min_size=1,
    max_size=40,
)


def items_of(spec: list[tuple[Op, int, bytes, int]]) -> list[Item]:
    return [
        Item(seqno, stored_key(cid, key), op, b"v" * size if op is Op.MUTATION else b"",
             cas=seqno, delete_time=0 if op is Op.MUTATION else 1_700_000_000 + seqno)
        for seqno, (op, cid, key, size) in enumerate(spec, start=1)
    ]  # fmt: skip


@settings(deadline=None, max_examples=300)
@given(
    spec=changes,
    budgets=st.lists(st.integers(1, 600), min_size=1, max_size=8),
    options=st.sampled_from(OPTIONS),
)
def test_the_check_in_the_framing_sends_what_the_check_before_it_sends(
    spec: list[tuple[Op, int, bytes, int]], budgets: list[int], options: ItemOptions
) -> None:
    items = items_of(spec)

    def plain(inner: DcpEncoder | Wrapped) -> CollectionEncoder:
        return CollectionEncoder(
            inner, aware=False, stream_filter=StreamFilter(), manifest=None, opaque=OPAQUE
        )

    fast = plain(DcpEncoder(VB, OPAQUE, options))
    reference = plain(Wrapped(DcpEncoder(VB, OPAQUE, options)))
    out: list[bytes] = []
    expected: list[bytes] = []
    at = call = 0
    while at < len(items):  # bounded: every call consumes at least one item
        budget = budgets[call % len(budgets)]
        got = fast.items(out, items[at:], budget)
        assert got == reference.items(expected, items[at:], budget), (at, budget)
        assert b"".join(out) == b"".join(expected), (at, budget)
        at += got[0]
        call += 1
    assert fast.skipped == reference.skipped == sum(1 for _, cid, _, _ in spec if cid != 0)


@settings(deadline=None, max_examples=200)
@given(spec=changes, budget=st.integers(1, 3000), options=st.sampled_from(OPTIONS))
def test_plain_items_is_items_unless_a_key_is_marked(
    spec: list[tuple[Op, int, bytes, int]], budget: int, options: ItemOptions
) -> None:
    items = items_of(spec)
    framer = ItemFramer(VB, OPAQUE, options)
    marked = any(item.key[0] == 0xFF for item in items)
    got = framer.plain_items(items, budget)
    assert got == (None if marked else framer.items(items, budget))


def records_of(spec: list[tuple[Op, int, bytes, int]]) -> list[bytes]:
    """The same changes as the store keeps them (storage/record.py)."""
    return [
        encode_record(op, seqno, stored_key(cid, key), b"v" * size if op is Op.MUTATION else b"",
                      cas=seqno, delete_time=0 if op is Op.MUTATION else 1_700_000_000 + seqno)
        for seqno, (op, cid, key, size) in enumerate(spec, start=1)
    ]  # fmt: skip


@settings(deadline=None, max_examples=300)
@given(
    spec=changes,
    budgets=st.lists(st.integers(1, 600), min_size=1, max_size=8),
    options=st.sampled_from(OPTIONS),
)
def test_stored_runs_check_in_the_framing_as_before_it(
    spec: list[tuple[Op, int, bytes, int]], budgets: list[int], options: ItemOptions
) -> None:
    """From disk: the same call-by-call comparison for stored records (`plain_stored`)."""
    records = records_of(spec)

    def plain(inner: DcpEncoder | Wrapped) -> CollectionEncoder:
        return CollectionEncoder(
            inner, aware=False, stream_filter=StreamFilter(), manifest=None, opaque=OPAQUE
        )

    fast = plain(DcpEncoder(VB, OPAQUE, options))
    reference = plain(Wrapped(DcpEncoder(VB, OPAQUE, options)))
    out: list[bytes] = []
    expected: list[bytes] = []
    at = call = 0
    while at < len(records):  # bounded: every call consumes at least one record
        budget = budgets[call % len(budgets)]
        got = fast.stored(out, records[at:], budget)
        assert got == reference.stored(expected, records[at:], budget), (at, budget)
        assert b"".join(out) == b"".join(expected), (at, budget)
        at += got[0]
        call += 1
    assert fast.skipped == reference.skipped == sum(1 for _, cid, _, _ in spec if cid != 0)


@settings(deadline=None, max_examples=200)
@given(spec=changes, budget=st.integers(1, 3000), options=st.sampled_from(OPTIONS))
def test_plain_stored_is_stored_unless_a_key_is_marked_or_a_record_is_rewritten(
    spec: list[tuple[Op, int, bytes, int]], budget: int, options: ItemOptions
) -> None:
    records = records_of(spec)
    framer = ItemFramer(VB, OPAQUE, options)
    marked = any(item.key[0] == 0xFF for item in items_of(spec))
    got = framer.plain_stored(records, budget)
    if marked:
        assert got is None
    elif got is not None:  # None: a record the fast path does not take (rewritten, NoValue)
        assert got == framer.stored(records, budget)
    if not marked and not options.no_value and all(op is Op.MUTATION for op, *_ in spec):
        assert got is not None  # every mutation of a plain run takes the fast path
