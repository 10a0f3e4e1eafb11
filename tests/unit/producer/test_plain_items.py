"""A plain (non-collections) application stream checks its memory runs' keys for the collection
marker inside the framing's pass (`ItemFramer.plain_items`, through `CollectionEncoder.items`):
the same bytes, counts and bytes counted, call by call, as the check-before path that an inner
encoder without `plain_items` gets (the shm publisher's rows; here the same `DcpEncoder`
behind a wrapper).

Runs hold default-collection keys, named-collection keys (marked, storage/keys.py) and
default-collection keys that begin with 0xff (stored marked with id 0, sent as written; and
written with every other first byte), keys up to 41 bytes (a tombstone's key reaches past a
mutation's key offset), mutations, deletions and expirations (tombstones with values: xattrs),
under every connection option (tombstones take the framer's item-by-item path without
IncludeDeleteTimes or with the expiry opcode, every item with NoValue), cut by random budgets.
A wider differential adds PREPARE / ABORT / commits to memory runs, stream-ids and datatypes;
every first byte of a key is tried on its own; a spy pins that `CollectionEncoder` takes the
fast path at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import Item, SnapshotStart
from changefeed.checkpoint.item import SyncItem
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
            st.binary(min_size=1, max_size=41),
            st.binary(min_size=1, max_size=40).map(lambda k: b"\xff" + k),
        ),
        st.integers(0, 120),
    ),
    min_size=1,
    max_size=40,
)


def value_of(op: Op, size: int) -> bytes:
    """A mutation's value, or a tombstone's (xattrs: at most a few bytes, often none)."""
    return b"v" * size if op is Op.MUTATION else b"x" * (size % 5)


def items_of(spec: list[tuple[Op, int, bytes, int]]) -> list[Item]:
    return [
        Item(seqno, stored_key(cid, key), op, value_of(op, size), cas=seqno,
             delete_time=0 if op is Op.MUTATION else 1_700_000_000 + seqno)
        for seqno, (op, cid, key, size) in enumerate(spec, start=1)
    ]  # fmt: skip


# A tombstone of a named collection whose key reaches past a mutation's key offset: a marker
# check that read every record's first key byte at the mutation's offset would miss it (the
# review's mutant D).
NAMED_TOMBSTONE: Final = [(Op.DELETION, 8, b"0123456789abcdef", 0)]
# A default-collection key beginning 0xfe: not the marker, on the fast path (mutant I).
NEAR_MARKER: Final = [(Op.MUTATION, 0, b"\xfeabc", 3), (Op.DELETION, 0, b"\xfe", 0)]


@settings(deadline=None, max_examples=300)
@given(
    spec=changes,
    budgets=st.lists(st.integers(1, 600), min_size=1, max_size=8),
    options=st.sampled_from(OPTIONS),
)
@example(spec=NAMED_TOMBSTONE, budgets=[1000], options=ItemOptions(delete_times=True))
@example(spec=NEAR_MARKER, budgets=[1000], options=ItemOptions(delete_times=True))
def test_the_check_in_the_framing_sends_what_the_check_before_it_sends(
    spec: list[tuple[Op, int, bytes, int]], budgets: list[int], options: ItemOptions
) -> None:
    _same_call_by_call("items", items_of(spec), spec, budgets, options)


@settings(deadline=None, max_examples=200)
@given(spec=changes, budget=st.integers(1, 3000), options=st.sampled_from(OPTIONS))
@example(spec=NAMED_TOMBSTONE, budget=1000, options=ItemOptions(delete_times=True))
@example(spec=NEAR_MARKER, budget=1000, options=ItemOptions(delete_times=True))
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
        encode_record(op, seqno, stored_key(cid, key), value_of(op, size), cas=seqno,
                      delete_time=0 if op is Op.MUTATION else 1_700_000_000 + seqno)
        for seqno, (op, cid, key, size) in enumerate(spec, start=1)
    ]  # fmt: skip


@settings(deadline=None, max_examples=300)
@given(
    spec=changes,
    budgets=st.lists(st.integers(1, 600), min_size=1, max_size=8),
    options=st.sampled_from(OPTIONS),
)
@example(spec=NAMED_TOMBSTONE, budgets=[1000], options=ItemOptions(delete_times=True))
@example(spec=NEAR_MARKER, budgets=[1000], options=ItemOptions(delete_times=True))
def test_stored_runs_check_in_the_framing_as_before_it(
    spec: list[tuple[Op, int, bytes, int]], budgets: list[int], options: ItemOptions
) -> None:
    """From disk: the same call-by-call comparison for stored records (`plain_stored`)."""
    _same_call_by_call("stored", records_of(spec), spec, budgets, options)


@settings(deadline=None, max_examples=200)
@given(spec=changes, budget=st.integers(1, 3000), options=st.sampled_from(OPTIONS))
@example(spec=NAMED_TOMBSTONE, budget=1000, options=ItemOptions(delete_times=True))
@example(spec=NEAR_MARKER, budget=1000, options=ItemOptions(delete_times=True))
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


@pytest.mark.parametrize("op", [Op.MUTATION, Op.DELETION, Op.EXPIRATION])
def test_only_the_collection_marker_as_first_byte_leaves_the_fast_path(op: Op) -> None:
    """Every first byte of a long key, alone in a run, under IncludeDeleteTimes (every op on the
    fast path): `plain_items` / `plain_stored` refuse the run iff the byte is the marker (0xff),
    read at the key's offset for the record's op (a tombstone's key begins 10 bytes before a
    mutation's: a key of 17 bytes reaches past both)."""
    framer = ItemFramer(VB, OPAQUE, ItemOptions(delete_times=True))
    for first in range(256):
        key = bytes([first]) + b"0123456789abcdef"
        item = Item(7, key, op, value_of(op, 4), cas=7, delete_time=0 if op is Op.MUTATION else 9)
        record = encode_record(op, 7, key, item.value, cas=7, delete_time=item.delete_time)
        if first == 0xFF:
            assert framer.plain_items([item], 1000) is None, first
            assert framer.plain_stored([record], 1000) is None, first
        else:
            assert framer.plain_items([item], 1000) == framer.items([item], 1000), first
            assert framer.plain_stored([record], 1000) == framer.stored([record], 1000), first


# The review's wider differential: sync items and commits in memory runs (a plain stream frames
# a PREPARE / ABORT as nothing, a commit as its document), stream-ids, tombstones with xattr
# values, datatypes 0-7, every combination of options.
wide_change = st.tuples(
    st.sampled_from(["mut", "mut", "del", "exp", "prep", "abort", "commit"]),
    st.sampled_from([0, 0, 0, 8, 200, 1000]),
    st.one_of(
        st.binary(min_size=1, max_size=41),
        st.binary(min_size=1, max_size=40).map(lambda k: b"\xff" + k),
    ),
    st.integers(0, 80),
    st.integers(0, 7),
)
WideSpec = list[tuple[str, int, bytes, int, int]]
DOC_OP: Final = {"mut": Op.MUTATION, "del": Op.DELETION, "exp": Op.EXPIRATION}


def wide_items(spec: WideSpec) -> list[Item]:
    out: list[Item] = []
    for seqno, (kind, cid, key, size, datatype) in enumerate(spec, start=1):
        key = stored_key(cid, key)
        if kind in DOC_OP:
            op = DOC_OP[kind]
            delete_time = 0 if op is Op.MUTATION else 1_700_000_000 + seqno
            out.append(Item(seqno, key, op, value_of(op, size), cas=seqno, datatype=datatype,
                            delete_time=delete_time))  # fmt: skip
        elif kind == "abort":
            out.append(SyncItem(seqno, key, Op.ABORT, Op.DELETION, b"", cas=seqno,
                                prepared_seqno=max(1, seqno - 1)))  # fmt: skip
        else:
            prepare = SyncItem(seqno, key, Op.PREPARE, Op.MUTATION, b"v" * size, cas=seqno,
                               datatype=datatype, level=1)  # fmt: skip
            out.append(prepare if kind == "prep" else prepare.committed(seqno))
    return out


def wide_records(spec: WideSpec) -> list[bytes]:
    """The stored changes of `spec` (a disk snapshot holds no sync items: their documents)."""
    out: list[bytes] = []
    for seqno, (kind, cid, key, size, datatype) in enumerate(spec, start=1):
        op = DOC_OP.get(kind, Op.MUTATION)
        delete_time = 0 if op is Op.MUTATION else 1_700_000_000 + seqno
        out.append(encode_record(op, seqno, stored_key(cid, key), value_of(op, size), cas=seqno,
                                 datatype=datatype, delete_time=delete_time))  # fmt: skip
    return out


wide_options = st.builds(
    ItemOptions, delete_times=st.booleans(), expiry_opcode=st.booleans(), no_value=st.booleans()
)


@settings(deadline=None, max_examples=120, derandomize=True)
@given(
    spec=st.lists(wide_change, min_size=1, max_size=30),
    budgets=st.lists(st.integers(1, 800), min_size=1, max_size=6),
    options=wide_options,
    stream_id=st.sampled_from([None, None, 3]),
    from_disk=st.booleans(),
)
def test_wider_runs_check_in_the_framing_as_before_it(
    spec: WideSpec,
    budgets: list[int],
    options: ItemOptions,
    stream_id: int | None,
    from_disk: bool,
) -> None:
    def plain(inner: DcpEncoder | Wrapped) -> CollectionEncoder:
        return CollectionEncoder(
            inner,
            aware=False,
            stream_filter=StreamFilter(),
            manifest=None,
            opaque=OPAQUE,
            stream_id=stream_id,
        )

    fast = plain(DcpEncoder(VB, OPAQUE, options, stream_id=stream_id))
    reference = plain(Wrapped(DcpEncoder(VB, OPAQUE, options, stream_id=stream_id)))
    out: list[bytes] = []
    expected: list[bytes] = []
    records, items = wide_records(spec), wide_items(spec)
    at = call = 0
    while at < len(spec):  # bounded: every call consumes at least one change
        budget = budgets[call % len(budgets)]
        if from_disk:
            got = fast.stored(out, records[at:], budget)
            assert got == reference.stored(expected, records[at:], budget), (at, budget)
        else:
            got = fast.items(out, items[at:], budget)
            assert got == reference.items(expected, items[at:], budget), (at, budget)
        assert b"".join(out) == b"".join(expected), (at, budget)
        at += got[0]
        call += 1
    assert fast.skipped == reference.skipped


class CountingEncoder(DcpEncoder):
    """A real `DcpEncoder` that counts the calls of its fast-path entries."""

    def __init__(self, vb: int, opaque: int, options: ItemOptions) -> None:
        super().__init__(vb, opaque, options)
        self.calls = {"plain_items": 0, "plain_stored": 0}

    def plain_items(
        self, out: list[bytes], items: Sequence[Item], bytes_max: int
    ) -> tuple[int, int] | None:
        self.calls["plain_items"] += 1
        return super().plain_items(out, items, bytes_max)

    def plain_stored(
        self, out: list[bytes], records: Sequence[bytes], bytes_max: int
    ) -> tuple[int, int] | None:
        self.calls["plain_stored"] += 1
        return super().plain_stored(out, records, bytes_max)


def test_a_plain_stream_frames_its_runs_on_the_fast_path() -> None:
    """`CollectionEncoder` on a connection without collections hands a run to `plain_items` /
    `plain_stored` (the check in the framing's pass), and the frames it appends are theirs;
    the differential tests cannot see a wiring that skips them (the review's mutant F)."""
    spec = [(Op.MUTATION, 0, b"key%d" % n, n) for n in range(5)]
    inner = CountingEncoder(VB, OPAQUE, ItemOptions(delete_times=True))
    encoder = CollectionEncoder(
        inner, aware=False, stream_filter=StreamFilter(), manifest=None, opaque=OPAQUE
    )
    framer = ItemFramer(VB, OPAQUE, ItemOptions(delete_times=True))
    out: list[bytes] = []
    assert encoder.items(out, items_of(spec), 10_000) == (5, len(out[0]))
    assert inner.calls == {"plain_items": 1, "plain_stored": 0}
    assert out == [framer.items(items_of(spec), 10_000)[0]]
    out.clear()
    assert encoder.stored(out, records_of(spec), 10_000) == (5, len(out[0]))
    assert inner.calls == {"plain_items": 1, "plain_stored": 1}
    assert out == [framer.stored(records_of(spec), 10_000)[0]]


def _same_call_by_call(
    method: str,
    run: Sequence[object],
    spec: list[tuple[Op, int, bytes, int]],
    budgets: list[int],
    options: ItemOptions,
) -> None:
    """Send ``run`` through ``method`` ("items" or "stored") of a plain stream's encoder and of
    the same encoder behind the check-first reference, a budget per call: every call's answer
    and the bytes so far equal, and the named-collection changes skipped by both."""

    def plain(inner: DcpEncoder | Wrapped) -> CollectionEncoder:
        return CollectionEncoder(
            inner, aware=False, stream_filter=StreamFilter(), manifest=None, opaque=OPAQUE
        )

    fast = plain(DcpEncoder(VB, OPAQUE, options))
    reference = plain(Wrapped(DcpEncoder(VB, OPAQUE, options)))
    send, send_reference = getattr(fast, method), getattr(reference, method)
    out: list[bytes] = []
    expected: list[bytes] = []
    at = call = 0
    while at < len(run):  # bounded: every call consumes at least one change
        budget = budgets[call % len(budgets)]
        got = send(out, run[at:], budget)
        assert got == send_reference(expected, run[at:], budget), (at, budget)
        assert b"".join(out) == b"".join(expected), (at, budget)
        at += got[0]
        call += 1
    assert fast.skipped == reference.skipped == sum(1 for _, cid, _, _ in spec if cid != 0)
