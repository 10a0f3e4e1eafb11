"""``ItemFramer`` on a replica stream: DCP_PREPARE / DCP_COMMIT / DCP_ABORT packed with one
``struct`` call each, byte for byte what the message encoders (protocol/dcp_items.py) build,
for any mix of sync and plain items (writes, deletes, expirations), whichever runs they arrive
in and however a budget cuts them, with or without the expiry opcode (a real replica stream
asks for it) (hypothesis, against a model that encodes every item on its own)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import Item, SyncItem
from changefeed.checkpoint.item import CommitItem
from changefeed.producer.item_encoding import ItemFramer, ItemOptions
from changefeed.protocol.dcp_items import (
    Abort,
    Commit,
    Deletion,
    Expiration,
    Mutation,
    Prepare,
    encode_abort,
    encode_commit,
    encode_deletion,
    encode_expiration,
    encode_mutation,
    encode_prepare,
)
from changefeed.storage import Op

VB, OPAQUE = 9, 0x1234
KEYS = [b"a", b"bb", b"k" * 300]
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(1, 2**64 - 1)


def reference(item: Item, sent: dict[bytes, int], options: ItemOptions) -> bytes:
    """One item's frame on a replica stream, from the message encoders; `sent` is the model of
    the prepares this stream sent and has not seen the end of."""
    if isinstance(item, SyncItem) and item.op is Op.PREPARE:
        sent[item.key] = item.seqno
        return encode_prepare(
            Prepare(
                VB, OPAQUE, item.seqno, item.key, item.value, item.cas, item.rev_seqno,
                item.flags, item.expiry, item.deleted, item.level, item.datatype,
                item.delete_time,
            )
        )  # fmt: skip
    if isinstance(item, SyncItem):
        sent.pop(item.key, None)
        abort = Abort(VB, OPAQUE, item.key, item.prepared_seqno, item.seqno)
        return encode_abort(abort)
    held = sent.pop(item.key, None)
    if isinstance(item, CommitItem) and held == item.prepared_seqno:
        return encode_commit(Commit(VB, OPAQUE, item.key, item.prepared_seqno, item.seqno))
    if item.op is Op.MUTATION:
        return encode_mutation(
            Mutation(
                VB, OPAQUE, item.seqno, item.key, item.value, item.cas, item.rev_seqno,
                item.flags, item.expiry, 0, item.datatype,
            )
        )  # fmt: skip
    assert options.delete_times
    if item.op is Op.EXPIRATION and options.expiry_opcode:
        return encode_expiration(
            Expiration(
                VB, OPAQUE, item.seqno, item.key, item.cas, item.rev_seqno, item.delete_time,
                item.value, item.datatype,
            )
        )  # fmt: skip
    return encode_deletion(
        Deletion(
            VB, OPAQUE, item.seqno, item.key, item.cas, item.rev_seqno, item.delete_time,
            item.value, item.datatype,
        )
    )  # fmt: skip


@st.composite
def histories(draw: st.DrawFn) -> list[Item]:
    """Items in seqno order: prepares (documents and deletes), their commits or aborts (or
    none), plain writes, deletes and expirations, commits of prepares this stream may not
    have sent."""
    items: list[Item] = []
    seqno = 0
    pending: dict[bytes, SyncItem] = {}
    for _ in range(draw(st.integers(1, 25))):
        seqno += draw(st.integers(1, 3))
        key = draw(st.sampled_from(KEYS))
        kind = draw(
            st.sampled_from(["prepare", "end", "plain", "delete", "expire", "stray commit"])
        )
        value = draw(st.binary(max_size=40))
        cas, datatype = draw(U64), draw(st.integers(0, 7))
        fields = dict(flags=draw(U32), expiry=draw(U32), rev_seqno=draw(U64))
        if kind == "prepare":
            deleted = draw(st.booleans())
            prepare = SyncItem(
                seqno, key, Op.PREPARE, Op.DELETION if deleted else Op.MUTATION, value, cas,
                fields["flags"] if not deleted else 0, fields["expiry"] if not deleted else 0,
                datatype, fields["rev_seqno"], draw(U32) if deleted else 0,
                level=draw(st.integers(1, 3)),
            )  # fmt: skip
            pending[key] = prepare
            items.append(prepare)
        elif kind == "end" and key in pending:
            prepare = pending.pop(key)
            if draw(st.booleans()):
                items.append(prepare.committed(seqno))
            else:
                abort = SyncItem(
                    seqno, key, Op.ABORT, Op.DELETION, b"", prepare.cas,
                    prepared_seqno=prepare.seqno,
                )  # fmt: skip
                items.append(abort)
        elif kind == "stray commit":  # a prepare read past on disk: sent as the document
            items.append(SyncItem(seqno - 1, key, Op.PREPARE, Op.MUTATION, value, cas, level=1)
                         .committed(seqno))  # fmt: skip
        elif kind in ("delete", "expire"):
            op = Op.DELETION if kind == "delete" else Op.EXPIRATION
            xattrs = value if datatype & 4 else b""  # a tombstone's value: its xattrs only
            items.append(
                Item(seqno, key, op, xattrs, cas, datatype=datatype, delete_time=draw(U32))
            )
        else:
            items.append(Item(seqno, key, Op.MUTATION, value, cas, datatype=datatype, **fields))
    return items


REPLICA_OPTIONS = [
    ItemOptions(delete_times=True, expiry_opcode=True, sync_writes=True),  # a replica's
    ItemOptions(delete_times=True, sync_writes=True),  # an expiration goes as a deletion
]


@pytest.mark.parametrize("options", REPLICA_OPTIONS, ids=["expiry-opcode", "deletions"])
@settings(max_examples=150, deadline=None)
@given(histories(), st.lists(st.integers(1, 6), max_size=8), st.integers(1, 600))
def test_replica_framing_equals_the_message_encoders(
    options: ItemOptions, items: list[Item], cuts: list[int], bytes_max: int
) -> None:
    framer = ItemFramer(VB, OPAQUE, options)
    sent: dict[bytes, int] = {}
    position = 0
    runs = iter(cuts)
    while position < len(items):  # each call frames at least one item: bounded
        run = items[position : position + next(runs, len(items))]
        budget = bytes_max if position % 2 else 1 << 30
        framed, count, written = framer.items(run, budget)
        expected = [reference(item, sent, options) for item in run[:count]]
        assert framed == b"".join(expected)
        assert written == len(framed)
        assert count == len(run) or written >= budget
        assert count == len(run) or sum(map(len, expected[:-1])) < budget
        position += count


OUT_OF_RANGE = [  # (what is wrong, the item framed): each names its field
    ("datatype", SyncItem(3, b"x", Op.PREPARE, Op.MUTATION, b"v", 5, datatype=0x10, level=1)),
    ("level 256", SyncItem(3, b"x", Op.PREPARE, Op.MUTATION, b"v", 5, level=256)),
    ("level -1", SyncItem(3, b"x", Op.PREPARE, Op.DELETION, b"", 5, level=-1)),
    ("cas 18446744073709551616", SyncItem(3, b"x", Op.PREPARE, Op.MUTATION, b"v", 2**64, level=1)),
    (
        "prepared_seqno 18446744073709551616",
        SyncItem(3, b"x", Op.ABORT, Op.DELETION, b"", 5, prepared_seqno=2**64),
    ),
]


@pytest.mark.parametrize(("field", "bad"), OUT_OF_RANGE, ids=[f for f, _ in OUT_OF_RANGE])
def test_a_field_out_of_range_is_our_bug_named_by_the_encoder(field: str, bad: SyncItem) -> None:
    framer = ItemFramer(VB, OPAQUE, ItemOptions(delete_times=True, sync_writes=True))
    with pytest.raises(ValueError, match=field):  # was a bare struct.error, naming nothing
        framer.items([bad], 1 << 20)


def test_the_sync_encoders_name_a_field_out_of_range() -> None:
    with pytest.raises(ValueError, match="DCP_PREPARE: level 256 does not fit 8 bits"):
        encode_prepare(Prepare(VB, OPAQUE, 3, b"x", b"v", 5, 1, 0, 0, False, 256))
    with pytest.raises(ValueError, match="DCP_PREPARE: delete_time -1 does not fit 32 bits"):
        encode_prepare(Prepare(VB, OPAQUE, 3, b"x", b"", 5, 1, 0, 0, True, 1, delete_time=-1))
    with pytest.raises(ValueError, match="DCP_COMMIT: seqno 18446744073709551616 does not fit"):
        encode_commit(Commit(VB, OPAQUE, b"x", 3, 2**64))
    with pytest.raises(ValueError, match="DCP_ABORT: vbucket 65536 does not fit 16 bits"):
        encode_abort(Abort(2**16, OPAQUE, b"x", 3, 4))
