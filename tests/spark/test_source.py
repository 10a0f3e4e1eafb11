"""``source`` helpers without Spark: grouping vbuckets into Spark partitions, and the batch
read's reduction of change rows to each key's newest live version."""

from __future__ import annotations

import pyarrow as pa

from changefeed.spark.offsets import VbOffset
from changefeed.spark.reading import VbRange
from changefeed.spark.schema import ARROW_SCHEMA
from changefeed.spark.source import group_ranges, latest_live_rows


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
