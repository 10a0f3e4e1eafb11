"""Which changefeed micro-batch a ``foreachBatch`` DataFrame is, from the running query's plan.

The mirror's driver path (``dist_mirror.py``) reads a small batch from the nodes itself
(``driver_read.py``) instead of running Spark's job for ``toArrow``. It may do so only when the
DataFrame holds exactly the source's rows of the batch: the query writes
``readStream.format("changefeed")`` straight into ``foreachBatch``, with no filter or projection
between, and the DataFrame is the one Spark handed over (a LogicalRDD over the RDD of the
batch's own execution), not one derived from it, even one checkpointed. Then the
batch's start and end offsets and the source's options are in the plan Spark runs the batch
with (``StreamExecution.lastExecution``: the write node over the source's
``StreamingDataSourceV2ScanRelation``, whose offsets are set for this batch, the first one's
start included), and the rows read from the nodes between them are the rows the source's task
would read: the same offsets, the same reader code, so exactly once is unchanged.

None of this is public API (Spark's plan classes through py4j); every failure to read it, and
every plan of another shape, gives ``None``, and the writer then runs Spark's job.

Spark counts a batch's input rows (``numInputRows`` in progress events, which ``changefeed
mirror`` prints) from the source scan's ``numOutputRows`` metric; a batch read in the driver
never runs that scan, so ``SourceBatch.count_rows`` adds the rows read to the metric, once per
batch: not when the metric already counts (another writer of the same batch read it first,
in the driver or through Spark's job).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Final

from changefeed.spark.offsets import Offsets, offsets_from_json
from changefeed.spark.running_query import running_query

log = logging.getLogger("changefeed.mirror")

SOURCE_NAME: Final = "changefeed"  # ChangefeedDataSource.name()


@dataclass(frozen=True)
class SourceBatch:
    """A micro-batch of the changefeed source: its options (as given to ``load``) and offsets.

    Attributes:
        scan: Spark's physical scan node of the batch (py4j), whose row metric Spark reports.
    """

    batch_id: int
    options: dict[str, str]
    start: Offsets
    end: Offsets
    scan: Any = None

    def count_rows(self, rows: int) -> None:
        """Report ``rows`` as the batch's input rows (Spark's ``numInputRows``), unless the
        batch's rows are counted already (see the module docstring)."""
        if self.scan is None:
            return
        try:
            metric = self.scan.metrics().get("numOutputRows")
            if metric.isDefined() and metric.get().isZero():
                metric.get().add(rows)
        except Exception as error:  # py4j and Spark internals: the count is only a metric
            log.debug("micro-batch %d: input rows not reported (%s)", self.batch_id, error)


def source_batch(batch_df: Any, batch_id: int) -> SourceBatch | None:
    """The changefeed batch ``batch_df`` holds unchanged, or None (see the module docstring)."""
    try:
        return _source_batch(batch_df, batch_id)
    except Exception as error:  # py4j and Spark internals: any failure means "not known"
        log.debug("micro-batch %d: not read from the plan (%s)", batch_id, error)
        return None


def _source_batch(batch_df: Any, batch_id: int) -> SourceBatch | None:
    query = running_query(batch_df)
    if query is None:
        return None
    execution = query.lastExecution()
    if execution is None or int(execution.currentBatchId()) != batch_id:
        return None
    write = execution.logical()
    if not _is(write, "WriteToMicroBatchDataSourceV1") or write.children().size() != 1:
        return None
    scan = write.child()
    if not _is(scan, "StreamingDataSourceV2ScanRelation"):
        return None
    table = scan.relation().table()
    if not _is(table, "PythonTable") or str(table.name()) != SOURCE_NAME:
        return None
    handed = batch_df._jdf.queryExecution().logical()
    if not _is(handed, "LogicalRDD") or _ids(handed.output()) != _ids(scan.output()):
        return None  # a DataFrame derived from the batch (a filter, another projection)
    # The same attributes are not enough: a derived frame checkpointed (``filter(...)
    # .localCheckpoint()``, ``checkpoint()``) is a new LogicalRDD over them. Spark builds the
    # handed frame's LogicalRDD on the RDD of the batch's own execution; any other is derived.
    if int(handed.rdd().id()) != int(execution.toRdd().id()):
        return None
    if not (scan.startOffset().isDefined() and scan.endOffset().isDefined()):
        return None
    start = offsets_from_json(json.loads(str(scan.startOffset().get().json())))
    end = offsets_from_json(json.loads(str(scan.endOffset().get().json())))
    # As JSON in one py4j call: iterating the Java map costs a call per entry (~30 ms a batch).
    mapper = batch_df.sparkSession.sparkContext._jvm.com.fasterxml.jackson.databind.ObjectMapper()
    given = json.loads(
        str(mapper.writeValueAsString(scan.relation().options().asCaseSensitiveMap()))
    )
    options = {str(k): str(v) for k, v in given.items()}
    return SourceBatch(batch_id, options, start, end, _physical_scan(execution))


def _physical_scan(execution: Any) -> Any:
    """The batch's one source scan in the physical plan (None if not exactly one)."""
    leaves = execution.executedPlan().collectLeaves()
    scans = [
        leaves.apply(i) for i in range(leaves.size()) if _is(leaves.apply(i), "MicroBatchScanExec")
    ]
    return scans[0] if len(scans) == 1 else None


def _is(node: Any, simple_name: str) -> bool:
    return str(node.getClass().getSimpleName()) == simple_name


def _ids(attributes: Any) -> str:
    """The attributes with their expression ids (``[vbucket#0, seqno#1L, ...]``), in one py4j
    call: per attribute, three calls cost ~20 ms a batch under load."""
    return str(attributes.toString())
