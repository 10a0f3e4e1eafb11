"""Executor-side reading: stream a group of vbuckets from start offsets to end seqnos and turn
the events into Arrow record batches of the change-row schema.

Stateless by design (Spark pickles the reader and runs ``read`` in executor workers): everything
comes from the partition and the options. Rows past a vbucket's end seqno are dropped (the node
ends a stream only after the whole snapshot holding the end seqno), so consecutive micro-batches
never overlap. A rollback becomes a row ``op = rollback`` placed before any row past it.

A vbucket is finished once its stream ended, or once the stream went past its end seqno (an item,
a snapshot start or a rollback seqno at or past it: seqnos only rise, so nothing at or below the
end can still come). The reader then stops without waiting for the rest of the snapshot holding
the end seqno, and a vbucket whose request had to ask past its end (see ``request_ends``) does
not wait for seqnos the node may never write.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field

import pyarrow as pa

from changefeed.consumer import (
    Changes,
    ClientConfig,
    DcpClient,
    Disconnected,
    Rollback,
    SessionState,
    Snapshot,
    StreamEnded,
    StreamRefused,
)
from changefeed.protocol.status import Status
from changefeed.spark.offsets import VbOffset
from changefeed.spark.options import SourceOptions
from changefeed.spark.schema import ARROW_SCHEMA, INT64_MAX, OP_BY_OPCODE, OP_ROLLBACK

ROWS_PER_BATCH_MAX = 65_536  # Arrow batch size handed to Spark


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


@dataclass
class _Columns:
    vbucket: list[int] = field(default_factory=list)
    seqno: list[int] = field(default_factory=list)
    key: list[str] = field(default_factory=list)
    value: list[bytes] = field(default_factory=list)
    op: list[str] = field(default_factory=list)
    cas: list[int] = field(default_factory=list)
    expiry: list[int] = field(default_factory=list)
    flags: list[int] = field(default_factory=list)
    rev_seqno: list[int] = field(default_factory=list)
    snap_start: list[int] = field(default_factory=list)
    snap_end: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqno)

    def to_batch(self) -> pa.RecordBatch:
        arrays = [pa.array(getattr(self, f.name), f.type) for f in ARROW_SCHEMA]
        return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA)


async def read_ranges(
    options: SourceOptions, ranges: list[VbRange]
) -> AsyncGenerator[pa.RecordBatch, None]:
    """Yield record batches of every change in ``ranges``; returns when every stream ended."""
    todo = [r for r in ranges if r.needs_reading]
    if not todo:
        return
    ends = {r.vbucket: r.end_seqno for r in todo}
    # The node answers start > end with ERANGE before it looks for a rollback (as kv_engine
    # does). A vbucket whose history fell behind our offset (a restored or failed-over node:
    # end < start) therefore asks up to its start seqno; the rollback comes first, and the
    # reader finishes the vbucket itself once it has everything up to ``ends``.
    request_ends = {r.vbucket: max(r.end_seqno, r.start.seqno) for r in todo}
    state = SessionState({r.vbucket: r.start.session(r.vbucket) for r in todo})
    config = ClientConfig(
        host=options.host,
        port=options.port,
        bucket=options.bucket,
        user=options.user,
        password=options.password,
        # Unique per read: the node closes the older connection of a reused DCP name, and
        # id() values repeat across the Python workers Spark forks from one daemon.
        name=f"changefeed:spark:{uuid.uuid4().hex}",
        rollback_to_snapshot=False,  # the mirror re-reads rolled-back keys from the node
    )
    snaps = {r.vbucket: (r.start.snap_start, r.start.snap_end) for r in todo}
    async with DcpClient(config) as client:
        await client.stream(sorted(ends), state, end_seqnos=request_ends)
        unfinished = set(ends)
        columns = _Columns()
        async for event in client.events():
            if isinstance(event, Changes):
                _append_changes(columns, event, ends, snaps, unfinished)
            elif isinstance(event, Snapshot):
                snaps[event.vbucket] = (event.snap_start, event.snap_end)
                if event.snap_start > ends[event.vbucket]:
                    unfinished.discard(event.vbucket)
            elif isinstance(event, Rollback):
                _on_rollback(columns, event, ranges, options)
                if event.seqno >= ends[event.vbucket]:
                    unfinished.discard(event.vbucket)
            elif isinstance(event, StreamEnded):
                unfinished.discard(event.vbucket)
            elif isinstance(event, StreamRefused):
                raise StreamFailedError(
                    f"vbucket {event.vbucket}: {Status.name_of(event.status)} {event.message}"
                )
            elif isinstance(event, Disconnected):
                pass  # the client reconnects and resumes from what we already took
            if len(columns) >= ROWS_PER_BATCH_MAX:
                yield columns.to_batch()
                columns = _Columns()
            if not unfinished:
                break  # closing the connection ends the streams still open
        if len(columns):
            yield columns.to_batch()


def _append_changes(
    out: _Columns,
    event: Changes,
    ends: dict[int, int],
    snaps: dict[int, tuple[int, int]],
    unfinished: set[int],
) -> None:
    cols = event.columns
    for i in range(len(cols)):
        vb = cols.vbucket[i]
        seqno = cols.seqno[i]
        if seqno >= ends[vb]:
            unfinished.discard(vb)
            if seqno > ends[vb]:
                continue  # past this micro-batch: the next one starts at ends[vb]
        cas = cols.cas[i]
        if cas > INT64_MAX:
            raise ValueError(f"vbucket {vb} seqno {seqno}: CAS {cas} does not fit a Spark long")
        snap_start, snap_end = snaps[vb]
        out.vbucket.append(vb)
        out.seqno.append(seqno)
        out.key.append(cols.key[i].decode("utf-8", "surrogateescape"))
        out.value.append(cols.value[i])
        out.op.append(OP_BY_OPCODE[cols.opcode[i]])
        out.cas.append(cas)
        expiry = cols.expiry[i]
        out.expiry.append(expiry - 2**32 if expiry >= 2**31 else expiry)
        flags = cols.flags[i]
        out.flags.append(flags - 2**32 if flags >= 2**31 else flags)  # u32 -> Spark int
        out.rev_seqno.append(cols.rev_seqno[i])
        out.snap_start.append(snap_start)
        out.snap_end.append(min(snap_end, ends[vb]))


def _on_rollback(
    out: _Columns, event: Rollback, ranges: list[VbRange], options: SourceOptions
) -> None:
    start = next(r.start for r in ranges if r.vbucket == event.vbucket)
    if event.seqno == 0 and start.seqno > 0 and options.fail_on_data_loss:
        raise DataLossError(
            f"vbucket {event.vbucket} must restart from seqno 0 (its history since seqno "
            f"{start.seqno} is gone or tombstones were purged); set failOnDataLoss=false to "
            "receive a rollback row instead and let the sink rebuild the vbucket"
        )
    out.vbucket.append(event.vbucket)
    out.seqno.append(event.seqno)
    out.key.append("")
    out.value.append(b"")
    out.op.append(OP_ROLLBACK)
    for name in ("cas", "expiry", "flags", "rev_seqno"):
        getattr(out, name).append(0)
    out.snap_start.append(event.seqno)
    out.snap_end.append(event.seqno)


def read_ranges_sync(options: SourceOptions, ranges: list[VbRange]) -> Iterator[pa.RecordBatch]:
    """Drive ``read_ranges`` on a private event loop, yielding batches as they are made."""
    loop = asyncio.new_event_loop()
    generator = read_ranges(options, ranges)
    try:
        while True:  # ends with StopAsyncIteration
            try:
                yield loop.run_until_complete(generator.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(generator.aclose())
        loop.close()
