"""A replica's run of mutations as columns (`VBucket.queue_replicated_columns`) against the
same run as items (`queue_replicated_run`, the simple model): the same copy, and a bad run
refused whole with the error naming its item."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from changefeed.checkpoint import Item, SyncItem
from changefeed.protocol.errors import InvalidArgumentsError
from changefeed.storage import Op, Store
from changefeed.vbucket import ReplicatedColumns, VBucket, VBucketState

KEYS = [b"a", b"b", b"c", b"p"]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(tmp_path, map_size_bytes=64 << 20, durable=False)
    yield opened
    opened.close()


def replica(store: Store, vb: int) -> VBucket:
    """A replica holding a pending prepare of key b"p"."""
    vbucket = VBucket(store, vb, state=VBucketState.REPLICA, rng=random.Random(vb))
    vbucket.replica_snapshot(1, 1)
    vbucket.queue_replicated(SyncItem(1, b"p", Op.PREPARE, Op.MUTATION, b"x", 5, level=1))
    return vbucket


def columns_of(items: list[Item]) -> ReplicatedColumns:
    return ReplicatedColumns(
        [i.seqno for i in items], [i.key for i in items], [i.body for i in items],
        [i.cas for i in items], [i.flags for i in items], [i.expiry for i in items],
        [i.datatype for i in items], [i.rev_seqno for i in items],
    )  # fmt: skip


_RUN = st.lists(
    st.tuples(st.sampled_from(KEYS), st.binary(max_size=8), st.integers(0, 7)),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(run=_RUN)
def test_columns_apply_as_the_items_do(store: Store, run: list[tuple[bytes, bytes, int]]) -> None:
    by_items, by_columns = replica(store, 0), replica(store, 1)
    items = [
        Item(2 + i, key, Op.MUTATION, value, cas=100 + i, flags=i, datatype=datatype, rev_seqno=1)
        for i, (key, value, datatype) in enumerate(run)
    ]
    for vbucket in (by_items, by_columns):
        vbucket.replica_snapshot(2, 1 + len(items))
    assert by_items.queue_replicated_run(items) == len(items)
    assert by_columns.queue_replicated_columns(columns_of(items)) == len(items)
    assert by_columns.high_seqno == by_items.high_seqno == 1 + len(items)
    assert by_columns.pending_prepares == by_items.pending_prepares  # ended by a write of p
    for key in KEYS:
        assert by_columns.get(key) == by_items.get(key)
    for vbucket in (by_items, by_columns):
        vbucket.release()


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"seqno": 3}, "does not follow 3"),
        ({"cas": 0}, "cas 0 is not a non-zero u64"),
        ({"datatype": 8}, "datatype 0x8"),
        ({"seqno": 9}, "outside the snapshot"),
    ],
)
def test_a_bad_run_is_refused_whole_naming_its_item(
    store: Store, bad: dict[str, int], error: str
) -> None:
    vbucket = replica(store, 0)
    vbucket.replica_snapshot(2, 5)
    fields = {"seqno": 4, "cas": 9, "datatype": 0} | bad
    items = [
        Item(2, b"a", Op.MUTATION, b"1", cas=7),
        Item(3, b"b", Op.MUTATION, b"2", cas=8),
        Item(fields["seqno"], b"c", Op.MUTATION, b"3", cas=fields["cas"],
             datatype=fields["datatype"]),
    ]  # fmt: skip
    with pytest.raises(InvalidArgumentsError, match=error):
        vbucket.queue_replicated_columns(columns_of(items))
    assert vbucket.high_seqno == 1  # nothing of the run was queued
