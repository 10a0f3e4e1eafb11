"""``merge_source``: a micro-batch reduced to each key's final change with Arrow kernels, held
equal to the row-by-row algorithm the mirror writer used before (the model below) on seeded
random batches, with and without rollback rows.
"""

from __future__ import annotations

import random
from typing import Any

import pyarrow as pa
import pytest

from changefeed.spark.merge_source import (
    DELETED,
    HISTORY_SCHEMA,
    MIRROR_COLUMNS,
    SOURCE_SCHEMA,
    latest_changes,
    rollback_plan,
)
from changefeed.spark.schema import ARROW_SCHEMA

VBUCKETS = 4


def row(vb: int, seqno: int, key: str, op: str = "mutation") -> dict[str, Any]:
    return {
        "vbucket": vb,
        "seqno": seqno,
        "key": key,
        "value": b"" if op != "mutation" else f"{key}@{seqno}".encode(),
        "op": op,
        "cas": 1000 + seqno,
        "expiry": 0,
        "flags": seqno % 7,
        "rev_seqno": 1 + seqno % 3,
        "snap_start": seqno,
        "snap_end": seqno,
    }


def random_batch(
    rng: random.Random, count: int, *, rollbacks: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A stream-ordered batch (seqnos rise per vbucket, and restart after a rollback row below
    the seqno reached) and a history of what the mirror and earlier batches held."""
    seqno = dict.fromkeys(range(VBUCKETS), 100)
    keys = {vb: [f"k{vb}-{i}" for i in range(12)] for vb in range(VBUCKETS)}
    rows = []
    for _ in range(count):
        vb = rng.randrange(VBUCKETS)
        if rollbacks and rng.random() < 0.05:
            seqno[vb] = rng.randint(seqno[vb] - 30, seqno[vb])
            rows.append({**row(vb, seqno[vb], "", "rollback"), "cas": 0, "rev_seqno": 0})
            continue
        seqno[vb] += rng.randint(1, 3)
        op = rng.choice(["mutation"] * 6 + ["deletion", "expiration"])
        rows.append(row(vb, seqno[vb], rng.choice(keys[vb]), op))
    history = [
        {"key": rng.choice(keys[vb] + [f"gone{vb}-{i}" for i in range(3)]), "vbucket": vb,
         "seqno": rng.randint(50, 130)}
        for vb in range(VBUCKETS) for _ in range(rng.randint(0, 15))
    ]  # fmt: skip
    return rows, history


def model(
    rows: list[dict[str, Any]], history: list[dict[str, Any]]
) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """The row-by-row algorithm: each key's last change; a rollback of V to R voids the final
    changes of V above R so far and every history key of V above R (to re-read); a later row
    of a key wins over its re-read."""
    final: dict[str, dict[str, Any]] = {}
    refetch: dict[str, int] = {}
    for r in rows:
        if r["op"] == "rollback":
            vb, seqno = r["vbucket"], r["seqno"]
            for key in [k for k, c in final.items() if c["seqno"] > seqno and c["vbucket"] == vb]:
                del final[key]
                refetch[key] = vb
            for h in history:
                if h["vbucket"] == vb and h["seqno"] > seqno:
                    final.pop(h["key"], None)
                    refetch[h["key"]] = vb
            continue
        refetch.pop(r["key"], None)
        final[r["key"]] = r
    return final, refetch


def as_source_rows(final: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        key: {**{c: r[c] for c in MIRROR_COLUMNS}, DELETED: r["op"] != "mutation"}
        for key, r in final.items()
    }


def by_key(table: pa.Table) -> dict[str, dict[str, Any]]:
    rows = table.to_pylist()
    out = {r["key"]: r for r in rows}
    assert len(out) == len(rows), "a key twice in the merge source"
    return out


@pytest.mark.parametrize("count", [0, 1, 50, 2000])
def test_latest_changes_equals_the_row_by_row_result(rng: random.Random, count: int) -> None:
    rows, _ = random_batch(rng, count, rollbacks=False)
    source = latest_changes(pa.Table.from_pylist(rows, schema=ARROW_SCHEMA))
    assert source.schema == SOURCE_SCHEMA
    want, refetch = model(rows, [])
    assert refetch == {}
    assert by_key(source) == as_source_rows(want)


def test_newest_seqno_wins_and_a_deletion_is_a_change() -> None:
    rows = [
        row(0, 5, "a"), row(1, 6, "b"), row(0, 7, "a", "deletion"), row(1, 9, "b"),
        row(0, 8, "c", "expiration"), row(0, 10, "c"),
    ]  # fmt: skip
    got = by_key(latest_changes(pa.Table.from_pylist(rows, schema=ARROW_SCHEMA)))
    assert {k: (r["seqno"], r[DELETED]) for k, r in got.items()} == {
        "a": (7, True),
        "b": (9, False),
        "c": (10, False),
    }


def test_latest_changes_refuses_rollback_rows() -> None:
    rows = [row(0, 5, "a"), {**row(0, 3, "", "rollback")}]
    with pytest.raises(AssertionError):
        latest_changes(pa.Table.from_pylist(rows, schema=ARROW_SCHEMA))


@pytest.mark.parametrize("count", [20, 300, 3000])
def test_rollback_plan_equals_the_row_by_row_result(rng: random.Random, count: int) -> None:
    for _ in range(10):
        rows, history = random_batch(rng, count, rollbacks=True)
        if not any(r["op"] == "rollback" for r in rows):
            rows.append({**row(0, 90, "", "rollback"), "cas": 0, "rev_seqno": 0})
        changes = pa.Table.from_pylist(rows, schema=ARROW_SCHEMA)
        source, refetch = rollback_plan(changes, pa.Table.from_pylist(history, HISTORY_SCHEMA))
        want, want_refetch = model(rows, history)
        assert source.schema == SOURCE_SCHEMA
        assert refetch == want_refetch
        assert by_key(source) == as_source_rows(want)


def test_a_row_after_the_rollback_row_wins_and_one_before_is_re_read() -> None:
    rows = [
        row(0, 30, "late"), row(0, 31, "early"), row(1, 40, "other"),
        {**row(0, 20, "", "rollback"), "cas": 0, "rev_seqno": 0},
        row(0, 21, "late"), row(0, 22, "fresh"),
    ]  # fmt: skip
    history = [{"key": "old", "vbucket": 0, "seqno": 25}, {"key": "kept", "vbucket": 0, "seqno": 9}]
    source, refetch = rollback_plan(
        pa.Table.from_pylist(rows, schema=ARROW_SCHEMA),
        pa.Table.from_pylist(history, HISTORY_SCHEMA),
    )
    assert refetch == {"early": 0, "old": 0}
    assert {k: r["seqno"] for k, r in by_key(source).items()} == {
        "late": 21,
        "fresh": 22,
        "other": 40,
    }
