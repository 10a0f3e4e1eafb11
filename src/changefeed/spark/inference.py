"""The document schema of a source: given (option ``schema``) or inferred from a sample.

The sample: each vbucket's changes from ``high seqno - inferSchemaSamples`` to its high seqno,
read over DCP, reduced to each key's newest change, mutations only. Those are the newest
versions of the keys changed last, so the result depends on the store's state only (not on
what is in the node's memory or on disk), and it favours the documents' current shape.
The fields are inferred as Spark's JSON reader does (``documents.infer_fields``).

Runs where Spark asks a data source for its schema (the driver's Python worker) and in
``changefeed mirror``, before a query starts: a query's schema is fixed while it runs.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.types import StructType

from changefeed.consumer.change_rows import OP_MUTATION
from changefeed.spark.documents import (
    CORRUPT_COLUMN,
    METADATA_DDL,
    check_document_fields,
    ddl_of_fields,
    infer_fields,
    quote,
)
from changefeed.spark.node_state import fetch_latest_sync
from changefeed.spark.offsets import VbOffset
from changefeed.spark.options import OptionError, SourceOptions
from changefeed.spark.reading import VbRange, read_ranges_sync
from changefeed.spark.schema import SCHEMA_DDL


def source_ddl(options: SourceOptions) -> str:
    """The DDL of the rows the source gives with ``options``.

    Raises:
        OptionError: neither ``schema`` nor ``inferSchema=true`` with ``format=json``, or a
            schema that is not DDL or StructType JSON.
        DocumentSchemaError: a document field named like a metadata column.
    """
    if not options.documents_as_json:
        return SCHEMA_DDL
    if options.schema:
        fields = user_fields_ddl(options.schema, options.corrupt_column)
    elif options.infer_schema:
        inferred = infer_document_fields(options)
        check_document_fields(inferred.fieldNames(), options.corrupt_column)
        fields = ddl_of_fields(inferred)
    else:
        raise OptionError("format json needs option schema, or inferSchema=true")
    parts = [METADATA_DDL, fields]
    named_corrupt = options.corrupt_column.lower() in fields.lower()
    if options.mode == "PERMISSIVE" and not named_corrupt:
        parts.append(f"{quote(options.corrupt_column)} string")
    return ", ".join(p for p in parts if p)


def user_fields_ddl(schema: str, corrupt_column: str = CORRUPT_COLUMN) -> str:
    """The DDL of the document fields of option ``schema`` (DDL, or StructType JSON).

    A DDL string is passed on as it is (Spark parses it; the reader checks the field names).
    """
    if not schema.startswith("{"):
        return schema
    try:
        struct = StructType.fromJson(json.loads(schema))
    except (ValueError, KeyError, TypeError) as error:
        raise OptionError(f"option schema is neither DDL nor StructType JSON: {error}") from None
    check_document_fields(struct.fieldNames(), corrupt_column)
    return ddl_of_fields(struct)


def sample_values(options: SourceOptions) -> list[bytes]:
    """The values of the sample (see the module docstring), in (vbucket, key) order."""
    latest, _ = fetch_latest_sync(options)
    ranges = []
    for vb, offset in sorted(latest.items()):
        start = max(0, offset.seqno - options.infer_samples)
        begin = VbOffset(offset.vb_uuid, start, start, start) if start else VbOffset()
        ranges.append(VbRange(vb, begin, offset.seqno, offset.vb_uuid))
    batches = list(read_ranges_sync(options, ranges))
    if not batches:
        return []
    changes = pa.Table.from_batches(batches, batches[0].schema)  # + names, collection-aware
    indexed = changes.append_column("_row", pa.array(range(changes.num_rows), pa.int64()))
    newest = indexed.group_by(["vbucket", "key"]).aggregate([("_row", "max")])
    picked = changes.take(newest.column("_row_max"))
    picked = picked.filter(pc.equal(picked.column("op"), OP_MUTATION))
    picked = picked.sort_by([("vbucket", "ascending"), ("key", "ascending")])
    values: list[bytes] = picked.column("value").to_pylist()
    return values


def infer_document_fields(options: SourceOptions) -> StructType:
    """The document fields inferred from the sample."""
    return infer_fields(sample_values(options))
