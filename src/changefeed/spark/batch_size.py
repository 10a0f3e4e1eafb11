"""How many changes a micro-batch can hold, known before it runs: the seqnos its offsets span.

The mirror writer picks its path per batch (``dist_mirror.py``): a small batch is cheaper to
collect and write from the driver than to shuffle to write tasks, a large one must stay in the
tasks (the driver's memory would bound it). Counting the rows would run the batch's read once
more, so the writer asks what the batch was planned as instead: Spark writes each micro-batch's
end offsets to the query's offset log before it runs the batch, and the batch before ends where
this one starts. The seqnos between them bound the batch's rows (deduplication only removes
rows; a rollback row adds one per vbucket, counted as one).

Spark hands ``foreachBatch`` a DataFrame without its offsets, so they are read where Spark keeps
them: the running query (``running_query.py``) and its offset log. That log is not public API
(``StreamExecution.offsetLog``); every failure to read it (another Spark, a query of another
session, a DataFrame not from a stream, offsets of another source) gives ``None``, and the
writer then treats the batch as large.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from changefeed.spark.offsets import Offsets, VbOffset, offsets_from_json
from changefeed.spark.running_query import running_query

log = logging.getLogger("changefeed.mirror")


def planned_changes(batch_df: Any, batch_id: int) -> int | None:
    """The seqnos micro-batch ``batch_id`` of ``batch_df``'s query spans, over all vbuckets
    (an upper bound on its change rows, plus one per rolled-back vbucket), or None if unknown."""
    try:
        ends = _offset_json(batch_df, batch_id)
        if ends is None:
            return None
        starts = _offset_json(batch_df, batch_id - 1) if batch_id > 0 else None
    except Exception as error:  # py4j and Spark internals: any failure means "unknown"
        log.debug("micro-batch %d: offsets not readable (%s)", batch_id, error)
        return None
    return seqnos_between(starts, ends)


def seqnos_between(starts: list[str | None] | None, ends: list[str | None]) -> int | None:
    """The seqnos from ``starts`` to ``ends`` (each a source's offset JSON, as in Spark's offset
    log; ``starts`` None: the first batch, counted from seqno 0), or None if an offset is not
    this source's."""
    total = 0
    for index, end_text in enumerate(ends):
        start_text = starts[index] if starts is not None and index < len(starts) else None
        end = _parse(end_text)
        start = _parse(start_text) if start_text is not None else {}
        if end is None or start is None:
            return None
        total += seqnos_spanned(start, end)
    return total


def seqnos_spanned(start: Offsets, end: Offsets) -> int:
    """The seqnos from ``start`` to ``end`` of one source, plus one per new history branch."""
    total = 0
    for vb, offset in end.items():
        before = start.get(vb, VbOffset())
        total += max(0, offset.seqno - before.seqno)
        if offset.vb_uuid != before.vb_uuid and before.vb_uuid != 0:
            total += 1  # a new history branch: room for the rollback row
    return total


def _parse(text: str | None) -> Offsets | None:
    if text is None:
        return None
    try:
        raw = json.loads(text)
        return offsets_from_json(raw) if isinstance(raw, dict) else None
    except ValueError:
        return None


def _offset_json(batch_df: Any, batch_id: int) -> list[str | None] | None:
    """The offsets Spark's offset log holds for ``batch_id`` of the query running this batch,
    one JSON text per source (None for a source without one), or None."""
    query = running_query(batch_df)
    if query is None:
        return None
    logged = query.offsetLog().get(batch_id)
    if not logged.isDefined():
        return None
    offsets = logged.get().offsets()
    out: list[str | None] = []
    for index in range(offsets.size()):
        offset = offsets.apply(index)
        out.append(str(offset.get().json()) if offset.isDefined() else None)
    return out
