"""Reading a mirror's tables without Spark: where the mirror is (``mirror_status``) and the
changes between two changelog versions (``changes``, like Spark's ``changes()`` and Delta's
change data feed: the same column names).

Both work on local paths and object-store URLs (``storage_options`` as for ``DeltaTable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from changefeed.spark import watermark
from changefeed.spark.delta_files import GROUP_COLUMN, table_uri
from changefeed.spark.mirror_tasks import COMMIT_VERSION

APP_ID = "changefeed-mirror"  # mirror.APP_ID (not imported: this module needs no writer)


class NoMirrorError(LookupError):
    """No mirror table where one was named; the message names the place."""


@dataclass(frozen=True)
class MirrorStatus:
    """Where a mirror is.

    Attributes:
        batch: the last micro-batch the mirror committed (None: none).
        resolved_hlc_ns: the resolved watermark (``watermark.py``; 0: none, or the local
            writer's tables, which do not record it).
        positions: vbucket -> (seqno, CAS) of its last committed change.
    """

    tables: str
    writer: str  # "distributed" or "local" (the layout of the tables)
    mirror_version: int
    changelog_version: int | None
    batch: int | None
    rows: int
    resolved_hlc_ns: int
    positions: dict[int, tuple[int, int]]

    @property
    def resolved_at(self) -> str | None:
        """The watermark as an ISO 8601 UTC time (None: none)."""
        if not self.resolved_hlc_ns:
            return None
        at = datetime.fromtimestamp(self.resolved_hlc_ns / 1e9, UTC)
        return at.isoformat(timespec="microseconds")

    def to_json(self) -> dict[str, Any]:
        return {
            "tables": self.tables, "writer": self.writer, "mirror_version": self.mirror_version,
            "changelog_version": self.changelog_version, "batch": self.batch, "rows": self.rows,
            "resolved_hlc_ns": self.resolved_hlc_ns, "resolved_at": self.resolved_at,
            "vbuckets": len(self.positions),
        }  # fmt: skip

    def line(self) -> str:
        """One line for ``changefeed mirror status``."""
        if not self.resolved_hlc_ns:
            return f"resolved watermark: none ({len(self.positions)} vbuckets with a position)"
        return (
            f"resolved watermark: {self.resolved_at} (HLC {self.resolved_hlc_ns}): every change "
            f"up to it of {len(self.positions)} vbuckets is in the tables"
        )


def mirror_status(
    tables: str | Path, storage_options: dict[str, str] | None = None
) -> MirrorStatus:
    """Where the mirror under ``tables`` is: its last batch, rows, and resolved watermark.

    Raises:
        NoMirrorError: there is no mirror table under ``tables``.
    """
    from deltalake import DeltaTable

    mirror_uri = table_uri(tables, "mirror")
    if not DeltaTable.is_deltatable(mirror_uri, storage_options):
        raise NoMirrorError(f"no mirror table at {mirror_uri}")
    mirror = DeltaTable(mirror_uri, storage_options=storage_options)
    changelog_uri = table_uri(tables, "changelog")
    changelog_version = None
    if DeltaTable.is_deltatable(changelog_uri, storage_options):
        changelog_version = DeltaTable(changelog_uri, storage_options=storage_options).version()
    actions = pa.table(mirror.get_add_actions(flatten=True))
    rows = int(pc.sum(actions.column("num_records")).as_py() or 0) if actions.num_rows else 0
    distributed = GROUP_COLUMN in mirror.metadata().partition_columns
    record = watermark.latest_record(mirror.history(watermark.HISTORY_SCAN_MAX)) or {}
    positions = watermark.from_metadata(record)
    return MirrorStatus(
        tables=str(tables), writer="distributed" if distributed else "local",
        mirror_version=mirror.version(), changelog_version=changelog_version,
        batch=mirror.transaction_version(APP_ID), rows=rows,
        resolved_hlc_ns=int(record.get("resolvedHlcNs", 0)),
        positions={vb: (p.seqno, p.cas) for vb, p in positions.items()},
    )  # fmt: skip


def changes(
    tables: str | Path,
    starting_version: int = 0,
    ending_version: int | None = None,
    storage_options: dict[str, str] | None = None,
) -> pa.Table:
    """The changelog rows committed in changelog versions ``starting_version`` to
    ``ending_version`` (inclusive; None: the latest), ordered by ``_commit_version``, then
    vbucket and stream order, with ``_change_type``, ``_commit_version`` and
    ``_commit_timestamp`` (rollback rows included: ``_change_type`` null, ``op`` 'rollback').

    Raises:
        ValueError: a range that is empty or starts below 0; tables of the local writer (no
            change-feed columns).
    """
    import pyarrow.dataset as ds
    from deltalake import DeltaTable

    if starting_version < 0 or (ending_version is not None and ending_version < starting_version):
        raise ValueError(f"version range {starting_version}..{ending_version} is empty")
    table = DeltaTable(table_uri(tables, "changelog"), storage_options=storage_options)
    if COMMIT_VERSION not in pa.schema(table.schema().to_arrow()).names:
        raise ValueError(
            f"changelog at {table.table_uri} has no {COMMIT_VERSION} column: written by the "
            "local writer (see docs/spark.md, Writers)"
        )
    where = ds.field(COMMIT_VERSION) >= starting_version
    if ending_version is not None:
        where = where & (ds.field(COMMIT_VERSION) <= ending_version)
    rows = table.to_pyarrow_dataset().to_table(filter=where)
    # Within a vbucket and commit, file order is stream order; sort stably by the other keys.
    order = pc.sort_indices(rows, [(COMMIT_VERSION, "ascending"), ("vbucket", "ascending")])
    return rows.take(order)


@dataclass(frozen=True)
class CollectionStatus:
    """One collection's tables in a collection-aware mirror (``collection_mirror.py``).

    Attributes:
        collection: ``scope.collection``.
        path: its tables' directory under the tables' root.
        dropped: None while the collection exists; else when its drop was seen.
        status: its tables' ``MirrorStatus`` (None: no mirror table written yet).
    """

    collection: str
    path: str
    dropped: dict[str, Any] | None
    status: MirrorStatus | None

    def line(self) -> str:
        """One line for ``changefeed mirror status``."""
        what = (
            "no table yet" if self.status is None
            else f"{self.status.rows:,} rows, last micro-batch {self.status.batch}"
        )  # fmt: skip
        if self.dropped is not None:
            what += f"; DROPPED (manifest {self.dropped.get('manifest_uid')}, seen at batch "
            what += f"{self.dropped.get('batch')}), tables kept"
        return f"{self.collection} ({self.path}): {what}"

    def to_json(self) -> dict[str, Any]:
        return {
            "collection": self.collection, "path": self.path, "dropped": self.dropped,
            **({} if self.status is None else {"table": self.status.to_json()}),
        }  # fmt: skip


def collection_statuses(
    tables: str | Path, storage_options: dict[str, str] | None = None
) -> list[CollectionStatus]:
    """The per-collection tables of a collection-aware mirror under ``tables``, in the order
    they were made (empty: not a collection-aware mirror)."""
    from changefeed.spark.collection_registry import Registry

    out = []
    for entry in Registry.load(str(tables), storage_options).entries:
        try:
            status: MirrorStatus | None = mirror_status(
                table_uri(tables, entry.path), storage_options
            )
        except NoMirrorError:
            status = None
        out.append(CollectionStatus(entry.name, entry.path, entry.dropped, status))
    return out
