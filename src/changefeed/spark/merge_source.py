"""The merge source of one micro-batch: each key's final change, with Arrow kernels only.

A micro-batch may change a key many times; the mirror needs only the last change, so each batch
is reduced to one row per key before it reaches Delta (a merge whose source holds a key twice
would update one target row twice). Deletions and expirations count as changes: a key created
and then deleted in the same batch ends as a tombstone row (``DELETED`` true), which removes the
key from the mirror or, if the mirror never held it, does nothing.

Without rollback rows, stream order is seqno order within a vbucket and a key lives in one
vbucket, so the last row of a key is its newest seqno (``latest_changes`` asserts both agree).

With rollback rows (``rollback_plan``), a rollback row of vbucket V at seqno R, at position p,
voids every change of V after R that came before it: the batch's own rows before p, and what the
mirror and earlier batches hold (``history``). A key whose final row a later rollback voids, or
that the history holds above R with no row after the rollback, is to be re-read from the node
(``mirror.py`` does that); a row after the rollback row is the new history's and wins. Loops run
over rollback rows only (rare), never over change rows.

Not here: reading the history or the node, and writing Delta (``mirror.py``).
"""

from __future__ import annotations

from typing import Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA, OP_MUTATION, OP_ROLLBACK

# A mirror row is a change row's document columns, key first (the merge key), taken from the
# change-row schema so the types cannot drift; op and the snapshot range are the stream's, not
# the document's. These are the columns of ``format=binary``; with ``format=json`` the document's
# typed columns take the place of ``value`` (``mirror_schema``).
MIRROR_COLUMNS: Final = ("key", "vbucket", "seqno", "value", "cas", "flags", "expiry", "rev_seqno")
MIRROR_SCHEMA: Final = pa.schema([CHANGE_ROW_SCHEMA.field(name) for name in MIRROR_COLUMNS])
# The merge source: a mirror row, or a tombstone for a key to delete.
# Internal column names, unlike any document field's.
DELETED: Final = "__changefeed_deleted"
_ROW: Final = "__changefeed_row"  # a batch row's position: stream order
_AT: Final = "__changefeed_at"
SOURCE_SCHEMA: Final = MIRROR_SCHEMA.append(pa.field(DELETED, pa.bool_()))
# What a rollback may have to undo: the keys of the mirror and of earlier batches' changes.
HISTORY_SCHEMA: Final = pa.schema(
    [MIRROR_SCHEMA.field(name) for name in ("key", "vbucket", "seqno")]
)

assert MIRROR_SCHEMA.names == list(MIRROR_COLUMNS), MIRROR_SCHEMA
assert set(CHANGE_ROW_SCHEMA.names) - set(MIRROR_COLUMNS) == {"op", "snap_start", "snap_end"}
_STREAM_ONLY: Final = ("op", "snap_start", "snap_end")


def mirror_schema(changes: pa.Schema) -> pa.Schema:
    """The mirror's columns for change rows of ``changes``: ``MIRROR_SCHEMA`` for change rows
    with ``value``; for typed documents its columns but ``value``, then the document's."""
    fields = [changes.field(name) for name in MIRROR_COLUMNS if name in changes.names]
    fields += [f for f in changes if f.name not in MIRROR_COLUMNS and f.name not in _STREAM_ONLY]
    schema = pa.schema(fields)
    assert schema.names[:3] == ["key", "vbucket", "seqno"], schema.names
    return schema


def source_schema(mirror: pa.Schema) -> pa.Schema:
    """A merge source row: a mirror row, or a tombstone (``DELETED``) for a key to delete."""
    return mirror.append(pa.field(DELETED, pa.bool_()))


def latest_changes(changes: pa.Table) -> pa.Table:
    """Each key's last change in a batch without rollback rows, as merge source rows.

    Args:
        changes: change rows in stream order.

    Returns:
        One row per key: its newest seqno, ``DELETED`` true for deletions and expirations.
    """
    assert not pc.any(pc.equal(changes.column("op"), OP_ROLLBACK), min_count=0).as_py()
    picked = _last_per_key(changes, check_seqnos=True)
    return _as_source(picked)


def rollback_plan(changes: pa.Table, history: pa.Table) -> tuple[pa.Table, dict[str, int]]:
    """Apply the rollback rows of a batch (see the module docstring).

    Args:
        changes: change rows in stream order, some of them ``rollback`` rows.
        history: ``HISTORY_SCHEMA`` rows of what the mirror and earlier batches hold, at least
            for the vbuckets of the rollback rows.

    Returns:
        ``(source, refetch)``: merge source rows (``source_schema``) of the keys whose final
        change survives, and ``key -> vbucket`` of the keys to re-read from the node.
        No key is in both.
    """
    is_rollback = pc.equal(changes.column("op"), OP_ROLLBACK)
    positions = _positions(changes.num_rows)
    rollbacks = (
        changes.append_column(_ROW, positions)
        .filter(is_rollback)
        .select([_ROW, "vbucket", "seqno"])
        .to_pylist()
    )
    assert rollbacks, "no rollback rows"
    data = changes.append_column(_ROW, positions).filter(pc.invert(is_rollback))
    picked = _last_per_key(data.drop_columns([_ROW]), positions=data.column(_ROW))
    void = pa.array(np.zeros(picked.num_rows, np.bool_))
    refetch: dict[str, int] = {}
    for rollback in rollbacks:  # bounded: rollback rows are a few per vbucket and batch
        at, vb, seqno = rollback[_ROW], rollback["vbucket"], rollback["seqno"]
        lost = history.filter(
            pc.and_(
                pc.equal(history.column("vbucket"), vb), pc.greater(history.column("seqno"), seqno)
            )
        )
        lost_keys = pc.unique(lost.column("key"))
        before = pc.and_(
            pc.less(picked.column(_ROW), at), pc.equal(picked.column("vbucket"), vb)
        )  # fmt: skip
        voided = pc.or_(
            pc.greater(picked.column("seqno"), seqno),
            pc.is_in(picked.column("key"), value_set=lost_keys),
        )
        void = pc.or_(void, pc.and_(before, voided))
        absent = pc.invert(pc.is_in(lost_keys, value_set=picked.column("key")))
        refetch.update(dict.fromkeys(lost_keys.filter(absent).to_pylist(), vb))
    again = picked.filter(void)
    refetch.update(
        zip(again.column("key").to_pylist(), again.column("vbucket").to_pylist(), strict=True)
    )
    source = _as_source(picked.filter(pc.invert(void)))
    refetched = pa.array(list(refetch), pa.string())
    assert not pc.any(pc.is_in(source.column("key"), refetched), min_count=0).as_py()
    return source, refetch


def _last_per_key(
    changes: pa.Table, *, positions: pa.Array | pa.ChunkedArray | None = None,
    check_seqnos: bool = False,
) -> pa.Table:  # fmt: skip
    """The last row of each key (by ``positions``, default row order), with its position."""
    if positions is None:
        positions = _positions(changes.num_rows)
    indexed = changes.append_column(_ROW, positions)
    local = indexed.append_column(_AT, _positions(indexed.num_rows))
    aggregates = [(_AT, "max")] + ([("seqno", "max")] if check_seqnos else [])
    grouped = local.group_by(["key"], use_threads=False).aggregate(aggregates)
    picked = local.take(grouped.column(f"{_AT}_max")).drop_columns([_AT])
    if check_seqnos:  # the last row is the newest: seqnos rise in stream order per vbucket
        newest = pc.equal(picked.column("seqno"), grouped.column("seqno_max"))
        assert pc.all(newest, min_count=0).as_py(), "a last row is not the newest seqno"
    assert picked.num_rows <= changes.num_rows, (picked.num_rows, changes.num_rows)
    return picked


def _positions(count: int) -> pa.Array:
    return pa.array(np.arange(count, dtype=np.int64))


def _as_source(picked: pa.Table) -> pa.Table:
    deleted = pc.not_equal(picked.column("op"), OP_MUTATION)
    mirror = mirror_schema(picked.drop_columns([_ROW]).schema)
    source = picked.select(mirror.names).append_column(DELETED, deleted)
    return source.cast(source_schema(mirror))
