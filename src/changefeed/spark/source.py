"""The ``changefeed`` Spark data source: ``spark.readStream.format("changefeed")`` for change
rows and ``spark.read.format("changefeed")`` for a consistent snapshot of the bucket.

Planning (``initialOffset``, ``latestOffset``, ``partitions``) runs in Spark's per-query runner
process and asks the node for high seqnos and vb_uuids; ``read`` runs on executors and streams
its vbucket group over DCP (``reading.py``). Rows travel as Arrow record batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

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

from changefeed.consumer.change_rows import OP_MUTATION
from changefeed.spark.node_state import fetch_latest_sync
from changefeed.spark.offsets import (
    Offsets,
    VbOffset,
    limit_offsets,
    offsets_from_json,
    offsets_to_json,
)
from changefeed.spark.options import OptionError, SourceOptions
from changefeed.spark.reading import VbRange, read_ranges_sync
from changefeed.spark.schema import ARROW_SCHEMA, SCHEMA_DDL


class VbucketGroup(InputPartition):
    """One Spark partition: a few vbuckets, each from a start offset to an end seqno."""

    def __init__(self, ranges: list[VbRange]) -> None:
        super().__init__(ranges)
        self.ranges = ranges


def group_ranges(ranges: list[VbRange], partitions: int) -> list[VbucketGroup]:
    """Deal vbuckets round-robin into at most ``partitions`` groups (balanced by count)."""
    live = [r for r in ranges if r.needs_reading]
    groups: list[list[VbRange]] = [[] for _ in range(min(partitions, len(live)))]
    for i, vb_range in enumerate(live):
        groups[i % len(groups)].append(vb_range)
    return [VbucketGroup(g) for g in groups if g]


class ChangefeedStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._target: Offsets | None = None

    def initialOffset(self) -> dict[str, Any]:
        latest, _ = fetch_latest_sync(self.options)
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
        self._target, _ = fetch_latest_sync(self.options)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        begin = offsets_from_json(start)
        latest = self._target if self._target is not None else fetch_latest_sync(self.options)[0]
        if isinstance(limit, ReadMaxRows) and limit.max_rows > 0:
            latest = limit_offsets(begin, latest, limit.max_rows)
        return offsets_to_json(latest)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        begin = offsets_from_json(start)
        finish = offsets_from_json(end)
        ranges = [
            VbRange(vb, begin.get(vb, VbOffset()), o.seqno, o.vb_uuid)
            for vb, o in sorted(finish.items())
        ]
        return group_ranges(ranges, self.options.partitions)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, VbucketGroup), partition
        yield from read_ranges_sync(self.options, partition.ranges)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to release: the node keeps no per-query state between micro-batches."""


class ChangefeedBatchReader(DataSourceReader):
    """A consistent snapshot: each vbucket up to its high seqno taken at planning, one row per
    live key (its newest version), deletions left out."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        latest, _ = fetch_latest_sync(self.options)
        ranges = [VbRange(vb, VbOffset(), o.seqno, o.vb_uuid) for vb, o in sorted(latest.items())]
        return group_ranges(ranges, self.options.partitions)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, VbucketGroup), partition
        batches = list(read_ranges_sync(self.options, partition.ranges))
        if not batches:
            return
        yield from latest_live_rows(pa.Table.from_batches(batches, ARROW_SCHEMA)).to_batches()


def latest_live_rows(table: pa.Table) -> pa.Table:
    """Keep each key's row with the highest seqno, then drop keys whose newest op is not a
    mutation. (A snapshot read from seqno 0 never contains rollback rows.)"""
    if table.num_rows == 0:
        return table
    indexed = table.append_column("_row", pa.array(range(table.num_rows), pa.int64()))
    newest = indexed.group_by(["vbucket", "key"]).aggregate([("_row", "max")])
    rows = newest.column("_row_max")
    picked = indexed.take(rows).drop_columns(["_row"])
    return picked.filter(pc.equal(picked.column("op"), OP_MUTATION))


class ChangefeedDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "changefeed"

    def schema(self) -> str:
        return SCHEMA_DDL

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return ChangefeedStreamReader(SourceOptions.parse(dict(self.options)))

    def reader(self, schema: StructType) -> DataSourceReader:
        return ChangefeedBatchReader(SourceOptions.parse(dict(self.options)))
