"""The ``changefeed`` source and the mirror writer on one local[2] session per module.

- ``maxOffsetsPerTrigger`` bounds every micro-batch, and the batches add up to every change;
- a batch read (``spark.read.format("changefeed")``) equals the store on every column;
- a diverged history (a node restored from an old copy of its data directory) reaches the
  changelog as ``rollback`` rows, and the mirror still equals the store afterwards, on every
  column (seqno, cas, flags, expiry, rev_seqno as well as the value).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest

from changefeed.cli.node_process import NodeProcess
from changefeed.spark import MirrorWriter
from support.nodes import NodeFactory

from .helpers import (
    Model,
    assert_changelog_once,
    assert_mirror_matches,
    changelog,
    diff,
    live,
    store_state,
    table_state,
    values_of,
    workload,
    write,
    write_meta,
)

FAST_NODE = ["--no-durable"]  # these tests never crash the machine, only processes


def run_mirror(spark: Any, node: NodeProcess, root: Path, **options: str) -> list[dict[str, Any]]:
    """One availableNow run of readStream -> foreachBatch(MirrorWriter); returns its progress."""
    opts = node.source_options(format="binary", **options)  # values are not JSON: compared as bytes
    query = (
        spark.readStream.format("changefeed")
        .options(**opts)
        .load()
        .writeStream.foreachBatch(MirrorWriter(root / "tables", opts))
        .option("checkpointLocation", str(root / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        finished = query.awaitTermination(180)
        assert finished, "the availableNow query did not finish in 180 s"
    finally:
        query.stop()
    assert query.exception() is None, query.exception()
    return [json.loads(p.json) if hasattr(p, "json") else p for p in query.recentProgress]


def seqno_span(progress: dict[str, Any]) -> int:
    """Seqnos between a batch's start and end offsets, all vbuckets together."""
    source = progress["sources"][0]
    start, end = (_as_dict(source["startOffset"]), _as_dict(source["endOffset"]))
    return sum(o["seqno"] - start.get(vb, {"seqno": 0})["seqno"] for vb, o in end.items())


def _as_dict(offset: Any) -> dict[str, Any]:
    """An offset as progress shows it: a JSON object, a JSON string, or None (no start)."""
    if offset is None:
        return {}
    return json.loads(offset) if isinstance(offset, str) else dict(offset)


def test_max_offsets_per_trigger_bounds_every_batch(
    spark: Any, nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=FAST_NODE)
    limit = 2500
    model: Model = {}
    # Every op a new key: no deduplication, so rows == seqnos and the total is exact.
    ops = [(f"u-{i:06d}", f"v-{rng.randrange(10**9)}".encode()) for i in range(12_000)]
    write(node.port, ops, model)

    progress = run_mirror(spark, node, tmp_path, maxOffsetsPerTrigger=str(limit))
    rows = [p["numInputRows"] for p in progress]
    print(f"rows per batch {rows}")
    assert all(r <= limit for r in rows), rows
    assert all(seqno_span(p) <= limit for p in progress), [seqno_span(p) for p in progress]
    assert sum(rows) == len(ops), (sum(rows), len(ops))
    assert len([r for r in rows if r]) >= len(ops) // limit, rows
    assert_mirror_matches(tmp_path / "tables", node, model)

    # More changes on the same checkpoint: updates and deletes of existing keys as well.
    more: list[tuple[str, bytes | None]] = [
        (f"u-{rng.randrange(12_000):06d}", None if rng.random() < 0.1 else b"w2-%d" % i)
        for i in range(6000)
    ]
    write(node.port, more, model)
    progress = run_mirror(spark, node, tmp_path, maxOffsetsPerTrigger=str(limit))
    rows = [p["numInputRows"] for p in progress]
    print(f"rows per batch after updates {rows}")
    assert all(r <= limit for r in rows), rows
    assert 0 < sum(rows) <= len(more), (sum(rows), len(more))
    assert_mirror_matches(tmp_path / "tables", node, model)
    assert_changelog_once(tmp_path / "tables")


def test_batch_read_equals_store(spark: Any, nodes: NodeFactory, rng: random.Random) -> None:
    node = nodes(args=FAST_NODE)
    model: Model = {}
    write(node.port, workload(rng, 15_000, keys=5000, delete_ratio=0.15), model)

    rows = spark.read.format("changefeed").options(**node.source_options(format="binary")).load()
    got = table_state(rows.toArrow())  # every column; a key read twice fails here
    truth = store_state(node)
    problem = diff(got, truth)
    assert not problem, f"batch read differs from the store: {problem}"
    assert not diff(values_of(truth), live(model)), diff(values_of(truth), live(model))


@pytest.mark.parametrize("w2", ["shorter", "longer"])
@pytest.mark.parametrize("restart", ["crash", "clean"])
def test_rollback_reaches_changelog_and_mirror_equals_store(
    spark: Any, nodes: NodeFactory, tmp_path: Path, rng: random.Random, w2: str, restart: str
) -> None:
    """W0; clean stop; copy OLD; W1 (updates, deletes, new keys) mirrored by query 1; restore
    OLD; start (``clean``) or start, crash and start again (``crash``); W2 (diverged: other
    values, some W1-only keys again, deletes); query 2 from the same checkpoint must roll back
    and end equal to the store. W2 ``shorter`` leaves the node's high seqnos below query 1's
    offsets (the reader must not ask for start > end), ``longer`` above them."""
    node = nodes(args=FAST_NODE)
    old_copy = tmp_path / "old-copy"
    model: Model = {}
    # W0 with flags and expiries: a re-read key must come back with them, not only its value.
    w0 = [(f"k-{i:05d}", f"W0-{i}".encode(), i, 3600 if i % 2 else 0) for i in range(3000)]
    write_meta(node.port, w0, model)
    node.stop()
    node.copy_data(old_copy)
    model_old = dict(model)

    node.start()
    w1: list[tuple[str, bytes | None]] = []
    for i in range(2000):
        key = f"k-{rng.randrange(3000):05d}"
        w1.append((key, None) if rng.random() < 0.2 else (key, f"W1-{i}".encode()))
    w1 += [(f"lost-{i:04d}", f"W1-lost-{i}".encode()) for i in range(800)]
    write(node.port, w1, model)
    run_mirror(spark, node, tmp_path, maxOffsetsPerTrigger="2000")
    assert_mirror_matches(tmp_path / "tables", node, model)

    node.stop()
    node.restore_data(old_copy)
    model = model_old
    node.start()  # a restored directory starts a new history branch (commit 1585e19)
    if restart == "crash":  # and a crash-restart another one
        node.kill()
        node.start()
    count = 700 if w2 == "shorter" else 7000
    w2_ops: list[tuple[str, bytes | None]] = []
    for i in range(count):
        roll = rng.random()
        if roll < 0.1:
            w2_ops.append((f"lost-{rng.randrange(1600):04d}", f"W2-lost-{i}".encode()))
        elif roll < 0.15:
            w2_ops.append((f"k-{rng.randrange(3000):05d}", None))
        else:
            w2_ops.append((f"k-{rng.randrange(4000):05d}", f"W2-{i}".encode()))
    write(node.port, w2_ops, model)

    # These batches are small: the driver writes them (dist_mirror.py), except with
    # ``crash``, where the write tasks do (both paths must roll back alike).
    tasks_only = {"mirrorDriverBatchMax": "0"} if restart == "crash" else {}
    progress = run_mirror(
        spark, node, tmp_path, maxOffsetsPerTrigger="2000", failOnDataLoss="false", **tasks_only
    )
    print(f"rows per batch {[p['numInputRows'] for p in progress]}")
    log = changelog(tmp_path / "tables")
    rollbacks = log.filter(pc.equal(log.column("op"), "rollback"))
    print(f"rollback rows {sorted(rollbacks.select(['vbucket', 'seqno']).to_pylist(), key=str)}")
    assert rollbacks.num_rows > 0, "query 2 read a diverged history without a rollback row"
    assert_mirror_matches(tmp_path / "tables", node, model)
