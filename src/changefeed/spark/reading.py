"""Executor-side reading: stream a group of vbuckets from start offsets to end seqnos and turn
the events into Arrow record batches of the change-row schema (built by
``consumer/change_rows.py``, at most about ``limits.ROWS_PER_BATCH_MAX`` rows each).

Stateless by design (Spark pickles the reader and runs ``read`` in executor workers): everything
comes from the partition and the options. Rows past a vbucket's end seqno are dropped (the node
ends a stream only after the whole snapshot holding the end seqno), so consecutive micro-batches
never overlap. A rollback becomes a row ``op = rollback`` placed before any row past it.

A vbucket is finished once its stream ended, or once the stream went past its end seqno (an item,
a snapshot start or a rollback seqno at or past it: seqnos only rise, so nothing at or below the
end can still come). The reader then stops without waiting for the rest of the snapshot holding
the end seqno, and a vbucket whose request had to ask past its end (see ``request_ends``) does
not wait for seqnos the node may never write.

Collection-aware reads (options ``collections`` / ``scope``) ask the node for the chosen
collections only; the rows get their ``scope`` and ``collection`` names and keys without the
collection id (``collection_rows.py``). System events and seqno-advanced messages are not rows:
they finish a vbucket as a change at or past its end does, and created collections' events
teach their names. A named collection that no longer exists is left out of the request (its
changes went with it, as a dropped collection's do on the node); when none is left, nothing is
read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from changefeed import limits
from changefeed.consumer import (
    Changes,
    ClientConfig,
    Disconnected,
    Rollback,
    SessionState,
    Snapshot,
    StreamEnded,
    StreamOpened,
    StreamRefused,
)
from changefeed.consumer.change_rows import ChangeRows
from changefeed.consumer.collections_admin import get_manifest
from changefeed.consumer.events import CollectionEvent, SeqnoAdvanced
from changefeed.protocol.collections_manifest import Manifest
from changefeed.protocol.status import Status
from changefeed.spark.change_runs import EndSeqnos, PendingChanges
from changefeed.spark.cluster import client_config, dcp_client, dial_seed
from changefeed.spark.collection_rows import CollectionNames, NamedRows
from changefeed.spark.offsets import VbOffset
from changefeed.spark.options import SourceOptions

_T = TypeVar("_T")


class DataLossError(RuntimeError):
    """The node can no longer continue a stream without starting over (failOnDataLoss=true)."""


class StreamFailedError(RuntimeError):
    """The node refused a stream (e.g. the vbucket is not served there)."""


@dataclass(frozen=True, slots=True)
class VbRange:
    vbucket: int
    start: VbOffset
    end_seqno: int
    end_vb_uuid: int = 0

    @property
    def needs_reading(self) -> bool:
        """New seqnos, or a new history branch (a rollback may be due even at equal seqnos)."""
        return self.end_seqno != self.start.seqno or self.end_vb_uuid != self.start.vb_uuid


@dataclass(frozen=True, slots=True)
class Chunk:
    """A record batch of change rows, and the vbuckets complete once it is taken: every row of
    theirs is in this batch or an earlier one. A snapshot read (``source.py``) can then hand on
    a finished vbucket's rows while the others are still streaming, rather than hold the whole
    partition until its last stream ends."""

    batch: pa.RecordBatch
    finished: frozenset[int]


Names = Mapping[int, tuple[str, str]]  # collection id -> (scope, collection), known before


async def read_ranges(
    options: SourceOptions, ranges: list[VbRange], names: Names | None = None
) -> AsyncGenerator[pa.RecordBatch, None]:
    """Yield record batches of every change in ``ranges``; returns when every stream ended.
    ``names``: collections the caller knows (a collection-aware read learns the rest)."""
    async for chunk in read_chunks(options, ranges, names):
        yield chunk.batch


async def fetch_manifest(options: SourceOptions) -> Manifest:
    """The bucket's collections manifest, from the first seed that answers."""
    conn, _ = await dial_seed(options, "changefeed-spark")
    try:
        return await get_manifest(conn)
    finally:
        await conn.close()


def fetch_manifest_sync(options: SourceOptions) -> Manifest:
    """``fetch_manifest`` on a private event loop (planning runs outside any loop)."""
    return asyncio.run(fetch_manifest(options))


async def collection_config(
    options: SourceOptions, config: ClientConfig, names: Names | None
) -> tuple[ClientConfig, CollectionNames] | None:
    """``config`` streaming the collections ``options`` choose, and the names of collections
    (the manifest now, over ``names``); None when every collection named is gone."""
    manifest = await fetch_manifest(options)
    known = CollectionNames(names)
    known.learn_manifest(manifest)
    if options.scope is not None:
        if manifest.scope(options.scope) is None:
            return None  # dropped with its collections (the planner checked it existed)
        return dataclasses.replace(config, scope=options.scope, collections_aware=True), known
    alive = tuple(p for p in options.collection_filter if manifest.resolve(p)[1] is not None)
    if options.collection_filter and not alive:
        return None
    return dataclasses.replace(config, collections=alive, collections_aware=True), known


async def read_chunks(
    options: SourceOptions, ranges: list[VbRange], names: Names | None = None
) -> AsyncGenerator[Chunk, None]:
    """``read_ranges``, each batch with the vbuckets finished by then (``Chunk``)."""
    to_read = [r for r in ranges if r.needs_reading]
    if not to_read:
        return
    ends = {r.vbucket: r.end_seqno for r in to_read}
    # The node answers start > end with ERANGE before it looks for a rollback (as kv_engine
    # does). A vbucket whose history fell behind our offset (a restored or failed-over node:
    # end < start) therefore asks up to its start seqno; the rollback comes first, and the
    # reader finishes the vbucket itself once it has everything up to ``ends``.
    request_ends = {r.vbucket: max(r.end_seqno, r.start.seqno) for r in to_read}
    state = SessionState({r.vbucket: r.start.session(r.vbucket) for r in to_read})
    config = client_config(
        options,
        # Unique per read: the node closes the older connection of a reused DCP name, and
        # id() values repeat across the Python workers Spark forks from one daemon.
        f"changefeed:spark:{uuid.uuid4().hex}",
        rollback_to_snapshot=False,  # the mirror re-reads rolled-back keys from the node
    )
    if options.transport == "shm" and all(r.end_seqno > r.start.seqno for r in to_read):
        # The node's shared-memory ring (changefeed.ipc); a branch change goes over TCP below.
        from changefeed.ipc.local_stream import read_bounded

        shm_dir = options.shm_dir or None
        async for batch in read_bounded(config, state, ends, directory=shm_dir):
            for row in batch.filter(pc.equal(batch.column("op"), "rollback")).to_pylist():
                _refuse_data_loss(row["vbucket"], row["seqno"], ranges, options)
            yield Chunk(batch, frozenset())  # the ring does not say; all are, once it returns
        return
    snaps = {r.vbucket: (r.start.snap_start, r.start.snap_end) for r in to_read}
    planned = {r.vbucket: r.end_vb_uuid for r in to_read}
    known: CollectionNames | None = None
    if options.collections_aware:
        chosen = await collection_config(options, config, names)
        if chosen is None:
            return  # the collections named are gone, and their changes with them
        config, known = chosen

    def new_rows() -> ChangeRows | NamedRows:
        return ChangeRows() if known is None else NamedRows(known)

    async with dcp_client(options, config) as client:
        state.stream_filter = client.stream_filter
        await client.stream(sorted(ends), state, end_seqnos=request_ends)
        unfinished = set(ends)
        rows = new_rows()
        # Changes wait here to become rows in large runs (change_runs.py); they are taken
        # before an event changes their vbucket's snapshot or end, and before a rollback row.
        pending = PendingChanges()
        end_seqnos = EndSeqnos(ends)
        async for event in client.events():
            if isinstance(event, Changes):
                pending.add(event.columns)
                unfinished -= end_seqnos.reached(event.columns)
            elif isinstance(event, Snapshot):
                if pending.holds(event.vbucket):
                    _settle(rows, pending, snaps, ends)
                snaps[event.vbucket] = (event.snap_start, event.snap_end)
                if event.snap_start > ends[event.vbucket]:
                    unfinished.discard(event.vbucket)
            elif isinstance(event, Rollback):
                _settle(rows, pending, snaps, ends)
                _on_rollback(rows, event, ranges, options)
                if event.seqno >= ends[event.vbucket]:
                    unfinished.discard(event.vbucket)
            elif isinstance(event, StreamOpened):
                branch = branch_point(event.failover_log, planned[event.vbucket])
                if branch is not None and branch < ends[event.vbucket]:
                    if pending.holds(event.vbucket):
                        _settle(rows, pending, snaps, ends)
                    ends[event.vbucket] = branch  # later seqnos are another history's
                    end_seqnos.put(event.vbucket, branch)
                    if client.session.get(event.vbucket).seqno >= branch:
                        unfinished.discard(event.vbucket)
            elif isinstance(event, StreamEnded):
                unfinished.discard(event.vbucket)
            elif isinstance(event, StreamRefused):
                raise StreamFailedError(
                    f"vbucket {event.vbucket}: {Status.name_of(event.status)} {event.message}"
                )
            elif isinstance(event, Disconnected):
                pass  # the client reconnects and resumes from what we already took
            elif isinstance(event, CollectionEvent):
                if known is not None:
                    known.learn_event(event.message)
                if event.message.seqno >= ends[event.vbucket]:
                    unfinished.discard(event.vbucket)
            elif isinstance(event, SeqnoAdvanced) and event.seqno >= ends[event.vbucket]:
                unfinished.discard(event.vbucket)
            if pending.full or len(pending) + len(rows) >= limits.ROWS_PER_BATCH_MAX:
                _settle(rows, pending, snaps, ends)
            if len(rows) >= limits.ROWS_PER_BATCH_MAX:
                yield Chunk(rows.to_batch(), frozenset(ends.keys() - unfinished))
                rows = new_rows()
            if not unfinished:
                break  # closing the connection ends the streams still open
        _settle(rows, pending, snaps, ends)
        if len(rows):
            yield Chunk(rows.to_batch(), frozenset(ends))


def _settle(
    rows: ChangeRows | NamedRows,
    pending: PendingChanges,
    snaps: Mapping[int, tuple[int, int]],
    ends: Mapping[int, int],
) -> None:
    """The pending changes as rows, under the snapshots and end seqnos they arrived in (rows
    past a vbucket's end are left out: the next micro-batch starts there)."""
    if len(pending):
        rows.append_changes(pending.take(), snaps, ends)


def branch_point(failover_log: list[tuple[int, int]], planned_uuid: int) -> int | None:
    """The last seqno the history of ``failover_log`` (newest entry first, as a stream
    request's answer carries it) shares with the history the planner saw (``planned_uuid``):
    the start seqno of the oldest entry newer than ``planned_uuid``. None when the log's
    newest entry is the planned one, or the planned uuid is unknown (0) or not in the log
    (nothing to say: the stream's own rollback rules apply)."""
    uuids = [entry_uuid for entry_uuid, _ in failover_log]
    if planned_uuid == 0 or planned_uuid not in uuids:
        return None
    index = uuids.index(planned_uuid)
    return None if index == 0 else failover_log[index - 1][1]


def _on_rollback(
    out: ChangeRows | NamedRows, event: Rollback, ranges: list[VbRange], options: SourceOptions
) -> None:
    _refuse_data_loss(event.vbucket, event.seqno, ranges, options)
    out.append_rollback(event.vbucket, event.seqno)


def _refuse_data_loss(
    vbucket: int, seqno: int, ranges: list[VbRange], options: SourceOptions
) -> None:
    start = next(r.start for r in ranges if r.vbucket == vbucket)
    if seqno == 0 and start.seqno > 0 and options.fail_on_data_loss:
        raise DataLossError(
            f"vbucket {vbucket} must restart from seqno 0 (its history since seqno "
            f"{start.seqno} is gone or tombstones were purged); set failOnDataLoss=false to "
            "receive a rollback row instead and let the sink rebuild the vbucket"
        )


def read_ranges_sync(
    options: SourceOptions, ranges: list[VbRange], names: Names | None = None
) -> Iterator[pa.RecordBatch]:
    """Drive ``read_ranges`` on a private event loop, yielding batches as they are made."""
    return _drive(read_ranges(options, ranges, names))


def read_chunks_sync(
    options: SourceOptions, ranges: list[VbRange], names: Names | None = None
) -> Iterator[Chunk]:
    """Drive ``read_chunks`` on a private event loop, yielding chunks as they are made."""
    return _drive(read_chunks(options, ranges, names))


def _drive(generator: AsyncGenerator[_T, None]) -> Iterator[_T]:
    loop = asyncio.new_event_loop()
    try:
        while True:  # ends with StopAsyncIteration
            try:
                yield loop.run_until_complete(generator.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(generator.aclose())
        loop.close()
