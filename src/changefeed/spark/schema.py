"""The change-row schema as Spark sees it (ARCHITECTURE.md, spark/).

The schema itself is declared once, in ``consumer/change_rows.py``, which the ipc/ fan-out
shares; here it gets its Spark name (``ARROW_SCHEMA``) and its DDL string, derived from it so the
two cannot drift. Arrow batches returned to Spark must match ``to_arrow_schema`` of that DDL
exactly: ``string``/``binary`` (not the large variants), ``int32`` for ``int``
(spark-python-datasource.md, gotcha 6); tests/unit/consumer/test_change_rows.py checks both ways.
"""

from __future__ import annotations

from typing import Final

import pyarrow as pa

from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA

ARROW_SCHEMA: Final = CHANGE_ROW_SCHEMA

# Spark DDL type names of the Arrow types the change-row schema may use (Spark's own mapping,
# pyspark.sql.pandas.types.to_arrow_type, read backwards). Any other type is refused at import.
_SPARK_TYPE_BY_ARROW: Final = {
    pa.int32(): "int",
    pa.int64(): "long",
    pa.string(): "string",
    pa.binary(): "binary",
    pa.bool_(): "boolean",
}


def ddl_of(schema: pa.Schema) -> str:
    """The Spark DDL string (``"name type, ..."``) of an Arrow schema of the types above.

    Raises:
        ValueError: a field's type has no entry in the mapping (e.g. a ``large_`` type).
    """
    parts = []
    for arrow_field in schema:
        spark_type = _SPARK_TYPE_BY_ARROW.get(arrow_field.type)
        if spark_type is None:
            raise ValueError(
                f"field {arrow_field.name}: Arrow {arrow_field.type} has no Spark type"
            )
        parts.append(f"{arrow_field.name} {spark_type}")
    return ", ".join(parts)


SCHEMA_DDL: Final = ddl_of(ARROW_SCHEMA)
assert SCHEMA_DDL.count(",") == len(ARROW_SCHEMA) - 1, SCHEMA_DDL
