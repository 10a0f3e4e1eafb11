"""Changes gathered across receive buffers (``spark/change_runs.py``), against simple models.

- ``concat_columns`` of buffers decoded one by one equals the decode of the joined buffers,
  field by field, keys and values included.
- Rows built from one joined run equal rows built buffer by buffer (every column), with end
  seqnos cutting some changes off, and the vbuckets reached are the model's.
- ``PendingChanges`` says which vbuckets it holds, when it is full, and gives back its changes
  in arrival order.
"""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.consumer.change_rows import ChangeRows
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp_items import (
    Deletion,
    Expiration,
    Mutation,
    encode_deletion,
    encode_expiration,
    encode_mutation,
)
from changefeed.spark.change_runs import EndSeqnos, PendingChanges, concat_columns

VBUCKETS = 4

# (kind, vbucket, seqno, key, value): one change
change_strategy = st.tuples(
    st.sampled_from(["mutation", "deletion", "expiration"]),
    st.integers(0, VBUCKETS - 1),
    st.integers(1, 2**63 - 1),
    st.binary(min_size=1, max_size=12).map(lambda b: b.hex().encode()),
    st.binary(max_size=40),
)
buffers_strategy = st.lists(st.lists(change_strategy, max_size=120), max_size=6)


def frame(change: tuple[str, int, int, bytes, bytes]) -> bytes:
    kind, vb, seqno, key, value = change
    if kind == "mutation":
        return encode_mutation(Mutation(vb, 1, seqno, key, value, cas=seqno, flags=7, expiry=3))
    if kind == "deletion":
        return encode_deletion(Deletion(vb, 1, seqno, key, cas=seqno))
    return encode_expiration(Expiration(vb, 1, seqno, key, cas=seqno, delete_time=5))


def decoded(buffers: list[list[tuple[str, int, int, bytes, bytes]]]) -> list[bytes]:
    return [b"".join(frame(c) for c in buffer) for buffer in buffers]


@settings(deadline=None, max_examples=40)
@given(buffers_strategy)
def test_joined_columns_equal_the_joined_buffers_decode(
    buffers: list[list[tuple[str, int, int, bytes, bytes]]],
) -> None:
    raw = decoded(buffers)
    parts = [decode_batch(b).changes for b in raw]
    joined = concat_columns(parts)
    whole = decode_batch(b"".join(raw)).changes
    assert joined == whole
    assert len(joined) == sum(len(b) for b in buffers)


@settings(deadline=None, max_examples=40)
@given(buffers_strategy, st.dictionaries(st.integers(0, VBUCKETS - 1), st.integers(0, 2**63 - 1)))
def test_rows_of_a_run_equal_rows_buffer_by_buffer(
    buffers: list[list[tuple[str, int, int, bytes, bytes]]], given_ends: dict[int, int]
) -> None:
    ends = {vb: given_ends.get(vb, 2**63 - 1) for vb in range(VBUCKETS)}
    snaps = {vb: (vb, 2**62 + vb) for vb in range(VBUCKETS)}
    parts = [decode_batch(b).changes for b in decoded(buffers)]
    one_by_one, reached = ChangeRows(), set()
    for part in parts:
        reached |= one_by_one.append_changes(part, snaps, ends)
    pending, lookup, seen = PendingChanges(rows_max=10**9), EndSeqnos(ends), set()
    for part in parts:
        pending.add(part)
        seen |= lookup.reached(part)
    run = ChangeRows()
    run.append_changes(pending.take(), snaps, ends)
    assert run.to_batch().equals(one_by_one.to_batch())
    model = {vb for b in buffers for _, vb, seqno, _, _ in b if seqno >= ends[vb]}
    assert seen == reached == model
    assert len(pending) == 0 and not any(pending.holds(vb) for vb in range(VBUCKETS))


def test_pending_changes_hold_and_fill() -> None:
    first = decode_batch(frame(("mutation", 1, 5, b"a", b"x")) * 3).changes
    second = decode_batch(frame(("deletion", 2, 6, b"b", b""))).changes
    pending = PendingChanges(rows_max=4)
    pending.add(first)
    assert pending.holds(1) and not pending.holds(2) and not pending.full
    pending.add(decode_batch(b"").changes)  # nothing: nothing changes
    assert len(pending) == 3
    pending.add(second)
    assert pending.full and pending.holds(2)
    taken = pending.take()
    assert taken.vbucket == [1, 1, 1, 2] and taken.key == [b"a", b"a", b"a", b"b"]
    assert not pending.holds(1) and len(pending) == 0
    assert len(pending.take()) == 0
    by_bytes = PendingChanges(rows_max=100, bytes_max=len(first.data))
    by_bytes.add(first)
    assert by_bytes.full
    empty = ChangeRows()
    empty.append_changes(concat_columns([]), {}, {})
    assert empty.to_batch().num_rows == 0
    assert isinstance(empty.to_batch(), pa.RecordBatch)
