"""The resolved watermark and the change-feed ``_change_type``, against simple models (no Spark).

Watermark: streams of per-vbucket changes (CAS rising within a vbucket, as the node's hybrid
clock makes them) cut into batches, some vbuckets rolled back: after every batch the watermark is
at most the HLC time of every vbucket's last committed change, and every change at or below it
is committed. Change types: a key's row is an insert if the key was not live just before it.
"""

from __future__ import annotations

import itertools

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.spark import watermark
from changefeed.spark.mirror_tasks import change_types

# A change: (vbucket, time step, is a rollback of that vbucket to its previous position).
changes_strategy = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 1000), st.booleans()), max_size=60
)


@settings(max_examples=80, deadline=None)
@given(changes=changes_strategy, cuts=st.lists(st.integers(0, 60), max_size=6))
def test_the_watermark_never_runs_ahead_of_a_vbuckets_committed_position(
    changes: list[tuple[int, int, bool]], cuts: list[int]
) -> None:
    clock: dict[int, int] = {}  # per vbucket: the last CAS issued (rises)
    seqno: dict[int, int] = {}
    rows: list[tuple[int, int, int, bool]] = []  # vbucket, seqno, cas, rollback
    for vb, step, is_rollback in changes:
        if is_rollback and seqno.get(vb):
            seqno[vb] -= 1
            rows.append((vb, seqno[vb], 0, True))
            continue
        clock[vb] = clock.get(vb, 1 << 40) + (step << 16) + 1  # ns in the upper bits
        seqno[vb] = seqno.get(vb, 0) + 1
        rows.append((vb, seqno[vb], clock[vb], False))
    bounds = sorted({0, len(rows), *(c for c in cuts if c <= len(rows))})
    positions: dict[int, watermark.Position] = {}
    committed: list[tuple[int, int, int, bool]] = []
    for start, end in itertools.pairwise(bounds):
        batch = rows[start:end]
        last = {vb: (s, 0 if rb else cas) for vb, s, cas, rb in batch}
        positions = watermark.advance(positions, [(vb, s, c) for vb, (s, c) in last.items()])
        committed += batch
        resolved = watermark.resolved_ns(positions)
        for position in positions.values():  # never ahead of any vbucket
            assert resolved <= (watermark.hlc_ns(position.cas) if position.cas else 0)
        # every change at or before the watermark is committed, of the vbuckets it counts
        for vb, _, cas, rb in rows[end:]:
            if not rb and vb in positions:
                assert watermark.hlc_ns(cas) > resolved or resolved == 0, (vb, cas, resolved)
    if not positions:
        assert watermark.resolved_ns(positions) == 0


def test_hlc_ns_drops_the_logical_counter() -> None:
    assert watermark.hlc_ns((123 << 16) | 0xFFFF) == 123 << 16
    with pytest.raises(ValueError, match="-1"):
        watermark.hlc_ns(-1)


def test_the_metadata_record_round_trips() -> None:
    positions = {3: watermark.Position(7, 5 << 16), 9: watermark.Position(2, 0)}
    record = watermark.to_metadata(positions, batch_id=4, groups=16)
    assert watermark.from_metadata(record) == positions
    assert record["resolvedHlcNs"] == 0
    assert watermark.latest_record([{"x": 1}, {"changefeed": record}, {}]) == record


ops = st.sampled_from(["mutation", "deletion", "expiration", "rollback"])


@settings(max_examples=50, deadline=None)
@given(
    rows=st.lists(st.tuples(st.sampled_from("abcd"), ops), max_size=30),
    held=st.sets(st.sampled_from("abcd")),
)
def test_change_types_follow_whether_the_key_was_live(
    rows: list[tuple[str, str]], held: set[str]
) -> None:
    live = set(held)
    expected: list[str | None] = []
    for key, op in rows:  # the model: one key at a time, in stream order
        if op == "rollback":
            expected.append(None)
        elif op == "mutation":
            expected.append("update_postimage" if key in live else "insert")
            live.add(key)
        else:
            expected.append("delete")
            live.discard(key)
    keys = pa.array([k if op != "rollback" else "" for k, op in rows], pa.string())
    got = change_types(keys, pa.array([op for _, op in rows], pa.string()),
                       pa.array(sorted(held), pa.string()))  # fmt: skip
    assert got.to_pylist() == expected
