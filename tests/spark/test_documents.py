"""Documents as typed columns, without Spark: parsing against a schema (vectorised and slow
path agree with ``json.loads``), the malformed-document modes, and schema inference.

The model each parse is checked against is ``json.loads`` plus Spark's reading rules written
out per type in ``helpers.expected_document`` (independent of ``documents.py``'s slow path).
"""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql.types import StructType

from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA
from changefeed.spark.documents import (
    METADATA_COLUMNS,
    DocumentReader,
    DocumentSchemaError,
    MalformedDocumentError,
    ddl_of_fields,
    infer_fields,
    merge_fields,
    parse_values,
)

from .helpers import expected_document

NESTED = pa.schema(
    [
        ("id", pa.int64()),
        ("price", pa.float64()),
        ("name", pa.string()),
        ("ok", pa.bool_()),
        ("tags", pa.list_(pa.field("element", pa.string()))),
        (
            "address",
            pa.struct(
                [
                    ("city", pa.string()),
                    ("zip", pa.int64()),
                    ("geo", pa.list_(pa.field("element", pa.float64()))),
                ]
            ),
        ),
    ]
)  # fmt: skip


def check(values: list[bytes], schema: pa.Schema) -> None:
    parsed = parse_values(pa.array(values, pa.binary()), schema)
    assert parsed.table.schema == schema
    rows = parsed.table.to_pylist()
    for i, raw in enumerate(values):
        want = expected_document(raw, schema)
        assert bool(parsed.malformed[i]) == (want is None), (raw, parsed.reasons.get(i))
        if want is not None:
            assert rows[i] == want, raw
        else:
            assert all(v is None for v in rows[i].values()), raw


def test_nested_documents_become_typed_columns() -> None:
    values = [
        b'{"id":1,"price":2,"name":"a","ok":true,"tags":["x","y"],"address":{"city":"Oslo","zip":150,"geo":[59,10.75]}}',
        b'{"id":2,"price":2.5,"name":null,"tags":[],"address":{"city":"Rome","extra":{"deep":1}}}',
        b'{"id":3,"address":null,"unknown":[1,2,3]}',
        b'{"id":4,"price":1e3,"name":"\\u00e9\\n","tags":null}',
        b"{}",
    ]  # fmt: skip
    check(values, NESTED)
    rows = parse_values(pa.array(values, pa.binary()), NESTED).table.to_pylist()
    assert rows[0]["price"] == 2.0 and isinstance(rows[0]["price"], float)  # int -> double
    assert rows[0]["address"] == {"city": "Oslo", "zip": 150, "geo": [59.0, 10.75]}
    assert rows[1]["address"]["zip"] is None and rows[1]["tags"] == []
    assert rows[2]["address"] is None and rows[4] == dict.fromkeys(NESTED.names)


def test_what_the_fast_path_refuses_takes_the_slow_path_and_agrees() -> None:
    values = [
        b'{"id":1,"name":5}',  # a number in a string field: its text
        b'{"id":2,"name":{"a":[1,true]}}',  # an object in a string field: its JSON
        b'{\n  "id": 3,\n  "name": "pretty"\n}',  # newlines between tokens
        b'  {"id":4}  ',  # whitespace around
        b'{"id":5,"id":6}',  # a key twice: the last wins
        b'{"id":"seven"}',  # malformed: a string in a bigint field
        b'{"id":8.5}',  # malformed: a double in a bigint field
        b"[1,2]",  # malformed: not an object
        b"not json",
        b"",
        b"   ",
        b'{"id":9}{"id":10}',  # two objects
        b'{"id":11',  # cut short
        b"\xff\xfe{}",  # not UTF-8
        # Each alone is malformed; joined they would read as three valid objects, one row
        # each, if a document's text could run on into the next one's.
        b'{"name":"}',
        b'{","id":1}',
        b"{}{}",
    ]
    check(values, NESTED)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.dictionaries(
                st.sampled_from(["id", "price", "name", "ok", "tags", "address", "x"]),
                st.recursive(
                    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
                    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["city", "zip", "geo"]), inner, max_size=3),
                    max_leaves=6,
                ),
            ).map(lambda d: json.dumps(d).encode()),
            st.binary(max_size=8),
        ),
        max_size=40,
    )
)  # fmt: skip
def test_parsing_agrees_with_json_loads(values: list[bytes]) -> None:
    check(values, NESTED)


def test_many_documents_with_a_few_bad_ones(rng: random.Random) -> None:
    values = [json.dumps({"id": i, "name": f"n{i}", "price": i / 2}).encode() for i in range(5000)]
    for at in rng.sample(range(len(values)), 7):
        values[at] = b'{"id": "bad"}'
    check(values, NESTED)


def change_rows(values: list[bytes | None]) -> pa.Table:
    """One change row per value (None: a deletion)."""
    rows = [
        {"vbucket": 3, "seqno": i + 1, "key": f"k{i}", "value": v or b"",
         "op": "mutation" if v is not None else "deletion", "cas": 10 + i, "expiry": 0,
         "flags": 0, "rev_seqno": 1, "snap_start": 1, "snap_end": 9}
        for i, v in enumerate(values)
    ]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=CHANGE_ROW_SCHEMA)


def output(*documents: pa.Field, corrupt: bool = True) -> pa.Schema:
    fields = [CHANGE_ROW_SCHEMA.field(name) for name in METADATA_COLUMNS]
    return pa.schema(
        [*fields, *documents, *([("_corrupt_record", pa.string())] if corrupt else [])]
    )


def test_modes_for_malformed_documents() -> None:
    changes = change_rows([b'{"n":1}', b"{oops", None, b'{"n":"x"}', b'{"n":4}'])
    schema = output(pa.field("n", pa.int64()))

    permissive = DocumentReader(schema, "PERMISSIVE").convert(changes).to_pylist()
    assert [r["n"] for r in permissive] == [1, None, None, None, 4]
    assert [r["_corrupt_record"] for r in permissive] == [None, "{oops", None, '{"n":"x"}', None]
    assert [r["op"] for r in permissive][2] == "deletion"  # no document: not malformed
    assert [r["cas"] for r in permissive] == [10, 11, 12, 13, 14]  # metadata stays

    dropped = DocumentReader(output(pa.field("n", pa.int64()), corrupt=False), "DROPMALFORMED")
    kept = dropped.convert(changes).to_pylist()
    assert [(r["seqno"], r["n"]) for r in kept] == [(1, 1), (3, None), (5, 4)]

    failfast = DocumentReader(output(pa.field("n", pa.int64()), corrupt=False), "FAILFAST")
    with pytest.raises(MalformedDocumentError, match=r"vbucket 3 seqno 2 key k1.*FAILFAST"):
        failfast.convert(changes)
    assert failfast.convert(changes.slice(0, 1)).num_rows == 1


def test_a_document_field_named_like_a_metadata_column_is_refused() -> None:
    with pytest.raises(DocumentSchemaError, match="'Key'"):
        DocumentReader(output(pa.field("Key", pa.string())))
    with pytest.raises(DocumentSchemaError, match=r"'m'.*map"):
        DocumentReader(output(pa.field("m", pa.map_(pa.string(), pa.int64()))))


def test_inference_merges_types_as_spark_does() -> None:
    values = [
        b'{"a":1,"b":"x","c":[1,2],"d":{"y":1},"e":null,"f":1}',
        b'{"a":2.5,"b":3,"c":[1.5],"d":{"z":true},"f":[]}',
        b'{"g":[]}',
        b"[1]",
        b"garbage",
    ]
    fields = infer_fields(values)
    assert ddl_of_fields(fields) == (
        "`a` double, `b` string, `c` array<double>, `d` struct<`y`:bigint,`z`:boolean>, "
        "`e` string, `f` string, `g` array<string>"
    )
    assert infer_fields(list(reversed(values))) == fields  # the order does not matter
    assert infer_fields([]) == StructType([])


def test_a_kept_schema_keeps_its_types_and_gains_new_fields() -> None:
    kept = infer_fields([b'{"a":1,"b":"x"}'])
    added = infer_fields([b'{"a":1.5,"c":true}'])
    assert ddl_of_fields(merge_fields(kept, added)) == "`a` bigint, `b` string, `c` boolean"


def test_dates_and_timestamps_are_parsed_and_bad_ones_are_malformed() -> None:
    schema = pa.schema([("d", pa.date32()), ("t", pa.timestamp("us", tz="UTC"))])
    values = [
        b'{"d":"2024-01-02","t":"2024-01-02T03:04:05Z"}',
        b'{"d":"2024-13-45"}',
        b'{"t":"yesterday"}',
        b'{"d":null}',
    ]
    parsed = parse_values(pa.array(values, pa.binary()), schema)
    assert parsed.malformed.tolist() == [False, True, True, False]
    first = parsed.table.to_pylist()[0]
    assert (str(first["d"]), first["t"].isoformat()) == ("2024-01-02", "2024-01-02T03:04:05+00:00")
