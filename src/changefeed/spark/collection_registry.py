"""Which tables hold which collection: the registry of a collection-aware mirror.

A collection-aware mirror (``collection_mirror.py``) keeps one changelog and one mirror table
per collection under ``<tables>/<scope>/<collection>/{changelog,mirror}``. The registry
(``_changefeed_collections.json`` in the tables' root) records, per collection: its names, its
id, where its tables are, the batch that first wrote them, and, once the collection is gone
from the manifest, when it was dropped. ``mirror status`` lists it.

It decides nothing about exactly once (each table's Delta app transaction does); it is only
metadata, rewritten whole (a local file is replaced by a rename, an S3 object by a put, both
atomic), and every change to it can be made again: a crash before or after a write leaves a
registry that the next batch brings up to date from the manifest.

A collection dropped and created again under the same name has a new id: the old tables stay
where they are, marked dropped, and the new collection's go to ``<collection>~<id in hex>``.
Rows are routed to tables by collection id (``route``), never by name: the old collection's
rows that arrive after the new one has tables still go to the old tables.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import pyarrow.fs as pafs

from changefeed.protocol.collections_manifest import Manifest
from changefeed.spark.delta_files import is_remote, table_fs, table_uri

REGISTRY_FILE: Final = "_changefeed_collections.json"
DROPPED_FILE: Final = "_changefeed_dropped.json"  # beside a dropped collection's tables


@dataclass(frozen=True)
class CollectionTables:
    """One collection's tables.

    Attributes:
        path: the tables' directory relative to the tables' root (``scope/collection``).
        cid: the collection id (None: seen only in rows, never in a manifest).
        dropped: None while the collection exists; else when its drop was seen
            (``manifest_uid``, ``batch``, ``at``).
    """

    scope: str
    collection: str
    path: str
    cid: int | None = None
    created_batch: int | None = None
    dropped: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return f"{self.scope}.{self.collection}"


@dataclass
class Registry:
    """Every collection a mirror has (had) tables for, in the order they came."""

    root: str
    storage_options: dict[str, str] | None = None
    entries: list[CollectionTables] = field(default_factory=list)

    @classmethod
    def load(cls, root: str, storage_options: dict[str, str] | None = None) -> Registry:
        """The registry under ``root`` (empty if there is none yet).

        Raises:
            ValueError: the file is not a registry (names the file).
        """
        registry = cls(root, storage_options)
        if not is_remote(table_uri(root, "")) and not Path(table_uri(root, "")).exists():
            return registry  # reading makes no directory (a refused start leaves none)
        fs = registry._fs()
        if fs.get_file_info(REGISTRY_FILE).type == pafs.FileType.NotFound:
            return registry
        with fs.open_input_stream(REGISTRY_FILE) as stream:
            text = stream.read().decode()
        try:
            raw = json.loads(text)
            registry.entries = [CollectionTables(**entry) for entry in raw["collections"]]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"{table_uri(root, REGISTRY_FILE)} is not a registry: {error}"
            ) from None
        return registry

    def _fs(self) -> pafs.FileSystem:
        return table_fs(table_uri(self.root, ""), self.storage_options)

    def save(self) -> None:
        fs = self._fs()
        text = json.dumps({"collections": [asdict(e) for e in self.entries]}, indent=1)
        temporary = f"{REGISTRY_FILE}.tmp"
        with fs.open_output_stream(temporary) as out:
            out.write(text.encode())
        fs.move(temporary, REGISTRY_FILE)

    def live(self, scope: str, collection: str) -> CollectionTables | None:
        """The newest entry named ``scope.collection`` (dropped or not). Names say nothing
        about which collection rows are of: route rows by id (``route``)."""
        found = [e for e in self.entries if e.scope == scope and e.collection == collection]
        return found[-1] if found else None

    def of_id(self, cid: int) -> CollectionTables | None:
        """The entry of collection ``cid`` (an id is never reused in a bucket)."""
        return next((e for e in self.entries if e.cid == cid), None)

    def route(
        self, present: Iterable[tuple[str, str, int]], batch: int
    ) -> dict[int, CollectionTables]:
        """Which tables each collection's rows in a batch go to, by collection id: ``present``
        is the batch's (scope, collection, collection id) of its rows.

        By id, not by name: ``s.c`` dropped and created again has a new id and new tables,
        and rows of the old one (written before its drop, read after the mirror saw the new
        one, or in the same batch) still go to the old tables. An id no entry has gets one:
        a collection no manifest the mirror read named (created and dropped between two of
        its batches), or an entry that had only rows' names so far (a registry written before
        rows carried ids) takes the id.
        """
        routes: dict[int, CollectionTables] = {}
        for scope, collection, cid in present:
            entry = self.of_id(cid)
            if entry is None:
                entry = self._adopt(scope, collection, cid) or self.add(
                    scope, collection, cid, batch
                )
            routes[cid] = entry
        return routes

    def _adopt(self, scope: str, collection: str, cid: int) -> CollectionTables | None:
        """The newest entry of these names without an id, now given ``cid`` (None: none)."""
        entry = self.live(scope, collection)
        if entry is None or entry.cid is not None:
            return None
        adopted = replace(entry, cid=cid)
        self.entries[self.entries.index(entry)] = adopted
        return adopted

    def add(self, scope: str, collection: str, cid: int | None, batch: int) -> CollectionTables:
        taken = {e.path for e in self.entries}
        path = f"{scope}/{collection}"
        if path in taken:  # the same name created again: a new id, new tables
            path = f"{scope}/{collection}~{cid if cid is not None else len(self.entries):x}"
        entry = CollectionTables(scope, collection, path, cid, batch)
        self.entries.append(entry)
        return entry

    def sync(self, manifest: Manifest, wanted: Any, batch: int) -> tuple[list[str], list[str]]:
        """Bring the registry up to ``manifest``: an entry for each collection ``wanted``
        (``wanted(scope, collection) -> bool``) that has none, and a drop mark on each entry
        whose collection the manifest no longer has.

        Returns:
            The names added and the names marked dropped.
        """
        added, dropped = [], []
        alive = manifest.by_id()
        for index, entry in enumerate(self.entries):
            if entry.dropped is not None or entry.cid is None or entry.cid in alive:
                continue
            mark = {"manifest_uid": f"{manifest.uid:x}", "batch": batch, "at": _now()}
            self.entries[index] = replace(entry, dropped=mark)
            self._mark_dropped(self.entries[index])
            dropped.append(entry.name)
        for cid, (scope, collection) in sorted(alive.items()):
            if not wanted(scope.name, collection.name):
                continue
            if self.of_id(cid) is not None or self._adopt(scope.name, collection.name, cid):
                continue  # has tables (an entry of rows' names only takes the manifest's id)
            self.add(scope.name, collection.name, cid, batch)
            added.append(f"{scope.name}.{collection.name}")
        return added, dropped

    def _mark_dropped(self, entry: CollectionTables) -> None:
        """A marker beside the tables, for someone looking at the directory."""
        fs = self._fs()
        fs.create_dir(entry.path, recursive=True)
        with fs.open_output_stream(f"{entry.path}/{DROPPED_FILE}") as out:
            out.write(json.dumps({"collection": entry.name, **(entry.dropped or {})}).encode())


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
