"""Purge and compaction inside a running mirror job (``spark/maintenance.py``).

- The options: a bad interval names its option; a negative one means never.
- The schedule, on real tables with a clock the test moves: nothing before the interval, the
  compaction once it has passed, and not again until the next interval.
- A running streaming query (real node, Spark local mode) with both intervals 0: deletions are
  mirrored, the node compacts its vbuckets (tombstones purged, purge seqnos raised), more writes
  come; the job's own batches then purge exactly the changelog's tombstones at or below each
  vbucket's purge seqno (and the mirror's position) in one commit, and compact the tables'
  small files in commits that change no row, every column compared at the versions before and
  after each. The mirror still equals the store; every change is logged once.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.schema import Schema as DeltaSchema
from deltalake.transaction import AddAction, create_table_with_add_actions

from changefeed.consumer import KvClient
from changefeed.spark import MirrorWriter, watermark
from changefeed.spark.compaction import COMPACT_METADATA_KEY
from changefeed.spark.delta_files import GROUP_COLUMN, now_ms, table_fs, write_data_file
from changefeed.spark.maintenance import (
    OPTION_COMPACT,
    OPTION_PURGE,
    MaintenanceError,
    TableMaintenance,
    interval,
)
from changefeed.spark.node_state import fetch_latest_sync
from changefeed.spark.options import SourceOptions
from changefeed.spark.purge import PURGE_METADATA_KEY, TOMBSTONES, committed_seqnos
from changefeed.spark.table_lease import LEASE_FILE, TablesLease
from support.nodes import NodeFactory

from .helpers import Model, assert_changelog_once, assert_mirror_matches, write
from .test_compaction import build_table

WAIT_S = 180.0


def test_intervals_are_checked_and_negative_is_never() -> None:
    assert interval({}, OPTION_PURGE, 600.0) == 600.0
    assert interval({"mirrorpurgeintervals": "0"}, OPTION_PURGE, 600.0) == 0.0
    assert interval({OPTION_COMPACT: "-1"}, OPTION_COMPACT, 300.0) is None
    for bad in ("soon", "nan"):
        with pytest.raises(MaintenanceError, match=f"{OPTION_PURGE}: '{bad}'"):
            interval({OPTION_PURGE: bad}, OPTION_PURGE, 600.0)
    with pytest.raises(MaintenanceError, match="mirrorcompactfilesmin"):
        TableMaintenance("/nowhere", {"mirrorCompactFilesMin": "0"})


def test_compaction_runs_at_its_interval(tmp_path: Path) -> None:
    tables = tmp_path / "tables"
    build_table(str(tables / "changelog"), "changelog", [[(0, 2)]] * 4)
    now = [100.0]
    upkeep = TableMaintenance(
        str(tables), {OPTION_PURGE: "-1", OPTION_COMPACT: "10", "mirrorCompactFilesMin": "2"},
        clock=lambda: now[0],
    )  # fmt: skip
    now[0] = 109.0
    assert upkeep.after_batch().compacted is None  # not yet due
    assert DeltaTable(str(tables / "changelog")).version() == 3
    now[0] = 110.0
    done = upkeep.after_batch()
    assert done.purged is None and not done.errors  # the purge is off
    assert done.compacted is not None and done.compacted.files_removed == 4
    build_table(str(tables / "changelog"), "changelog", [])  # nothing new
    now[0] = 115.0
    assert upkeep.after_batch().compacted is None  # the next interval starts at 110


def test_a_failed_compaction_is_logged_and_the_job_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An unreadable small file (pyarrow's ArrowInvalid, not an OSError) fails the compaction:
    ``after_batch`` records it in one line and returns, the table untouched (it raised before
    the fix, ending the query after its batch had committed)."""
    tables = tmp_path / "tables"
    uri = str(tables / "changelog")
    build_table(uri, "changelog", [[(0, 2)]] * 4)
    victim = sorted((tables / "changelog" / f"{GROUP_COLUMN}=0").glob("*.parquet"))[0]
    with victim.open("r+b") as out:  # a bad footer
        out.seek(-6, os.SEEK_END)
        out.write(b"XXXXXX")
    upkeep = TableMaintenance(
        str(tables), {OPTION_PURGE: "-1", OPTION_COMPACT: "0", "mirrorCompactFilesMin": "2"}
    )
    with caplog.at_level("WARNING", logger="changefeed.mirror"):
        done = upkeep.after_batch()
    assert done.compacted is None
    assert len(done.errors) == 1 and done.errors[0].startswith("compaction: ArrowInvalid"), done
    assert any("compaction skipped" in r.getMessage() for r in caplog.records)
    assert DeltaTable(uri).version() == 3  # nothing committed
    # The purge is guarded the same way: options that reach no node fail, the job goes on.
    purging = TableMaintenance(str(tables), {OPTION_PURGE: "0", OPTION_COMPACT: "-1",
                                             "cluster": "127.0.0.1:1"})  # fmt: skip
    failed = purging.after_batch()
    assert failed.purged is None and len(failed.errors) == 1, failed
    assert failed.errors[0].startswith("purge: "), failed


async def _compact_node(port: int) -> tuple[dict[int, int], int]:
    async with await KvClient.connect("127.0.0.1", port) as kv:
        points, purged = {}, 0
        for vb in range(kv.vbuckets):
            summary = await kv.compact(vb, drop_deletes=True)
            points[vb] = summary.purge_seqno
            purged += summary.purged
        return points, purged


def _wait_committed(tables: Path, options: dict[str, str], what: str) -> None:
    """Until the mirror has committed every vbucket up to the node's high seqno."""
    deadline = time.monotonic() + WAIT_S
    while True:
        latest, _ = fetch_latest_sync(SourceOptions.parse(options))
        high = {vb: o.seqno for vb, o in latest.items() if o.seqno}
        committed = committed_seqnos(str(tables), None)
        if all(committed.get(vb, 0) >= seqno for vb, seqno in high.items()):
            return
        assert time.monotonic() < deadline, f"{what}: not committed in {WAIT_S} s"
        time.sleep(0.2)


def _commits(uri: str, key: str) -> list[int]:
    """Versions of the table's commits whose info holds ``key``, oldest first."""
    return sorted(c["version"] for c in DeltaTable(uri).history() if key in c)


def _rows(uri: str, version: int) -> list[dict[str, Any]]:
    """Every row of the table at ``version``, every column, in a stable order."""
    table = DeltaTable(uri, version=version).to_pyarrow_table()
    return sorted(table.to_pylist(), key=lambda r: (r["vbucket"], r["seqno"], str(r["op"])))


def _sorted(table: pa.Table) -> pa.Table:
    keys = [c for c in ("vbucket", "seqno", "op") if c in table.column_names]
    return table.sort_by([(c, "ascending") for c in keys])


@pytest.mark.slow
def test_a_running_job_purges_and_compacts(spark: Any, nodes: NodeFactory, tmp_path: Path) -> None:
    node = nodes(args=["--no-durable"])
    model: Model = {}
    first = [(f"a{i}", f"v{i}".encode()) for i in range(240)]
    write(node.port, first + [(f"a{i}", None) for i in range(0, 240, 3)], model)
    tables = tmp_path / "tables"
    options = node.source_options(
        format="binary", maxOffsetsPerTrigger="100", mirrorCompactFilesMin="2",
        **{OPTION_PURGE: "0", OPTION_COMPACT: "0"},
    )  # fmt: skip
    query = (
        spark.readStream.format("changefeed").options(**options).load()
        .writeStream.foreachBatch(MirrorWriter(tables, options))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="0 seconds").start()
    )  # fmt: skip
    try:
        _wait_committed(tables, options, "the first writes")
        points, purged = asyncio.run(_compact_node(node.port))
        assert purged > 0, points
        later = [(f"b{i}", b"x") for i in range(60)] + [(f"b{i}", None) for i in range(0, 60, 2)]
        write(node.port, later, model)  # above every purge point: they stay
        _wait_committed(tables, options, "the later writes")
        changelog_uri = str(tables / "changelog")
        deadline = time.monotonic() + WAIT_S
        while not _commits(changelog_uri, PURGE_METADATA_KEY):  # the batch after the writes
            assert time.monotonic() < deadline, "no purge in the job"
            time.sleep(0.2)
    finally:
        query.stop()
    assert query.exception() is None, query.exception()

    # The purge: exactly the tombstones at or below the store's purge points, in one commit.
    purges = _commits(changelog_uri, PURGE_METADATA_KEY)
    assert len(purges) == 1, purges  # later purges found nothing more to do
    before, after = _rows(changelog_uri, purges[0] - 1), _rows(changelog_uri, purges[0])
    gone = [r for r in before if r["op"] in TOMBSTONES and r["seqno"] <= points[r["vbucket"]]]
    assert len(gone) == purged  # what the store purged, nothing newer
    assert after == [r for r in before if r not in gone]
    # Compaction: commits that change no row, every column; the tables hold fewer files.
    for name in ("changelog", "mirror"):
        uri = str(tables / name)
        compactions = _commits(uri, COMPACT_METADATA_KEY)
        assert compactions, f"{name}: never compacted"
        for version in compactions:
            old = _sorted(DeltaTable(uri, version=version - 1).to_pyarrow_table())
            new = _sorted(DeltaTable(uri, version=version).to_pyarrow_table())
            assert new.num_rows and new.equals(old), (name, version)
    assert_mirror_matches(tables, node, model)
    logged = assert_changelog_once(tables)
    deletions = pc.sum(pc.is_in(logged.column("op"), pa.array(TOMBSTONES))).as_py()
    assert deletions == 80 + 30 - purged


def purge_tables_of(root: Path, rows: list[tuple[int, int, str]], high: dict[int, int]) -> None:
    """A changelog of ``rows`` ``(vbucket, seqno, op)`` in one file per vbucket group and a
    mirror whose position record says every vbucket committed up to ``high``: the tables a
    job leaves, through the writer's own file and commit calls."""
    full = pa.schema([("vbucket", pa.int32()), ("seqno", pa.int64()), ("op", pa.string()),
                      (GROUP_COLUMN, pa.int32())])  # fmt: skip
    for name in ("changelog", "mirror"):
        uri = str(root / name)
        fs = table_fs(uri, None)
        adds = []
        picked = rows if name == "changelog" else [r for r in rows if r[2] == "mutation"]
        for group in sorted({vb % 4 for vb, _, _ in picked}):
            mine = [r for r in picked if r[0] % 4 == group]
            part = pa.table({
                "vbucket": pa.array([r[0] for r in mine], pa.int32()),
                "seqno": pa.array([r[1] for r in mine], pa.int64()),
                "op": pa.array([r[2] for r in mine], pa.string()),
            })  # fmt: skip
            added = write_data_file(fs, name, part, group, 0)
            adds.append(AddAction(added["path"], added["size"], {GROUP_COLUMN: str(group)},
                                  now_ms(), True, added["stats"]))  # fmt: skip
        record = watermark.to_metadata(
            {vb: watermark.Position(seqno, 1 << 16) for vb, seqno in high.items()}, 0, 4
        )
        props = CommitProperties(
            app_transactions=[Transaction("changefeed-mirror", 0)],
            custom_metadata={watermark.METADATA_KEY: record} if name == "mirror" else None,  # type: ignore[dict-item]
        )
        create_table_with_add_actions(
            uri, DeltaSchema.from_arrow(full), adds, mode="append", partition_by=[GROUP_COLUMN],
            commit_properties=props,
        )  # fmt: skip


def test_the_job_purges_under_the_lease_it_holds(nodes: NodeFactory, tmp_path: Path) -> None:
    """The short version of the streaming test: the store's purge points from a real node
    after its compaction, tables as a job leaves them, the lease held as a job holds it; the
    upkeep removes exactly the tombstones at or below each vbucket's point, and the job still
    holds the lease afterwards."""
    node = nodes(args=["--no-durable"])
    model: Model = {}
    ops = [(f"a{i}", b"v") for i in range(200)] + [(f"a{i}", None) for i in range(150)]
    write(node.port, ops, model)
    latest, _ = fetch_latest_sync(SourceOptions.parse(node.source_options()))
    high = {vb: o.seqno for vb, o in latest.items() if o.seqno}
    deadline = time.monotonic() + WAIT_S
    while True:  # the node purges only flushed tombstones, each vbucket's newest kept
        points, purged = asyncio.run(_compact_node(node.port))
        if purged:
            break
        assert time.monotonic() < deadline, f"the node purged no tombstone: {points}"
        time.sleep(0.5)
    # Every seqno of a vbucket a row: tombstones on both sides of the points, and mutations.
    rows = [(vb, seqno, ("deletion", "expiration", "mutation")[seqno % 3])
            for vb, top in high.items() for seqno in range(1, top + 3)]  # fmt: skip
    tables = tmp_path / "tables"
    purge_tables_of(tables, rows, high)  # committed up to high: rows above it are not limited
    lease = TablesLease(str(tables), None)
    lease.hold()
    try:
        upkeep = TableMaintenance(
            str(tables), node.source_options(**{OPTION_PURGE: "0", OPTION_COMPACT: "-1"})
        )
        done = upkeep.after_batch()
        assert not done.errors, done.errors
        # Still the job's: the upkeep neither released the lease (the file would be gone) nor
        # took it as another owner (the file would name it).
        held = json.loads((tables / LEASE_FILE).read_text())
        assert held["owner"] == lease.owner, held
    finally:
        lease.release()
    limit = {vb: min(points[vb], high[vb]) for vb in high}
    gone = [r for r in rows if r[2] in TOMBSTONES and r[1] <= limit[r[0]]]
    assert gone and done.purged == len(gone)
    after = DeltaTable(str(tables / "changelog")).to_pyarrow_table()
    left = sorted(zip(*(after.column(n).to_pylist() for n in ("vbucket", "seqno", "op")),
                      strict=True))  # fmt: skip
    assert left == sorted(r for r in rows if r not in gone)
    assert upkeep.after_batch().purged == 0  # nothing more until the store purges more


def test_mirror_flags_are_checked_before_spark(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from changefeed.cli.main import cli
    from changefeed.cli.mirror_maintenance import maintenance_options

    result = CliRunner().invoke(
        cli, ["mirror", "--tables", str(tmp_path / "t"), "--purge-every", "soon"]
    )
    assert result.exit_code == 2 and "'soon' is not a number of seconds" in result.output
    assert not (tmp_path / "t").exists()
    assert maintenance_options("-1", None) == {OPTION_PURGE: "-1"}
    assert interval(maintenance_options("-1", "0.0"), OPTION_PURGE, 600.0) is None
    assert interval(maintenance_options("-1", "0.0"), OPTION_COMPACT, 300.0) == 0.0


def test_upkeep_flags_are_refused_for_the_local_writer(tmp_path: Path) -> None:
    """The local writer has no upkeep: its flags are refused in one line, not ignored."""
    from click.testing import CliRunner
    from deltalake import write_deltalake

    from changefeed.cli.main import cli

    def run(*args: str) -> tuple[int, list[str]]:
        result = CliRunner().invoke(cli, ["mirror", "--tables", str(tmp_path / "t"), *args])
        return result.exit_code, [x for x in result.output.splitlines() if x.startswith("Error")]

    code, errors = run("--writer", "local", "--compact-every", "5")
    assert code == 2 and len(errors) == 1 and "--writer local" in errors[0], errors
    code, errors = run("--writer", "local", "--purge-every", "never")
    assert code == 2 and "--purge-every:" in errors[0], errors
    # Tables the local writer made (not partitioned by the vbucket group), no --writer.
    write_deltalake(
        str(tmp_path / "t" / "mirror"), pa.table({"vbucket": pa.array([0], pa.int32())})
    )
    code, errors = run("--compact-every", "5")
    assert code == 2 and "the local writer's tables" in errors[0], errors
