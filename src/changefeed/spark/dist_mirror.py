"""The distributed mirror writer: Spark's tasks write the files, the driver commits file actions.

``MirrorWriter`` (``mirror.py``) uses it for ``foreachBatch`` unless the tables were written by
the single-process writer. For micro-batch b:

1. the driver reads the two tables' versions and whether they hold b already (the Delta app
   transaction ``changefeed-mirror``: a replayed batch is skipped, table by table), and the
   mirror's file list per vbucket group (O(files): no per-key state);
2. one Spark stage: each row gets its stream position and its group (``vbucket % groups``,
   ``groups`` fixed when the tables are created), the batch is repartitioned by group into
   ``tasks`` tasks and each group goes to ``mirror_tasks.run_group`` (``applyInArrow``), which
   writes the group's Parquet files and returns their actions and the vbuckets' positions;
3. the driver collects those rows (a few per group) and commits the changelog's adds, then the
   mirror's adds and removes, each in one Delta transaction carrying b (delta-rs
   ``create_write_transaction`` with ``app_transactions``); the mirror's commit also records
   every vbucket's position and the resolved watermark (``watermark.py``).

Small batches take a shorter path to the same commits (an adaptive writer): a batch whose
offsets span at most ``driver_batch_max`` seqnos (option ``mirrorDriverBatchMax``, default
``DEFAULT_DRIVER_BATCH_MAX``; 0: never; ``batch_size.py`` reads the span from Spark's offset log
before the batch runs) is collected to the driver (``toArrow``: one Spark stage, the read) and
its groups go through the same ``run_group`` there, in two threads (``run_groups_here``).
The files, actions, positions and commits are the same as the tasks' would be; what it saves is
the shuffle, the second stage and its Python workers, about a second per batch, which is most
of the latency of a steady stream's small batches. The driver then holds one small batch at a
time (bounded by the option), and the mirror files' key hashes it caches (as a worker does).

A crash anywhere leaves either nothing or whole commits: files written by tasks of a batch that
did not commit are in no table (orphans for a vacuum), and the replay writes new ones. The
changelog commits first, so a replay finds one of: neither committed, the changelog only (the
tasks then write the mirror only), or both (nothing to do).

Both tables are partitioned by ``_vb_group``; readers see it as a column (``read_mirror``
drops it). The changelog follows the change-feed convention (``_change_type``,
``_commit_version``, ``_commit_timestamp``; ``mirror_tasks.py``).

Parallelism: ``tasks`` per batch is the ``mirrorTasks`` option, else Spark's
``spark.default.parallelism`` (the executors' cores), at most ``groups``. ``groups`` is the
``mirrorGroups`` option when the tables are created (default ``new_table_groups``: on a local
master twice Spark's default parallelism, 4 to 64; on a cluster twice the configured executor
cores, 16 to 64), stored in both tables' descriptions (a restart reads the mirror's, else the
changelog's); more groups than tasks lets a larger cluster use more tasks later, fewer make a
small batch's files fewer.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.schema import Schema as DeltaSchema
from deltalake.transaction import AddAction, RemoveAction, create_table_with_add_actions

from changefeed.spark import watermark
from changefeed.spark.batch_plan import SourceBatch, source_batch
from changefeed.spark.batch_size import planned_changes, seqnos_spanned
from changefeed.spark.delta_files import (
    ACTION_DDL,
    ACTION_SCHEMA,
    GROUP_COLUMN,
    KIND_ADD,
    KIND_POSITION,
    KIND_REMOVE,
    now_ms,
    table_uri,
)
from changefeed.spark.maintenance import TableMaintenance
from changefeed.spark.merge_source import mirror_schema
from changefeed.spark.mirror_tasks import (
    CHANGEFEED_FIELDS,
    FileRef,
    GroupPlan,
    position_column,
    run_group,
)
from changefeed.spark.options import bool_option
from changefeed.spark.table_lease import TablesLease

log = logging.getLogger("changefeed.mirror")

# Default vbucket groups of new tables: twice the executors' cores (room for a cluster twice as
# large), within these bounds. A steady stream's small batch writes two files per group, so
# fewer groups are faster there (16 -> 4 groups: the files of a 1,000-change batch 187 -> 47 ms),
# while a large batch has at most one write task per group. The groups are fixed when the
# tables are created, so on a cluster, whose cores at the first batch may be far fewer than
# later (dynamic allocation, executors still registering), they come from the configured
# executors, at least CLUSTER_GROUPS_MIN (``new_table_groups``).
GROUPS_PER_CORE: Final = 2
DEFAULT_GROUPS_MIN: Final = 4
DEFAULT_GROUPS_MAX: Final = 64
CLUSTER_GROUPS_MIN: Final = 16
CLUSTER_CORE_KEYS: Final = (
    "spark.executor.cores",
    "spark.executor.instances",
    "spark.dynamicAllocation.enabled",
    "spark.dynamicAllocation.maxExecutors",
)
GROUPS_MAX: Final = 1024
# A batch planned at most this many changes is written by the driver (``mirrorDriverBatchMax``).
DEFAULT_DRIVER_BATCH_MAX: Final = 50_000
DRIVER_THREADS: Final = 2  # threads running a small batch's groups in the driver


class SchemaMismatchError(RuntimeError):
    """A batch's columns do not fit a table's; the message names the column."""


class MirrorOwnerError(RuntimeError):
    """The tables hold batches of another query (another checkpoint); the message says which."""


class DistributedMirrorWriter:
    """``foreachBatch`` callable: see the module docstring.

    Args:
        tables: a directory or an object-store URL (``s3://bucket/prefix``) holding both tables.
        options: the source's options (the node to re-read rolled-back keys from), and the
            writer's: ``mirrorTasks``, ``mirrorGroups``.
        storage_options: deltalake storage options (None: from the environment, e.g. ``AWS_*``).
    """

    def __init__(
        self,
        tables: str,
        options: dict[str, str],
        app_id: str,
        merge_schema: bool,
        storage_options: dict[str, str] | None = None,
    ) -> None:
        self.tables = tables
        self.options = dict(options)
        self.app_id = app_id
        self.merge_schema = merge_schema
        self.storage_options = storage_options
        self.mirror_uri = table_uri(tables, "mirror")
        self.changelog_uri = table_uri(tables, "changelog")
        lowered = {k.lower(): v for k, v in self.options.items()}
        self.tasks = _positive(lowered, "mirrortasks")
        self.groups_wanted = _positive(lowered, "mirrorgroups")  # None: default_groups
        self.driver_batch_max = _count(lowered, "mirrordriverbatchmax", DEFAULT_DRIVER_BATCH_MAX)
        self.driver_read = bool_option(lowered, "mirrordriverread", True)
        self.last_in_driver = False  # which path the last batch took
        self.last_read_in_driver = False  # whether its rows were read by the driver itself
        self.timings: dict[str, float] = {}  # the last batch's phases (seconds; a profile)
        if self.groups_wanted is not None and self.groups_wanted > GROUPS_MAX:
            raise ValueError(f"mirrorGroups {self.groups_wanted} is above {GROUPS_MAX}")
        self.lease = TablesLease(table_uri(tables, ""), storage_options)
        self.maintenance = TableMaintenance(tables, self.options, storage_options)
        self._first_batch = True
        self.rows_written = 0  # change rows the last batch logged (0 when it was skipped)
        self._tables: dict[str, DeltaTable] = {}
        self._positions_at: tuple[int, dict[int, watermark.Position]] | None = None

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        self.write_batch(batch_df, batch_id)

    def write_batch(self, batch_df: Any, batch_id: int, in_driver: bool | None = None) -> None:
        """Write micro-batch ``batch_id``; ``in_driver`` picks the path (None: by the batch's
        planned size, ``driver_batch_max``; see the module docstring)."""
        started = time.perf_counter()
        source = self._source_batch(batch_df, batch_id)
        if in_driver is None:
            in_driver = self.small(batch_df, batch_id, source)
        planned_s = time.perf_counter() - started
        self.last_in_driver = in_driver
        self.last_read_in_driver = False
        self._write(batch_df, batch_id, in_driver, source if in_driver else None)
        self.timings["plan"] = planned_s  # the batch's offsets and size, from Spark

    def small(self, batch_df: Any, batch_id: int, source: SourceBatch | None = None) -> bool:
        """Whether the batch is planned at most ``driver_batch_max`` changes (unknown: no):
        from its offsets in Spark's plan (``source``), else from the offset log."""
        if self.driver_batch_max == 0:
            return False
        if source is not None:
            planned: int | None = seqnos_spanned(source.start, source.end)
        else:
            planned = planned_changes(batch_df, batch_id)
        return planned is not None and planned <= self.driver_batch_max

    def _source_batch(self, batch_df: Any, batch_id: int) -> SourceBatch | None:
        """The changefeed batch the driver can read itself (``driver_read.py``), or None."""
        if not self.driver_read or self.driver_batch_max == 0:
            return None
        from changefeed.spark.driver_read import readable

        source = source_batch(batch_df, batch_id)
        return source if source is not None and readable(source) else None

    def _rows_here(self, batch_df: Any, source: SourceBatch | None) -> pa.Table:
        """A small batch's rows in the driver: read from the nodes (``source``), else (or after
        a transport failure) Spark's job (``toArrow``)."""
        if source is None:
            return batch_df.toArrow()
        from changefeed.spark.driver_read import rows_in_driver

        rows, self.last_read_in_driver = rows_in_driver(batch_df, source)
        return rows

    def _write(
        self, batch_df: Any, batch_id: int, in_driver: bool, source: SourceBatch | None
    ) -> None:
        lap = _Laps()
        self.timings = lap.seconds
        self.lease.hold()
        changelog = self._load(self.changelog_uri)
        mirror = self._load(self.mirror_uri)
        if self._first_batch:
            self._check_owner(mirror, batch_id)
            self._first_batch = False
        write_changelog = not _done(changelog, self.app_id, batch_id)
        self.rows_written = 0
        if _done(mirror, self.app_id, batch_id):
            return
        from pyspark.sql import functions as F
        from pyspark.sql.pandas.types import to_arrow_schema

        batch_schema = to_arrow_schema(batch_df.schema)
        if GROUP_COLUMN in batch_schema.names:  # a document field of that name: ours wins
            batch_schema = batch_schema.remove(batch_schema.get_field_index(GROUP_COLUMN))
        groups = self._groups(mirror, changelog, batch_df)
        mirror_target = self._target(mirror, mirror_schema(batch_schema))
        changelog_fields = [*batch_schema, pa.field("batch_id", pa.int64())]
        changelog_target = self._target(
            changelog, pa.schema(changelog_fields + list(CHANGEFEED_FIELDS))
        )
        # New columns (mergeSchema) go in first, in their own commits: the changelog's version
        # that the tasks write into its rows must be the one the data commit gets.
        self._evolve(mirror, mirror_target)
        self._evolve(changelog, changelog_target)
        plan = GroupPlan(
            mirror_uri=self.mirror_uri, changelog_uri=self.changelog_uri,
            storage_options=self.storage_options, options=self.options, batch_id=batch_id,
            write_changelog=write_changelog, write_mirror=True,
            changelog_version=None if changelog is None else changelog.version(),
            commit_timestamp_ms=now_ms(), mirror_schema=mirror_target,
            changelog_schema=changelog_target, mirror_files=_files_by_group(mirror),
            position=position_column(batch_schema.names),
        )  # fmt: skip
        lap("prepare")
        if in_driver:
            rows = self._rows_here(batch_df, source)
            lap("read")
            actions = run_groups_here(plan, rows, groups)
        else:
            tasks = min(groups, self.tasks or _default_parallelism(batch_df))
            keyed = batch_df.withColumn(plan.position, F.monotonically_increasing_id()).withColumn(
                GROUP_COLUMN, F.pmod(F.col("vbucket"), F.lit(groups)).cast("int")
            )
            actions = (
                keyed.repartition(tasks, GROUP_COLUMN)
                .groupBy(GROUP_COLUMN)
                .applyInArrow(_group_function(plan), ACTION_DDL)
                .toArrow()
            )
        lap("files")
        if write_changelog:
            logged = actions.filter(pc.equal(actions.column("table_name"), "changelog"))
            self.rows_written = int(pc.sum(logged.column("num_records")).as_py() or 0)
            self._commit(changelog, self.changelog_uri, "changelog", actions, changelog_target,
                         batch_id, None, groups)  # fmt: skip
            committed = self._load(self.changelog_uri)
            expected = 0 if plan.changelog_version is None else plan.changelog_version + 1
            assert committed is not None and committed.version() == expected, (
                "another writer committed to the changelog", expected,
            )  # fmt: skip
            lap("changelog commit")
        before = self._positions(mirror)
        batch_positions = actions.filter(pc.equal(actions.column("kind"), KIND_POSITION))
        after = watermark.advance(
            before,
            zip(*(batch_positions.column(n).to_pylist() for n in ("vbucket", "seqno", "cas")),
                strict=True),
        )  # fmt: skip
        record = watermark.to_metadata(after, batch_id, groups)
        self._commit(mirror, self.mirror_uri, "mirror", actions, mirror_target, batch_id, record,
                     groups)  # fmt: skip
        committed_mirror = self._load(self.mirror_uri)
        assert committed_mirror is not None, self.mirror_uri
        self._positions_at = (committed_mirror.version(), after)
        lap("mirror commit")
        self.maintenance.after_batch()  # purge and compaction when due (maintenance.py)
        lap("maintenance")

    def _commit(
        self, table: DeltaTable | None, uri: str, name: str, actions: pa.Table,
        schema: pa.Schema, batch_id: int, record: dict[str, Any] | None, groups: int,
    ) -> None:  # fmt: skip
        mine = actions.filter(pc.equal(actions.column("table_name"), name)).to_pylist()
        adds = [AddAction(a["path"], a["size"], {GROUP_COLUMN: str(a["grp"])}, now_ms(), True,
                          a["stats"]) for a in mine if a["kind"] == KIND_ADD]  # fmt: skip
        removes = [RemoveAction(a["path"], True, now_ms(), a["size"], {GROUP_COLUMN: str(a["grp"])})
                   for a in mine if a["kind"] == KIND_REMOVE]  # fmt: skip
        props = CommitProperties(
            app_transactions=[Transaction(self.app_id, batch_id)],
            custom_metadata={watermark.METADATA_KEY: record} if record is not None else None,
        )
        full = schema.append(pa.field(GROUP_COLUMN, pa.int32()))
        if table is None:
            assert not removes, removes
            description = json.dumps({"changefeed": {"vbucketGroups": groups}})
            create_table_with_add_actions(
                uri, DeltaSchema.from_arrow(full), adds, mode="append",
                partition_by=[GROUP_COLUMN], description=description,
                storage_options=self.storage_options, commit_properties=props,
            )  # fmt: skip
            return
        table.create_write_transaction(
            [*adds, *removes], "append", full, partition_by=[GROUP_COLUMN],
            commit_properties=props,
        )  # fmt: skip
        log.info("%s: batch %d committed (%d files added, %d removed)", name, batch_id,
                 len(adds), len(removes))  # fmt: skip

    def _evolve(self, table: DeltaTable | None, target: pa.Schema) -> None:
        """Add ``target``'s columns that ``table`` lacks (``_target`` allowed them)."""
        if table is None:
            return
        have = pa.schema(table.schema().to_arrow()).names
        new = [f for f in target if f.name not in have]
        if new:
            from deltalake.schema import Field

            table.alter.add_columns([Field.from_arrow(f) for f in new])
            log.info("%s: columns added: %s", table.table_uri, ", ".join(f.name for f in new))

    def _target(self, table: DeltaTable | None, wanted: pa.Schema) -> pa.Schema:
        """The columns of ``table``'s files for a batch of ``wanted`` columns: the table's (a
        column the batch lacks is written null), then new ones if ``mergeSchema``.

        Raises:
            SchemaMismatchError: a new column without ``mergeSchema``, or a type with no cast.
        """
        if table is None:
            return wanted
        have = pa.schema(table.schema().to_arrow())
        have = have.remove(have.get_field_index(GROUP_COLUMN))
        new = [f for f in wanted if f.name not in have.names]
        if new and not self.merge_schema:
            raise SchemaMismatchError(
                f"{table.table_uri}: the batch has columns the table lacks: "
                f"{', '.join(repr(f.name) for f in new)} (a field new in the query's schema). "
                "Set option mergeSchema=true (changefeed mirror --merge-schema) to add them, or "
                "leave them out of the schema."
            )
        fields = list(have)
        for target in have:
            if target.name not in wanted.names:
                continue
            given = wanted.field(target.name).type
            if given != target.type and not _castable(given, target.type):
                raise SchemaMismatchError(
                    f"{table.table_uri}: column {target.name!r} is {given} in the batch but "
                    f"{target.type} in the table; declare it as {target.type} in the schema, "
                    "or write to new tables"
                )
        return pa.schema(fields + new)

    def _groups(
        self, mirror: DeltaTable | None, changelog: DeltaTable | None, batch_df: Any
    ) -> int:
        """The tables' vbucket groups: the mirror's, else the changelog's (a driver that died
        between batch 0's two commits: the mirror must get the groups the changelog's files are
        partitioned by, or a rollback's lookup of a vbucket's changes by group misses them),
        else, for new tables, ``mirrorGroups`` or ``new_table_groups``."""
        existing, uri = (mirror, self.mirror_uri) if mirror is not None else (
            changelog, self.changelog_uri)  # fmt: skip
        if existing is None:
            if self.groups_wanted is not None:
                return self.groups_wanted
            context = batch_df.sparkSession.sparkContext
            conf = context.getConf()
            return new_table_groups(
                str(context.master), {k: conf.get(k, None) for k in CLUSTER_CORE_KEYS},
                _default_parallelism(batch_df),
            )  # fmt: skip
        try:
            described = json.loads(existing.metadata().description or "{}")
            return int(described["changefeed"]["vbucketGroups"])
        except (ValueError, KeyError, TypeError):
            raise MirrorOwnerError(
                f"table {uri} was not written by the distributed writer "
                "(no vbucket groups in its description)"
            ) from None

    def _positions(self, mirror: DeltaTable | None) -> dict[int, watermark.Position]:
        """The vbuckets' positions at the mirror's version: from our last commit, else from
        the commit history (a restart, or another writer's commit)."""
        if mirror is None:
            return {}
        cached = self._positions_at
        if cached is not None and cached[0] == mirror.version():
            return cached[1]
        record = watermark.latest_record(mirror.history(watermark.HISTORY_SCAN_MAX))
        return {} if record is None else watermark.from_metadata(record)

    def _check_owner(self, mirror: DeltaTable | None, batch_id: int) -> None:
        """A query's first batch continues the tables' batches (or replays the last one)."""
        if mirror is None:
            return
        committed = mirror.transaction_version(self.app_id)
        if committed is not None and batch_id < committed:
            raise MirrorOwnerError(
                f"tables {self.tables} hold micro-batch {committed} of another query, and this "
                f"query is at batch {batch_id}: give that query's --checkpoint, or other --tables"
            )

    def _load(self, uri: str) -> DeltaTable | None:
        """The table at ``uri`` as of now (loaded once, then brought up to date), or None."""
        table = self._tables.get(uri)
        if table is not None:
            table.update_incremental()
            return table
        if not DeltaTable.is_deltatable(uri, self.storage_options):
            return None
        table = self._tables[uri] = DeltaTable(uri, storage_options=self.storage_options)
        return table

    def close(self) -> None:
        """Release the tables' lease (the next job need not wait for it to expire)."""
        self.lease.release()


def _group_function(plan: GroupPlan) -> Callable[[tuple[pa.Scalar, ...], pa.Table], pa.Table]:
    """The ``applyInArrow`` function of a batch's groups (runs in the Python workers); typed,
    as pyspark tells the Arrow grouped-map forms apart by the hints."""

    def run(key: tuple[pa.Scalar, ...], rows: pa.Table) -> pa.Table:
        return run_group(plan, int(key[0].as_py()), rows)

    return run


class _Laps:
    """Seconds between calls, by name: where a batch's time went (``timings``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._at = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._at
        self._at = now


def run_groups_here(plan: GroupPlan, rows: pa.Table, groups: int) -> pa.Table:
    """What the write tasks would return for ``rows`` (the whole batch, in stream order, as
    ``toArrow`` collects it: partition by partition), computed in this process: each group's
    rows go to ``run_group`` as a task would get them, with their place in the batch as the
    stream position."""
    vbuckets = rows.column("vbucket").to_numpy()
    group_of = np.mod(vbuckets, groups).astype(np.int32)
    if GROUP_COLUMN in rows.column_names:  # a document field of that name: ours wins
        rows = rows.drop_columns([GROUP_COLUMN])
    keyed = rows.append_column(plan.position, pa.array(np.arange(rows.num_rows, dtype=np.int64)))
    keyed = keyed.append_column(GROUP_COLUMN, pa.array(group_of))

    def one(group: int) -> pa.Table:
        return run_group(plan, group, keyed.filter(pa.array(group_of == group)))

    # Groups touch disjoint files: a few threads overlap their Parquet and Arrow work, which
    # releases the GIL (measured: the groups of a 1,000-row batch 329 -> 245 ms, same CPU).
    present = [int(g) for g in np.unique(group_of).tolist()]
    with ThreadPoolExecutor(max(1, min(DRIVER_THREADS, len(present)))) as pool:
        parts = list(pool.map(one, present))
    return pa.concat_tables([ACTION_SCHEMA.empty_table(), *parts])


def _files_by_group(mirror: DeltaTable | None) -> dict[int, list[FileRef]]:
    if mirror is None:
        return {}
    files = pa.table(mirror.get_add_actions(flatten=True))
    by_group: dict[int, list[FileRef]] = {}
    for path, size, group in zip(
        files.column("path").to_pylist(), files.column("size_bytes").to_pylist(),
        files.column(f"partition.{GROUP_COLUMN}").to_pylist(), strict=True,
    ):  # fmt: skip
        by_group.setdefault(int(group), []).append(FileRef(path, int(size)))
    return by_group


def _done(table: DeltaTable | None, app_id: str, batch_id: int) -> bool:
    if table is None:
        return False
    version = table.transaction_version(app_id)
    return version is not None and version >= batch_id


def _castable(given: pa.DataType, target: pa.DataType) -> bool:
    try:
        pa.array([], given).cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return False
    return True


def _positive(options: dict[str, str], name: str) -> int | None:
    text = options.get(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"option {name}: {text!r} is not a positive integer")
    return value


def _count(options: dict[str, str], name: str, default: int) -> int:
    text = options.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"option {name}: {text!r} is not a count (0 or more)")
    return value


def default_groups(cores: int) -> int:
    """The vbucket groups of new tables for ``cores`` executor cores (``GROUPS_PER_CORE``)."""
    return max(DEFAULT_GROUPS_MIN, min(DEFAULT_GROUPS_MAX, GROUPS_PER_CORE * cores))


def new_table_groups(master: str, conf: dict[str, str | None], default_parallelism: int) -> int:
    """The vbucket groups of new tables without ``mirrorGroups``, for Spark master ``master``
    with configuration ``conf`` (``CLUSTER_CORE_KEYS``; None: not set).

    A local master (``local``, ``local[N]``) has its cores from the start: Spark's default
    parallelism. A cluster's default parallelism counts the cores registered so far (2 before
    any executor does), and the groups stay with the tables: there they follow the configured
    executors (``spark.executor.instances``, or ``spark.dynamicAllocation.maxExecutors`` with
    dynamic allocation, times ``spark.executor.cores``), and are at least
    ``CLUSTER_GROUPS_MIN`` (all the same when those are not set)."""
    if master == "local" or master.startswith("local["):
        return default_groups(default_parallelism)
    return max(CLUSTER_GROUPS_MIN, default_groups(planned_cores(conf)))


def planned_cores(conf: dict[str, str | None]) -> int:
    """The executor cores ``conf`` plans (0: not known from it)."""
    dynamic = (conf.get("spark.dynamicAllocation.enabled") or "false").strip().lower() == "true"
    executors = conf.get(
        "spark.dynamicAllocation.maxExecutors" if dynamic else "spark.executor.instances"
    )
    cores = conf.get("spark.executor.cores")
    try:
        return max(0, int(executors or 0)) * max(0, int(cores or 0))
    except ValueError:
        return 0  # Spark refuses such a value itself


def _default_parallelism(batch_df: Any) -> int:
    return max(1, int(batch_df.sparkSession.sparkContext.defaultParallelism))
