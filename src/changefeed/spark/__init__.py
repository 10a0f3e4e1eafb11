"""The Spark side: the ``changefeed`` Python data source and the exactly-once mirror writer.

from changefeed.spark import register, MirrorWriter
register(spark)
df = spark.readStream.format("changefeed").option("cluster", "127.0.0.1:11210").load()
"""

from __future__ import annotations

from typing import Any

from changefeed.spark.mirror import MirrorWriter, read_mirror
from changefeed.spark.schema import ARROW_SCHEMA, SCHEMA_DDL
from changefeed.spark.source import ChangefeedDataSource


def register(spark: Any) -> None:
    """Register format ``changefeed`` on ``spark`` (the package must be installed on workers)."""
    spark.dataSource.register(ChangefeedDataSource)


__all__ = [
    "ARROW_SCHEMA",
    "SCHEMA_DDL",
    "ChangefeedDataSource",
    "MirrorWriter",
    "read_mirror",
    "register",
]
