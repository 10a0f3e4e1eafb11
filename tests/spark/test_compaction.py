"""Compaction of the changelog and mirror tables (``spark/compaction.py``, ``mirror compact``).

- Property (real delta-rs tables, built with the writer's own file and commit calls): after a
  compaction the table reads the same, every column, row order within a partition kept; the
  batch ids recorded (exactly once) and the newest position record are unchanged; partitions
  with at least ``files_min`` small files hold fewer files, no other file is touched; a second
  compaction with the same settings finds nothing.
- The planner alone against a model: runs stay in one group, in commit order, within the target.
- The command: refused with one line while a mirror job holds the tables; ``--json``.
"""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.schema import Schema as DeltaSchema
from deltalake.transaction import AddAction, create_table_with_add_actions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changefeed.cli.main import cli
from changefeed.spark import watermark
from changefeed.spark.compaction import (
    COMPACT_METADATA_KEY,
    SMALL_BYTES,
    TARGET_BYTES,
    CompactionError,
    FileEntry,
    compact_held,
    plan_runs,
    settings_of,
    table_files,
)
from changefeed.spark.delta_files import GROUP_COLUMN, now_ms, table_fs, write_data_file
from changefeed.spark.purge import purge_held
from changefeed.spark.table_lease import LEASE_FILE

APP_ID = "changefeed-mirror"
SCHEMA = pa.schema([("vbucket", pa.int32()), ("seqno", pa.int64()), ("key", pa.string()),
                    ("value", pa.binary()), ("op", pa.string()),
                    ("batch_id", pa.int64())])  # fmt: skip
OPS = ("mutation", "deletion", "expiration")  # a row's op: by its seqno
LARGE_ROWS = 200  # a file of this many rows is above SPLIT_BYTES, one of at most 20 below
SPLIT_BYTES = 3000

# A batch: (group, rows) pairs, each a file of that group (now and then a large one).
batches_strategy = st.lists(
    st.lists(st.tuples(st.integers(0, 3), st.one_of(st.integers(1, 20), st.just(LARGE_ROWS))),
             min_size=1, max_size=4),
    min_size=1, max_size=10,
)  # fmt: skip


def build_table(uri: str, name: str, batches: list[list[tuple[int, int]]]) -> None:
    """A table as the distributed writer leaves it: per batch, one commit of one file per
    (group, rows) with the batch id as app transaction (and, for the mirror, a position
    record), through the writer's own ``write_data_file``. Seqnos grow with the batches."""
    fs = table_fs(uri, None)
    seqno = 0
    full = SCHEMA.append(pa.field(GROUP_COLUMN, pa.int32()))
    for batch_id, files in enumerate(batches):
        adds = []
        for group, count in files:
            seqnos = range(seqno, seqno + count)
            rows = pa.table({
                "vbucket": pa.array([group] * count, pa.int32()),
                "seqno": pa.array(seqnos, pa.int64()),
                "key": pa.array([f"k{s}" for s in seqnos], pa.string()),
                "value": pa.array([b"v%d" % s for s in seqnos], pa.binary()),
                "op": pa.array([OPS[s % 3] for s in seqnos], pa.string()),
                "batch_id": pa.array([batch_id] * count, pa.int64()),
            })  # fmt: skip
            seqno += count
            added = write_data_file(fs, name, rows, group, batch_id)
            adds.append(AddAction(added["path"], added["size"], {GROUP_COLUMN: str(group)},
                                  now_ms(), True, added["stats"]))  # fmt: skip
        positions = {vb: watermark.Position(seqno, seqno << 16) for vb in range(4)}
        record = watermark.to_metadata(positions, batch_id, 4) if name == "mirror" else None
        props = CommitProperties(
            app_transactions=[Transaction(APP_ID, batch_id)],
            custom_metadata={watermark.METADATA_KEY: record} if record else None,  # type: ignore[dict-item]
        )
        if batch_id == 0:
            create_table_with_add_actions(
                uri, DeltaSchema.from_arrow(full), adds, mode="append",
                partition_by=[GROUP_COLUMN], commit_properties=props,
            )  # fmt: skip
        else:
            DeltaTable(uri).create_write_transaction(adds, "append", full,
                                                     partition_by=[GROUP_COLUMN],
                                                     commit_properties=props)  # fmt: skip


def rows_by_group(uri: str) -> dict[int, list[dict[str, object]]]:
    """Every row, every column, per partition in the files' commit order (by modification
    time, ties in the log's order), then each file's row order."""
    fs = table_fs(uri, None)
    out: dict[int, list[dict[str, object]]] = {}
    for entry in sorted(table_files(DeltaTable(uri)), key=lambda e: e.modified):
        out.setdefault(entry.group, []).extend(pq.read_table(entry.path, filesystem=fs).to_pylist())
    return out


def delta_rows(uri: str) -> dict[int, list[dict[str, object]]]:
    """Every row as a Delta reader sees it (``to_pyarrow_table``), per partition, by seqno."""
    out: dict[int, list[dict[str, object]]] = {}
    for row in DeltaTable(uri).to_pyarrow_table().to_pylist():
        out.setdefault(int(str(row[GROUP_COLUMN])), []).append(row)
    return {g: sorted(rows, key=lambda r: int(str(r["seqno"]))) for g, rows in out.items()}


def assert_stats_describe_the_files(uri: str, paths: set[str]) -> None:
    """The Delta statistics of the files ``paths`` (what filtered reads prune by) are those of
    their rows: row count, and per column with statistics its min, max and null count."""
    actions = pa.table(DeltaTable(uri).get_add_actions(flatten=True)).to_pylist()
    fs = table_fs(uri, None)
    for action in (a for a in actions if a["path"] in paths):
        rows = pq.read_table(action["path"], filesystem=fs)
        assert action["num_records"] == rows.num_rows
        for column in ("vbucket", "seqno", "key", "op", "batch_id"):
            bounds = pc.min_max(rows.column(column))
            assert action[f"min.{column}"] == bounds["min"].as_py(), (column, action)
            assert action[f"max.{column}"] == bounds["max"].as_py(), (column, action)
            assert action[f"null_count.{column}"] == 0, (column, action)


def check_compaction(
    root: Path, name: str, batches: list[list[tuple[int, int]]], files_min: int,
    small_bytes: int, purge_at: int | None,
) -> None:  # fmt: skip
    """Build the table, purge its tombstones at or below ``purge_at`` (None: no purge), compact
    it; check everything the compaction keeps (module docstring)."""
    uri = str(root / name)
    build_table(uri, name, batches)
    built = rows_by_group(uri)
    for rows in built.values():  # commit order is batch order, which is seqno order here
        assert [r["seqno"] for r in rows] == sorted(r["seqno"] for r in rows)  # type: ignore[type-var]
    if purge_at is not None:
        purge_held(str(root), {vb: purge_at for vb in range(4)})
        gone = {s for s in range(purge_at + 1) if OPS[s % 3] != "mutation"}
        kept = {g: [r for r in rows if name != "changelog" or r["seqno"] not in gone]
                for g, rows in built.items()}  # fmt: skip
        assert rows_by_group(uri) == {g: rows for g, rows in kept.items() if rows}
    before = DeltaTable(uri)
    rows_before, delta_before = rows_by_group(uri), delta_rows(uri)
    files_before = table_files(before)
    record_before = watermark.latest_record(before.history(watermark.HISTORY_SCAN_MAX))
    version = before.version()
    runs = plan_runs(files_before, small_bytes=small_bytes, target_bytes=TARGET_BYTES,
                     files_min=files_min)  # fmt: skip

    report = compact_held(str(root), files_min=files_min, small_bytes=small_bytes)
    done = next(t for t in report.tables if t.table == name)

    after = DeltaTable(uri)
    assert delta_rows(uri) == delta_before  # what Delta readers see: every row, every column
    assert rows_by_group(uri) == rows_before  # and in commit order, each group's rows in order
    assert after.transaction_version(APP_ID) == len(batches) - 1  # exactly once: unchanged
    record_after = watermark.latest_record(after.history(watermark.HISTORY_SCAN_MAX))
    assert record_after == record_before
    if not runs:
        assert done.version is None and after.version() == version
        return
    assert done.version == version + 1 == after.version()  # one commit
    assert COMPACT_METADATA_KEY in after.history(1)[0]
    merged = {e.path for run in runs for e in run}
    paths_after = {f.path for f in table_files(after)}
    assert paths_after & merged == set()
    assert {f.path for f in files_before} - merged <= paths_after  # no other file touched
    new = paths_after - {f.path for f in files_before}
    assert len(new) == len(runs) == done.files_added and done.files_removed == len(merged)
    assert_stats_describe_the_files(uri, new)
    cut = min(r["seqno"] for rows in delta_before.values() for r in rows) + 7  # type: ignore[type-var]
    filtered = DeltaTable(uri).to_pyarrow_table(filters=[("seqno", ">", cut)])
    assert sorted(filtered.column("seqno").to_pylist()) == sorted(
        r["seqno"]
        for rows in delta_before.values()
        for r in rows
        if r["seqno"] > cut  # type: ignore[operator]
    )
    again = compact_held(str(root), files_min=files_min, small_bytes=small_bytes)
    assert all(t.version is None for t in again.tables)


@settings(
    deadline=None, max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batches_strategy, st.sampled_from(["changelog", "mirror"]), st.integers(2, 5),
       st.sampled_from([SMALL_BYTES, SPLIT_BYTES]), st.none() | st.integers(0, 60))  # fmt: skip
def test_compaction_keeps_every_row_and_the_batch_ids(
    tmp_path_factory: pytest.TempPathFactory, batches: list[list[tuple[int, int]]], name: str,
    files_min: int, small_bytes: int, purge_at: int | None,
) -> None:  # fmt: skip
    root = tmp_path_factory.mktemp("tables")
    check_compaction(root, name, batches, files_min, small_bytes, purge_at)


def test_a_large_file_between_small_ones_keeps_its_place(tmp_path: Path) -> None:
    """Batches 0, 1 small, 2 large, 3, 4 small in one group: 0 and 1 merge, 3 and 4 merge,
    the large file stays between them (batches read [2, 0, 1, 3, 4] before the fix)."""
    batches = [[(0, 2)], [(0, 2)], [(0, LARGE_ROWS)], [(0, 2)], [(0, 2)]]
    check_compaction(tmp_path, "changelog", batches, 2, SPLIT_BYTES, None)
    order = [r["batch_id"] for r in rows_by_group(str(tmp_path / "changelog"))[0]]
    assert list(dict.fromkeys(order)) == [0, 1, 2, 3, 4]


def test_a_purged_file_keeps_its_place(tmp_path: Path) -> None:
    """The purge rewrites batch 0's file; a compaction then keeps batch 0's rows first (they
    moved behind the later batches before the fix: the rewritten file was stamped then)."""
    check_compaction(tmp_path, "changelog", [[(0, 2)]] * 5, 2, SMALL_BYTES, 1)
    order = [r["batch_id"] for r in rows_by_group(str(tmp_path / "changelog"))[0]]
    assert order == sorted(order) and order[0] == 0


entries_strategy = st.lists(
    st.builds(FileEntry, st.text("abc", min_size=1, max_size=4), st.integers(1, 100),
              st.integers(0, 3), st.integers(0, 50)),
    max_size=30, unique_by=lambda e: e.path,
)  # fmt: skip


@given(entries_strategy, st.integers(2, 6), st.integers(1, 120), st.integers(1, 300))
def test_runs_follow_the_model(
    entries: list[FileEntry], files_min: int, small: int, target: int
) -> None:
    runs = plan_runs(entries, small_bytes=small, target_bytes=target, files_min=files_min)
    assert all(len(run) > 1 for run in runs)
    found = 0
    for group in {e.group for e in entries}:
        # The group's commit order: by time, ties in the order given.
        ordered = [e for e in sorted(entries, key=lambda e: e.modified) if e.group == group]
        mine = [run for run in runs if run[0].group == group]
        if sum(1 for e in ordered if e.size < small) < files_min:
            assert not mine
            continue
        # The runs, the small files left alone and the large files (None) cut the group's
        # files into consecutive segments; a run never holds a large file, and two segments
        # of small files meet only where the second would take the first past the target.
        starts = {id(run[0]): run for run in mine}
        segments: list[list[FileEntry] | None] = []
        at = 0
        while at < len(ordered):
            if ordered[at].size >= small:
                segments.append(None)
                at += 1
                continue
            run = starts.get(id(ordered[at]), [ordered[at]])
            assert run == ordered[at : at + len(run)], "a run is consecutive, in order"
            found += len(run) > 1
            segments.append(run)
            at += len(run)
        for segment in segments:
            assert segment is None or len(segment) == 1 or sum(e.size for e in segment) <= target
        for first, second in itertools.pairwise(segments):
            if first is not None and second is not None:
                assert sum(e.size for e in first) + second[0].size > target
    assert found == len(runs)


def test_bad_settings_name_the_option() -> None:
    with pytest.raises(CompactionError, match="mirrorcompactfilesmin: '1'"):
        settings_of({"mirrorCompactFilesMin": "1"})
    with pytest.raises(CompactionError, match="mirrorcompactsmallbytes: 'x'"):
        settings_of({"mirrorCompactSmallBytes": "x"})
    assert settings_of({"mirrorCompactFilesMin": "3"})["files_min"] == 3


def compact_command(tables: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["mirror", "compact", "--tables", str(tables), *extra])
    return result.exit_code, result.output


def test_compact_command_reports_json(tmp_path: Path) -> None:
    tables = tmp_path / "tables"
    build_table(str(tables / "changelog"), "changelog", [[(0, 3), (1, 2)]] * 6)
    code, text = compact_command(tables, "--json", "--files-min", "4")
    assert code == 0, text
    report = json.loads(text)
    assert report["tables"]["changelog"]["files_removed"] == 12
    assert report["tables"]["changelog"]["files_added"] == 2
    assert report["tables"]["changelog"]["rows"] == 30
    assert report["tables"]["mirror"]["version"] is None  # no mirror table here
    assert not (tables / LEASE_FILE).exists(), "the lease is released"


def test_compact_command_is_refused_while_a_job_holds_the_tables(tmp_path: Path) -> None:
    tables = tmp_path / "tables"
    build_table(str(tables / "changelog"), "changelog", [[(0, 1)]] * 3)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"owner": f"{socket.gethostname()}:{holder.pid}", "host": socket.gethostname(),
                  "pid": holder.pid, "renewed": time.time()}  # fmt: skip
        (tables / LEASE_FILE).write_text(json.dumps(record))
        code, text = compact_command(tables)
    finally:
        holder.kill()
        holder.wait()
    assert code == 1, text
    errors = [line for line in text.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "another mirror job" in errors[0], text


def test_compact_command_refuses_a_missing_table(tmp_path: Path) -> None:
    code, text = compact_command(tmp_path / "nothing")
    assert code == 2 and "no changelog table" in text, text


@pytest.mark.parametrize("command", ["compact", "purge"])
def test_an_unsupported_object_store_is_one_line(command: str) -> None:
    """``--tables gs://…``: a usage error naming the value (a ValueError's traceback before)."""
    result = CliRunner().invoke(cli, ["mirror", command, "--tables", "gs://b/x"])
    assert result.exit_code == 2, (result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "gs://b/x" in errors[0] and "s3://" in errors[0], result.output


def test_files_stamped_alike_keep_the_commit_s_order(tmp_path: Path) -> None:
    """Five files of one group in one commit, stamped in the same millisecond: their order is
    the commit's action order (it fell back to the files' random names before the fix)."""
    uri = str(tmp_path / "changelog")
    fs = table_fs(uri, None)
    stamp = now_ms()
    adds = []
    for part in range(5):
        rows = pa.table({"vbucket": pa.array([0, 0], pa.int32()),
                         "seqno": pa.array([2 * part, 2 * part + 1], pa.int64())})  # fmt: skip
        added = write_data_file(fs, "changelog", rows, 0, 0)
        adds.append(AddAction(added["path"], added["size"], {GROUP_COLUMN: "0"}, stamp, True,
                              added["stats"]))  # fmt: skip
    full = pa.schema([("vbucket", pa.int32()), ("seqno", pa.int64()), (GROUP_COLUMN, pa.int32())])
    create_table_with_add_actions(uri, DeltaSchema.from_arrow(full), adds, mode="append",
                                  partition_by=[GROUP_COLUMN])  # fmt: skip
    assert [e.path for e in table_files(DeltaTable(uri))] == [a.path for a in adds]
    compact_held(str(tmp_path), files_min=2)
    assert [r["seqno"] for r in rows_by_group(uri)[0]] == list(range(10))
