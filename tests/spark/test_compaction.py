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
    CompactionError,
    FileEntry,
    compact_held,
    plan_runs,
    settings_of,
    table_files,
)
from changefeed.spark.delta_files import GROUP_COLUMN, now_ms, table_fs, write_data_file
from changefeed.spark.table_lease import LEASE_FILE

APP_ID = "changefeed-mirror"
SCHEMA = pa.schema([("vbucket", pa.int32()), ("seqno", pa.int64()), ("key", pa.string()),
                    ("value", pa.binary()), ("batch_id", pa.int64())])  # fmt: skip

# A batch: (group, rows) pairs, each a file of that group.
batches_strategy = st.lists(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20)), min_size=1, max_size=4),
    min_size=1, max_size=10,
)  # fmt: skip


def build_table(uri: str, name: str, batches: list[list[tuple[int, int]]]) -> None:
    """A table as the distributed writer leaves it: per batch, one commit of one file per
    (group, rows) with the batch id as app transaction (and, for the mirror, a position
    record), through the writer's own ``write_data_file``."""
    fs = table_fs(uri, None)
    seqno = 0
    full = SCHEMA.append(pa.field(GROUP_COLUMN, pa.int32()))
    for batch_id, files in enumerate(batches):
        adds = []
        for group, count in files:
            rows = pa.table({
                "vbucket": pa.array([group] * count, pa.int32()),
                "seqno": pa.array(range(seqno, seqno + count), pa.int64()),
                "key": pa.array([f"k{seqno + i}" for i in range(count)], pa.string()),
                "value": pa.array([b"v%d" % (seqno + i) for i in range(count)], pa.binary()),
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
    """Every row, every column, per partition in the files' commit order (then row order)."""
    table = DeltaTable(uri)
    fs = table_fs(uri, None)
    entries = sorted(table_files(table), key=lambda e: (e.modified, e.path))
    out: dict[int, list[dict[str, object]]] = {}
    for entry in entries:
        out.setdefault(entry.group, []).extend(pq.read_table(entry.path, filesystem=fs).to_pylist())
    return out


@settings(
    deadline=None, max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batches_strategy, st.sampled_from(["changelog", "mirror"]), st.integers(2, 5))
def test_compaction_keeps_every_row_and_the_batch_ids(
    tmp_path_factory: pytest.TempPathFactory,
    batches: list[list[tuple[int, int]]], name: str, files_min: int,
) -> None:  # fmt: skip
    root = tmp_path_factory.mktemp("tables")
    uri = str(root / name)
    build_table(uri, name, batches)
    before = DeltaTable(uri)
    rows_before = rows_by_group(uri)
    files_before = table_files(before)
    record_before = watermark.latest_record(before.history(watermark.HISTORY_SCAN_MAX))
    version = before.version()

    report = compact_held(str(root), files_min=files_min)
    done = next(t for t in report.tables if t.table == name)

    after = DeltaTable(uri)
    assert rows_by_group(uri) == rows_before  # every column, order within a group kept
    assert after.transaction_version(APP_ID) == len(batches) - 1  # exactly once: unchanged
    record_after = watermark.latest_record(after.history(watermark.HISTORY_SCAN_MAX))
    assert record_after == record_before
    counts = {g: sum(1 for f in files_before if f.group == g) for g in rows_before}
    compacted = {g for g, n in counts.items() if n >= files_min}
    if not compacted:
        assert done.version is None and after.version() == version
        return
    assert done.version == version + 1 == after.version()  # one commit
    commit = after.history(1)[0]
    assert COMPACT_METADATA_KEY in commit
    files_after = table_files(after)
    for group, count in counts.items():
        now = sum(1 for f in files_after if f.group == group)
        assert now == (1 if group in compacted else count), (group, count, now)
    untouched = {f.path for f in files_before if f.group not in compacted}
    assert untouched <= {f.path for f in files_after}
    assert done.files_removed == sum(counts[g] for g in compacted)
    again = compact_held(str(root), files_min=files_min)
    assert all(t.version is None for t in again.tables)


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
    for group in {e.group for e in entries}:
        small_files = sorted((e for e in entries if e.group == group and e.size < small),
                             key=lambda e: (e.modified, e.path))  # fmt: skip
        mine = [run for run in runs if run[0].group == group]
        if len(small_files) < files_min:
            assert not mine
            continue
        # The runs and the small files left alone cut the small files into consecutive
        # segments; a segment ends only where the next file would take it past the target.
        starts = {id(run[0]): run for run in mine}
        segments, at = [], 0
        while at < len(small_files):
            run = starts.get(id(small_files[at]), [small_files[at]])
            assert run == small_files[at : at + len(run)], "a run is consecutive, in order"
            segments.append(run)
            at += len(run)
        assert sum(len(s) for s in segments) == len(small_files)
        assert all(s[0].group == group for s in segments)
        for segment in segments:
            assert len(segment) == 1 or sum(e.size for e in segment) <= target
        for first, second in itertools.pairwise(segments):
            assert sum(e.size for e in first) + second[0].size > target


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
