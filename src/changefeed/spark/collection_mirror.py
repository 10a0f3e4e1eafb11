"""The collection-aware mirror: one changelog and one mirror table per collection.

``MirrorWriter`` hands a batch here when its source is collection-aware (options
``collections`` / ``scope``): the rows carry ``scope``, ``collection`` and ``collection_id``.
For micro-batch b:

1. the driver reads the manifest (one KV request) and brings the registry up to date
   (``collection_registry.py``): a collection the options choose that has no tables yet gets
   an entry, one the manifest no longer has is marked dropped (its tables stay as they are,
   with a marker file beside them; nothing is emptied);
2. the batch is cached (``persist``: the source is read once, not once per collection) and the
   collections present in it are listed (one small aggregation) and routed by collection id
   (``Registry.route``): rows of ``s.c`` dropped and created again go to the tables of the
   id they are of, not to the newest tables of that name;
3. each collection with rows, each new collection (its empty tables are created now, at the
   first batch after it appeared), and, when the batch has rollback rows, every collection
   with tables, is written by its own writer: the same ``MirrorWriter`` as a bucket's (the
   distributed one, or the local one if asked), on ``<tables>/<path>`` with that
   collection's rows, the rollback rows (a rollback voids a vbucket, every collection of it),
   and the source options narrowed to the collection (its re-reads ask for its id's keys
   only; a dropped collection has none left on the node, ``refetch.py``).

Exactly once per table: each table pair records the batch ids it committed as its own Delta
app transaction, as a bucket's tables do. A crash after collection A's commit and before B's
leaves A at b and B before it; Spark replays b, A's writer skips it and B's writes it. A
collection without rows in a batch records nothing for it: its last batch stays the one that
last had rows, which a replay does not change. So one id per table is enough; a shared id file
would have to be written after every table's commit and be trusted over the tables, a second
truth that can disagree with them after a crash.

Cost: one Spark job per collection with rows in the batch (plus the listing job), so a batch
touching many collections costs more scheduling than one of a bucket; the source read is not
repeated.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from changefeed.consumer.change_rows import OP_ROLLBACK
from changefeed.spark.collection_registry import CollectionTables, Registry
from changefeed.spark.collection_rows import (
    COLLECTION_ID_COLUMN,
    COLLECTION_ID_OPTION,
    NAME_COLUMNS,
)
from changefeed.spark.delta_files import table_uri
from changefeed.spark.options import SourceOptions
from changefeed.spark.reading import fetch_manifest_sync
from changefeed.spark.table_lease import TablesLease

log = logging.getLogger("changefeed.mirror")


class TableWriter(Protocol):
    """What writes one collection's tables (``MirrorWriter`` for one collection)."""

    rows_written: int

    def __call__(self, batch_df: Any, batch_id: int) -> None: ...

    def close(self) -> None: ...


MakeWriter = Callable[[str, dict[str, str]], TableWriter]


class CollectionMirrorWriter:
    """``foreachBatch`` callable of a collection-aware mirror (see the module docstring).

    Args:
        tables: the tables' root (a directory or an ``s3://`` URL).
        options: the source's options (collection-aware).
        make_writer: a writer of one collection's tables, from their root and the options
            narrowed to the collection.
    """

    def __init__(
        self,
        tables: str,
        options: dict[str, str],
        make_writer: MakeWriter,
        storage_options: dict[str, str] | None = None,
    ) -> None:
        self.tables = tables
        self.options = dict(options)
        self.source = SourceOptions.parse(self.options)
        assert self.source.collections_aware, "a collection-aware source's options"
        self.make_writer = make_writer
        self.storage_options = storage_options
        self.lease = TablesLease(table_uri(tables, ""), storage_options)
        self.writers: dict[str, TableWriter] = {}
        self.rows_written = 0
        self.last_added: list[str] = []
        self.last_dropped: list[str] = []

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        from pyspark import StorageLevel
        from pyspark.sql import functions as F

        self.lease.hold()  # before the registry: a second job is refused before it writes
        registry = Registry.load(self.tables, self.storage_options)
        manifest = fetch_manifest_sync(self.source)
        before = list(registry.entries)
        added, dropped = registry.sync(manifest, self.source.wants, batch_id)
        self.last_added, self.last_dropped = added, dropped
        for name in added:
            log.info("collection %s: new tables (batch %d)", name, batch_id)
        for name in dropped:
            log.info(
                "collection %s: dropped, its tables kept and marked (batch %d)", name, batch_id
            )
        cached = batch_df.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            present = [
                (row[0], row[1], row[2])
                for row in cached.select(*NAME_COLUMNS).distinct().collect()  # a few rows
            ]
            has_rollback = any(cid is None for _, _, cid in present)
            routes = registry.route([p for p in present if p[2] is not None], batch_id)
            targets: dict[str, CollectionTables] = {}
            ids: dict[str, list[int]] = {}  # tables -> the collection ids whose rows go there
            for cid, entry in routes.items():
                targets[entry.path] = entry
                ids.setdefault(entry.path, []).append(cid)
            for entry in registry.entries:
                is_new = entry.created_batch == batch_id and entry.dropped is None
                if is_new or (has_rollback and entry.path not in targets):
                    targets.setdefault(entry.path, entry)
            if registry.entries != before:
                registry.save()
            self.rows_written = 0
            rollback = F.col("op") == F.lit(OP_ROLLBACK)
            for entry in targets.values():
                mine = (
                    F.col(COLLECTION_ID_COLUMN).isin(ids[entry.path])
                    if entry.path in ids
                    else F.lit(False)  # a new collection's empty tables, or rollback rows only
                )
                rows = cached.filter(mine | rollback).drop(*NAME_COLUMNS)
                writer = self._writer(entry)
                writer(rows, batch_id)
                self.rows_written += writer.rows_written
        finally:
            cached.unpersist()

    def _writer(self, entry: CollectionTables) -> TableWriter:
        writer = self.writers.get(entry.path)
        if writer is None:
            narrowed = {
                k: v for k, v in self.options.items() if k.lower() not in ("scope", "collections")
            }
            if entry.cid is not None:  # its re-reads ask for its id's keys (refetch.py)
                narrowed["collections"] = entry.name
                narrowed[COLLECTION_ID_OPTION] = str(entry.cid)
            root = table_uri(self.tables, entry.path)
            writer = self.writers[entry.path] = self.make_writer(root, narrowed)
        return writer

    def close(self) -> None:
        """Release every table's lease and the root's."""
        for writer in self.writers.values():
            writer.close()
        self.lease.release()
