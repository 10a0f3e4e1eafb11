"""The mirror's driver path reading a small batch itself (``driver_read.py``, ``batch_plan.py``).

- Every micro-batch of a real stream, read in the driver for the offsets Spark planned, equals
  what Spark's task read gives (``toArrow``) on every column and in each vbucket's order, across
  a diverged history (rollback rows); the same stream written by two writers, one reading in the
  driver and one collecting with ``toArrow``, leaves the same tables (every column, metadata
  included), and the mirror equals the store.
- The same comparison for typed documents of every Spark type the schema option maps.

Typed documents, the position column's name and Spark's row count: ``test_dist_mirror.py``
(the default suite; this module is slow).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from changefeed.cli.node_process import NodeProcess
from changefeed.spark import MirrorWriter
from changefeed.spark.batch_plan import source_batch
from changefeed.spark.driver_read import read_batch, spark_arrow_schema
from changefeed.spark.mirror_tasks import COMMIT_TIMESTAMP
from support.nodes import NodeFactory

from .helpers import (
    Model,
    assert_mirror_matches,
    run_available_now,
    write,
    write_meta,
)
from .test_pipeline import FAST_NODE


def by_vbucket(rows: pa.Table) -> dict[int, list[dict[str, Any]]]:
    """Each vbucket's rows in the order read (tasks may interleave vbuckets differently)."""
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows.to_pylist():
        out[row["vbucket"]].append(row)
    return dict(out)


class ComparingSink:
    """``foreachBatch``: reads each batch both ways and compares, then hands it to the writers."""

    def __init__(self, writers: list[MirrorWriter]) -> None:
        self.writers = writers
        self.rows = 0
        self.rollbacks = 0
        self.batches: list[int] = []

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        source = source_batch(batch_df, batch_id)
        assert source is not None, f"batch {batch_id}: not read from the plan"
        by_spark = batch_df.toArrow()
        by_driver = read_batch(source, batch_df.schema, spark_arrow_schema(batch_df))
        assert by_driver.schema == by_spark.schema
        assert by_vbucket(by_driver) == by_vbucket(by_spark), f"batch {batch_id}"
        self.rows += by_driver.num_rows
        self.rollbacks += pc.sum(pc.equal(by_driver.column("op"), "rollback")).as_py() or 0
        self.batches.append(batch_id)
        for writer in self.writers:
            writer(batch_df, batch_id)


def run_compared(spark: Any, node: NodeProcess, root: Path, **options: str) -> ComparingSink:
    opts = node.source_options(format="binary", maxOffsetsPerTrigger="900", **options)
    writers = [
        MirrorWriter(root / "driver-read", opts),
        MirrorWriter(root / "to-arrow", {**opts, "mirrorDriverRead": "false"}),
    ]
    sink = ComparingSink(writers)
    run_available_now(spark, opts, sink, root / "checkpoint", closing=writers)
    assert writers[0].last_in_driver and writers[1].last_in_driver
    return sink


def sorted_rows(table: pa.Table, keys: list[str]) -> list[dict[str, Any]]:
    return table.sort_by([(k, "ascending") for k in keys]).to_pylist()


def assert_same_tables(root: Path) -> None:
    """The tables written from the driver's read and from ``toArrow`` hold the same rows."""
    for name, keys in (("mirror", ["key"]), ("changelog", ["batch_id", "vbucket", "seqno", "op"])):
        tables = [DeltaTable(str(root / path / name)) for path in ("driver-read", "to-arrow")]
        rows = [t.to_pyarrow_table().drop_columns([COMMIT_TIMESTAMP], ) if name == "changelog"
                else t.to_pyarrow_table() for t in tables]  # fmt: skip
        assert rows[0].schema == rows[1].schema, name
        assert sorted_rows(rows[0], keys) == sorted_rows(rows[1], keys), name
        assert tables[0].version() == tables[1].version(), name


@pytest.mark.slow  # ~90 s; the default suite's rollback tests (test_pipeline.py) take this path
def test_the_driver_reads_what_the_task_reads_rollbacks_included(
    spark: Any, nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=FAST_NODE)
    old_copy = tmp_path / "old-copy"
    model: Model = {}
    w0 = [(f"k-{i:05d}", f"W0-{i}".encode(), i, 3600 if i % 2 else 0) for i in range(1200)]
    write_meta(node.port, w0, model)
    node.stop()
    node.copy_data(old_copy)
    model_old = dict(model)
    node.start()
    w1: list[tuple[str, bytes | None]] = [
        (f"k-{rng.randrange(1200):05d}", None if rng.random() < 0.2 else f"W1-{i}".encode())
        for i in range(600)
    ]
    w1 += [(f"lost-{i:04d}", f"W1-lost-{i}".encode()) for i in range(300)]
    write(node.port, w1, model)
    first = run_compared(spark, node, tmp_path)
    assert first.rows > 0 and first.rollbacks == 0
    assert_mirror_matches(tmp_path / "driver-read", node, model)

    node.stop()
    node.restore_data(old_copy)  # a new history branch: the next query must roll back
    model = model_old
    node.start()
    w2: list[tuple[str, bytes | None]] = [
        (f"lost-{rng.randrange(300):04d}", f"W2-lost-{i}".encode()) if i % 5 == 0
        else (f"k-{rng.randrange(1500):05d}", f"W2-{i}".encode())
        for i in range(700)
    ]  # fmt: skip
    write(node.port, w2, model)
    second = run_compared(spark, node, tmp_path, failOnDataLoss="false")
    print(f"batches {first.batches} then {second.batches}; rollback rows {second.rollbacks}")
    assert second.rollbacks > 0, "the second query read a diverged history without rollbacks"
    assert_same_tables(tmp_path)
    assert_mirror_matches(tmp_path / "driver-read", node, model)


RICH_SCHEMA = (
    "n bigint, d double, name string, ts timestamp, day date, price decimal(10,2), "
    "tags array<string>, inner struct<a:int,b:string>, ok boolean"
)


@pytest.mark.slow  # ~20 s; the default suite's typed documents: test_dist_mirror.py
def test_the_driver_reads_rich_typed_documents_as_sparks_task_does(
    spark: Any, nodes: NodeFactory, tmp_path: Path
) -> None:
    """Each batch of typed documents (every Spark type the schema option maps: timestamps,
    dates, decimals, arrays, structs, booleans; a value of the wrong type, malformed JSON, a
    deletion), read by the driver and by Spark's task (``toArrow``): the same Arrow schema and
    the same rows in each vbucket's order."""
    node = nodes(args=FAST_NODE)
    docs: list[tuple[str, bytes | None]] = []
    for i in range(300):
        doc: dict[str, Any] = {
            "n": "not a number" if i % 50 == 7 else i, "d": i / 3, "name": f"n{i}",
            "ts": f"2024-01-02T03:04:{i % 60:02d}.123456Z", "day": "2024-02-29",
            "price": f"{i}.25", "tags": [str(i), None], "inner": {"a": i, "b": None},
            "ok": i % 2 == 0,
        }  # fmt: skip
        docs.append((f"k{i:03d}", json.dumps(doc).encode()))
    docs += [("bad", b"{oops"), ("k001", None)]
    write(node.port, docs)
    opts = node.source_options(schema=RICH_SCHEMA, maxOffsetsPerTrigger="200")
    sink = ComparingSink([])
    run_available_now(spark, opts, sink, tmp_path / "checkpoint")
    assert len(sink.batches) > 1 and sink.rows > 0, (sink.batches, sink.rows)
