"""`SyncItem.prepares` (an active's run of durable SETs built in one pass) against
`SyncItem(...)` one by one: the same items, field for field and body for body, and the same
error for a field that does not fit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.checkpoint.item import SyncItem
from changefeed.storage import Op

_FIELDS = st.tuples(
    st.integers(1, 2**63),  # seqno
    st.binary(min_size=1, max_size=40),  # key
    st.binary(max_size=80),  # value
    st.integers(0, 2**64 - 1),  # cas
    st.integers(0, 2**32 - 1),  # flags
    st.integers(0, 2**32 - 1),  # expiry
    st.integers(0, 7),  # datatype
    st.integers(1, 2**40),  # rev_seqno
)
# A field past its extras field's width (seqno and rev_seqno 8 bytes, flags and expiry 4).
_OVERSIZE = st.sampled_from([(0, 2**64), (4, 2**32), (5, 2**32), (7, 2**64)])


def _one_by_one(
    rows: list[tuple[int, bytes, bytes, int, int, int, int, int]], level: int
) -> list[SyncItem]:
    return [
        SyncItem(seqno, key, Op.PREPARE, Op.MUTATION, value, cas, flag, expiry, datatype, rev,
                 level=level)
        for seqno, key, value, cas, flag, expiry, datatype, rev in rows
    ]  # fmt: skip


def _columns(
    rows: list[tuple[int, bytes, bytes, int, int, int, int, int]], level: int
) -> list[SyncItem]:
    seqnos, keys, values, cases, flags, expiries, datatypes, revs = (
        [row[i] for row in rows] for i in range(8)
    )
    return SyncItem.prepares(seqnos, keys, values, cases, flags, expiries, datatypes, revs, level)


@given(st.lists(_FIELDS, max_size=20), st.integers(1, 3))
def test_prepares_equal_the_items_built_one_by_one(
    rows: list[tuple[int, bytes, bytes, int, int, int, int, int]], level: int
) -> None:
    got = _columns(rows, level)
    want = _one_by_one(rows, level)
    assert got == want  # SyncItem.__eq__: every field, the body, doc_op, level, prepared_seqno
    for item, row in zip(got, want, strict=True):
        assert type(item) is SyncItem
        assert item.op is Op.PREPARE and item.doc_op is Op.MUTATION
        assert item.body == row.body and item.value == row.value
        assert (item.level, item.prepared_seqno, item.delete_time) == (level, 0, 0)


@given(st.lists(_FIELDS, min_size=1, max_size=8), st.data(), _OVERSIZE)
def test_a_field_that_does_not_fit_raises_as_one_by_one(
    rows: list[tuple[int, bytes, bytes, int, int, int, int, int]],
    data: st.DataObject,
    oversize: tuple[int, int],
) -> None:
    at = data.draw(st.integers(0, len(rows) - 1))
    field, value = oversize
    bad = list(rows[at])
    bad[field] = value
    rows = [*rows[:at], tuple(bad), *rows[at + 1 :]]  # type: ignore[list-item]
    with pytest.raises(ValueError) as one_by_one:
        _one_by_one(rows, 1)
    with pytest.raises(ValueError) as columns:
        _columns(rows, 1)
    assert str(columns.value) == str(one_by_one.value)
    assert f"item seqno {rows[at][0]}" in str(columns.value)


def test_columns_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        SyncItem.prepares([1, 2], [b"a"], [b""], [1], [0], [0], [0], [1], 1)
