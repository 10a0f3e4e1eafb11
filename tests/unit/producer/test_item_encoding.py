"""``ItemFramer``: runs of items and of stored records framed once, byte for byte the messages the
protocol encoders build, for every connection option, however a byte budget cuts a run."""

from __future__ import annotations

import itertools

import pytest

from changefeed.checkpoint import Item
from changefeed.producer.item_encoding import ItemFramer, ItemOptions, encode_item
from changefeed.protocol.dcp_items import (
    Deletion,
    Expiration,
    Mutation,
    encode_deletion,
    encode_expiration,
    encode_mutation,
)
from changefeed.storage import CorruptRecordError, Op, Record
from changefeed.storage.record import encode_stored

VB, OPAQUE = 5, 0xABCD

OPTIONS = [
    ItemOptions(delete_times=d, expiry_opcode=e, no_value=n)
    for d, e, n in itertools.product((False, True), repeat=3)
]
STREAM_IDS = [None, 7]


def items() -> list[Item]:
    """Mutations and tombstones, with xattr/JSON datatypes, empty and non-empty values."""
    return [
        Item(11, b"a", Op.MUTATION, b"value-a", 1 << 60, 3, 99, 1, 4),
        Item(12, b"bb", Op.DELETION, b"", 1 << 61, delete_time=1234, rev_seqno=9),
        Item(13, b"ccc", Op.MUTATION, b"", 77),
        Item(14, b"dddd", Op.EXPIRATION, b"", 78, delete_time=4321),
        Item(15, b"e", Op.DELETION, b"xattrs", 79, datatype=4, delete_time=5),
        Item(16, b"f" * 250, Op.MUTATION, b"v" * 1000, 2**64 - 1, 2**32 - 1, 2**32 - 1, 7),
    ]


def mutations(count: int) -> list[Item]:
    return [Item(s, b"key%d" % s, Op.MUTATION, b"x" * (s % 13), s + 100) for s in range(1, count)]


def reference(item: Item, options: ItemOptions, stream_id: int | None) -> bytes:
    """What the message encoders (protocol/dcp_items.py) send for `item` on this connection."""
    value = b"" if options.no_value else item.value
    datatype = 0 if options.no_value else item.datatype
    if item.op is Op.MUTATION:
        return encode_mutation(
            Mutation(
                VB, OPAQUE, item.seqno, item.key, value, item.cas, item.rev_seqno, item.flags,
                item.expiry, 0, datatype, stream_id,
            )
        )  # fmt: skip
    if item.op is Op.EXPIRATION and options.expiry_opcode and options.delete_times:
        return encode_expiration(
            Expiration(
                VB, OPAQUE, item.seqno, item.key, item.cas, item.rev_seqno, item.delete_time,
                value, datatype, stream_id,
            )
        )  # fmt: skip
    delete_time = item.delete_time if options.delete_times else None
    return encode_deletion(
        Deletion(
            VB, OPAQUE, item.seqno, item.key, item.cas, item.rev_seqno, delete_time, value,
            datatype, stream_id,
        )
    )  # fmt: skip


def stored(item: Item) -> bytes:
    """The stored form the store keeps for `item` (storage/record.py)."""
    record = Record.create(
        VB, item.seqno, item.key, item.op, cas=item.cas, value=item.value,
        rev_seqno=item.rev_seqno, flags=0 if item.deleted else item.flags,
        expiry=0 if item.deleted else item.expiry, datatype=item.datatype,
        delete_time=item.delete_time if item.deleted else 0,
    )  # fmt: skip
    return encode_stored(record)


@pytest.mark.parametrize("stream_id", STREAM_IDS)
@pytest.mark.parametrize("options", OPTIONS)
def test_items_and_stored_records_frame_as_the_message_encoders(
    options: ItemOptions, stream_id: int | None
) -> None:
    framer = ItemFramer(VB, OPAQUE, options, stream_id)
    run = items()
    expected = [reference(one, options, stream_id) for one in run]
    framed, count, written = framer.items(run, 1 << 30)
    assert (framed, count, written) == (b"".join(expected), len(run), len(framed))
    records = [stored(one) for one in run]
    assert framer.stored(records, 1 << 30) == (framed, count, written)
    for one, frame in zip(run, expected, strict=True):  # one by one, and the single-item API
        assert framer.items([one], 1) == (frame, 1, len(frame))
        assert framer.stored([stored(one)], 1) == (frame, 1, len(frame))
        assert encode_item(one, VB, OPAQUE, options, stream_id) == frame


@pytest.mark.parametrize("options", [ItemOptions(), ItemOptions(delete_times=True)])
def test_a_budget_cuts_a_run_after_the_frame_that_reaches_it(options: ItemOptions) -> None:
    framer = ItemFramer(VB, OPAQUE, options)
    run = mutations(40)
    run[7] = Item(8, b"gone", Op.DELETION, b"", 9)  # a tombstone: the fallback when V1
    frames = [reference(one, options, None) for one in run]
    ends = list(itertools.accumulate(map(len, frames)))
    for bytes_max in range(1, ends[-1] + 50, 7):
        count = next((n + 1 for n, end in enumerate(ends) if end >= bytes_max), len(run))
        expected = (b"".join(frames[:count]), count, ends[count - 1])
        assert framer.items(run, bytes_max) == expected, bytes_max
        assert framer.stored([stored(one) for one in run], bytes_max) == expected, bytes_max


def test_a_damaged_stored_record_is_caught_not_sent() -> None:
    framer = ItemFramer(VB, OPAQUE, ItemOptions())
    good = stored(mutations(3)[0])
    bad_tag = b"\x7f" + good[1:]
    with pytest.raises(CorruptRecordError):
        framer.stored([good, bad_tag], 1 << 20)
    short = good[:20]  # a known tag on a record shorter than its head
    with pytest.raises(CorruptRecordError):
        ItemFramer(VB, OPAQUE, ItemOptions(no_value=True)).stored([short], 1 << 20)
