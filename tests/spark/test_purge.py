"""Tombstone purge of the changelog (``spark/purge.py``, ``changefeed mirror purge``).

- Property: against a model (a row goes iff it is a deletion or expiration at or below the
  smaller of its vbucket's store purge point and mirror position), and never a row above the
  store's purge point.
- A real node and Spark local mode: deletions mirrored, the node compacted (tombstones purged,
  purge seqnos raised), more deletions mirrored after that; the purge removes exactly the
  changelog's delete rows at or below each vbucket's purge seqno in one commit, keeps every
  other row, leaves the mirror equal to the store, and the mirror job goes on after it.
- Refused with one line while another mirror job holds the tables.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from click.testing import CliRunner
from deltalake import DeltaTable
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.cli.main import cli
from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import KvClient
from changefeed.spark.purge import (
    PURGE_METADATA_KEY,
    TOMBSTONES,
    parse_purge_seqnos,
    purge_limits,
    tombstones_to_drop,
)
from changefeed.spark.table_lease import LEASE_FILE
from support.nodes import NodeFactory

from .helpers import Model, assert_mirror_matches, changelog, write
from .test_pipeline import run_mirror

OPS = ("mutation", "deletion", "expiration", "rollback")
rows_strategy = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 60), st.sampled_from(OPS)), max_size=80
)
points_strategy = st.dictionaries(st.integers(0, 5), st.integers(0, 60), max_size=6)


@settings(deadline=None)  # a loaded machine: no timing in tests
@given(rows_strategy, points_strategy, points_strategy)
def test_purge_drops_exactly_the_model_tombstones(
    rows: list[tuple[int, int, str]], points: dict[int, int], committed: dict[int, int]
) -> None:
    table = pa.table({
        "vbucket": pa.array([r[0] for r in rows], pa.int32()),
        "seqno": pa.array([r[1] for r in rows], pa.int64()),
        "op": pa.array([r[2] for r in rows], pa.string()),
    })  # fmt: skip
    drop = tombstones_to_drop(table, purge_limits(points, committed)).to_pylist()
    model = [
        op in ("deletion", "expiration") and vb in points and vb in committed
        and seqno <= min(points[vb], committed[vb])
        for vb, seqno, op in rows
    ]  # fmt: skip
    assert drop == model
    for (vb, seqno, _), dropped in zip(rows, drop, strict=True):
        if dropped:  # the safety rule, said on its own
            assert seqno <= points[vb] and seqno <= committed[vb]


def test_purge_seqnos_are_read_from_stat_keys() -> None:
    stats = {"vb_0:purge_seqno": "7", "vb_0:high_seqno": "9", "vb_12:purge_seqno": "0", "x": "1"}
    assert parse_purge_seqnos(stats) == {0: 7, 12: 0}


def purge_command(node_address: str, tables: Path) -> tuple[int, str]:
    result = CliRunner().invoke(
        cli, ["mirror", "purge", "--cluster", node_address, "--tables", str(tables), "--json"]
    )
    return result.exit_code, result.output


async def _compact(port: int) -> tuple[dict[int, int], int]:
    """Every vbucket compacted, its tombstones dropped: the purge seqnos, tombstones purged."""
    async with await KvClient.connect("127.0.0.1", port) as kv:
        points, purged = {}, 0
        for vb in range(kv.vbuckets):
            summary = await kv.compact(vb, drop_deletes=True)
            points[vb] = summary.purge_seqno
            purged += summary.purged
        return points, purged


def mirror_compact_purge(
    spark: Any, node: NodeProcess, root: Path, model: Model, *, later: bool
) -> tuple[pa.Table, dict[int, int], int]:
    """Deletions mirrored, the node compacted (every tombstone it may drop dropped), with
    ``later`` more deletions mirrored after that, then ``mirror purge``. Checks the changelog
    lost exactly its delete rows at or below each vbucket's purge seqno, in one commit, and
    nothing else; returns the changelog before, the purge seqnos and the tombstones purged."""
    first = [(f"a{i}", f"v{i}".encode()) for i in range(300)]
    write(node.port, first + [(f"a{i}", None) for i in range(0, 300, 3)], model)
    run_mirror(spark, node, root)
    points, purged = asyncio.run(_compact(node.port))
    assert purged > 0, points
    if later:  # deleted after the compaction: above every purge point, they must stay
        ops = [(f"b{i}", b"x") for i in range(100)] + [(f"b{i}", None) for i in range(0, 100, 2)]
        write(node.port, ops, model)
        run_mirror(spark, node, root)
    tables = root / "tables"
    before = changelog(tables)
    version = DeltaTable(str(tables / "changelog")).version()

    code, text = purge_command(node.address, tables)
    assert code == 0, text
    report = json.loads(text)

    after = changelog(tables)
    tombstone = pc.is_in(before.column("op"), value_set=pa.array(TOMBSTONES))
    rows = before.select(["vbucket", "seqno", "op"]).to_pylist()
    gone = [r for r, dead in zip(rows, tombstone.to_pylist(), strict=True)
            if dead and r["seqno"] <= points[r["vbucket"]]]  # fmt: skip
    assert len(gone) == purged, (len(gone), purged)  # what the store purged, nothing newer
    assert report["removed"] == purged == report["tables"]["changelog"]["removed"]
    kept = sorted((r["vbucket"], r["seqno"], r["op"]) for r in rows if r not in gone)
    now = sorted((r["vbucket"], r["seqno"], r["op"])
                 for r in after.select(["vbucket", "seqno", "op"]).to_pylist())  # fmt: skip
    assert now == kept
    deletions = 100 + (50 if later else 0)
    assert sum(1 for r in now if r[2] == "deletion") == deletions - purged
    table = DeltaTable(str(tables / "changelog"))
    assert table.version() == version + 1, "one commit"
    assert PURGE_METADATA_KEY in table.history(1)[0]
    assert_mirror_matches(tables, node, model)
    return before, points, purged


def test_purge_removes_the_tombstones_the_store_purged(
    spark: Any, nodes: NodeFactory, tmp_path: Path
) -> None:
    """One round (the compaction keeps each vbucket's newest tombstone: those stay)."""
    node = nodes(args=["--no-durable"])
    mirror_compact_purge(spark, node, tmp_path, {}, later=False)


@pytest.mark.slow
def test_purge_keeps_later_tombstones_and_the_job_goes_on(
    spark: Any, nodes: NodeFactory, tmp_path: Path
) -> None:
    node = nodes(args=["--no-durable"])
    model: Model = {}
    mirror_compact_purge(spark, node, tmp_path, model, later=True)
    tables = tmp_path / "tables"
    after = changelog(tables)
    code, text = purge_command(node.address, tables)  # nothing more to purge
    assert code == 0 and json.loads(text)["removed"] == 0, text
    write(node.port, [(f"c{i}", b"y") for i in range(50)] + [("b1", None)], model)
    run_mirror(spark, node, tmp_path)  # the job goes on over the purged changelog
    assert_mirror_matches(tables, node, model)
    assert changelog(tables).num_rows == after.num_rows + 51


def test_purge_is_refused_while_a_mirror_job_holds_the_tables(
    nodes: NodeFactory, tmp_path: Path
) -> None:
    node = nodes(args=["--no-durable"])
    tables = tmp_path / "tables"
    (tables / "changelog").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket
        import time

        record = {"owner": f"{socket.gethostname()}:{holder.pid}", "host": socket.gethostname(),
                  "pid": holder.pid, "renewed": time.time()}  # fmt: skip
        (tables / LEASE_FILE).write_text(json.dumps(record))
        code, text = purge_command(node.address, tables)
    finally:
        holder.kill()
        holder.wait()
    assert code == 1, text
    errors = [line for line in text.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "another mirror job" in errors[0], text
