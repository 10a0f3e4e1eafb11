"""The streaming query running a ``foreachBatch`` DataFrame's batch, from Spark's driver.

Spark hands ``foreachBatch`` a DataFrame without its query; the query's id is a local property
of the thread running the batch (``sql.streaming.queryId``), and the session's query manager
gives the query. The mirror writer reads what Spark planned for the batch there (its offsets:
``batch_size.py``, its plan: ``batch_plan.py``). None of it is public API (Spark's
``StreamExecution`` through py4j): callers treat every failure as "not known".
"""

from __future__ import annotations

from typing import Any, Final

QUERY_ID_PROPERTY: Final = "sql.streaming.queryId"


def running_query(batch_df: Any) -> Any:
    """The JVM ``StreamExecution`` running ``batch_df``'s batch in this thread, or None (not a
    stream's batch, or a query of another session). May raise py4j errors."""
    from pyspark.sql import SparkSession

    query_id = batch_df.sparkSession.sparkContext.getLocalProperty(QUERY_ID_PROPERTY)
    session = SparkSession.getActiveSession()
    if not query_id or session is None:
        return None
    query = session.streams.get(query_id)
    if query is None:
        return None
    return query._jsq.streamingQuery()
