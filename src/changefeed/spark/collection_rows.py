"""Change rows of a collection-aware read: each row's ``scope`` and ``collection`` by name, its
``collection_id``, and its key without the collection id the wire puts in front of it.

A stream that negotiated collections sends every key as ``LEB128(collection id) + key``
(protocol/collections.py). The reader cuts the prefix off by moving each change's
``key_start`` past it (``strip_collection_ids``: no copy of the data; ids below 128 are one
byte and read with array operations, longer ones by the protocol's decoder), then builds the
change rows as always (``consumer/change_rows.py``) and appends the names and the id.

The id is what says which collection a row is of: names are reused (``s.c`` dropped and
created again is a new collection with a new id), so the collection mirror routes rows by id
(``collection_registry.Registry.route``) and a table's re-reads ask for its id's keys.

Names come from ``CollectionNames``: the manifest read when the read starts (so every
collection alive then), the names the planner has seen in earlier manifests (a collection
dropped since still has rows before its drop), and the stream's own system events (a
collection created after the manifest was read). A row whose collection none of them names
(dropped before this query first saw a manifest) gets scope ``_unknown`` and collection
``cid_<id in hex>``: kept, not lost, and named so a person can tell.

System events are not rows: they move the vbucket's position (the reader finishes a vbucket on
them as on a change) and teach names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA, ChangeRows
from changefeed.protocol.batch import FIELD_DTYPES, OFFSET_NAMES, ChangeColumns
from changefeed.protocol.collections import SystemEvent, SystemEventMessage, decode_leb128
from changefeed.protocol.collections_manifest import Manifest

SCOPE_COLUMN: Final = "scope"
COLLECTION_COLUMN: Final = "collection"
COLLECTION_ID_COLUMN: Final = "collection_id"
NAME_COLUMNS: Final = (SCOPE_COLUMN, COLLECTION_COLUMN, COLLECTION_ID_COLUMN)
NAME_FIELDS: Final = (
    pa.field(SCOPE_COLUMN, pa.string()),
    pa.field(COLLECTION_COLUMN, pa.string()),
    pa.field(COLLECTION_ID_COLUMN, pa.int64()),
)
NAMES_DDL: Final = f"{SCOPE_COLUMN} string, {COLLECTION_COLUMN} string, {COLLECTION_ID_COLUMN} long"
# A per-collection table's source options carry its collection id under this (internal)
# option: its re-reads ask for that id's keys, whatever collection has its name now.
COLLECTION_ID_OPTION: Final = "collectionId"
NAMED_ROW_SCHEMA: Final = pa.schema([*CHANGE_ROW_SCHEMA, *NAME_FIELDS])
UNKNOWN_SCOPE: Final = "_unknown"
NO_COLLECTION: Final = -1  # a rollback row: it voids the vbucket, every collection of it


def unknown_collection(cid: int) -> str:
    """The ``collection`` of a row whose collection no manifest or event named."""
    return f"cid_{cid:x}"


def strip_collection_ids(columns: ChangeColumns) -> tuple[ChangeColumns, NDArray[np.int64]]:
    """``columns`` with each key's collection-id prefix cut off, and each change's id.

    Raises:
        ProtocolError: a malformed prefix, or a key that is nothing but a prefix.
    """
    count = len(columns)
    if not count:
        return columns, np.zeros(0, np.int64)
    data = np.frombuffer(columns.data, np.uint8)
    starts = columns.array("key_start").astype(np.int64)
    ends = columns.array("key_end").astype(np.int64)
    first = data[np.minimum(starts, max(0, len(data) - 1))].astype(np.int64)
    cids = first.copy()
    used = np.ones(count, np.int64)
    long_form = (first >= 0x80) | (ends - starts < 2)
    for row in np.flatnonzero(long_form).tolist():  # ids >= 128 (rare), or a short key
        from changefeed.protocol.collections import split_key

        key = bytes(columns.data[int(starts[row]) : int(ends[row])])
        cid, _ = split_key(key)  # raises for a bad prefix or no key after it
        cids[row] = cid
        used[row] = decode_leb128(key)[1]
    arrays = {name: columns.array(name) for name in (*FIELD_DTYPES, *OFFSET_NAMES)}
    arrays["key_start"] = starts + used
    return ChangeColumns(arrays, columns.data), cids


class CollectionNames:
    """Collection id -> (scope name, collection name), from manifests and system events."""

    def __init__(self, known: Mapping[int, tuple[str, str]] | None = None) -> None:
        self._names: dict[int, tuple[str, str]] = dict(known or {})
        self._scopes: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._names)

    def get(self, cid: int) -> tuple[str, str] | None:
        return self._names.get(cid)

    def items(self) -> Iterable[tuple[int, tuple[str, str]]]:
        return self._names.items()

    def learn_manifest(self, manifest: Manifest) -> None:
        for scope in manifest.scopes:
            self._scopes[scope.uid] = scope.name
            for collection in scope.collections:
                self._names[collection.uid] = (scope.name, collection.name)

    def learn_event(self, message: SystemEventMessage) -> None:
        """A created scope or collection names itself in its event (a drop names nothing)."""
        name = message.name.decode("utf-8", "replace")
        if message.event is SystemEvent.CREATE_SCOPE:
            self._scopes[message.scope_id] = name
        elif message.event is SystemEvent.BEGIN_COLLECTION and message.collection_id is not None:
            scope = self._scopes.get(message.scope_id, f"sid_{message.scope_id:x}")
            self._names[message.collection_id] = (scope, name)

    def to_json(self) -> dict[str, list[str]]:
        return {str(cid): list(names) for cid, names in sorted(self._names.items())}

    @classmethod
    def from_json(cls, raw: Mapping[str, list[str]]) -> CollectionNames:
        return cls({int(cid): (names[0], names[1]) for cid, names in raw.items()})

    def columns(self, cids: NDArray[np.int64]) -> tuple[pa.Array, pa.Array, pa.Array]:
        """The ``scope``, ``collection`` and ``collection_id`` columns of rows of ``cids``
        (null for a rollback row): one lookup per distinct id."""
        present, index = np.unique(cids, return_inverse=True)
        scopes: list[str | None] = []
        names: list[str | None] = []
        for cid in present.tolist():
            if cid == NO_COLLECTION:
                scopes.append(None)
                names.append(None)
                continue
            found = self._names.get(cid, (UNKNOWN_SCOPE, unknown_collection(cid)))
            scopes.append(found[0])
            names.append(found[1])
        take = pa.array(index.astype(np.int64))
        ids = pa.array(cids, pa.int64(), mask=cids == NO_COLLECTION)
        return (
            pa.array(scopes, pa.string()).take(take),
            pa.array(names, pa.string()).take(take),
            ids,
        )


class NamedRows:
    """``ChangeRows`` of a collection-aware read, with each row's collection id kept beside
    them; ``to_batch`` appends the names (``NAMED_ROW_SCHEMA``)."""

    __slots__ = ("_cids", "_rows", "names")

    def __init__(self, names: CollectionNames) -> None:
        self._rows = ChangeRows()
        self._cids: list[NDArray[np.int64]] = []
        self.names = names

    def __len__(self) -> int:
        return len(self._rows)

    def append_changes(
        self,
        columns: ChangeColumns,
        snapshots: Mapping[int, tuple[int, int]],
        end_seqnos: Mapping[int, int],
    ) -> set[int]:
        """``ChangeRows.append_changes`` of the changes with their prefixes cut off."""
        stripped, cids = strip_collection_ids(columns)
        before = len(self._rows)
        reached = self._rows.append_changes(stripped, snapshots, end_seqnos)
        if len(self._rows) > before:
            # The rows ChangeRows kept: those at or below their vbucket's end (its rule).
            vbuckets = stripped.array("vbucket")
            present, at = np.unique(vbuckets, return_inverse=True)  # a step per vbucket
            ends = np.array([end_seqnos[vb] for vb in present.tolist()], np.uint64)[at]
            kept = cids[stripped.array("seqno") <= ends]
            assert len(kept) == len(self._rows) - before, (len(kept), len(self._rows), before)
            self._cids.append(kept)
        return reached

    def append_rollback(self, vbucket: int, seqno: int) -> None:
        self._rows.append_rollback(vbucket, seqno)
        self._cids.append(np.full(1, NO_COLLECTION, np.int64))

    def to_batch(self) -> pa.RecordBatch:
        batch = self._rows.to_batch()
        cids = np.concatenate(self._cids) if self._cids else np.zeros(0, np.int64)
        assert len(cids) == batch.num_rows, (len(cids), batch.num_rows)
        return pa.RecordBatch.from_arrays(
            [*batch.columns, *self.names.columns(cids)], schema=NAMED_ROW_SCHEMA
        )


def split_names(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, list[pa.Array]]:
    """A named batch as change rows and its name columns: the document parse sees the
    former, and the names go back onto what it returns (``with_names``)."""
    names = [batch.column(name) for name in NAME_COLUMNS]
    rows = pa.RecordBatch.from_arrays(
        [batch.column(name) for name in CHANGE_ROW_SCHEMA.names], schema=CHANGE_ROW_SCHEMA
    )
    return rows, names


def with_names(
    changes: pa.RecordBatch, names: list[pa.Array], out: pa.RecordBatch
) -> pa.RecordBatch:
    """``out`` (rows made of ``changes``, in order, maybe fewer: DROPMALFORMED drops
    malformed documents) with the name columns of the rows it kept appended last."""
    if out.num_rows != changes.num_rows:
        keep = pa.array(_kept(changes, out))
        names = [column.filter(keep) for column in names]
    return pa.RecordBatch.from_arrays(
        [*out.columns, *names], schema=pa.schema([*out.schema, *NAME_FIELDS])
    )


def _kept(changes: pa.RecordBatch, out: pa.RecordBatch) -> NDArray[np.bool_]:
    """Which rows of ``changes`` are in ``out``: a change row is its (vbucket, seqno), unique
    in a read; rollback rows are never dropped."""

    def codes(batch: pa.RecordBatch) -> NDArray[np.int64]:
        vbuckets = batch.column("vbucket").to_numpy(zero_copy_only=False).astype(np.int64)
        seqnos = batch.column("seqno").to_numpy(zero_copy_only=False).astype(np.int64)
        out: NDArray[np.int64] = (vbuckets << 47) | seqnos  # seqnos < 2**47, vbuckets < 2**16
        return out

    rollback = np.asarray(
        changes.column("op").to_numpy(zero_copy_only=False) == "rollback", np.bool_
    )
    out_rollback = np.asarray(
        out.column("op").to_numpy(zero_copy_only=False) == "rollback", np.bool_
    )
    kept = np.isin(codes(changes), codes(out)[~out_rollback])
    return kept | rollback
