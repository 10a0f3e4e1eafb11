"""``Item``: built from a stored record field for field; meta items are distinct markers."""

from __future__ import annotations

from changefeed.checkpoint.item import CHECKPOINT_START, DUMMY, Item
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
