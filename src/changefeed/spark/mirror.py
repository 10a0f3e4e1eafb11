"""The mirror writer: a change stream → an append-only changelog table and a current-state
mirror table (Delta Lake, written with ``deltalake``), exactly once across query restarts.

Used from ``foreachBatch``::

    writer = MirrorWriter("/data/tables", options)            # options: the source's options
    query = df.writeStream.foreachBatch(writer).option("checkpointLocation", ck).start()

Exactly once: Spark may run a batch again after a crash (at-least-once ``foreachBatch``). Each
table records the batch id as a Delta app transaction in the same commit as the data, and a
batch whose id is not newer than the recorded one is skipped (spark-python-datasource.md §5).

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

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from changefeed.consumer import ClientConfig
from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA, INT64_MAX, OP_MUTATION, OP_ROLLBACK
from changefeed.consumer.current_state import Document, read_current_state
from changefeed.spark.options import SourceOptions

log = logging.getLogger("changefeed.mirror")

APP_ID = "changefeed-mirror"
# A mirror row is a change row's document columns, key first (the merge key), taken from the
# change-row schema so the types cannot drift; op and the snapshot range are the stream's, not
# the document's.
MIRROR_COLUMNS = ("key", "vbucket", "seqno", "value", "cas", "flags", "expiry", "rev_seqno")
MIRROR_SCHEMA = pa.schema([CHANGE_ROW_SCHEMA.field(name) for name in MIRROR_COLUMNS])
# The merge source: a mirror row, or a tombstone for a key to delete.
SOURCE_SCHEMA = MIRROR_SCHEMA.append(pa.field("deleted", pa.bool_()))
assert MIRROR_SCHEMA.names == list(MIRROR_COLUMNS), MIRROR_SCHEMA
assert set(CHANGE_ROW_SCHEMA.names) - set(MIRROR_COLUMNS) == {"op", "snap_start", "snap_end"}


@dataclass
class _Change:
    """The final change of one key in a batch: a row to upsert, or None to delete."""

    vbucket: int
    seqno: int
    row: dict[str, Any] | None


class MirrorWriter:
    """``foreachBatch`` callable maintaining ``<path>/changelog`` and ``<path>/mirror``.

    Args:
        path: directory holding both tables.
        options: the source's options (dict) — the node to re-read rolled-back keys from.
        app_id: the Delta app-transaction id; one per query writing these tables.
    """

    def __init__(self, path: str | Path, options: dict[str, str], app_id: str = APP_ID) -> None:
        self.path = Path(path)
        self.options = dict(options)
        self.app_id = app_id
        self.changelog_path = self.path / "changelog"
        self.mirror_path = self.path / "mirror"

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        self.write(batch_df.toArrow(), batch_id)

    def write(self, changes: pa.Table, batch_id: int) -> None:
        """Apply one micro-batch (Arrow table of change rows in stream order)."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not _done(self.changelog_path, self.app_id, batch_id):
            log_rows = changes.append_column(
                "batch_id", pa.array([batch_id] * changes.num_rows, pa.int64())
            )
            write_deltalake(
                str(self.changelog_path),
                log_rows,
                mode="append",
                commit_properties=_txn(self.app_id, batch_id),
            )
        if not _done(self.mirror_path, self.app_id, batch_id):
            self._apply_mirror(changes, batch_id)

    def _apply_mirror(self, changes: pa.Table, batch_id: int) -> None:
        if pc.any(pc.equal(changes.column("op"), OP_ROLLBACK)).as_py():
            source = self._source_with_rollbacks(changes, batch_id)
        else:
            source = _source_without_rollbacks(changes)
        if source.num_rows == 0 and DeltaTable.is_deltatable(str(self.mirror_path)):
            _commit_empty(self.mirror_path, self.app_id, batch_id)
            return
        props = _txn(self.app_id, batch_id)
        if not DeltaTable.is_deltatable(str(self.mirror_path)):
            live = source.filter(pc.invert(source.column("deleted"))).drop_columns(["deleted"])
            write_deltalake(str(self.mirror_path), live, mode="append", commit_properties=props)
            return
        (
            DeltaTable(str(self.mirror_path))
            .merge(
                source, "t.key = s.key", source_alias="s", target_alias="t", commit_properties=props
            )
            .when_matched_delete("s.deleted")
            .when_matched_update_all("NOT s.deleted", except_cols=["deleted"])
            .when_not_matched_insert_all("NOT s.deleted", except_cols=["deleted"])
            .execute()
        )

    def _source_with_rollbacks(self, changes: pa.Table, batch_id: int) -> pa.Table:
        final = self._final_changes(changes, batch_id)
        rows = [
            {**c.row, "deleted": False} if c.row is not None else _tombstone(key, c.vbucket)
            for key, c in final.items()
        ]
        return pa.Table.from_pylist(rows, schema=SOURCE_SCHEMA)

    def _final_changes(self, changes: pa.Table, batch_id: int) -> dict[str, _Change]:
        """Each key's last change in the batch, with rollbacks applied (see module docstring)."""
        final: dict[str, _Change] = {}
        refetch: dict[str, int] = {}  # key -> its vbucket, to re-read from the node
        history: pa.Table | None = None  # read once per batch, at its first rollback row
        rows = changes.to_pylist()
        for row in rows:
            if row["op"] == OP_ROLLBACK:
                if history is None:
                    history = self._history(batch_id)
                self._rollback(final, refetch, history, row["vbucket"], row["seqno"])
                continue
            key = row["key"]
            refetch.pop(key, None)
            row_or_none = _mirror_row(row) if row["op"] == OP_MUTATION else None
            final[key] = _Change(row["vbucket"], row["seqno"], row_or_none)
        for key, change in self._refetch(refetch).items():
            final[key] = change
        return final

    def _rollback(
        self,
        final: dict[str, _Change],
        refetch: dict[str, int],
        history: pa.Table,
        vb: int,
        seqno: int,
    ) -> None:
        for key in [k for k, c in final.items() if c.seqno > seqno and c.vbucket == vb]:
            del final[key]
            refetch[key] = vb
        mask = pc.and_(
            pc.equal(history.column("vbucket"), vb), pc.greater(history.column("seqno"), seqno)
        )
        for key in pc.unique(history.filter(mask).column("key")).to_pylist():
            final.pop(key, None)
            refetch[key] = vb
        log.info("rollback of vbucket %d to seqno %d: %d keys to re-read", vb, seqno, len(refetch))

    def _history(self, batch_id: int) -> pa.Table:
        """``(key, vbucket, seqno)`` of every mirror row and of every change row that batches
        before ``batch_id`` logged: what a rollback may have to undo."""
        columns = ["key", "vbucket", "seqno"]
        parts = [pa.table({c: pa.array([], MIRROR_SCHEMA.field(c).type) for c in columns})]
        if DeltaTable.is_deltatable(str(self.mirror_path)):
            parts.append(DeltaTable(str(self.mirror_path)).to_pyarrow_table(columns=columns))
        if DeltaTable.is_deltatable(str(self.changelog_path)):
            logged = DeltaTable(str(self.changelog_path)).to_pyarrow_table(
                columns=[*columns, "op", "batch_id"]
            )
            keep = pc.and_(
                pc.less(logged.column("batch_id"), batch_id),
                pc.not_equal(logged.column("op"), OP_ROLLBACK),
            )
            parts.append(logged.filter(keep).select(columns))
        return pa.concat_tables([p.cast(parts[0].schema) for p in parts])

    def _refetch(self, keys: dict[str, int]) -> dict[str, _Change]:
        """The node's current version of each key (``key -> vbucket``), or None if gone."""
        if not keys:
            return {}
        options = SourceOptions.parse(self.options)
        config = ClientConfig(
            host=options.host,
            port=options.port,
            bucket=options.bucket,
            user=options.user,
            password=options.password,
        )
        raw = {key.encode("utf-8", "surrogateescape"): key for key in keys}
        docs = asyncio.run(read_current_state(config, set(keys.values()), raw.keys()))
        out: dict[str, _Change] = {}
        for raw_key, key in raw.items():
            doc = docs.get(raw_key)
            if doc is None or doc.deleted:  # purged or never there: gone, like a tombstone
                seqno = 0 if doc is None else doc.seqno
                out[key] = _Change(keys[key], seqno, None)
                continue
            assert doc.vbucket == keys[key], (key, doc.vbucket, keys[key])
            out[key] = _Change(doc.vbucket, doc.seqno, _document_row(key, doc))
        assert len(out) == len(keys), (len(out), len(keys))
        log.info("re-read %d keys: %d live", len(out), sum(c.row is not None for c in out.values()))
        return out


def _document_row(key: str, doc: Document) -> dict[str, Any]:
    """A mirror row of a live document read from the node, narrowed as change rows are
    (``consumer/change_rows.py``): flags and expiry u32 -> int32; a CAS above int64 refused.

    Raises:
        ValueError: the CAS does not fit an int64 (Spark long).
    """
    assert not doc.deleted, doc
    if doc.cas > INT64_MAX:
        raise ValueError(f"key {key!r}: CAS {doc.cas} does not fit an int64 (Spark long)")
    row = {
        "key": key,
        "vbucket": doc.vbucket,
        "seqno": doc.seqno,
        "value": doc.value,
        "cas": doc.cas,
        "flags": _int32(doc.flags),
        "expiry": _int32(doc.expiry),
        "rev_seqno": doc.rev_seqno,
    }
    assert list(row) == MIRROR_SCHEMA.names, list(row)
    return row


def _int32(u32: int) -> int:
    assert 0 <= u32 < 2**32, u32
    return u32 - 2**32 if u32 >= 2**31 else u32


def _mirror_row(row: dict[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in MIRROR_SCHEMA.names}


def _tombstone(key: str, vbucket: int) -> dict[str, Any]:
    return {
        "key": key,
        "vbucket": vbucket,
        "seqno": 0,
        "value": b"",
        "cas": 0,
        "flags": 0,
        "expiry": 0,
        "rev_seqno": 0,
        "deleted": True,
    }


def _source_without_rollbacks(changes: pa.Table) -> pa.Table:
    """Vectorised: each key's last row (stream order = seqno order per vbucket) as the merge
    source, ``deleted`` for deletions and expirations."""
    indexed = changes.append_column("_row", pa.array(range(changes.num_rows), pa.int64()))
    last = indexed.group_by(["key"]).aggregate([("_row", "max")]).column("_row_max")
    picked = indexed.take(last)
    deleted = pc.not_equal(picked.column("op"), OP_MUTATION)
    return picked.select(MIRROR_SCHEMA.names).append_column("deleted", deleted).cast(SOURCE_SCHEMA)


def _commit_empty(path: Path, app_id: str, batch_id: int) -> None:
    """Record the batch id even when the batch changes nothing, so a replay is skipped."""
    empty = pa.Table.from_pylist([], schema=MIRROR_SCHEMA)
    write_deltalake(str(path), empty, mode="append", commit_properties=_txn(app_id, batch_id))


def _txn(app_id: str, batch_id: int) -> CommitProperties:
    return CommitProperties(app_transactions=[Transaction(app_id, batch_id)])


def _done(path: Path, app_id: str, batch_id: int) -> bool:
    """True if this table already committed ``batch_id`` (a replayed batch)."""
    if not DeltaTable.is_deltatable(str(path)):
        return False
    version = DeltaTable(str(path)).transaction_version(app_id)
    return version is not None and version >= batch_id


def read_mirror(path: str | Path) -> pa.Table:
    """The mirror table as Arrow (key, vbucket, seqno, value, ...)."""
    return DeltaTable(str(Path(path) / "mirror")).to_pyarrow_table()
