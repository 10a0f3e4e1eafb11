"""The node's current version of keys as merge-source rows: what a rollback voided is read
again from the node. The single-process writer (``mirror``) and the distributed writer's tasks
(``mirror_tasks``) both call it; it sits below both so neither imports the other."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import pyarrow as pa

from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA, INT64_MAX, OP_DELETION, OP_MUTATION
from changefeed.consumer.current_state import Document, read_current_state
from changefeed.protocol.collections import encode_leb128
from changefeed.spark.cluster import client_config, reachable_config
from changefeed.spark.collection_rows import COLLECTION_ID_OPTION
from changefeed.spark.documents import DocumentReader
from changefeed.spark.merge_source import latest_changes, mirror_schema, source_schema
from changefeed.spark.options import SourceOptions
from changefeed.spark.reading import fetch_manifest_sync

log = logging.getLogger("changefeed.mirror")


def refetch_source(
    keys: dict[str, int], schema: pa.Schema, source_options: dict[str, str]
) -> pa.Table:
    """The node's current version of each key (``key -> vbucket``) as merge source rows
    for change rows of ``schema``: the document, or a tombstone if it is gone. Typed
    documents are parsed as the source parses them (malformed ones: null fields and, if
    the schema has the column, the corrupt record). The distributed writer's tasks call it too.
    Options naming one collection (a collection-aware mirror's table) re-read its keys: those
    of its collection id (``COLLECTION_ID_OPTION``) when the options carry one, so a table of
    ``s.c`` dropped and created again never reads the new collection's documents. A collection
    no longer in the manifest has nothing on the node (its documents went with it): each key
    comes back as a tombstone, and the table deletes what the rollback voided.
    """
    if not keys:
        return source_schema(mirror_schema(schema)).empty_table()
    options = SourceOptions.parse(source_options)
    config = client_config(options, "changefeed-mirror")
    narrowed = options.collection_filter if len(options.collection_filter) == 1 else ()
    prefix = b""
    gone = False
    if narrowed:  # one collection's tables: its keys, which arrive with its id in front
        cid = _collection_id(source_options)
        manifest = fetch_manifest_sync(options)
        if cid is None:  # options of tables whose id was never known: by name
            _, found = manifest.resolve(narrowed[0])
        else:  # by id: the name may be another collection's now
            scope_found = manifest.by_id().get(cid)
            found = None if scope_found is None else scope_found[1]
            if scope_found is not None:  # its name now (a rename keeps the id)
                narrowed = (f"{scope_found[0].name}.{scope_found[1].name}",)
        gone = found is None  # dropped: its documents went with it
        prefix = b"" if found is None else encode_leb128(found.uid)
    raw = {prefix + key.encode("utf-8", "surrogateescape"): key for key in keys}

    async def current() -> dict[bytes, Document]:
        # Through whichever seed answers: the first may be the node that just failed.
        reachable = await reachable_config(options, config)
        if narrowed:
            reachable = dataclasses.replace(reachable, collections=narrowed)
        return await read_current_state(reachable, set(keys.values()), raw.keys())

    docs = {} if gone else asyncio.run(current())
    rows: list[dict[str, Any]] = []
    for raw_key, key in raw.items():
        doc = docs.get(raw_key)
        if doc is None or doc.deleted:  # purged or never there: gone, like a tombstone
            rows.append(_tombstone(key, keys[key]))
            continue
        assert doc.vbucket == keys[key], (key, doc.vbucket, keys[key])
        rows.append(_document_row(key, doc))
    assert len(rows) == len(keys), (len(rows), len(keys))
    live = sum(row["op"] == OP_MUTATION for row in rows)
    log.info("re-read %d keys: %d live", len(rows), live)
    changes = pa.Table.from_pylist(rows, schema=CHANGE_ROW_SCHEMA)
    if "value" not in schema.names:
        reader = DocumentReader(schema, "PERMISSIVE", options.corrupt_column)
        changes = pa.Table.from_batches([reader.convert(changes)])
    return latest_changes(changes)


def _collection_id(source_options: dict[str, str]) -> int | None:
    """The collection id the options carry (``COLLECTION_ID_OPTION``), if any.

    Raises:
        ValueError: the value is not a collection id (names it).
    """
    lowered = {k.lower(): v for k, v in source_options.items()}
    text = lowered.get(COLLECTION_ID_OPTION.lower())
    if text is None:
        return None
    try:
        cid = int(text)
    except ValueError:
        cid = -1
    if not 0 <= cid < 2**32:
        raise ValueError(f"option {COLLECTION_ID_OPTION}: {text!r} is not a collection id")
    return cid


def _document_row(key: str, doc: Document) -> dict[str, Any]:
    """The change row of a live document read from the node, narrowed as change rows are
    (``consumer/change_rows.py``): flags and expiry u32 -> int32; a CAS above int64 refused.

    Raises:
        ValueError: the CAS does not fit an int64 (Spark long).
    """
    assert not doc.deleted, doc
    if doc.cas > INT64_MAX:
        raise ValueError(f"key {key!r}: CAS {doc.cas} does not fit an int64 (Spark long)")
    row = {
        "vbucket": doc.vbucket, "seqno": doc.seqno, "key": key, "value": doc.value,
        "op": OP_MUTATION, "cas": doc.cas, "expiry": _int32(doc.expiry),
        "flags": _int32(doc.flags), "rev_seqno": doc.rev_seqno, "snap_start": doc.seqno,
        "snap_end": doc.seqno,
    }  # fmt: skip
    assert list(row) == CHANGE_ROW_SCHEMA.names, list(row)
    return row


def _int32(u32: int) -> int:
    assert 0 <= u32 < 2**32, u32
    return u32 - 2**32 if u32 >= 2**31 else u32


def _tombstone(key: str, vbucket: int) -> dict[str, Any]:
    """A change row that deletes ``key`` (gone from the node, or purged)."""
    return {
        "vbucket": vbucket, "seqno": 0, "key": key, "value": b"", "op": OP_DELETION, "cas": 0,
        "expiry": 0, "flags": 0, "rev_seqno": 0, "snap_start": 0, "snap_end": 0,
    }  # fmt: skip
