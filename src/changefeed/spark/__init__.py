"""The Spark side: the ``changefeed`` Python data source and the exactly-once mirror writer.

from changefeed.spark import register, MirrorWriter
register(spark)
df = spark.readStream.format("changefeed").option("cluster", "127.0.0.1:11210").load()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from changefeed.spark.schema import ARROW_SCHEMA, SCHEMA_DDL
from changefeed.spark.source import ChangefeedDataSource

if TYPE_CHECKING:
    from changefeed.spark.mirror import MirrorWriter, read_mirror


def __getattr__(name: str) -> Any:
    # The mirror writer runs in the driver only; Spark's Python workers import this package to
    # unpickle the source, and the writer's imports (deltalake, pyarrow.dataset) would cost each
    # fresh worker ~0.3 s.
    if name in ("MirrorWriter", "read_mirror"):
        from changefeed.spark import mirror

        return getattr(mirror, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
