"""``consumer/change_rows.py``: the change-row schema agrees with what Spark derives from the
data source's DDL, and decoded columns (mutations, deletions V1/V2, expirations) become exactly
the rows and types the schema declares, including the narrowing of unsigned wire fields."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from changefeed import limits
from changefeed.consumer.change_rows import (
    CHANGE_ROW_SCHEMA,
    INT64_MAX,
    OP_BY_OPCODE,
    OP_DELETION,
    OP_EXPIRATION,
    OP_MUTATION,
    OP_ROLLBACK,
    OPS,
    ChangeRows,
)
from changefeed.protocol.batch import ChangeColumns, decode_batch
from changefeed.protocol.dcp_items import (
    Deletion,
    Expiration,
    Mutation,
    encode_deletion,
    encode_expiration,
    encode_mutation,
)
from changefeed.protocol.opcode import Opcode
from changefeed.spark import ARROW_SCHEMA as SPARK_PACKAGE_SCHEMA
from changefeed.spark.mirror import MIRROR_SCHEMA, SOURCE_SCHEMA
from changefeed.spark.schema import ARROW_SCHEMA, SCHEMA_DDL, ddl_of

# The DDL the data source declared by hand before the schema was declared once: an independent
# oracle for the derived string.
DDL_BEFORE = (
    "vbucket int, seqno long, key string, value binary, op string, cas long, expiry int, "
    "flags int, rev_seqno long, snap_start long, snap_end long"
)
SNAPSHOTS = {0: (1, 10), 3: (5, 40)}


def spark_simple_string(ddl: str) -> str:
    """``"a int, b long"`` as Spark prints the StructType it parses from it (long = bigint)."""
    aliases = {"long": "bigint"}
    fields = [part.split() for part in ddl.split(", ")]
    assert all(len(f) == 2 for f in fields), fields
    return "struct<" + ",".join(f"{name}:{aliases.get(kind, kind)}" for name, kind in fields) + ">"


def decoded(*wires: bytes) -> ChangeColumns:
    batch = decode_batch(b"".join(wires))
    assert not batch.controls
    assert batch.consumed == sum(len(w) for w in wires)
    return batch.changes


# -- the schema ----------------------------------------------------------------------------------


def test_spark_uses_the_one_change_row_schema() -> None:
    assert ARROW_SCHEMA is CHANGE_ROW_SCHEMA
    assert SPARK_PACKAGE_SCHEMA is CHANGE_ROW_SCHEMA
    assert SCHEMA_DDL == DDL_BEFORE


def test_schema_is_what_spark_derives_from_the_ddl() -> None:
    # Spark hands a Python data source the StructType of its DDL and expects Arrow batches of
    # exactly to_arrow_schema(StructType) (spark-python-datasource.md, gotcha 6).
    struct_type = from_arrow_schema(CHANGE_ROW_SCHEMA)
    assert struct_type.simpleString() == spark_simple_string(SCHEMA_DDL)
    assert to_arrow_schema(struct_type) == CHANGE_ROW_SCHEMA
    assert not any(pa.types.is_large_string(t) or pa.types.is_large_binary(t)
                   for t in CHANGE_ROW_SCHEMA.types)  # fmt: skip


def test_ddl_of_refuses_types_spark_would_not_return() -> None:
    assert ddl_of(pa.schema([("a", pa.int32()), ("b", pa.bool_())])) == "a int, b boolean"
    for wide in (pa.large_string(), pa.large_binary(), pa.uint64()):
        with pytest.raises(ValueError, match="has no Spark type"):
            ddl_of(pa.schema([("x", wide)]))


def test_mirror_schema_is_a_subset_of_the_change_row_schema() -> None:
    assert MIRROR_SCHEMA.names[0] == "key"
    for name in MIRROR_SCHEMA.names:
        assert MIRROR_SCHEMA.field(name) == CHANGE_ROW_SCHEMA.field(name), name
    assert set(CHANGE_ROW_SCHEMA.names) - set(MIRROR_SCHEMA.names) == {
        "op",
        "snap_start",
        "snap_end",
    }
    assert SOURCE_SCHEMA.names == [*MIRROR_SCHEMA.names, "deleted"]


def test_op_names() -> None:
    assert OP_BY_OPCODE == {
        Opcode.DCP_MUTATION: OP_MUTATION,
        Opcode.DCP_DELETION: OP_DELETION,
        Opcode.DCP_EXPIRATION: OP_EXPIRATION,
    }
    assert OPS == ("mutation", "deletion", "expiration", "rollback")
    assert OP_ROLLBACK not in OP_BY_OPCODE.values(), "a rollback is no DCP item"


# -- the conversion -------------------------------------------------------------------------------


def test_decoded_columns_become_change_rows() -> None:
    columns = decoded(
        encode_mutation(
            Mutation(
                0,
                7,
                3,
                b"k\xc3\xa9",
                b"v1",
                cas=11,
                rev_seqno=2,
                flags=0xFFFF_FFFE,
                expiry=2**31,
                datatype=1,
            )
        ),
        encode_deletion(Deletion(3, 7, 9, b"gone", cas=12, rev_seqno=4, delete_time=None)),
        encode_deletion(Deletion(3, 7, 12, b"gone2", cas=13, rev_seqno=5, delete_time=99)),
        encode_expiration(Expiration(0, 7, 4, b"old", cas=14, rev_seqno=6, delete_time=98)),
    )
    rows = ChangeRows()
    assert rows.append_changes(columns, SNAPSHOTS) == set()
    batch = rows.to_batch()
    assert batch.schema == CHANGE_ROW_SCHEMA
    common = {"value": b"", "expiry": 0, "flags": 0}
    assert batch.to_pylist() == [
        {"vbucket": 0, "seqno": 3, "key": "ké", "value": b"v1", "op": "mutation", "cas": 11,
         "expiry": -(2**31), "flags": -2, "rev_seqno": 2, "snap_start": 1, "snap_end": 10},
        {"vbucket": 3, "seqno": 9, "key": "gone", "op": "deletion", "cas": 12, "rev_seqno": 4,
         "snap_start": 5, "snap_end": 40} | common,
        {"vbucket": 3, "seqno": 12, "key": "gone2", "op": "deletion", "cas": 13, "rev_seqno": 5,
         "snap_start": 5, "snap_end": 40} | common,
        {"vbucket": 0, "seqno": 4, "key": "old", "op": "expiration", "cas": 14, "rev_seqno": 6,
         "snap_start": 1, "snap_end": 10} | common,
    ]  # fmt: skip


def test_end_seqnos_drop_later_rows_and_cut_the_snapshot() -> None:
    columns = decoded(
        *(encode_mutation(Mutation(0, 7, seqno, b"a%d" % seqno, b"")) for seqno in (8, 10, 11)),
        *(encode_mutation(Mutation(3, 7, seqno, b"b%d" % seqno, b"")) for seqno in (20, 21)),
    )
    rows = ChangeRows()
    reached = rows.append_changes(columns, SNAPSHOTS, {0: 10, 3: 30})
    assert reached == {0}, "vbucket 0 reached its end at seqno 10; vbucket 3 did not"
    batch = rows.to_batch()
    assert batch.column("seqno").to_pylist() == [8, 10, 20, 21]
    assert batch.column("snap_end").to_pylist() == [10, 10, 30, 30]
    assert batch.column("snap_start").to_pylist() == [1, 1, 5, 5]


def test_rows_accumulate_across_calls_with_rollbacks_between() -> None:
    rows = ChangeRows()
    rows.append_changes(decoded(encode_mutation(Mutation(3, 7, 30, b"x", b"1"))), SNAPSHOTS)
    rows.append_rollback(3, 25)
    rows.append_changes(decoded(encode_mutation(Mutation(3, 7, 26, b"x", b"2"))), SNAPSHOTS)
    assert len(rows) == 3
    table = rows.to_batch().to_pylist()
    assert [(r["op"], r["seqno"]) for r in table] == [
        ("mutation", 30),
        ("rollback", 25),
        ("mutation", 26),
    ]
    assert table[1] == {"vbucket": 3, "seqno": 25, "key": "", "value": b"", "op": "rollback",
                        "cas": 0, "expiry": 0, "flags": 0, "rev_seqno": 0, "snap_start": 25,
                        "snap_end": 25}  # fmt: skip


def test_an_empty_batch() -> None:
    rows = ChangeRows()
    assert rows.append_changes(ChangeColumns(), SNAPSHOTS) == set()
    assert rows.append_changes(ChangeColumns(), {}, {}) == set()
    batch = rows.to_batch()
    assert batch.num_rows == 0
    assert batch.schema == CHANGE_ROW_SCHEMA


def test_a_cas_over_int64_is_refused_and_nothing_of_the_call_is_kept() -> None:
    fits = encode_mutation(Mutation(0, 7, 2, b"max", b"", cas=INT64_MAX))
    rows = ChangeRows()
    rows.append_changes(decoded(fits), SNAPSHOTS)
    assert rows.to_batch().column("cas").to_pylist() == [INT64_MAX]
    too_big = encode_mutation(Mutation(0, 7, 5, b"big", b"", cas=INT64_MAX + 1))
    with pytest.raises(ValueError, match=r"vbucket 0 seqno 5: CAS 9223372036854775808"):
        rows.append_changes(decoded(fits, too_big), SNAPSHOTS)
    assert len(rows) == 1, "the rows of the refused call before the bad one are removed too"
    assert rows.to_batch().num_rows == 1
    assert 2**64 - 1 > INT64_MAX == 2**63 - 1


def test_rows_per_batch_bound() -> None:
    assert limits.ROWS_PER_BATCH_MAX == 65_536
    assert limits.ROWS_PER_BATCH_MAX * 32 * 1024 <= 2**31
