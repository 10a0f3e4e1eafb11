"""The items' fast builders (`Item.of_body`, `Item.from_record`, `SyncItem.committed`,
`SyncItem.prepares`) set every slot by hand instead of through `__init__`: each of their items
has every slot of its class set, to what the normal constructor sets. Compared slot by slot
(not through `__eq__`, which compares only the fields it names), so a slot added to a class and
to its `__init__` but not to a builder fails here instead of raising later on first read."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from changefeed.checkpoint.item import CommitItem, Item, SyncItem
from changefeed.storage import Op, Record

U16 = st.integers(0, 0xFFFF)
U32 = st.integers(0, 0xFFFF_FFFF)
U64 = st.integers(0, 0xFFFF_FFFF_FFFF_FFFF)
SEQNO = st.integers(1, 1 << 48)
KEY = st.binary(min_size=1, max_size=16)
VALUE = st.binary(max_size=32)
DATATYPE = st.integers(0, 7)


def slots_of(cls: type) -> list[str]:
    """Every slot an instance of `cls` has: its own and its bases'."""
    return [slot for klass in cls.__mro__ for slot in getattr(klass, "__slots__", ())]


def assert_same_slots(got: object, want: object) -> None:
    """`got` and `want` are of one class and hold the same value in every slot; a slot not
    set on `got` fails naming it."""
    assert type(got) is type(want), (type(got), type(want))
    for slot in slots_of(type(want)):
        assert hasattr(want, slot), f"the reference {type(want).__name__} has no {slot}"
        assert hasattr(got, slot), f"the builder left {type(got).__name__}.{slot} unset"
        assert getattr(got, slot) == getattr(want, slot), slot


def test_the_slot_lists_are_the_classes_fields() -> None:
    """The helper sees the classes' slots (a test that compared no slot could not fail)."""
    assert {"seqno", "key", "op", "body", "cas", "rev_seqno"} <= set(slots_of(Item))
    assert set(slots_of(SyncItem)) == {*slots_of(Item), "doc_op", "level", "prepared_seqno"}
    assert set(slots_of(CommitItem)) == {*slots_of(Item), "prepared_seqno"}


@given(SEQNO, KEY, st.sampled_from([Op.MUTATION, Op.DELETION, Op.EXPIRATION]), VALUE, U64,
       U32, U32, DATATYPE, SEQNO, U32)  # fmt: skip
def test_of_body_and_from_record_set_every_slot_as_the_constructor(
    seqno: int, key: bytes, op: Op, value: bytes, cas: int, flags: int, expiry: int,
    datatype: int, rev_seqno: int, delete_time: int,
) -> None:  # fmt: skip
    if op is Op.MUTATION:
        delete_time = 0
    else:
        flags = expiry = 0
    want = Item(seqno, key, op, value, cas, flags, expiry, datatype, rev_seqno, delete_time)
    of_body = Item.of_body(
        seqno, key, op, want.body, cas, flags, expiry, datatype, rev_seqno, delete_time
    )
    assert_same_slots(of_body, want)
    record = Record.create(
        3, seqno, key, op, cas=cas, value=value, rev_seqno=rev_seqno, flags=flags,
        expiry=expiry, datatype=datatype, delete_time=delete_time,
    )  # fmt: skip
    assert_same_slots(Item.from_record(record), want)


@given(SEQNO, KEY, st.sampled_from([Op.MUTATION, Op.DELETION]), VALUE, U64, U32, U32,
       DATATYPE, SEQNO, U32, st.integers(1, 1000), st.integers(1, 3))  # fmt: skip
def test_committed_sets_every_slot_as_the_constructor(
    seqno: int, key: bytes, doc_op: Op, value: bytes, cas: int, flags: int, expiry: int,
    datatype: int, rev_seqno: int, delete_time: int, later: int, level: int,
) -> None:  # fmt: skip
    if doc_op is Op.MUTATION:
        delete_time = 0
    else:
        flags = expiry = 0
    prepare = SyncItem(
        seqno, key, Op.PREPARE, doc_op, value, cas, flags, expiry, datatype, rev_seqno,
        delete_time, level=level,
    )  # fmt: skip
    want = CommitItem(
        seqno + later, key, doc_op, value, cas, flags, expiry, datatype, rev_seqno, delete_time
    )
    want.prepared_seqno = seqno  # the one slot `CommitItem` adds: what it commits
    assert_same_slots(prepare.committed(seqno + later), want)


@given(
    st.lists(st.tuples(KEY, VALUE, U64, U32, U32, DATATYPE, SEQNO), min_size=1, max_size=8),
    SEQNO,
    st.integers(1, 3),
)
def test_prepares_set_every_slot_as_the_constructor(
    columns: list[tuple[bytes, bytes, int, int, int, int, int]], first: int, level: int
) -> None:
    seqnos = range(first, first + len(columns))
    keys, values, cases, flags, expiries, datatypes, revs = zip(*columns, strict=True)
    got = SyncItem.prepares(seqnos, keys, values, cases, flags, expiries, datatypes, revs, level)
    assert len(got) == len(columns)
    for item, seqno, (key, value, cas, flag, expiry, datatype, rev) in zip(
        got, seqnos, columns, strict=True
    ):
        want = SyncItem(
            seqno, key, Op.PREPARE, Op.MUTATION, value, cas, flag, expiry, datatype, rev,
            level=level,
        )  # fmt: skip
        assert_same_slots(item, want)
