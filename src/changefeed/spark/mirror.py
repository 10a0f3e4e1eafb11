"""The mirror writer: a change stream → an append-only changelog table and a current-state
mirror table (Delta Lake, written with ``deltalake``), exactly once across query restarts.

Used from ``foreachBatch``::

    writer = MirrorWriter("/data/tables", options)            # options: the source's options
    query = df.writeStream.foreachBatch(writer).option("checkpointLocation", ck).start()

Two writers stand behind ``MirrorWriter``. ``foreachBatch`` uses the distributed one
(``dist_mirror.py``: Spark's tasks write the files, the driver commits the file actions; tables
partitioned by vbucket group, also on S3) unless the option ``mirrorWriter=local`` asks for this
module's, or the tables were written by it. A collection-aware source (options
``collections`` / ``scope``) gets one table pair per collection under
``<path>/<scope>/<collection>/`` (``collection_mirror.py``), each written by one of these
writers. The rest of this docstring is about this module's
writer, the *local* one, which ``write(arrow_table, batch_id)`` always uses: the batch is
collected to the driver and written from there.

Exactly once: Spark may run a batch again after a crash (at-least-once ``foreachBatch``). Each
table records the batch id as a Delta app transaction in the same commit as the data, and a
batch whose id is not newer than the recorded one is skipped (spark-python-datasource.md §5).

The mirror is partitioned by ``vbucket``. A batch is first reduced to each key's final change
(``merge_source.py``: newest seqno wins, deletions included). Then:

- if no key of the batch is in the mirror (``key_index.py``: hashes of the mirror's keys kept
  in memory, checked against the table version), its live rows are appended: the cost does not
  depend on the table's size, and most batches of a change stream create keys;
- otherwise a delta-rs merge on ``(vbucket, key)`` whose predicate names the vbuckets holding
  the batch's existing keys (``t.vbucket IN (...)``), so only those partitions are scanned and
  rewritten. Without it, a streamed merge reads every file of the target.

Either way the data and the batch id go in one commit. Each batch that touches a vbucket adds a
file to its partition, so partitions that gathered ``PARTITION_SMALL_FILES_MAX`` small files are
compacted (at most ``COMPACTIONS_PER_BATCH_MAX`` a batch; a compaction changes no rows and
carries no batch id). One query writes a mirror at a time: the key index assumes that nobody
else inserts keys between its check and the commit (another writer's commit only makes it
rebuild), and Delta's conflict check does not stop two blind appends of the same key.

Readers: deltalake, DuckDB, polars and ``read_mirror`` see the ``vbucket`` column as usual. The
data files of a partitioned Delta table do not hold it (it is in the file's directory), so
Spark, reading the file list, needs the table directory as ``basePath``:
``spark.read.option("basePath", p).parquet(*DeltaTable(p).file_uris())``.

Documents as typed columns (``format=json``): both tables take the batch's columns, the
document's fields in place of ``value`` (``merge_source.mirror_schema``). A batch with a column
the table lacks (a field added to the query's schema) is refused with ``SchemaEvolutionError``
naming it, unless ``mergeSchema`` is set: then the column is added to the table (Delta schema
merge), null in the rows written before. A table column the batch lacks is written as null; a
column whose type changed is cast when that loses nothing, else refused, naming it.

A mirror table written before the vbucket partitioning (unpartitioned) is still read and
written correctly, with the same predicate, but each merge scans the whole table; the writer
says so once in its log and ``repartition_mirror`` rewrites it. Any other layout is refused.

Rollbacks: a ``rollback`` row for vbucket V at seqno R means every change of V after R is void.
Rows of this batch after R (before the rollback row) are dropped; keys of V that the mirror holds
with a seqno above R, and keys of V that an earlier batch changed above R (the changelog: a key
deleted in the lost history is in no mirror row, yet it may be live again), are re-read from the
node, and a row of the stream after the rollback row wins over the re-read.

A re-read takes each key's newest version with all its metadata (seqno, CAS, flags, expiry,
rev_seqno) from a DCP stream of V from seqno 0 to the node's high seqno
(``consumer/current_state.py``), so a re-read row is the node's document, column for column, and
a later rollback compares true seqnos. GET cannot do this (it answers neither seqno, expiry nor
rev_seqno) and the node has no GET_META. The stream must start at 0, not at R: a voided key's
newest version may be older than R. A key the stream does not bring, or brings as a tombstone,
is deleted from the mirror. The re-read may see versions newer than this batch's end; the next
batch brings them again, unchanged. It costs one backfill of each rolled-back vbucket per batch
holding rollback rows (rollbacks are rare), and memory for the re-read keys only.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from changefeed.consumer.change_rows import (
    OP_ROLLBACK,
)
from changefeed.spark.collection_mirror import CollectionMirrorWriter
from changefeed.spark.delta_files import GROUP_COLUMN, table_uri
from changefeed.spark.dist_mirror import DistributedMirrorWriter
from changefeed.spark.key_index import KeyIndex, key_hashes
from changefeed.spark.merge_source import (
    DELETED,
    HISTORY_SCHEMA,
    MIRROR_COLUMNS,
    MIRROR_SCHEMA,
    latest_changes,
    mirror_schema,
    rollback_plan,
    source_schema,
)
from changefeed.spark.refetch import refetch_source

log = logging.getLogger("changefeed.mirror")

APP_ID: Final = "changefeed-mirror"
WRITER_DISTRIBUTED: Final = "distributed"  # dist_mirror.py: Spark's tasks write the files
WRITER_LOCAL: Final = "local"  # this module's writer: the batch collected to the driver
PARTITION_COLUMNS: Final = ["vbucket"]

# Compaction. A batch adds one file to each partition it touches: 64 files for a 500k-row batch
# over 64 vbuckets (~1 MB each), as many for a 1k-row batch of a steady stream (~2 KB each). A
# partition with 16 files smaller than the target is compacted: that bounds a merge's scan of a
# partition to ~16 opens beyond its large files, and a compaction rewrites ~16 small files (a
# row is rewritten a few times until its file reaches the target). At most 8 partitions a
# batch: when every partition fills at once (uniform keys), the work is spread over 8 batches.
# Measured with 64 partitions of ~20 tiny files each: ~0.5 s to compact all of them at once.
PARTITION_SMALL_FILES_MAX: Final = 16
COMPACTIONS_PER_BATCH_MAX: Final = 8
FILE_BYTES_TARGET: Final = 32 * 1024 * 1024

__all__ = [
    "APP_ID",
    "MIRROR_COLUMNS",
    "MIRROR_SCHEMA",
    "MirrorLayoutError",
    "MirrorWriter",
    "SchemaEvolutionError",
    "read_mirror",
    "repartition_mirror",
]


class MirrorLayoutError(RuntimeError):
    """The mirror table is partitioned in a way this writer does not know; the message names it."""


class SchemaEvolutionError(RuntimeError):
    """A batch's columns do not fit a table's schema; the message names the field."""


class MirrorWriter:
    """``foreachBatch`` callable maintaining ``<path>/changelog`` and ``<path>/mirror``.

    Args:
        path: directory holding both tables.
        options: the source's options (dict) — the node to re-read rolled-back keys from.
        app_id: the Delta app-transaction id; one per query writing these tables.
        merge_schema: add a batch's new columns to the tables (default: option ``mergeSchema``
            of ``options``, else false: a new column is refused).
        writer: ``"distributed"`` or ``"local"`` for ``foreachBatch`` (default: option
            ``mirrorWriter``, else from the tables' layout, distributed for new tables).
        storage_options: deltalake storage options for ``s3://`` tables (default: the
            environment's ``AWS_*``).
        per_collection: one table pair per collection (``collection_mirror.py``); default:
            when ``options`` make the source collection-aware.
    """

    def __init__(
        self,
        path: str | Path,
        options: dict[str, str],
        app_id: str = APP_ID,
        merge_schema: bool | None = None,
        writer: str | None = None,
        storage_options: dict[str, str] | None = None,
        per_collection: bool | None = None,
    ) -> None:
        self.tables = table_uri(path, "").rstrip("/")  # a URL given as a Path is mended
        self.path = Path(path)
        self.options = dict(options)
        self.storage_options = storage_options
        given_writer = writer or {k.lower(): v for k, v in options.items()}.get("mirrorwriter")
        if given_writer not in (None, WRITER_DISTRIBUTED, WRITER_LOCAL):
            raise ValueError(
                f"mirror writer {given_writer!r}: give {WRITER_DISTRIBUTED!r} or {WRITER_LOCAL!r}"
            )
        if given_writer == WRITER_LOCAL and "://" in self.tables:
            raise ValueError(f"tables {self.tables}: the local writer writes local paths only")
        self.writer = given_writer
        self._distributed: DistributedMirrorWriter | None = None
        self.rows_written = 0  # change rows of the last batch logged (0 when it was skipped)
        self.app_id = app_id
        if merge_schema is None:
            given = {k.lower(): v for k, v in self.options.items()}.get("mergeschema", "false")
            merge_schema = given.lower() == "true"
        self.merge_schema = merge_schema
        self.changelog_path = self.path / "changelog"
        self.mirror_path = self.path / "mirror"
        self._tables: dict[Path, DeltaTable] = {}  # loaded once, then brought up to date
        self._index: KeyIndex | None = None  # the mirror's keys, while its version matches
        self._warned_unpartitioned = False
        if per_collection is None:
            lowered = {k.lower() for k in self.options}
            per_collection = bool(lowered & {"collections", "scope"})
        self._collections: CollectionMirrorWriter | None = None
        if per_collection:

            def one_collection(root: str, narrowed: dict[str, str]) -> MirrorWriter:
                return MirrorWriter(
                    root, narrowed, app_id, self.merge_schema, writer, storage_options,
                    per_collection=False,
                )  # fmt: skip

            self._collections = CollectionMirrorWriter(
                self.tables, self.options, one_collection, storage_options
            )

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        if self._collections is not None:
            self._collections(batch_df, batch_id)
            self.rows_written = self._collections.rows_written
            return
        if self._use_distributed():
            if self._distributed is None:
                self._distributed = DistributedMirrorWriter(
                    self.tables, self.options, self.app_id, self.merge_schema, self.storage_options
                )
            self._distributed(batch_df, batch_id)
            self.rows_written = self._distributed.rows_written
            return
        self.write(batch_df.toArrow(), batch_id)

    @property
    def last_timings(self) -> dict[str, float]:
        """Where the last batch's time went, by phase (seconds; the distributed writer's
        ``timings``; empty for the local writer): the profile the benchmark prints."""
        return dict(self._distributed.timings) if self._distributed is not None else {}

    @property
    def last_in_driver(self) -> bool:
        """Whether the distributed writer wrote the last batch from the driver (a small one)."""
        return self._distributed is not None and self._distributed.last_in_driver

    @property
    def last_read_in_driver(self) -> bool:
        """Whether the driver also read the last batch's rows from the nodes itself."""
        return self._distributed is not None and self._distributed.last_read_in_driver

    def _use_distributed(self) -> bool:
        """The distributed writer unless asked for the local one or the tables are the local
        writer's (a mirror partitioned by vbucket, or an unpartitioned one)."""
        if self.writer is not None:
            return self.writer == WRITER_DISTRIBUTED
        if "://" in self.tables:
            return True
        for name in ("mirror", "changelog"):
            path = str(self.path / name)
            if DeltaTable.is_deltatable(path):
                return GROUP_COLUMN in DeltaTable(path).metadata().partition_columns
        return True

    def close(self) -> None:
        """Release what the writer holds (the distributed writer's lease on the tables)."""
        if self._distributed is not None:
            self._distributed.close()
        if self._collections is not None:
            self._collections.close()

    def write(self, changes: pa.Table, batch_id: int) -> None:
        """Apply one micro-batch (Arrow table of change rows in stream order)."""
        self.path.mkdir(parents=True, exist_ok=True)
        changelog = self._table(self.changelog_path)
        self.rows_written = 0
        if not _done(changelog, self.app_id, batch_id):
            self.rows_written = changes.num_rows
            batch_ids = pa.array(np.full(changes.num_rows, batch_id, np.int64))
            rows, evolve = self._conform(changes.append_column("batch_id", batch_ids), changelog)
            write_deltalake(
                changelog if changelog is not None else str(self.changelog_path),
                rows,
                mode="append",
                schema_mode="merge" if evolve else None,
                commit_properties=_txn(self.app_id, batch_id),
            )
        if not _done(self._table(self.mirror_path), self.app_id, batch_id):
            self._apply_mirror(changes, batch_id)

    def _apply_mirror(self, changes: pa.Table, batch_id: int) -> None:
        if pc.any(pc.equal(changes.column("op"), OP_ROLLBACK), min_count=0).as_py():
            source = self._source_with_rollbacks(changes, batch_id)
        else:
            source = latest_changes(changes)
        assert source.schema == source_schema(mirror_schema(changes.schema)), source.schema
        live = pc.invert(source.column(DELETED))
        hashes = key_hashes(source.column("key"))
        props = _txn(self.app_id, batch_id)
        table = self._table(self.mirror_path)
        source, evolve = self._conform(source, table)
        if table is None:
            rows = source.filter(live).drop_columns([DELETED])
            write_deltalake(
                str(self.mirror_path), rows, mode="append", partition_by=PARTITION_COLUMNS,
                commit_properties=props,
            )  # fmt: skip
            created = self._table(self.mirror_path)
            assert created is not None, self.mirror_path
            self._index = KeyIndex.empty(created.version())
            self._index.add(hashes[live.to_numpy(zero_copy_only=False)], created.version())
            return
        self._check_layout(table)
        index = self._key_index(table)
        held = index.may_hold(hashes)
        if held.any():
            vbuckets = np.unique(source.column("vbucket").to_numpy()[held]).tolist()
            _merge(table, source, vbuckets, props, evolve)
        else:  # no key of the batch is in the mirror: a merge would only insert
            rows = source.filter(live).drop_columns([DELETED])
            write_deltalake(
                table, rows, mode="append", schema_mode="merge" if evolve else None,
                commit_properties=props,
            )  # fmt: skip
        index.add(hashes[live.to_numpy(zero_copy_only=False) & ~held], table.version())
        self._compact(table, index)

    def _conform(self, rows: pa.Table, table: DeltaTable | None) -> tuple[pa.Table, bool]:
        """``rows`` in ``table``'s columns (see the module docstring), and whether the table
        must take new columns (``mergeSchema``).

        Raises:
            SchemaEvolutionError: a new column without ``mergeSchema``, or a type that changed.
        """
        if table is None:
            return rows, False
        have = pa.schema(table.schema().to_arrow())
        new = [n for n in rows.column_names if n not in have.names and n != DELETED]
        if new and not self.merge_schema:
            raise SchemaEvolutionError(
                f"{table.table_uri}: the batch has columns the table lacks: "
                f"{', '.join(repr(n) for n in new)} (a field new in the query's schema). Set "
                "option mergeSchema=true (changefeed mirror --merge-schema) to add them, or "
                "leave them out of the schema."
            )
        columns, fields = [], []
        for field in have:
            if field.name not in rows.column_names:  # dropped from the query's schema
                columns.append(pa.nulls(rows.num_rows, field.type))
                fields.append(field)
                continue
            column = rows.column(field.name)
            if column.type != field.type:
                try:
                    column = column.cast(field.type, safe=True)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                    raise SchemaEvolutionError(
                        f"{table.table_uri}: column {field.name!r} is {column.type} in the "
                        f"batch but {field.type} in the table; declare it as {field.type} in "
                        "the schema, or write to new tables"
                    ) from None
            columns.append(column)
            fields.append(field.with_type(column.type))
        for name in rows.column_names:
            if name not in have.names:
                columns.append(rows.column(name))
                fields.append(rows.schema.field(name))
        return pa.Table.from_arrays(columns, schema=pa.schema(fields)), bool(new)

    def _table(self, path: Path) -> DeltaTable | None:
        """The Delta table at ``path`` as of now, or None if there is none yet."""
        table = self._tables.get(path)
        if table is not None:
            table.update_incremental()
            return table
        if not DeltaTable.is_deltatable(str(path)):
            return None
        table = self._tables[path] = DeltaTable(str(path))
        return table

    def _key_index(self, table: DeltaTable) -> KeyIndex:
        if self._index is None or self._index.version != table.version():
            started = time.perf_counter()
            self._index = KeyIndex.of_table(table)
            log.info(
                "mirror %s at version %d: read %d keys in %.2f s", self.mirror_path,
                table.version(), len(self._index), time.perf_counter() - started,
            )  # fmt: skip
        return self._index

    def _check_layout(self, table: DeltaTable) -> None:
        partitioning = list(table.metadata().partition_columns)
        if partitioning == PARTITION_COLUMNS:
            return
        if partitioning:
            raise MirrorLayoutError(
                f"mirror table {self.mirror_path} is partitioned by {partitioning}; this writer "
                f"writes mirrors partitioned by {PARTITION_COLUMNS} or not at all. Point the "
                "query at another directory, or rewrite the table with repartition_mirror()."
            )
        if not self._warned_unpartitioned:
            self._warned_unpartitioned = True
            log.warning(
                "mirror table %s is not partitioned by vbucket (written by an older changefeed):"
                " it stays correct, but every merge reads the whole table. To partition it, stop"
                " the query and run changefeed.spark.mirror.repartition_mirror(%r).",
                self.mirror_path, str(self.path),
            )  # fmt: skip

    def _compact(self, table: DeltaTable, index: KeyIndex) -> None:
        """Compact the partitions with the most small files, if any has too many."""
        files = pa.table(table.get_add_actions(flatten=True))
        small = files.filter(pc.less(files.column("size_bytes"), FILE_BYTES_TARGET))
        partitioned = "partition.vbucket" in small.column_names
        if not partitioned:
            if small.num_rows <= PARTITION_SMALL_FILES_MAX:
                return
            table.optimize.compact(target_size=FILE_BYTES_TARGET)
        else:
            counts = small.group_by(["partition.vbucket"]).aggregate([("size_bytes", "count")])
            crowded = counts.filter(
                pc.greater(counts.column("size_bytes_count"), PARTITION_SMALL_FILES_MAX)
            ).sort_by([("size_bytes_count", "descending")])
            if crowded.num_rows == 0:
                return
            vbuckets = crowded.column("partition.vbucket")[:COMPACTIONS_PER_BATCH_MAX].to_pylist()
            table.optimize.compact(
                partition_filters=[("vbucket", "in", [str(vb) for vb in vbuckets])],
                target_size=FILE_BYTES_TARGET,
            )
        index.version = table.version()  # compaction moves rows between files, keys stay

    def _source_with_rollbacks(self, changes: pa.Table, batch_id: int) -> pa.Table:
        """The merge source of a batch holding rollback rows (see the module docstring)."""
        rollbacks = changes.filter(pc.equal(changes.column("op"), OP_ROLLBACK))
        vbuckets = pc.unique(rollbacks.column("vbucket")).to_pylist()
        source, refetch = rollback_plan(changes, self._history(batch_id, vbuckets))
        log.info(
            "rollback of vbuckets %s (%d rollback rows): %d keys to re-read",
            vbuckets, rollbacks.num_rows, len(refetch),
        )  # fmt: skip
        return pa.concat_tables([source, self._refetch(refetch, changes.schema)])

    def _history(self, batch_id: int, vbuckets: list[int]) -> pa.Table:
        """``(key, vbucket, seqno)`` of every mirror row and of every change row that batches
        before ``batch_id`` logged, in ``vbuckets``: what a rollback may have to undo."""
        import pyarrow.dataset as ds  # here: it costs ~0.2 s of import (pandas), rollbacks are rare

        columns = HISTORY_SCHEMA.names
        in_vbuckets = ds.field("vbucket").isin(vbuckets)
        parts = [HISTORY_SCHEMA.empty_table()]
        mirror = self._table(self.mirror_path)
        if mirror is not None:
            rows = mirror.to_pyarrow_dataset().to_table(columns=columns, filter=in_vbuckets)
            parts.append(rows.cast(HISTORY_SCHEMA))
        changelog = self._table(self.changelog_path)
        if changelog is not None:
            earlier = (ds.field("batch_id") < batch_id) & (ds.field("op") != OP_ROLLBACK)
            logged = changelog.to_pyarrow_dataset().to_table(
                columns=columns, filter=in_vbuckets & earlier
            )
            parts.append(logged.cast(HISTORY_SCHEMA))
        return pa.concat_tables(parts)

    def _refetch(self, keys: dict[str, int], schema: pa.Schema) -> pa.Table:
        return refetch_source(keys, schema, self.options)


def _merge(
    table: DeltaTable,
    source: pa.Table,
    vbuckets: list[int],
    props: CommitProperties,
    evolve: bool = False,
) -> None:
    """Merge ``source`` on ``(vbucket, key)``, scanning only the partitions of ``vbuckets``
    (which must hold every vbucket of a source key the table holds)."""
    assert vbuckets, "a merge must scan some partition"
    listed = ", ".join(str(int(vb)) for vb in vbuckets)
    predicate = f"t.vbucket IN ({listed}) AND t.vbucket = s.vbucket AND t.key = s.key"
    (
        table.merge(
            source,
            predicate,
            source_alias="s",
            target_alias="t",
            merge_schema=evolve,
            commit_properties=props,
        )
        .when_matched_delete(f"s.{DELETED}")
        .when_matched_update_all(f"NOT s.{DELETED}", except_cols=[DELETED])
        .when_not_matched_insert_all(f"NOT s.{DELETED}", except_cols=[DELETED])
        .execute()
    )


def _txn(app_id: str, batch_id: int) -> CommitProperties:
    return CommitProperties(app_transactions=[Transaction(app_id, batch_id)])


def _done(table: DeltaTable | None, app_id: str, batch_id: int) -> bool:
    """True if ``table`` already committed ``batch_id`` (a replayed batch)."""
    if table is None:
        return False
    version = table.transaction_version(app_id)
    return version is not None and version >= batch_id


def read_mirror(path: str | Path, storage_options: dict[str, str] | None = None) -> pa.Table:
    """The mirror table as Arrow (key, vbucket, seqno, value, ...), without the distributed
    writer's partition column."""
    table = DeltaTable(table_uri(path, "mirror"), storage_options=storage_options)
    rows = table.to_pyarrow_table()
    return rows.drop_columns([GROUP_COLUMN]) if GROUP_COLUMN in rows.column_names else rows


def repartition_mirror(path: str | Path) -> bool:
    """Rewrite the mirror table under ``path`` (the ``MirrorWriter`` path) partitioned by
    vbucket, in one overwrite commit; the app transactions recorded stay. Run it while no query
    writes the tables. The old files stay until a Delta vacuum removes them.

    Returns:
        False if the table was already partitioned by vbucket (nothing written).

    Raises:
        MirrorLayoutError: the table is partitioned by something else.
    """
    mirror_path = Path(path) / "mirror"
    table = DeltaTable(str(mirror_path))
    partitioning = list(table.metadata().partition_columns)
    if partitioning == PARTITION_COLUMNS:
        return False
    if partitioning:
        raise MirrorLayoutError(f"mirror table {mirror_path} is partitioned by {partitioning}")
    rows = table.to_pyarrow_table()
    write_deltalake(
        table, rows, mode="overwrite", partition_by=PARTITION_COLUMNS, schema_mode="overwrite"
    )
    assert DeltaTable(str(mirror_path)).metadata().partition_columns == PARTITION_COLUMNS
    log.info("mirror table %s rewritten partitioned by vbucket (%d rows)", mirror_path, len(rows))
    return True
