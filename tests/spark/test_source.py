"""``source`` helpers without Spark: grouping vbuckets into Spark partitions (a small
micro-batch in one), the batch read's reduction of change rows to each key's newest live
version, and its release of a finished vbucket's rows while the others stream
(``PendingRows``)."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from changefeed import limits
from changefeed.spark import source
from changefeed.spark.offsets import VbOffset
from changefeed.spark.options import SourceOptions
from changefeed.spark.reading import VbRange
from changefeed.spark.schema import ARROW_SCHEMA
from changefeed.spark.source import (
    ONE_TASK_SEQNOS_MAX,
    ChangefeedBatchReader,
    ChangefeedStreamReader,
    PendingRows,
    group_ranges,
    latest_live_rows,
)

_DEFAULTS = {"cas": 0, "expiry": 0, "flags": 0, "rev_seqno": 0, "snap_start": 0, "snap_end": 0}


def change_rows(rows: list[tuple[int, int, str, bytes, str]]) -> pa.Table:
    """A change-row table of ``(vbucket, seqno, key, value, op)``."""
    return pa.Table.from_pylist(
        [{"vbucket": vb, "seqno": s, "key": k, "value": v, "op": op} | _DEFAULTS
         for vb, s, k, v, op in rows],
        schema=ARROW_SCHEMA,
    )  # fmt: skip


def reference_live(rows: list[tuple[int, int, str, bytes, str]]) -> set[tuple[str, bytes]]:
    """What a snapshot must hold, computed row by row: each key's newest change, if a mutation."""
    newest: dict[str, tuple[int, bytes, str]] = {}
    for _, seqno, key, value, op in rows:
        if key not in newest or seqno > newest[key][0]:
            newest[key] = (seqno, value, op)
    return {(key, value) for key, (_, value, op) in newest.items() if op == "mutation"}


def test_group_ranges_deals_only_vbuckets_with_work() -> None:
    ranges = [VbRange(vb, VbOffset(1, 5, 5, 5), 5 + vb % 3, 1) for vb in range(10)]
    ranges.append(VbRange(10, VbOffset(1, 5, 5, 5), 5, 2))  # same seqno, new branch: read it
    groups = group_ranges(ranges, 3)
    dealt = [[r.vbucket for r in g.ranges] for g in groups]
    assert dealt == [[1, 5, 10], [2, 7], [4, 8]]
    assert sorted(vb for g in dealt for vb in g) == [1, 2, 4, 5, 7, 8, 10]
    assert group_ranges(ranges[:1], 4) == [], "nothing to read: no partitions"
    assert len(group_ranges(ranges, 100)) == 7, "at most one partition per vbucket"


def test_latest_live_rows_keeps_each_keys_newest_mutation() -> None:
    rows = [
        (0, 1, "a", b"a1", "mutation"),
        (1, 1, "b", b"b1", "mutation"),
        (0, 2, "a", b"a2", "mutation"),
        (1, 2, "b", b"", "deletion"),
        (0, 3, "c", b"c1", "mutation"),
        (0, 4, "c", b"", "expiration"),
        (1, 3, "d", b"d1", "mutation"),
    ]
    table = pa.Table.from_pylist(
        [
            {"vbucket": vb, "seqno": s, "key": k, "value": v, "op": op}
            | {"cas": 0, "expiry": 0, "flags": 0, "rev_seqno": 0, "snap_start": 0, "snap_end": 0}
            for vb, s, k, v, op in rows
        ],
        schema=ARROW_SCHEMA,
    )
    got = latest_live_rows(table)
    assert got.schema == ARROW_SCHEMA
    assert sorted(zip(got["key"].to_pylist(), got["value"].to_pylist(), strict=True)) == [
        ("a", b"a2"),
        ("d", b"d1"),
    ]
    assert latest_live_rows(table.slice(0, 0)).num_rows == 0


@pytest.mark.parametrize("repeats", [False, True])
def test_latest_live_rows_matches_a_row_by_row_reference(repeats: bool) -> None:
    """Unique keys take the hash check only (no group-by, no copy when all are live); keys that
    repeat take the group-by. Both give each key's newest version, deletions left out."""
    rng = random.Random(7)
    keys = [f"k{i:05d}" for i in range(3000)]
    rows = []
    for vb in range(4):
        seqno = 0
        for key in keys[vb::4]:
            for _ in range(rng.randint(1, 3) if repeats else 1):
                seqno += 1
                op = "deletion" if repeats and rng.random() < 0.2 else "mutation"
                rows.append((vb, seqno, key, f"{key}@{seqno}".encode(), op))
    # Vbuckets interleaved at random, each in seqno order (as the wire and PendingRows keep it).
    lanes = [[r for r in rows if r[0] == vb] for vb in range(4)]
    rows = []
    while any(lanes):
        rows.append(rng.choice([lane for lane in lanes if lane]).pop(0))
    table = change_rows(rows)
    got = latest_live_rows(table)
    assert got.schema == ARROW_SCHEMA
    assert set(zip(got["key"].to_pylist(), got["value"].to_pylist(), strict=True)) == (
        reference_live(rows)
    )
    assert got.num_rows == len(reference_live(rows)), "one row per live key"
    if not repeats:
        assert got is table, "unique live keys: the table itself, nothing copied"


def test_pending_rows_release_finished_vbuckets_once_worth_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of a finished vbucket are handed on (all of them, once) when at least
    ``RELEASE_ROWS_MIN`` are held; rows of unfinished vbuckets stay; None releases all."""
    monkeypatch.setattr(source, "RELEASE_ROWS_MIN", 10)
    pending = PendingRows()
    batch = change_rows([(vb, s, f"{vb}-{s}", b"{}", "mutation")
                         for s in range(1, 9) for vb in (0, 1, 2)]).to_batches()[0]  # fmt: skip
    pending.add(batch)
    assert pending.release(frozenset()) == [], "nothing finished"
    assert pending.release(frozenset({0})) == [], "8 rows of vbucket 0: fewer than 10"
    (first,) = pending.release(frozenset({0, 1}))
    assert sorted(set(first.column("vbucket").to_pylist())) == [0, 1]
    assert first.num_rows == 16 and len(pending) == 8
    assert pending.release(frozenset({0, 1})) == [], "released vbuckets are not released again"
    pending.add(change_rows([(2, 9, "2-9", b"{}", "mutation")]).to_batches()[0])
    (rest,) = pending.release(None)
    assert sorted(rest.column("seqno").to_pylist()) == list(range(1, 10))
    assert pc.all(pc.equal(rest.column("vbucket"), 2)).as_py()
    assert len(pending) == 0 and pending.release(None) == []


def test_a_snapshot_release_is_handed_on_in_even_bounded_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Vbuckets that finish together come as one table; Spark gets it in batches of at most
    ``ROWS_PER_BATCH_MAX`` rows, of even size, holding each live row once."""
    monkeypatch.setattr(limits, "ROWS_PER_BATCH_MAX", 1000)
    reader = ChangefeedBatchReader(SourceOptions.parse({"format": "binary"}))
    table = change_rows([(vb, s, f"{vb}-{s}", b"{}", "mutation")
                         for vb in range(5) for s in range(1, 501)])  # fmt: skip
    batches = list(reader._convert(table))
    assert [b.num_rows for b in batches] == [834, 834, 832]
    assert all(b.schema == ARROW_SCHEMA for b in batches)
    keys = [k for b in batches for k in b.column("key").to_pylist()]
    assert sorted(keys) == sorted(table.column("key").to_pylist())
    assert list(reader._convert(table.slice(0, 0))) == []


@pytest.mark.parametrize("span", [1, ONE_TASK_SEQNOS_MAX, ONE_TASK_SEQNOS_MAX + 1])
def test_a_small_micro_batch_is_read_in_one_task(span: int) -> None:
    options = SourceOptions.parse({"partitions": "4"})
    reader = ChangefeedStreamReader(options)
    start = {str(vb): VbOffset(7, 100, 100, 100).to_dict() for vb in range(8)}
    end = {vb: dict(o) for vb, o in start.items()}
    for i in range(span):  # spread over the vbuckets
        end[str(i % 8)]["seqno"] += 1
    end = {vb: o | {"snap_start": o["seqno"], "snap_end": o["seqno"]} for vb, o in end.items()}
    parts = reader.partitions(start, end)
    assert len(parts) == (1 if span <= ONE_TASK_SEQNOS_MAX else 4), [len(parts), span]
    covered = sorted(r.vbucket for p in parts for r in p.ranges)  # type: ignore[attr-defined]
    assert covered == sorted({i % 8 for i in range(span)})
