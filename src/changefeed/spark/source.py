"""The ``changefeed`` Spark data source: ``spark.readStream.format("changefeed")`` for change
rows and ``spark.read.format("changefeed")`` for a consistent snapshot of the bucket.

Planning (``initialOffset``, ``latestOffset``, ``partitions``) runs in Spark's per-query runner
process and asks each vbucket's active node for its high seqno and vb_uuid (``node_state.py``;
option ``cluster`` lists seed nodes, any reachable one gives the map); ``read`` runs on
executors and streams its vbucket group over DCP, each vbucket from its active (``reading.py``).
A failover moves the streams and the planning with the map, so a query keeps running through it.
Rows travel as Arrow record batches.

With ``format=json`` (the default) ``read`` turns each batch's documents into the schema's typed
columns (``documents.py``); the schema comes from option ``schema`` or is inferred when Spark
asks for it (``inference.py``). ``reportLatestOffset`` carries the node's high seqnos and the
lag behind them (``lag.py``), so a ``StreamingQueryListener`` sees it in each progress event
(``sources[0].latestOffset``).

Options ``collections`` / ``scope`` make the source collection-aware: rows end with ``scope``
and ``collection`` (names) and ``collection_id`` (which collection: names are reused), keys are
the documents' own, and the node streams the chosen collections only (``collection_rows.py``).
The planner reads the manifest for each batch and hands the names it has seen to the reads, so
rows of a collection dropped since still carry its name.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from changefeed import limits
from changefeed.consumer.change_rows import OP_MUTATION
from changefeed.spark.collection_rows import (
    NAME_COLUMNS,
    NAMES_DDL,
    CollectionNames,
    split_names,
    with_names,
)
from changefeed.spark.documents import DocumentReader, DocumentSchemaError
from changefeed.spark.inference import source_ddl
from changefeed.spark.key_index import key_hashes
from changefeed.spark.lag import Lag, LagTracker
from changefeed.spark.node_state import LatestPoller, fetch_latest_sync
from changefeed.spark.offsets import (
    Offsets,
    VbOffset,
    limit_offsets,
    offsets_from_json,
    offsets_to_json,
)
from changefeed.spark.options import OptionError, SourceOptions
from changefeed.spark.reading import (
    Names,
    VbRange,
    fetch_manifest_sync,
    read_chunks_sync,
    read_ranges_sync,
)


class VbucketGroup(InputPartition):
    """One Spark partition: a few vbuckets, each from a start offset to an end seqno (and,
    collection-aware, the collection names the planner knows)."""

    def __init__(self, ranges: list[VbRange], names: Names | None = None) -> None:
        super().__init__(ranges)
        self.ranges = ranges
        self.names = dict(names or {})


def group_ranges(
    ranges: list[VbRange], partitions: int, names: Names | None = None
) -> list[VbucketGroup]:
    """Deal vbuckets round-robin into at most ``partitions`` groups (balanced by count)."""
    live = [r for r in ranges if r.needs_reading]
    groups: list[list[VbRange]] = [[] for _ in range(min(partitions, len(live)))]
    for i, vb_range in enumerate(live):
        groups[i % len(groups)].append(vb_range)
    return [VbucketGroup(g, names) for g in groups if g]


def batch_ranges(begin: Offsets, finish: Offsets) -> list[VbRange]:
    """Each vbucket's range of a micro-batch from ``begin`` to ``finish`` (its offsets): what
    ``partitions`` deals out, and what the mirror's driver path reads itself
    (``driver_read.py``)."""
    return [
        VbRange(vb, begin.get(vb, VbOffset()), o.seqno, o.vb_uuid)
        for vb, o in sorted(finish.items())
    ]


def planned_names(options: SourceOptions, known: CollectionNames) -> Names | None:
    """The collection names for a batch's reads: ``known`` and the manifest now (None: the
    source is not collection-aware)."""
    if not options.collections_aware:
        return None
    known.learn_manifest(fetch_manifest_sync(options))
    return dict(known.items())


def document_reader(options: SourceOptions, schema: StructType) -> DocumentReader | None:
    """What turns change rows into rows of ``schema`` (None for ``format=binary``)."""
    if not options.documents_as_json:
        return None
    from pyspark.sql.pandas.types import to_arrow_schema

    output = to_arrow_schema(schema, timezone="UTC")  # as Spark checks what read() returns
    if options.collections_aware:  # the names are appended after the parse (``convert``)
        output = pa.schema([f for f in output if f.name not in NAME_COLUMNS])
    return DocumentReader(output, options.mode, options.corrupt_column)


def convert(documents: DocumentReader | None, batch: pa.RecordBatch) -> pa.RecordBatch:
    """A read's batch as the source's rows: documents parsed (``format=json``), and a
    collection-aware batch's names kept last."""
    if documents is None:
        return batch
    if NAME_COLUMNS[0] not in batch.schema.names:
        return documents.convert(batch)
    changes, names = split_names(batch)
    return with_names(changes, names, documents.convert(changes))


def _rows(
    options: SourceOptions, documents: DocumentReader | None, partition: VbucketGroup
) -> Iterator[pa.RecordBatch]:
    for batch in read_ranges_sync(options, partition.ranges, partition.names):
        yield convert(documents, batch)


# While nothing is new, ``latestOffset`` waits this long for a change before answering "no
# data" (Spark then asks again ~10 ms later): a query with a zero trigger interval fires as
# soon as a change is written, without ~40 idle planning rounds a second (~30% of a core).
IDLE_WAIT_S: Final = 0.25
IDLE_PROBE_S: Final = 0.02  # how often the nodes' high seqnos are asked meanwhile
# A micro-batch of at most this many seqnos is read by one task: one DCP connection per node
# and one Python worker instead of ``partitions`` of each, for what takes a connection ~50 ms
# to stream (a steady stream's small batches: bare read 587/751 -> 387/497 ms per batch, e2e
# p50 1.21/1.49 -> 0.94/1.02 s at 2,000 changes/s, load 8-10, two runs each).
ONE_TASK_SEQNOS_MAX: Final = 20_000


class ChangefeedStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: SourceOptions, documents: DocumentReader | None = None) -> None:
        self.options = options
        self.documents = documents
        self._target: Offsets | None = None
        self._latest: Offsets = {}
        self._lag: Lag | None = None
        self._lag_tracker = LagTracker(options)
        self._after = 0  # items behind the end of the batch being planned
        self._names = CollectionNames()  # every collection seen by this query's planning
        self._poller: LatestPoller | None = None  # made in the runner (a reader is pickled)

    def _ask_latest(self) -> Offsets:
        if self._poller is None:
            self._poller = LatestPoller(self.options)
        return self._poller.fetch()[0]

    def initialOffset(self) -> dict[str, Any]:
        latest = self._ask_latest()
        if self.options.starting_offsets == "latest":
            return offsets_to_json(latest)
        given = self.options.starting_json()
        if given is None:  # earliest
            return offsets_to_json({vb: VbOffset() for vb in latest})
        try:
            offsets = offsets_from_json(given)
        except ValueError as error:
            raise OptionError(f"option startingOffsets: {error}") from None
        return offsets_to_json({vb: offsets.get(vb, VbOffset()) for vb in latest})

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_offsets_per_trigger:
            return ReadMaxRows(self.options.max_offsets_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._ask_latest()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        begin = offsets_from_json(start)
        now = self._ask_latest()
        if self._target is None and _same(now, begin):
            assert self._poller is not None
            if self._poller.wait_for_change(begin, IDLE_WAIT_S, IDLE_PROBE_S):
                now = self._ask_latest()
        # ``start`` is what the sink committed: the lag is the node's high seqnos minus it.
        self._latest = now
        self._lag = self._lag_tracker.update(begin, now)
        latest = self._target if self._target is not None else now
        if isinstance(limit, ReadMaxRows) and limit.max_rows > 0:
            latest = limit_offsets(begin, latest, limit.max_rows)
        self._after = sum(max(0, o.seqno - latest.get(vb, o).seqno) for vb, o in now.items())
        return offsets_to_json(latest)

    def reportLatestOffset(self) -> dict[str, Any]:
        """The node's high seqnos and the lag behind them when this batch was planned (in each
        progress event as ``sources[0].latestOffset``): ``lag`` before the batch (what the
        sink had committed), and ``lag.afterBatch``, the items still behind once it commits.
        Spark sends no progress event while a query is idle (``onQueryIdle`` instead), so a
        listener sees the catch-up in the last batch's ``afterBatch``."""
        lag = self._lag.to_json() if self._lag is not None else None
        if lag is not None:
            lag["afterBatch"] = {"items": self._after}
        return {
            "highSeqnos": {str(vb): o.seqno for vb, o in sorted(self._latest.items())},
            "lag": lag,
        }

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        ranges = batch_ranges(offsets_from_json(start), offsets_from_json(end))
        names = planned_names(self.options, self._names)
        span = sum(max(0, r.end_seqno - r.start.seqno) for r in ranges)
        tasks = 1 if span <= ONE_TASK_SEQNOS_MAX else self.options.partitions
        return group_ranges(ranges, tasks, names)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, VbucketGroup), partition
        yield from _rows(self.options, self.documents, partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to release: the node keeps no per-query state between micro-batches."""

    def stop(self) -> None:
        """The query stopped: close the planning connections."""
        if self._poller is not None:
            self._poller.close()
            self._poller = None


def _same(now: Offsets, begin: Offsets) -> bool:
    """Nothing to read between ``begin`` and ``now``: no new seqno, no new history branch."""
    return all(
        o.seqno <= begin.get(vb, VbOffset()).seqno
        and o.vb_uuid == begin.get(vb, VbOffset()).vb_uuid
        for vb, o in now.items()
    )


class ChangefeedBatchReader(DataSourceReader):
    """A consistent snapshot: each vbucket up to its high seqno taken at planning, one row per
    live key (its newest version), deletions left out."""

    def __init__(self, options: SourceOptions, documents: DocumentReader | None = None) -> None:
        self.options = options
        self.documents = documents

    def partitions(self) -> Sequence[InputPartition]:
        latest, _ = fetch_latest_sync(self.options)
        ranges = [VbRange(vb, VbOffset(), o.seqno, o.vb_uuid) for vb, o in sorted(latest.items())]
        names = planned_names(self.options, CollectionNames())
        return group_ranges(ranges, self.options.partitions, names)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Each finished vbucket's live rows, handed on while the partition's other vbuckets
        still stream: the node backfills a few vbuckets of a connection at a time, so Spark
        (and the parse) work on the first ones while the node reads the next."""
        assert isinstance(partition, VbucketGroup), partition
        pending = PendingRows()
        for chunk in read_chunks_sync(self.options, partition.ranges, partition.names):
            pending.add(chunk.batch)
            for table in pending.release(chunk.finished):
                yield from self._convert(table)
        for table in pending.release(None):
            yield from self._convert(table)

    def _convert(self, changes: pa.Table) -> Iterator[pa.RecordBatch]:
        """The live rows of ``changes`` in batches of at most about ``ROWS_PER_BATCH_MAX``
        (vbuckets that finish together, e.g. all at the end, come as one large table)."""
        live = latest_live_rows(changes)
        parts = -(-live.num_rows // limits.ROWS_PER_BATCH_MAX)
        size = -(-live.num_rows // max(1, parts))  # even parts
        for start in range(0, live.num_rows, max(1, size)):
            for batch in live.slice(start, size).combine_chunks().to_batches():
                yield convert(self.documents, batch)


RELEASE_ROWS_MIN: Final = limits.ROWS_PER_BATCH_MAX  # rows of finished vbuckets worth a release


class PendingRows:
    """A snapshot read's change rows held until their vbucket's stream is complete: only then
    is a key's newest version known (a vbucket's rows hold all of its keys' versions).

    ``release`` hands on the rows of finished vbuckets once there are ``RELEASE_ROWS_MIN`` of
    them (fewer rows per table would cost a parse call and an Arrow batch each), and keeps the
    others; ``release(None)`` hands on everything (every stream has ended)."""

    def __init__(self) -> None:
        self._batches: list[pa.RecordBatch] = []
        self._rows = 0
        self._released: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return self._rows

    def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows:
            self._batches.append(batch)
            self._rows += batch.num_rows

    def release(self, finished: frozenset[int] | None) -> list[pa.Table]:
        """The held rows of the ``finished`` vbuckets (None: of every vbucket), as one table,
        when worth it; else nothing."""
        if not self._rows:
            return []
        table = pa.Table.from_batches(self._batches, self._batches[0].schema)
        if finished is None:
            self._batches, self._rows = [], 0
            return [table]
        if finished == self._released or self._rows < RELEASE_ROWS_MIN:
            return []  # nothing newly finished, or too few rows held to be worth a table
        done = pc.is_in(table.column("vbucket"), pa.array(sorted(finished), pa.int32()))
        count = pc.sum(done).as_py() or 0
        if count < RELEASE_ROWS_MIN:
            return []
        self._released = finished
        if count == table.num_rows:
            self._batches, self._rows = [], 0
            return [table]
        rest = table.filter(pc.invert(done)).combine_chunks()
        self._batches, self._rows = rest.to_batches(), rest.num_rows
        return [table.filter(done)]


def latest_live_rows(table: pa.Table) -> pa.Table:
    """Keep each key's last row (its newest: a key has one vbucket, and a vbucket's rows come
    in seqno order, as the wire and ``PendingRows`` keep them), then drop keys whose newest op
    is not a mutation. (A snapshot read from seqno 0 never contains rollback rows.)

    Rows are copied only when some are dropped: a backfill from disk holds each key once, and
    holds no deletions unless tombstones are still kept. Whether a key repeats is first asked
    of 64-bit key hashes (distinct hashes mean distinct keys; a sort, ~5x cheaper than the
    group-by), and the group-by runs only when two hashes are equal."""
    if table.num_rows == 0:
        return table
    picked = table
    if _may_repeat(table.column("key")):
        rows = pa.array(np.arange(table.num_rows, dtype=np.int64))
        # A key has one vbucket; in a collection-aware read, one per collection.
        names = [n for n in (*NAME_COLUMNS, "key") if n in table.column_names]
        keyed = pa.table({**{n: table.column(n) for n in names}, "_row": rows})
        newest = keyed.group_by(names).aggregate([("_row", "max")])
        if newest.num_rows != table.num_rows:
            picked = table.take(newest.column("_row_max"))
    live = pc.equal(picked.column("op"), OP_MUTATION)
    return picked if pc.all(live).as_py() else picked.filter(live)


def _may_repeat(keys: pa.ChunkedArray) -> bool:
    """False only if no two keys are equal (their hashes all differ)."""
    hashes = np.sort(key_hashes(keys))
    return bool(np.any(hashes[1:] == hashes[:-1]))


def top_level_names(ddl: str) -> list[str]:
    """The field names of a DDL string's top level (``a int, `b c` struct<x:int>``: a, b c),
    without Spark (which a data source's schema call may not have)."""
    names, depth, start, quoted = [], 0, 0, False
    for at, char in enumerate(ddl + ","):
        if char == "`":
            quoted = not quoted
        elif quoted:
            continue
        elif char in "<(":
            depth += 1
        elif char in ">)":
            depth -= 1
        elif char == "," and depth == 0:
            part = ddl[start:at].strip()
            start = at + 1
            if part.startswith("`"):
                names.append(part[1 : part.index("`", 1)])
            elif part:
                names.append(part.split()[0].split(":")[0])
    return names


class ChangefeedDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "changefeed"

    def schema(self) -> str:
        """Change rows (``format=binary``), or metadata columns and the documents' fields;
        collection-aware, then ``scope``, ``collection`` and ``collection_id``."""
        options = SourceOptions.parse(dict(self.options))
        ddl = source_ddl(options)
        if not options.collections_aware:
            return ddl
        clash = [n for n in top_level_names(ddl) if n.lower() in NAME_COLUMNS]
        if clash:
            raise DocumentSchemaError(
                f"document field {clash[0]!r} has the name of a column of a collection-aware "
                "read (scope, collection, collection_id); give a schema without it, or read "
                "format=binary"
            )
        return f"{ddl}, {NAMES_DDL}"

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        options = SourceOptions.parse(dict(self.options))
        return ChangefeedStreamReader(options, document_reader(options, schema))

    def reader(self, schema: StructType) -> DataSourceReader:
        options = SourceOptions.parse(dict(self.options))
        return ChangefeedBatchReader(options, document_reader(options, schema))
