"""Compaction of the changelog and mirror tables: a vbucket group's small Parquet files merged.

Each micro-batch adds one changelog file (and usually one mirror file) per vbucket group it
touches, so a latency-oriented job (small batches, ``--trigger 0``) leaves thousands of small
files, and every reader opens each of them. The mirror's write tasks already merge a group's
small files once it has ``mirror_tasks.SMALL_FILES_MAX`` of them; the changelog, append only,
never did. ``compact_table`` merges, per partition (``_vb_group``), runs of consecutive small
files (each below ``small_bytes``) into files of at most about ``target_bytes``, when the
partition holds at least ``files_min`` small ones.

What it keeps, so that readers and the writer do not notice:

- every row, column for column: files are read with the table's schema (a column added later
  reads null, as Delta readers see it) and written by the writer's own ``write_data_file``
  (same types, same Delta statistics);
- a group's rows in commit order: files are ordered by their add action's modification time
  (the writer stamps a batch's files at its commit), ties by their order in the Delta log (a
  commit's own files in action order); a run is consecutive in that order (a file that is not
  small ends it, so no row moves past it) and its file is stamped with the run's last time, as
  the purge's rewritten files keep theirs: a group's rows read in this order are in batch
  order before and after. (Two commits touching one group within the same millisecond, or a
  clock stepped back, are not ordered by it: delta-rs does not tell a file's commit version.)
- one Delta commit per table: readers see the old files or the new ones, never both. Its
  actions say ``dataChange: false`` (nothing changed: change-feed and streaming readers of the
  table skip the commit), and it carries no app transaction: the batch ids recorded in the
  table (``changefeed-mirror``, exactly once) stay as they were. A mirror commit carries the
  newest position record forward (``watermark.py``), so the positions are one commit away;
- one writer at a time: the command holds the tables' lease (``table_lease.py``), refused while a
  mirror job runs; a running job compacts between its batches (``maintenance.py``), under the
  lease it holds, so a batch's expected changelog version (its rows' ``_commit_version``) is
  read after the compaction's commit.

A crash before the commit leaves only unreferenced files (orphans for a vacuum), as a write
task's does. Old files stay on disk, referenced by older versions (time travel), until a vacuum.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable
from deltalake.transaction import AddAction, RemoveAction

from changefeed.spark import watermark
from changefeed.spark.delta_files import GROUP_COLUMN, now_ms, table_fs, table_uri, write_data_file
from changefeed.spark.table_lease import TablesLease

log = logging.getLogger("changefeed.mirror")

TABLES: Final = ("changelog", "mirror")
COMPACT_METADATA_KEY: Final = "changefeedCompact"  # in the compaction commit's info
SMALL_BYTES: Final = 8 * 1024 * 1024  # a file below this is small
TARGET_BYTES: Final = 64 * 1024 * 1024  # a merged file gathers small ones up to about this
FILES_MIN: Final = 8  # a partition is compacted once it holds this many small files


class CompactionError(RuntimeError):
    """The tables cannot be compacted (another layout, a bad setting); the message says why."""


@dataclass(frozen=True)
class FileEntry:
    """A data file of the table, as its add action names it."""

    path: str
    size: int
    group: int
    modified: int  # the add action's modification time (ms): the commit order (module doc)


@dataclass
class TableCompaction:
    """What the compaction did to one table."""

    table: str
    files_removed: int = 0
    files_added: int = 0
    rows: int = 0  # rows moved into the new files
    groups: int = 0  # partitions compacted
    version: int | None = None  # the compaction commit's version (None: nothing to do)


@dataclass
class CompactReport:
    """What a compaction did to each table (``mirror compact`` prints it; the job's upkeep
    keeps the last one in ``Upkeep.compacted``)."""

    tables: list[TableCompaction] = field(default_factory=list)

    @property
    def files_removed(self) -> int:
        return sum(t.files_removed for t in self.tables)

    def to_json(self) -> dict[str, object]:
        """The report for ``mirror compact --json``: the files removed in all, and per table
        the files removed and added, the rows moved, the groups compacted and the commit's
        version (null: nothing to do)."""
        return {
            "files_removed": self.files_removed,
            "tables": {t.table: {"files_removed": t.files_removed, "files_added": t.files_added,
                                 "rows": t.rows, "groups": t.groups, "version": t.version}
                       for t in self.tables},
        }  # fmt: skip


def plan_runs(
    files: list[FileEntry], *, small_bytes: int, target_bytes: int, files_min: int
) -> list[list[FileEntry]]:
    """The runs of files to merge, each into one file: per group holding at least
    ``files_min`` small files, its files in commit order (``files`` as ``table_files`` gives
    them; sorted by modification time here, ties kept in their given order) cut into runs of
    consecutive small files of at most ``target_bytes``; a file that is not small ends a run
    (merging past it would move rows behind it), and a run of one file is left alone (merging
    it changes nothing)."""
    if files_min < 2 or small_bytes < 1 or target_bytes < 1:
        raise CompactionError(
            f"files_min {files_min} must be at least 2 and the sizes positive "
            f"(small {small_bytes}, target {target_bytes})"
        )
    by_group: dict[int, list[FileEntry]] = {}
    for entry in sorted(files, key=lambda e: e.modified):  # stable: ties keep the log's order
        by_group.setdefault(entry.group, []).append(entry)
    runs: list[list[FileEntry]] = []
    for group in sorted(by_group):
        ordered = by_group[group]
        if sum(1 for e in ordered if e.size < small_bytes) < files_min:
            continue
        run: list[FileEntry] = []
        size = 0
        for entry in ordered:
            if entry.size >= small_bytes or (run and size + entry.size > target_bytes):
                runs.append(run)
                run, size = [], 0
            if entry.size < small_bytes:
                run.append(entry)
                size += entry.size
        runs.append(run)
    return [run for run in runs if len(run) > 1]


def table_files(table: DeltaTable) -> list[FileEntry]:
    """The table's data files with their partition (``GROUP_COLUMN``), in commit order: by
    modification time, ties in the log's order (delta-rs lists a commit's files in action
    order)."""
    actions = pa.table(table.get_add_actions(flatten=True))
    if not actions.num_rows:
        return []
    names = ("path", "size_bytes", f"partition.{GROUP_COLUMN}", "modification_time")
    columns = [actions.column(name).to_pylist() for name in names]
    entries = [
        FileEntry(str(path), int(size), int(group), modification_millis(modified))
        for path, size, group, modified in zip(*columns, strict=True)
    ]
    return sorted(entries, key=lambda e: e.modified)


def modification_millis(value: Any) -> int:
    """A modification time as delta-rs lists it (a datetime or epoch milliseconds)."""
    if hasattr(value, "timestamp"):
        return int(value.timestamp() * 1000)
    return int(value or 0)


def compact_table(
    uri: str,
    name: str,
    storage_options: dict[str, str] | None = None,
    *,
    small_bytes: int = SMALL_BYTES,
    target_bytes: int = TARGET_BYTES,
    files_min: int = FILES_MIN,
) -> TableCompaction:
    """Merge the small files of table ``name`` at ``uri`` in one commit (the caller holds the
    tables' lease).

    Raises:
        CompactionError: a table not partitioned by ``GROUP_COLUMN`` (not the distributed
            writer's), or a bad setting.
    """
    done = TableCompaction(name)
    if not DeltaTable.is_deltatable(uri, storage_options):
        return done
    table = DeltaTable(uri, storage_options=storage_options)
    if table.metadata().partition_columns != [GROUP_COLUMN]:
        raise CompactionError(
            f"table {uri} is partitioned by {table.metadata().partition_columns}, not "
            f"{GROUP_COLUMN}: compaction rewrites tables of the distributed writer only"
        )
    runs = plan_runs(
        table_files(table), small_bytes=small_bytes, target_bytes=target_bytes,
        files_min=files_min,
    )  # fmt: skip
    if not runs:
        return done
    fs = table_fs(uri, storage_options)
    schema = pa.schema(table.schema().to_arrow())
    file_schema = schema.remove(schema.get_field_index(GROUP_COLUMN))
    tag = table.version() + 1  # in the new files' names (a batch id's place)
    actions: list[AddAction | RemoveAction] = []
    for run in runs:
        group = run[0].group
        parts = [pq.read_table(e.path, filesystem=fs, schema=file_schema) for e in run]
        rows = pa.concat_tables(parts).combine_chunks()
        added = write_data_file(fs, name, rows, group, tag)
        removed_at = now_ms()
        partition: dict[str, str | None] = {GROUP_COLUMN: str(group)}
        # dataChange false: the same rows in other files (Delta's OPTIMIZE does the same). The
        # new file takes the run's place in the commit order: its last file's time.
        actions += [RemoveAction(e.path, False, removed_at, e.size, partition) for e in run]
        actions.append(AddAction(added["path"], added["size"], partition, run[-1].modified,
                                 False, added["stats"]))  # fmt: skip
        done.files_removed += len(run)
        done.files_added += 1
        done.rows += rows.num_rows
    done.groups = len({run[0].group for run in runs})
    counts = {"filesRemoved": done.files_removed, "filesAdded": done.files_added,
              "rows": done.rows}  # fmt: skip
    metadata: dict[str, Any] = {COMPACT_METADATA_KEY: counts}
    if name == "mirror":  # the positions stay one commit away for the writer and ``status``
        record = watermark.latest_record(table.history(watermark.HISTORY_SCAN_MAX))
        if record is not None:
            metadata[watermark.METADATA_KEY] = record
    table.create_write_transaction(
        actions, "append", schema, partition_by=[GROUP_COLUMN],
        commit_properties=CommitProperties(custom_metadata=metadata),
    )  # fmt: skip
    table.update_incremental()
    done.version = table.version()
    log.info(
        "%s: compacted %d files into %d (%d rows, %d groups), version %d", name,
        done.files_removed, done.files_added, done.rows, done.groups, done.version,
    )  # fmt: skip
    return done


def compact_held(
    tables: str, storage_options: dict[str, str] | None = None, **settings: int
) -> CompactReport:
    """``compact_table`` on both tables under ``tables``, by a caller holding the lease (a
    running mirror job between its batches)."""
    return CompactReport(
        [compact_table(table_uri(tables, n), n, storage_options, **settings) for n in TABLES]
    )


def compact_tables(
    tables: str, storage_options: dict[str, str] | None = None, **settings: int
) -> CompactReport:
    """``compact_held``, holding the tables' lease meanwhile.

    Raises:
        MirrorBusyError: a mirror job holds the tables.
        CompactionError: see ``compact_table``.
    """
    lease = TablesLease(table_uri(tables, ""), storage_options)
    lease.hold()
    try:
        return compact_held(tables, storage_options, **settings)
    finally:
        lease.release()


def settings_of(options: Mapping[str, str]) -> dict[str, int]:
    """The compaction settings a writer's options give (``mirrorCompactFilesMin``,
    ``mirrorCompactSmallBytes``); the defaults for the others.

    Raises:
        CompactionError: a value that is not a whole number in range, naming it.
    """
    lowered = {k.lower(): v for k, v in options.items()}
    out = {"files_min": FILES_MIN, "small_bytes": SMALL_BYTES, "target_bytes": TARGET_BYTES}
    for option, key, least in (("mirrorcompactfilesmin", "files_min", 2),
                               ("mirrorcompactsmallbytes", "small_bytes", 1)):  # fmt: skip
        text = lowered.get(option)
        if text is None:
            continue
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise CompactionError(f"option {option}: {text!r} is not a whole number >= {least}")
        out[key] = value
    return out
