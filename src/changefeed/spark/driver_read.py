"""A small micro-batch read from the nodes in the driver: the rows Spark's ``toArrow`` collects.

The mirror's driver path (``dist_mirror.py``) writes a small batch's groups in the driver. Its
rows came from ``toArrow``: a Spark job of one task (scheduling, a Python worker, the task's
DCP read, the Arrow transfer back), ~40 % of a small batch's time. Here the driver reads the
batch's offset range itself with the source's own reader (``source.batch_ranges``,
``reading.read_ranges_sync``, ``source.convert``: the code the source's task runs), one DCP
connection per node as a one-task batch does, and the rows are cast to the Arrow schema
``toArrow`` gives for the DataFrame's schema. Rows, their order within each vbucket, rollback
rows and failures (``failOnDataLoss``) are those of the task; the offsets are Spark's for the
batch (``batch_plan.py``), so what is committed with the batch id is the same.

A read that fails on the way (a node gone during a failover, a refused stream, a dropped
connection) falls back to Spark's job (``toArrow``, ``rows_in_driver``): nothing is committed
before the rows are in, and Spark's task reads the same offsets and is retried
(``spark.task.maxFailures``) where the driver's read is not. Data loss and bad options fail the
batch as the task would.

Not for collection-aware sources (those batches are split per collection before any writer
sees them) nor ``transport=shm`` (executors run on the node's host, the driver may not).
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa

from changefeed.protocol.errors import ProtocolError
from changefeed.spark.batch_plan import SourceBatch
from changefeed.spark.cluster import retriable
from changefeed.spark.options import OptionError, SourceOptions
from changefeed.spark.reading import DataLossError, StreamFailedError, read_ranges_sync
from changefeed.spark.source import batch_ranges, convert, document_reader

log = logging.getLogger("changefeed.mirror")


def readable(batch: SourceBatch) -> bool:
    """Whether the driver can read ``batch`` as the source's task would."""
    options = SourceOptions.parse(batch.options)
    return not options.collections_aware and options.transport == "tcp"


def read_batch(batch: SourceBatch, schema: Any, arrow_schema: pa.Schema) -> pa.Table:
    """The rows of ``batch``, as ``toArrow`` of a DataFrame of Spark schema ``schema`` gives
    them (``arrow_schema``: ``spark_arrow_schema`` of it).

    Raises:
        reading.DataLossError, reading.StreamFailedError: as the source's task would.
    """
    options = SourceOptions.parse(batch.options)
    documents = document_reader(options, schema)
    ranges = batch_ranges(batch.start, batch.end)
    parts = [convert(documents, rows) for rows in read_ranges_sync(options, ranges)]
    if not parts:
        return arrow_schema.empty_table()
    return pa.Table.from_batches(parts).cast(arrow_schema)


def transport_failure(error: BaseException) -> bool:
    """Whether the driver's read failed where Spark's task would be retried: a node unreachable,
    gone or slow, a refused stream, a connection closed mid-frame. Not data loss
    (``failOnDataLoss``), nor bad options: those fail the task's every attempt too."""
    if isinstance(error, DataLossError | OptionError):
        return False
    return isinstance(error, StreamFailedError | ProtocolError | EOFError) or retriable(error)


def rows_in_driver(batch_df: Any, batch: SourceBatch) -> tuple[pa.Table, bool]:
    """The rows of ``batch_df`` (the batch ``batch``) and whether the driver read them itself:
    read from the nodes, else, after a transport failure, collected by Spark's job (``toArrow``,
    whose task Spark retries; see the module docstring).

    Raises:
        reading.DataLossError, options.OptionError: as the source's task would.
    """
    try:
        rows = read_batch(batch, batch_df.schema, spark_arrow_schema(batch_df))
    except Exception as error:
        if not transport_failure(error):
            raise
        log.warning(
            "micro-batch %d: the driver's read failed (%s: %s); reading it with Spark's job",
            batch.batch_id, type(error).__name__, error,
        )  # fmt: skip
        return batch_df.toArrow(), False
    batch.count_rows(rows.num_rows)
    return rows, True


def spark_arrow_schema(batch_df: Any) -> pa.Schema:
    """The Arrow schema ``batch_df.toArrow()`` casts its rows to (pyspark's ``toArrow``)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    large = batch_df.sparkSession.conf.get("spark.sql.execution.arrow.useLargeVarTypes", "false")
    return to_arrow_schema(
        batch_df.schema,
        error_on_duplicated_field_names_in_struct=True,
        timezone="UTC",
        prefers_large_types=str(large).lower() == "true",
    )
