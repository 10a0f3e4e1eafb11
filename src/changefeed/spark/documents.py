"""Documents as typed columns: JSON values parsed into Arrow columns of a Spark schema.

A change row carries its document as ``value`` bytes (``consumer/change_rows.py``). With
``format=json`` (the source's default) the reader replaces ``value`` by the document's fields,
typed by a schema the user gives (``schema``) or one inferred from a sample (``infer_fields``),
and keeps the metadata columns (``METADATA_COLUMNS``).

Parsing (``parse_values``) is vectorised: the values that look like one JSON object (first byte
``{``, last byte ``}``) are joined with ``\\n`` and parsed by pyarrow's JSON reader in one call
against the schema. That call is trusted to have kept documents apart only when it returns
exactly one row per document. Where a document ends (on ``}``) the parser is inside a string
(then the raw ``\\n`` is an error), inside a container right after a value (then the next
document's ``{`` without a comma is an error), or at the top level: so each document's ``{``
opens a new top-level object, no document gives zero rows, and equal counts mean row i is
document i (``test_documents.py`` has documents built to break this). When the call
fails (a malformed document, a field of another type than the schema's), the run is split in
halves until the failing documents are found; runs of at most ``SLOW_RUN_MAX`` failing
documents, and the values that do not look like one object, take the slow path: ``json.loads``
per document, then the value is fitted to the schema as Spark's JSON reader does (any JSON value
becomes its text in a ``string`` field, integers become doubles in a ``double`` field), dumped
again and parsed with the rest. A document that still fails is malformed.

Malformed documents follow Spark's JSON reader modes:

- ``PERMISSIVE``: the row stays, its fields null, its raw text in the corrupt-record column
  (``_corrupt_record`` unless ``columnNameOfCorruptRecord`` says otherwise);
- ``DROPMALFORMED``: the change row is dropped (a mirror then keeps the key's previous version);
- ``FAILFAST``: ``MalformedDocumentError`` naming the change and what is wrong.

A field of the wrong type makes the whole document malformed (Spark 3 keeps the fields that did
parse; here they are null). Deletions, expirations and rollbacks have no document: their fields
are null and they are never malformed.

Inference (``infer_fields``) follows Spark's JSON schema inference: objects become structs with
fields sorted by name, integers ``bigint``, other numbers ``double``, an integer field that also
holds doubles ``double``, arrays the merge of their elements, a field with conflicting types
``string``, a field that is always null ``string``. It is deterministic: the result depends on
the set of documents only.

Not here: which documents to sample (``source.py``), Delta schema evolution (``mirror.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DoubleType,
    LongType,
    NullType,
    StringType,
    StructField,
    StructType,
)

from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA, OP_MUTATION
from changefeed.spark.schema import ddl_of

FORMAT_JSON: Final = "json"
FORMAT_BINARY: Final = "binary"
FORMATS: Final = (FORMAT_JSON, FORMAT_BINARY)
MODES: Final = ("PERMISSIVE", "DROPMALFORMED", "FAILFAST")
CORRUPT_COLUMN: Final = "_corrupt_record"
# Every change-row column but the document: these stay as they are in both formats.
METADATA_COLUMNS: Final = tuple(name for name in CHANGE_ROW_SCHEMA.names if name != "value")
METADATA_SCHEMA: Final = pa.schema([CHANGE_ROW_SCHEMA.field(name) for name in METADATA_COLUMNS])
METADATA_DDL: Final = ddl_of(METADATA_SCHEMA)
RESERVED_COLUMNS: Final = ("batch_id",)  # the changelog table's (mirror.py)

SLOW_RUN_MAX: Final = 64  # failing runs this short go to json.loads instead of being split
_BLOCK_BYTES_MIN: Final = 1 << 20  # pyarrow's JSON reader block size, at least
_OPEN, _CLOSE, _NEWLINE = ord("{"), ord("}"), b"\n"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class MalformedDocumentError(ValueError):
    """A document is not a JSON object of the schema (mode FAILFAST); the message names it."""


class DocumentSchemaError(ValueError):
    """A document schema the reader cannot use (a field named like a metadata column, a type
    JSON documents cannot be parsed into); the message names the field."""


# -- schemas -----------------------------------------------------------------------------------


def quote(name: str) -> str:
    """A field name as Spark DDL writes it (backticks, doubled inside)."""
    return "`" + name.replace("`", "``") + "`"


def ddl_of_fields(fields: StructType) -> str:
    """The DDL of a struct's fields (``"`a` bigint, `b` struct<`c`:string>"``)."""
    return ", ".join(f"{quote(f.name)} {_ddl_type(f.dataType)}" for f in fields.fields)


def _ddl_type(data_type: DataType) -> str:
    if isinstance(data_type, StructType):
        inner = ",".join(f"{quote(f.name)}:{_ddl_type(f.dataType)}" for f in data_type.fields)
        return f"struct<{inner}>"
    if isinstance(data_type, ArrayType):
        return f"array<{_ddl_type(data_type.elementType)}>"
    return str(data_type.simpleString())


def check_document_fields(names: Iterable[str], corrupt_column: str) -> None:
    """Raise DocumentSchemaError for a document field that would hide a metadata column (Spark
    resolves column names case-insensitively)."""
    taken = {name.lower() for name in (*METADATA_COLUMNS, corrupt_column, *RESERVED_COLUMNS)}
    for name in names:
        if name.lower() in taken:
            raise DocumentSchemaError(
                f"document field {name!r} has the name of a metadata column "
                f"({', '.join((*METADATA_COLUMNS, *RESERVED_COLUMNS))}, {corrupt_column}); "
                "give a schema without it "
                "(option schema), or read the documents as bytes (format=binary)"
            )


def document_schema(output: pa.Schema, corrupt_column: str) -> pa.Schema:
    """The document fields of an output schema: every field but metadata and corrupt record."""
    return pa.schema(
        [f for f in output if f.name not in METADATA_COLUMNS and f.name != corrupt_column]
    )


def _parse_type(arrow_type: pa.DataType, path: str) -> pa.DataType:
    """The type pyarrow's JSON reader is asked for (dates come as strings, then a cast).

    Raises:
        DocumentSchemaError: a type JSON documents cannot be parsed into.
    """
    if pa.types.is_struct(arrow_type):
        return pa.struct([f.with_type(_parse_type(f.type, f"{path}.{f.name}")) for f in arrow_type])
    if pa.types.is_list(arrow_type):
        item = arrow_type.value_field
        return pa.list_(item.with_type(_parse_type(item.type, f"{path}[]")))
    if pa.types.is_date32(arrow_type):
        return pa.string()
    supported = (
        pa.types.is_boolean(arrow_type)
        or pa.types.is_integer(arrow_type)
        or pa.types.is_floating(arrow_type)
        or pa.types.is_decimal(arrow_type)
        or pa.types.is_string(arrow_type)
        or pa.types.is_timestamp(arrow_type)
    )
    if not supported:
        raise DocumentSchemaError(
            f"document field {path!r}: type {arrow_type} cannot be read from JSON here "
            "(supported: boolean, integers, float, double, decimal, string, date, timestamp, "
            "struct, array); declare it as string"
        )
    return arrow_type


# -- parsing -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Parsed:
    """Documents parsed into ``table`` (one row per value, null where malformed)."""

    table: pa.Table
    malformed: npt.NDArray[np.bool_]  # per value
    reasons: dict[int, str]  # value index -> why it is malformed


def parse_values(values: pa.Array, schema: pa.Schema) -> Parsed:
    """Parse each value (``binary``, no nulls) as one JSON object of ``schema``.

    Fields of a document missing from ``schema`` are ignored; fields of ``schema`` missing from
    a document are null.
    """
    count = len(values)
    _parse_schema(schema)  # refuses types JSON cannot be read into
    malformed = np.zeros(count, np.bool_)
    reasons: dict[int, str] = {}
    pieces: list[tuple[npt.NDArray[np.int64], pa.Table]] = []
    slow: list[int] = []
    if count:
        fast = _looks_like_one_object(values)
        _parse_run(values, np.flatnonzero(fast), schema, pieces, slow)
        slow.extend(np.flatnonzero(~fast).tolist())
    if slow:
        _parse_slowly(values, sorted(slow), schema, pieces, malformed, reasons)
    bad = np.flatnonzero(malformed)
    if len(bad):
        pieces.append((bad, schema.empty_table().take(pa.nulls(len(bad), pa.int64()))))
    table = _in_order(pieces, schema, count)
    assert table.num_rows == count, (table.num_rows, count)
    return Parsed(table, malformed, reasons)


def _looks_like_one_object(values: pa.Array) -> npt.NDArray[np.bool_]:
    """Per value: non-empty, first byte ``{`` and last byte ``}`` (numpy gathers, no loop)."""
    offsets, data = _offsets_and_data(values)
    starts, ends = offsets[:-1], offsets[1:]
    nonempty = ends > starts
    first = data[np.where(nonempty, starts, 0)] if len(data) else np.zeros(len(starts), np.uint8)
    last = data[np.where(nonempty, ends - 1, 0)] if len(data) else np.zeros(len(starts), np.uint8)
    ok: npt.NDArray[np.bool_] = nonempty & (first == _OPEN) & (last == _CLOSE)
    return ok


def _offsets_and_data(
    values: pa.Array,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
    assert values.type == pa.binary(), values.type
    assert values.null_count == 0, values.null_count
    _, offsets_buffer, data_buffer = values.buffers()
    offsets = np.frombuffer(offsets_buffer, np.int32, len(values) + 1, values.offset * 4)
    data = (
        np.frombuffer(data_buffer, np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    )
    return offsets.astype(np.int64), data


def _parse_run(
    values: pa.Array,
    indices: npt.NDArray[np.int64],
    schema: pa.Schema,
    pieces: list[tuple[npt.NDArray[np.int64], pa.Table]],
    slow: list[int],
) -> None:
    """Parse ``values[indices]`` (each looks like one object) in as few calls as it takes."""
    unsplit = [indices]
    while unsplit:  # bounded: every split halves a run; runs <= SLOW_RUN_MAX stop
        run = unsplit.pop()
        if not len(run):
            continue
        table = _parse_joined(_subset(values, run), schema)
        if table is not None:
            pieces.append((run, table))
        elif len(run) <= SLOW_RUN_MAX:
            slow.extend(run.tolist())
        else:
            half = len(run) // 2
            unsplit += [run[half:], run[:half]]


def _subset(values: pa.Array, indices: npt.NDArray[np.int64]) -> pa.Array:
    if len(indices) and int(indices[-1]) - int(indices[0]) + 1 == len(indices):
        return values.slice(int(indices[0]), len(indices))  # a contiguous run: no copy
    return values.take(pa.array(indices))


def _parse_schema(schema: pa.Schema) -> pa.Schema:
    """What pyarrow's reader is asked for (see ``_parse_type``); raises DocumentSchemaError."""
    return pa.schema([f.with_type(_parse_type(f.type, f.name)) for f in schema])


def _parse_joined(values: pa.Array, schema: pa.Schema) -> pa.Table | None:
    """One pyarrow parse of ``values`` joined by newlines, cast to ``schema``; None unless it
    gave one row each (a value a cast refuses, like a bad date, counts as a failed parse)."""
    if not len(values):
        return schema.empty_table()
    newline = pa.array([_NEWLINE], pa.binary())
    joined = pc.binary_join_element_wise(values, newline[0], pa.scalar(b"", pa.binary()))
    _, offsets_buffer, data_buffer = joined.buffers()
    first, last = np.frombuffer(offsets_buffer, np.int32, len(joined) + 1, joined.offset * 4)[
        [0, -1]
    ]
    buffer = data_buffer.slice(int(first), int(last - first))
    # One thread: Spark runs a reader per core already, and pyarrow's pool on top of them
    # cost ~20% more CPU for the same parse (measured on 64k-document batches).
    read_options = pa_json.ReadOptions(
        use_threads=False, block_size=max(_BLOCK_BYTES_MIN, len(buffer) // 2 + 1)
    )
    parse_schema = _parse_schema(schema)
    parse_options = pa_json.ParseOptions(
        explicit_schema=parse_schema, unexpected_field_behavior="ignore"
    )
    try:
        table = pa_json.read_json(pa.BufferReader(buffer), read_options, parse_options)
        if table.num_rows != len(values):
            return None
        table = table.select(schema.names)
        return table if parse_schema == schema else table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None


def _parse_slowly(
    values: pa.Array,
    indices: list[int],
    schema: pa.Schema,
    pieces: list[tuple[npt.NDArray[np.int64], pa.Table]],
    malformed: npt.NDArray[np.bool_],
    reasons: dict[int, str],
) -> None:
    """``json.loads`` each value, fit it to the schema, and parse the refitted documents."""
    fitted: list[bytes] = []
    kept: list[int] = []
    raw_values = values.take(pa.array(indices, pa.int64())).to_pylist()
    for index, raw in zip(indices, raw_values, strict=True):
        try:
            document = json.loads(raw)
            if not isinstance(document, dict):
                raise _Mismatch(f"a JSON {type(document).__name__}, not an object")
            refit = {f.name: _fit(document.get(f.name), f.type, f.name) for f in schema}
        except (ValueError, RecursionError) as error:
            malformed[index] = True
            reasons[index] = str(error) if isinstance(error, _Mismatch) else f"not JSON: {error}"
            continue
        fitted.append(json.dumps(refit, separators=(",", ":"), allow_nan=False).encode())
        kept.append(index)
    if not kept:
        return
    documents = pa.array(fitted, pa.binary())
    table = _parse_joined(documents, schema)
    if table is not None:
        pieces.append((np.array(kept, np.int64), table))
        return
    for i, index in enumerate(kept):  # one of them has a value pyarrow refuses (a bad date...)
        one = _parse_joined(documents.slice(i, 1), schema)
        if one is None:
            malformed[index] = True
            reasons[index] = "a value that does not parse as its field's type"
        else:
            pieces.append((np.array([index], np.int64), one))


class _Mismatch(ValueError):
    """A JSON value of another type than its field's."""


def _fit(value: Any, arrow_type: pa.DataType, path: str) -> Any:
    """``value`` as pyarrow's reader takes it for ``arrow_type``, as Spark's reader reads it.

    Raises:
        _Mismatch: naming the field, when Spark would not read the value as that type.
    """
    if value is None:
        return None
    if pa.types.is_string(arrow_type):
        return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    if pa.types.is_struct(arrow_type):
        if not isinstance(value, dict):
            raise _Mismatch(f"field {path!r} is not an object")
        return {f.name: _fit(value.get(f.name), f.type, f"{path}.{f.name}") for f in arrow_type}
    if pa.types.is_list(arrow_type):
        if not isinstance(value, list):
            raise _Mismatch(f"field {path!r} is not an array")
        return [_fit(item, arrow_type.value_type, f"{path}[]") for item in value]
    if pa.types.is_boolean(arrow_type):
        if not isinstance(value, bool):
            raise _Mismatch(f"field {path!r} is not a boolean")
        return value
    if pa.types.is_integer(arrow_type):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Mismatch(f"field {path!r} is not an integer")
        return value
    if pa.types.is_floating(arrow_type) or pa.types.is_decimal(arrow_type):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Mismatch(f"field {path!r} is not a number")
        return value
    return value  # dates and timestamps: pyarrow parses the text (or refuses it)


def _in_order(
    pieces: list[tuple[npt.NDArray[np.int64], pa.Table]], schema: pa.Schema, count: int
) -> pa.Table:
    """The pieces' rows put back at their value indices (each index exactly once)."""
    if len(pieces) == 1 and np.array_equal(pieces[0][0], np.arange(count)):
        return pieces[0][1]
    if not pieces:
        return schema.empty_table()
    indices = np.concatenate([at for at, _ in pieces])
    table = pa.concat_tables([t for _, t in pieces])
    assert len(indices) == count == table.num_rows, (len(indices), count, table.num_rows)
    order = np.empty(count, np.int64)
    order[indices] = np.arange(count)
    return table.take(pa.array(order))


# -- change rows -> document rows ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DocumentReader:
    """Turns change-row batches into batches of ``output``: its metadata columns as they are,
    its document fields parsed from ``value``, and (if ``output`` has it) the corrupt record.

    Picklable (Spark ships it to executors with the reader).
    """

    output: pa.Schema
    mode: str = "PERMISSIVE"
    corrupt_column: str = CORRUPT_COLUMN

    def __post_init__(self) -> None:
        assert self.mode in MODES, self.mode
        documents = document_schema(self.output, self.corrupt_column)
        check_document_fields(documents.names, self.corrupt_column)
        for field in documents:
            _parse_type(field.type, field.name)
        corrupt = self.output.get_field_index(self.corrupt_column)
        if corrupt >= 0 and self.output.field(corrupt).type != pa.string():
            raise DocumentSchemaError(f"column {self.corrupt_column!r} must be a string")

    @property
    def documents(self) -> pa.Schema:
        return document_schema(self.output, self.corrupt_column)

    def convert(self, changes: pa.RecordBatch | pa.Table) -> pa.RecordBatch:
        """The rows of ``changes`` (``CHANGE_ROW_SCHEMA``) as ``output`` rows.

        Raises:
            MalformedDocumentError: mode FAILFAST and a mutation's document is malformed.
        """
        table = pa.Table.from_batches([changes]) if isinstance(changes, pa.RecordBatch) else changes
        is_document = pc.equal(table.column("op"), OP_MUTATION).to_numpy(zero_copy_only=False)
        rows = np.flatnonzero(is_document)
        values = table.column("value").combine_chunks()
        if len(rows) < table.num_rows:
            values = values.take(pa.array(rows))
        parsed = parse_values(values, self.documents)
        bad = rows[parsed.malformed]
        if len(bad) and self.mode == "FAILFAST":
            at = int(bad[0])
            raise MalformedDocumentError(
                f"vbucket {table.column('vbucket')[at]} seqno {table.column('seqno')[at]} key "
                f"{table.column('key')[at]}: malformed JSON document "
                f"({parsed.reasons[int(np.flatnonzero(parsed.malformed)[0])]}); "
                f"{len(bad)} malformed in this batch (mode FAILFAST)"
            )
        # Each row's document: its parsed row, or null (not a mutation).
        where = np.full(table.num_rows, -1, np.int64)
        where[rows] = np.arange(len(rows))
        fields = parsed.table
        if len(rows) < table.num_rows:
            fields = fields.take(pa.array(where, mask=where < 0))
        columns = []
        for field in self.output:
            if field.name in METADATA_COLUMNS:
                columns.append(table.column(field.name))
            elif field.name == self.corrupt_column:
                columns.append(_corrupt_texts(table.column("value"), bad, table.num_rows))
            else:
                columns.append(fields.column(field.name))
        out = pa.Table.from_arrays(columns, schema=self.output)
        if len(bad) and self.mode == "DROPMALFORMED":
            keep = np.ones(table.num_rows, np.bool_)
            keep[bad] = False
            out = out.filter(pa.array(keep))
        batches = out.combine_chunks().to_batches()
        assert len(batches) <= 1, len(batches)
        return batches[0] if batches else _empty_batch(self.output)


def _corrupt_texts(values: pa.ChunkedArray, bad: npt.NDArray[np.int64], count: int) -> pa.Array:
    """Null except at ``bad``: the raw value as text (invalid UTF-8 replaced)."""
    if not len(bad):
        return pa.nulls(count, pa.string())
    texts: list[str | None] = [None] * count
    raw = values.take(pa.array(bad)).to_pylist()
    for at, value in zip(bad.tolist(), raw, strict=True):  # malformed rows only
        texts[at] = value.decode("utf-8", "replace")
    return pa.array(texts, pa.string())


def _empty_batch(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in schema], schema=schema)


# -- inference -----------------------------------------------------------------------------------


def infer_fields(values: Sequence[bytes]) -> StructType:
    """The document fields Spark's JSON inference gives ``values`` (objects only; others and
    malformed values are left out). Order-independent: the result depends on the set only."""
    merged: DataType = NullType()
    for raw in values:
        try:
            document = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if isinstance(document, dict):
            merged = _merge(merged, _infer(document))
    if not isinstance(merged, StructType):
        return StructType([])
    fields = _no_nulls(merged)
    assert isinstance(fields, StructType), fields
    return fields


def _infer(value: Any) -> DataType:
    if value is None:
        return NullType()
    if isinstance(value, bool):
        return BooleanType()
    if isinstance(value, int):
        return LongType() if INT64_MIN <= value <= INT64_MAX else DoubleType()
    if isinstance(value, float):
        return DoubleType()
    if isinstance(value, str):
        return StringType()
    if isinstance(value, list):
        element: DataType = NullType()
        for item in value:
            element = _merge(element, _infer(item))
        return ArrayType(element, True)
    assert isinstance(value, dict), type(value)
    return StructType([StructField(name, _infer(value[name]), True) for name in sorted(value)])


def _merge(a: DataType, b: DataType) -> DataType:
    """Spark's ``compatibleType`` for JSON inference (commutative and associative)."""
    if isinstance(a, NullType):
        return b
    if isinstance(b, NullType) or a == b:
        return a
    if {type(a), type(b)} == {LongType, DoubleType}:
        return DoubleType()
    if isinstance(a, StructType) and isinstance(b, StructType):
        mine = {f.name: f.dataType for f in a.fields}
        theirs = {f.name: f.dataType for f in b.fields}
        names = sorted(mine.keys() | theirs.keys())
        return StructType(
            [
                StructField(n, _merge(mine.get(n, NullType()), theirs.get(n, NullType())), True)
                for n in names
            ]
        )
    if isinstance(a, ArrayType) and isinstance(b, ArrayType):
        return ArrayType(_merge(a.elementType, b.elementType), True)
    return StringType()


def _no_nulls(data_type: DataType) -> DataType:
    """Types inference could not decide (always null, empty arrays) become ``string``."""
    if isinstance(data_type, NullType):
        return StringType()
    if isinstance(data_type, StructType):
        return StructType([StructField(f.name, _no_nulls(f.dataType), True) for f in data_type])
    if isinstance(data_type, ArrayType):
        return ArrayType(_no_nulls(data_type.elementType), True)
    return data_type


def merge_fields(kept: StructType, added: StructType) -> StructType:
    """``kept``'s fields as they are, then ``added``'s fields that ``kept`` lacks: a field's
    type, once chosen (e.g. by a mirror table), stays."""
    names = {f.name for f in kept.fields}
    return StructType([*kept.fields, *(f for f in added.fields if f.name not in names)])
