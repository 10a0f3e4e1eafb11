"""``Item``: built from a stored record field for field; meta items are distinct markers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.checkpoint.item import CHECKPOINT_START, DUMMY, CommitItem, Item, SyncItem
from changefeed.storage import Op, Record


def test_from_record_copies_every_field() -> None:
    record = Record.create(
        3, 17, b"key", Op.MUTATION, cas=99, value=b"value", rev_seqno=4, flags=5, expiry=6,
        datatype=1,
    )  # fmt: skip
    item = Item.from_record(record)
    assert item == Item(17, b"key", Op.MUTATION, b"value", 99, 5, 6, 1, 4, 0)
    assert not item.deleted


def test_tombstones_are_deleted_and_keep_delete_time() -> None:
    record = Record.create(0, 8, b"k", Op.EXPIRATION, cas=1, delete_time=1234)
    item = Item.from_record(record)
    assert item.deleted
    assert item.op is Op.EXPIRATION
    assert item.delete_time == 1234


def test_repr_is_bounded() -> None:
    item = Item(1, b"k" * 300, Op.MUTATION, b"v" * 10_000, cas=1)
    assert len(repr(item)) < 200


def test_meta_items_are_distinct_and_never_items() -> None:
    assert DUMMY is not CHECKPOINT_START
    assert not isinstance(DUMMY, Item)
    assert "dummy" in repr(DUMMY)


def test_the_body_is_the_one_the_store_keeps_and_holds_the_value() -> None:
    cases = [
        (Op.MUTATION, b"value", dict(flags=5, expiry=6, datatype=1, rev_seqno=4)),
        (Op.DELETION, b"", dict(delete_time=1234, rev_seqno=2)),
        (Op.EXPIRATION, b"xattrs", dict(delete_time=99, datatype=4)),
    ]
    for op, value, fields in cases:
        record = Record.create(3, 17, b"key", op, cas=99, value=value, **fields)
        item = Item(17, b"key", op, value, 99, **fields)
        assert item.body == record.body  # encoded once, byte for byte the stored body
        assert item.value == value
        assert item.extras_size == record.extras_len
        assert Item.from_record(record) == item
        assert Item.from_record(record).body is record.body  # shared, not encoded again


def test_items_compare_by_value_and_refuse_fields_that_do_not_fit() -> None:
    one = Item(1, b"k", Op.MUTATION, b"v", cas=1)
    assert one == Item(1, b"k", Op.MUTATION, b"v", cas=1)
    assert one != Item(1, b"k", Op.MUTATION, b"w", cas=1)
    assert one != "not an item"
    for bad in (dict(flags=2**32), dict(rev_seqno=-1), dict(seqno=2**64)):
        fields = dict(seqno=1, key=b"k", op=Op.MUTATION, value=b"", cas=1) | bad
        with pytest.raises(ValueError):
            Item(**fields)  # type: ignore[arg-type]


@given(
    st.integers(1, 2**40), st.binary(min_size=1, max_size=30),
    st.sampled_from([Op.MUTATION, Op.DELETION]),
    st.binary(max_size=60), st.integers(1, 2**63), st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1), st.integers(0, 7), st.integers(1, 2**40), st.integers(0, 2**32 - 1),
    st.integers(1, 2**20),
)  # fmt: skip
def test_committed_is_the_document_encoded_at_the_commit_seqno(
    seqno: int, key: bytes, doc_op: Op, value: bytes, cas: int, flags: int, expiry: int,
    datatype: int, rev_seqno: int, delete_time: int, later: int,
) -> None:  # fmt: skip
    """`committed` re-packs only the extras of the prepare's body; the item equals the one
    built from the fields (every field, the body, the prepared seqno)."""
    if doc_op is Op.DELETION:
        flags = expiry = 0
    else:
        delete_time = 0
    prepare = SyncItem(
        seqno, key, Op.PREPARE, doc_op, value, cas, flags, expiry, datatype, rev_seqno,
        delete_time, level=1,
    )  # fmt: skip
    got = prepare.committed(seqno + later)
    want = CommitItem(
        seqno + later, key, doc_op, value, cas, flags, expiry, datatype, rev_seqno, delete_time
    )
    want.prepared_seqno = seqno
    assert type(got) is CommitItem and got == want and got.body == want.body
    assert got.value == value and got.prepared_seqno == seqno
