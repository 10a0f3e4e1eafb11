"""Tombstone purge of the mirror's tables: deletions the store itself no longer keeps.

The store purges a tombstone (compaction) and raises the vbucket's *purge seqno*: a DCP
consumer resuming below it must start over. The changelog kept every ``delete`` row forever;
``purge_tables`` removes those the store has purged too, so the tables keep what the store keeps.

A row is a tombstone when its ``op`` is ``deletion`` or ``expiration``. Tombstone T of vbucket V
is removed when ``T.seqno <= limit(V)``, where ``limit(V)`` is the smallest of

- V's purge seqno on every node holding a copy of V (``purge_points``: STAT vbucket-seqno of
  each node of the cluster map, active and replicas: a copy promoted later must not be behind
  the point either); a node that does not answer refuses the purge;
- the seqno the mirror table has committed for V (its watermark record, ``watermark.py``): rows
  a rollback made void stay until the new history passes them.

A vbucket with no limit (never committed, or no node reported it) loses nothing. Every other
row (mutations, rollback rows) stays. The changelog is rewritten in one Delta transaction: the
files holding purged rows are replaced by files without them (same partition), the others are
untouched; readers see either all of the purge or none. The mirror table holds no tombstones by
construction (a deleted key's row is removed in the batch that deletes it; it has no ``op``
column), so there is nothing of it to purge.

The purge is a writer of the tables, so it holds the tables' lease (``table_lease.py``): it is
refused while a mirror job runs (whose commits expect the changelog's next version), and a job
starting meanwhile waits for it to release. A running job purges by itself, between its
batches, under the lease it holds (``maintenance.py``, ``purge(..., lease_held=True)``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable
from deltalake.transaction import AddAction, RemoveAction

from changefeed.consumer.change_rows import OP_DELETION, OP_EXPIRATION
from changefeed.consumer.connection import Connection
from changefeed.consumer.dcp_map import MapFollower
from changefeed.consumer.handshake import connect
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status
from changefeed.spark import watermark
from changefeed.spark.cluster import dial_seed
from changefeed.spark.compaction import modification_millis
from changefeed.spark.delta_files import GROUP_COLUMN, now_ms, table_fs, table_uri, write_data_file
from changefeed.spark.options import SourceOptions
from changefeed.spark.table_lease import TablesLease

log = logging.getLogger("changefeed.mirror")

AGENT: Final = "changefeed-purge"
NODE_TIMEOUT_S: Final = 10.0
TOMBSTONES: Final = (OP_DELETION, OP_EXPIRATION)
PURGE_METADATA_KEY: Final = "changefeedPurge"  # in the purge commit's info
TABLES: Final = ("changelog",)  # the mirror holds no tombstones (module docstring)


class PurgeError(RuntimeError):
    """The purge cannot be done safely (a node did not answer, tables of another layout); the
    message says which."""


@dataclass
class TablePurge:
    """What the purge did to one table."""

    table: str
    removed: int = 0
    files_rewritten: int = 0
    version: int | None = None  # the purge commit's version (None: nothing to commit)


@dataclass
class PurgeReport:
    limits: dict[int, int] = field(default_factory=dict)  # vbucket -> highest seqno purged
    tables: list[TablePurge] = field(default_factory=list)

    @property
    def removed(self) -> int:
        return sum(t.removed for t in self.tables)

    def to_json(self) -> dict[str, object]:
        return {
            "removed": self.removed,
            "tables": {t.table: {"removed": t.removed, "files_rewritten": t.files_rewritten,
                                 "version": t.version} for t in self.tables},
            "limits": {str(vb): seqno for vb, seqno in sorted(self.limits.items())},
        }  # fmt: skip


# -- the rule ---------------------------------------------------------------------------------


def purge_limits(
    points: Mapping[int, int], committed: Mapping[int, int]
) -> dict[int, int]:  # fmt: skip
    """Per vbucket, the highest seqno whose tombstones may go: the smaller of the store's purge
    point and the mirror's committed seqno; vbuckets missing from either are left out."""
    return {vb: min(point, committed[vb]) for vb, point in points.items() if vb in committed}


def tombstones_to_drop(rows: pa.Table, limits: Mapping[int, int]) -> pa.Array:
    """A boolean per row of ``rows`` (columns ``vbucket``, ``seqno``, ``op``): True for a
    tombstone at or below its vbucket's limit."""
    vbuckets = rows.column("vbucket").to_numpy(zero_copy_only=False)
    seqnos = rows.column("seqno").to_numpy(zero_copy_only=False)
    tombstone = np.asarray(
        pc.is_in(rows.column("op"), value_set=pa.array(TOMBSTONES)).to_numpy(zero_copy_only=False),
        dtype=np.bool_,
    )
    limit = np.full(rows.num_rows, -1, np.int64)  # seqnos are >= 0: -1 keeps everything
    if limits and rows.num_rows:
        known = np.fromiter(limits.keys(), np.int64)
        values = np.fromiter(limits.values(), np.int64)
        order = np.argsort(known)
        known, values = known[order], values[order]
        at = np.minimum(np.searchsorted(known, vbuckets), len(known) - 1)
        limit = np.where(known[at] == vbuckets, values[at], -1)
    return pa.array(tombstone & (seqnos <= limit) & (limit >= 0))


# -- the store's purge points -----------------------------------------------------------------


async def purge_points(options: SourceOptions) -> dict[int, int]:
    """Per vbucket, its smallest purge seqno over the nodes holding a copy of it (every node of
    the cluster map, or the seed alone without a map).

    Raises:
        PurgeError: a node of the map did not answer (its copies' points are unknown).
        SeedsUnreachableError, StatusError: no seed answered, or it refused us.
    """

    async def dial(host: str, port: int) -> Connection:
        return await connect(
            host, port, agent=AGENT, user=options.user, password=options.password,
            bucket=options.bucket, timeout_s=NODE_TIMEOUT_S,
        )  # fmt: skip

    conn, seed = await dial_seed(options, AGENT)
    follower = MapFollower(seed[0], seed[1], dial)
    try:
        await follower.read(conn)
        points = parse_purge_seqnos(await _stat_seqnos(conn))
    finally:
        await conn.close()
    if follower.cluster_map is None:
        return points
    for node in follower.cluster_map.nodes:
        if node.server == follower.bootstrap:
            continue
        try:
            async with asyncio.timeout(NODE_TIMEOUT_S):
                other = await dial(*follower.address(node.server))
                try:
                    found = parse_purge_seqnos(await _stat_seqnos(other))
                finally:
                    await other.close()
        except (OSError, TimeoutError) as error:
            raise PurgeError(
                f"node {node.server} did not answer ({error!r}): the purge needs every copy's "
                "purge seqno; try again once it is back or failed over"
            ) from None
        for vb, seqno in found.items():
            points[vb] = min(seqno, points.get(vb, seqno))
    return points


def purge_points_sync(options: SourceOptions) -> dict[int, int]:
    return asyncio.run(purge_points(options))


async def _stat_seqnos(conn: Connection) -> dict[str, str]:
    opaque = conn.next_opaque()
    request = encode_request(Opcode.STAT, opaque=opaque, key=b"vbucket-seqno")
    frames = await conn.request_many(
        request, opaque, lambda f: not f.key or f.status != Status.SUCCESS
    )
    if frames[-1].status != Status.SUCCESS:
        raise PurgeError(f"STAT vbucket-seqno failed: {Status.name_of(frames[-1].status)}")
    return {f.key.decode(): f.value.decode() for f in frames if f.key}


def parse_purge_seqnos(stats: Mapping[str, str]) -> dict[int, int]:
    """``vb_<N>:purge_seqno`` keys of STAT vbucket-seqno -> ``{N: seqno}``."""
    out = {}
    for key, value in stats.items():
        name, _, stat = key.partition(":")
        if stat == "purge_seqno" and name.startswith("vb_"):
            out[int(name[3:])] = int(value)
    return out


# -- the tables -------------------------------------------------------------------------------


def committed_seqnos(tables: str, storage_options: dict[str, str] | None) -> dict[int, int]:
    """Per vbucket, the seqno the mirror table has committed (its newest watermark record)."""
    uri = table_uri(tables, "mirror")
    if not DeltaTable.is_deltatable(uri, storage_options):
        return {}
    mirror = DeltaTable(uri, storage_options=storage_options)
    record = watermark.latest_record(mirror.history(watermark.HISTORY_SCAN_MAX))
    if record is None:
        return {}
    return {vb: position.seqno for vb, position in watermark.from_metadata(record).items()}


def purge_tables(
    tables: str, limits: Mapping[int, int], storage_options: dict[str, str] | None = None
) -> list[TablePurge]:
    """Remove the tombstones at or below ``limits`` from the changelog in one transaction,
    holding the tables' lease.

    Raises:
        MirrorBusyError: a mirror job holds the tables.
        PurgeError: a table not written by the distributed writer.
    """
    lease = TablesLease(table_uri(tables, ""), storage_options)
    lease.hold()
    try:
        return purge_held(tables, limits, storage_options)
    finally:
        lease.release()


def purge_held(
    tables: str, limits: Mapping[int, int], storage_options: dict[str, str] | None = None
) -> list[TablePurge]:
    """``purge_tables`` by a caller that holds the tables' lease (a running mirror job between
    its batches: taking the lease again would release it at the end)."""
    return [_purge_table(tables, name, limits, storage_options) for name in TABLES]


def purge(
    tables: str,
    options: SourceOptions,
    storage_options: dict[str, str] | None = None,
    *,
    lease_held: bool = False,
) -> PurgeReport:
    """``purge_tables`` at the limits of the store's purge points and the mirror's position
    (``lease_held``: ``purge_held``, for the job that holds the lease)."""
    points = purge_points_sync(options)
    limits = purge_limits(points, committed_seqnos(tables, storage_options))
    write = purge_held if lease_held else purge_tables
    return PurgeReport(limits, write(tables, limits, storage_options))


def _purge_table(
    tables: str, name: str, limits: Mapping[int, int], storage_options: dict[str, str] | None
) -> TablePurge:
    uri = table_uri(tables, name)
    done = TablePurge(name)
    if not limits or not DeltaTable.is_deltatable(uri, storage_options):
        return done
    table = DeltaTable(uri, storage_options=storage_options)
    if table.metadata().partition_columns != [GROUP_COLUMN]:
        raise PurgeError(
            f"table {uri} is partitioned by {table.metadata().partition_columns}, not "
            f"{GROUP_COLUMN}: the purge rewrites tables of the distributed writer only"
        )
    fs = table_fs(uri, storage_options)
    schema = pa.schema(table.schema().to_arrow())
    file_schema = schema.remove(schema.get_field_index(GROUP_COLUMN))
    adds: list[AddAction] = []
    removes: list[RemoveAction] = []
    for path, size, group, modified in _candidate_files(table, max(limits.values())):
        keys = pq.read_table(path, columns=["vbucket", "seqno", "op"], filesystem=fs)
        drop = tombstones_to_drop(keys, limits)
        count = int(pc.sum(drop).as_py() or 0)
        if not count:
            continue
        rows = pq.read_table(path, filesystem=fs, schema=file_schema).filter(pc.invert(drop))
        removes.append(RemoveAction(path, True, now_ms(), size, {GROUP_COLUMN: str(group)}))
        done.removed += count
        done.files_rewritten += 1
        if rows.num_rows:
            added = write_data_file(fs, name, rows, group, table.version() + 1)
            # The replaced file's time: its place in the group's commit order (compaction.py).
            adds.append(AddAction(added["path"], added["size"], {GROUP_COLUMN: str(group)},
                                  modified, True, added["stats"]))  # fmt: skip
    if not removes:
        return done
    record = {"removed": done.removed, "limits": {str(vb): s for vb, s in sorted(limits.items())}}
    info = CommitProperties(custom_metadata={PURGE_METADATA_KEY: json.dumps(record)})
    table.create_write_transaction(
        [*adds, *removes], "append", schema, partition_by=[GROUP_COLUMN], commit_properties=info
    )
    table.update_incremental()
    done.version = table.version()
    log.info("%s: purged %d tombstones (%d files rewritten), version %d", name, done.removed,
             done.files_rewritten, done.version)  # fmt: skip
    return done


def _candidate_files(table: DeltaTable, highest: int) -> list[tuple[str, int, int, int]]:
    """``(path, size, group, modified)`` of the files that may hold a tombstone at or below
    ``highest``, by their statistics: a file whose ``op`` is only ``mutation``, or whose
    smallest seqno is above every limit, holds none."""
    files = pa.table(table.get_add_actions(flatten=True))
    names = files.column_names

    def column(name: str) -> list[object]:
        return files.column(name).to_pylist() if name in names else [None] * files.num_rows

    out = []
    for path, size, group, modified, low_op, high_op, low_seqno in zip(
        column("path"), column("size_bytes"), column(f"partition.{GROUP_COLUMN}"),
        column("modification_time"), column("min.op"), column("max.op"), column("min.seqno"),
        strict=True,
    ):  # fmt: skip
        if low_op == high_op == "mutation":
            continue
        if isinstance(low_seqno, int) and low_seqno > highest:
            continue
        out.append((str(path), int(str(size)), int(str(group)), modification_millis(modified)))
    return out
