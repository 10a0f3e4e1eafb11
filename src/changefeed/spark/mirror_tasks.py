"""What one Spark task of the distributed mirror writer does with one vbucket group of a batch.

A group (``vbucket % groups``) is a partition of both tables: its files are written by the one
task holding the group's rows, so tasks never touch each other's files and the driver only
commits what they report. For group g of batch b the task:

1. puts the group's change rows back in stream order (``plan.position``: a vbucket's rows come
   from one source partition, whose ids rise in stream order) and reduces them to each key's final
   change (``merge_source.latest_changes``), or applies the batch's rollback rows
   (``merge_source.rollback_plan``: the history is the group's mirror rows and its earlier
   changelog rows, and the node is asked for the voided keys, as ``mirror.py`` does);
2. finds the mirror files of g that may hold a key of the batch by 64-bit key hashes (cached
   per file in the worker: data files never change, so the cache needs no invalidation), plus
   the group's small files once there are too many (compaction happens here, in the same
   commit), and rewrites them with the batch's changes applied: copy on write. A batch whose
   keys are all new only adds a file;
3. writes the changelog rows of g, each with its change-feed columns: ``_change_type``
   (``insert`` / ``update_postimage`` / ``delete``, from whether the key was live before the
   row: the previous row of the key in the batch, else the mirror's files read in step 2),
   ``_commit_version`` (the changelog version the driver's commit will have) and
   ``_commit_timestamp``. A rollback row has a null ``_change_type``;
4. reports the file actions and each vbucket's position (its last change's seqno and CAS).

No per-key state outlives the task except the hash cache; the driver holds none.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from changefeed.consumer.change_rows import OP_MUTATION, OP_ROLLBACK
from changefeed.spark.delta_files import (
    GROUP_COLUMN,
    KIND_POSITION,
    actions_table,
    remove_row,
    table_fs,
    write_data_file,
)
from changefeed.spark.key_index import Hashes, key_hashes
from changefeed.spark.merge_source import (
    DELETED,
    HISTORY_SCHEMA,
    latest_changes,
    rollback_plan,
)

log = logging.getLogger("changefeed.mirror")

POSITION: Final = "__changefeed_position"  # the row's place in the stream (per vbucket)
CHANGE_TYPE: Final = "_change_type"
COMMIT_VERSION: Final = "_commit_version"
COMMIT_TIMESTAMP: Final = "_commit_timestamp"
CHANGE_INSERT: Final = "insert"
CHANGE_UPDATE: Final = "update_postimage"
CHANGE_DELETE: Final = "delete"
CHANGEFEED_FIELDS: Final = (
    pa.field(CHANGE_TYPE, pa.string()),
    pa.field(COMMIT_VERSION, pa.int64()),
    pa.field(COMMIT_TIMESTAMP, pa.timestamp("us", tz="UTC")),
)
# A group's small files are merged once it has more than this many (each batch adds one).
SMALL_FILES_MAX: Final = 16
FILE_BYTES_SMALL: Final = 32 * 1024 * 1024
_HASH_CACHE_MAX: Final = 32 * 1024 * 1024  # hashes (8 bytes each) kept per worker process
_hash_cache: OrderedDict[str, Hashes] = OrderedDict()
_hash_cache_total = 0  # hashes in _hash_cache (summing them per file read cost O(files))
_hash_cache_lock = threading.Lock()  # the driver runs a small batch's groups in threads


@dataclass(frozen=True)
class FileRef:
    path: str
    size: int


@dataclass(frozen=True)
class GroupPlan:
    """What the driver tells every task of a batch (pickled into the tasks).

    Attributes:
        mirror_files: per group, the mirror's files at the version the batch starts from.
        changelog_version: the changelog's version before this batch (None: no table yet).
        mirror_schema / changelog_schema: the files' columns (without ``GROUP_COLUMN``).
    """

    mirror_uri: str
    changelog_uri: str
    storage_options: dict[str, str] | None
    options: dict[str, str]
    batch_id: int
    write_changelog: bool
    write_mirror: bool
    changelog_version: int | None
    commit_timestamp_ms: int
    mirror_schema: pa.Schema
    changelog_schema: pa.Schema
    mirror_files: dict[int, list[FileRef]] = field(default_factory=dict)
    position: str = POSITION  # the stream-position column's name (``position_column``)


def position_column(names: list[str]) -> str:
    """A name for the rows' stream position that no column of the batch has (Spark's names
    ignore case): ``POSITION``, else with ``_`` appended until free (a document field of that
    name stays a field)."""
    taken = {n.lower() for n in names}
    name = POSITION
    while name in taken:  # bounded: each round is longer than every name
        name += "_"
    return name


def run_group(plan: GroupPlan, group: int, rows: pa.Table) -> pa.Table:
    """The file actions and positions of one group of a batch (``ACTION_SCHEMA`` rows)."""
    order = pc.sort_indices(rows, [(plan.position, "ascending")])
    changes = rows.take(order).drop_columns([plan.position, GROUP_COLUMN])
    actions: list[dict[str, Any]] = []
    has_rollback = pc.any(pc.equal(changes.column("op"), OP_ROLLBACK), min_count=0).as_py()
    files = plan.mirror_files.get(group, [])
    mirror_fs = table_fs(plan.mirror_uri, plan.storage_options)
    if has_rollback:
        history = _history(plan, group, changes, mirror_fs, files)
        source, refetch = rollback_plan(changes, history)
        if refetch:
            from changefeed.spark.refetch import refetch_source  # the node client: rare

            source = pa.concat_tables(
                [source, refetch_source(refetch, changes.schema, plan.options)]
            )
    else:
        source = latest_changes(changes)
    touched, old = _touched_files(mirror_fs, files, source)
    if plan.write_mirror:
        keys = source.column("key")
        kept = old.filter(pc.invert(pc.is_in(old.column("key"), value_set=keys)))
        live = source.filter(pc.invert(source.column(DELETED))).drop_columns([DELETED])
        merged = pa.concat_tables(
            [conform(kept, plan.mirror_schema), conform(live, plan.mirror_schema)]
        )
        if merged.num_rows:
            added = write_data_file(mirror_fs, "mirror", merged, group, plan.batch_id)
            actions.append(added)
            # The next batch asks which files hold its keys: this one's are known now (in the
            # driver's path, and in a worker that gets the group again, no read back).
            _remember(added["path"], np.sort(key_hashes(merged.column("key"))))
        actions += [remove_row("mirror", f.path, f.size, group) for f in touched]
    if plan.write_changelog:
        assert plan.write_mirror, "the changelog commits first: a batch it holds skips it"
        version = 0 if plan.changelog_version is None else plan.changelog_version + 1
        logged = changelog_rows(changes, old.column("key"), plan.batch_id, version,
                                plan.commit_timestamp_ms)  # fmt: skip
        changelog_fs = table_fs(plan.changelog_uri, plan.storage_options)
        rows_out = conform(logged, plan.changelog_schema)
        actions.append(write_data_file(changelog_fs, "changelog", rows_out, group, plan.batch_id))
    actions += positions(changes)
    return actions_table(actions)


def changelog_rows(
    changes: pa.Table, held: pa.Array | pa.ChunkedArray, batch_id: int, version: int,
    timestamp_ms: int,
) -> pa.Table:  # fmt: skip
    """``changes`` with ``batch_id`` and the change-feed columns (see the module docstring).

    Args:
        held: keys live in the mirror before the batch (at least every key of ``changes`` that
            is; others are ignored).
    """
    count = changes.num_rows
    logged = changes.append_column("batch_id", pa.array(np.full(count, batch_id, np.int64)))
    logged = logged.append_column(
        CHANGEFEED_FIELDS[0], change_types(changes.column("key"), changes.column("op"), held)
    )
    logged = logged.append_column(CHANGEFEED_FIELDS[1], pa.array(np.full(count, version, np.int64)))
    stamp = pa.array(np.full(count, timestamp_ms * 1000, np.int64)).cast(CHANGEFEED_FIELDS[2].type)
    return logged.append_column(CHANGEFEED_FIELDS[2], stamp)


def change_types(
    keys: pa.Array | pa.ChunkedArray, ops: pa.Array | pa.ChunkedArray,
    held: pa.Array | pa.ChunkedArray,
) -> pa.Array:  # fmt: skip
    """Per change row (in stream order): ``insert`` if its key was not live before it,
    ``update_postimage`` if it was, ``delete`` for deletions and expirations, null for a
    rollback row. A key's first row looks at ``held``, later rows at the row before."""
    count = len(keys)
    op = np.asarray(ops.to_numpy(zero_copy_only=False), dtype=object)
    mutation = op == OP_MUTATION
    rollback = op == OP_ROLLBACK
    data = np.flatnonzero(~rollback)  # the rows that change a key, in stream order
    live_before = np.zeros(count, np.bool_)
    if len(data):
        data_keys = pc.take(keys, pa.array(data))
        order = np.asarray(
            pc.sort_indices(
                pa.table({"k": data_keys, "p": pa.array(np.arange(len(data)))}),
                [("k", "ascending"), ("p", "ascending")],
            )
        )
        sorted_keys = np.asarray(pc.take(data_keys, pa.array(order)).to_numpy(zero_copy_only=False),
                                 dtype=object)  # fmt: skip
        rows = data[order]
        first = np.ones(len(rows), np.bool_)
        first[1:] = sorted_keys[1:] != sorted_keys[:-1]
        in_mirror = np.asarray(
            pc.is_in(pc.take(keys, pa.array(rows)), value_set=_array(held)).to_numpy(
                zero_copy_only=False
            )
        )
        previous_mutation = np.zeros(len(rows), np.bool_)
        previous_mutation[1:] = mutation[rows[:-1]]
        live_before[rows] = np.where(first, in_mirror, previous_mutation)
    kinds = np.where(mutation, np.where(live_before, CHANGE_UPDATE, CHANGE_INSERT), CHANGE_DELETE)
    return pa.array(kinds.astype(object), pa.string(), mask=rollback)


def positions(changes: pa.Table) -> list[dict[str, Any]]:
    """Each vbucket's position after the batch: its last row's seqno and CAS; after a final
    rollback row, the rollback's seqno and CAS 0 (the time of that seqno is not known)."""
    if changes.num_rows == 0:
        return []
    indexed = changes.select(["vbucket"]).append_column("i", pa.array(np.arange(changes.num_rows)))
    last = indexed.group_by(["vbucket"], use_threads=False).aggregate([("i", "max")])
    picked = changes.take(last.column("i_max")).select(["vbucket", "seqno", "cas", "op"])
    out = []
    for row in picked.to_pylist():  # one per vbucket of the group
        cas = 0 if row["op"] == OP_ROLLBACK else row["cas"]
        out.append({"kind": KIND_POSITION, "vbucket": row["vbucket"], "seqno": row["seqno"],
                    "cas": cas})  # fmt: skip
    return out


def conform(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """``rows`` with exactly ``schema``'s columns: missing ones null, others cast (the driver
    checked that the casts lose nothing)."""
    columns = []
    for target in schema:
        if target.name in rows.column_names:
            column = rows.column(target.name)
            columns.append(column if column.type == target.type else column.cast(target.type))
        else:
            columns.append(pa.nulls(rows.num_rows, target.type))
    return pa.Table.from_arrays(columns, schema=schema)


def _touched_files(
    fs: pafs.FileSystem, files: list[FileRef], source: pa.Table
) -> tuple[list[FileRef], pa.Table]:
    """The group's files to rewrite (those that may hold a key of ``source``, and the small
    ones once there are too many), and their rows."""
    wanted = np.sort(key_hashes(source.column("key")))
    touched = []
    small = [f for f in files if f.size < FILE_BYTES_SMALL]
    crowded = len(small) > SMALL_FILES_MAX
    for ref in files:
        if crowded and ref.size < FILE_BYTES_SMALL:
            touched.append(ref)
            continue
        hashes = _file_hashes(fs, ref.path)
        if len(wanted) and len(hashes):
            at = np.minimum(np.searchsorted(hashes, wanted), len(hashes) - 1)
            if bool(np.any(hashes[at] == wanted)):
                touched.append(ref)
    tables = [pq.read_table(ref.path, filesystem=fs) for ref in touched]
    if not tables:
        return touched, pa.table({"key": pa.array([], pa.string())})
    return touched, pa.concat_tables(tables, promote_options="permissive")


def _file_hashes(fs: pafs.FileSystem, path: str) -> Hashes:
    with _hash_cache_lock:
        cached = _hash_cache.get(path)
        if cached is not None:
            _hash_cache.move_to_end(path)
            return cached
    keys = pq.read_table(path, columns=["key"], filesystem=fs).column("key")
    hashes: Hashes = np.sort(key_hashes(keys))
    _remember(path, hashes)
    return hashes


def _remember(path: str, hashes: Hashes) -> None:
    """Cache a file's sorted key hashes, dropping the least recently used past the bound."""
    global _hash_cache_total
    with _hash_cache_lock:
        if path in _hash_cache:
            return
        _hash_cache[path] = hashes
        _hash_cache_total += len(hashes)
        while _hash_cache_total > _HASH_CACHE_MAX and len(_hash_cache) > 1:
            _, dropped = _hash_cache.popitem(last=False)
            _hash_cache_total -= len(dropped)


def _history(
    plan: GroupPlan, group: int, changes: pa.Table, fs: pafs.FileSystem, files: list[FileRef]
) -> pa.Table:
    """``(key, vbucket, seqno)`` of the group's mirror rows and earlier changelog rows in the
    vbuckets of the batch's rollback rows: what a rollback may have to undo."""
    import pyarrow.dataset as ds

    rollbacks = changes.filter(pc.equal(changes.column("op"), OP_ROLLBACK))
    vbuckets = pc.unique(rollbacks.column("vbucket"))
    names = HISTORY_SCHEMA.names
    parts = [HISTORY_SCHEMA.empty_table()]
    for ref in files:
        rows = pq.read_table(ref.path, columns=names, filesystem=fs)
        parts.append(rows.filter(pc.is_in(rows.column("vbucket"), vbuckets)).cast(HISTORY_SCHEMA))
    if plan.changelog_version is not None:
        from deltalake import DeltaTable

        table = DeltaTable(plan.changelog_uri, version=plan.changelog_version,
                           storage_options=plan.storage_options)  # fmt: skip
        where = (
            (ds.field(GROUP_COLUMN) == group) & ds.field("vbucket").isin(vbuckets.to_pylist())
            & (ds.field("batch_id") < plan.batch_id) & (ds.field("op") != OP_ROLLBACK)
        )  # fmt: skip
        logged = table.to_pyarrow_dataset().to_table(columns=names, filter=where)
        parts.append(logged.cast(HISTORY_SCHEMA))
    return pa.concat_tables(parts)


def _array(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def hash_cache_size() -> int:
    """Hashes cached in this process (the tests look)."""
    return _hash_cache_total
