"""``consumer/change_rows.py``: the change-row schema agrees with what Spark derives from the
data source's DDL, and decoded columns (mutations, deletions V1/V2, expirations) become exactly
the rows and types the schema declares, including the narrowing of unsigned wire fields."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st
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
from changefeed.spark.merge_source import DELETED, MIRROR_SCHEMA, SOURCE_SCHEMA
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
    assert SOURCE_SCHEMA.names == [*MIRROR_SCHEMA.names, DELETED]


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


# -- the conversion against a per-row oracle ------------------------------------------------------


def rows_one_by_one(
    columns: ChangeColumns,
    snapshots: dict[int, tuple[int, int]],
    ends: dict[int, int] | None,
) -> tuple[list[dict[str, object]], set[int]]:
    """What ``append_changes`` must give, computed row by row in plain Python (the conversion
    as it was written before it was vectorised)."""
    out, reached = [], set()
    for i in range(len(columns)):
        vb, seqno = columns.vbucket[i], columns.seqno[i]
        end = limits.SEQNO_MAX if ends is None else ends[vb]
        if seqno >= end and ends is not None:
            reached.add(vb)
        if seqno > end:
            continue
        snap_start, snap_end = snapshots[vb]
        expiry, flags = columns.expiry[i], columns.flags[i]
        out.append({
            "vbucket": vb, "seqno": seqno, "key": columns.key[i].decode(),
            "value": columns.value[i], "op": OP_BY_OPCODE[columns.opcode[i]],
            "cas": columns.cas[i], "expiry": expiry - 2**32 if expiry >= 2**31 else expiry,
            "flags": flags - 2**32 if flags >= 2**31 else flags,
            "rev_seqno": columns.rev_seqno[i], "snap_start": snap_start,
            "snap_end": min(snap_end, end),
        })  # fmt: skip
    return out, reached


def random_changes(rng: random.Random, count: int) -> bytes:
    """Items of a few vbuckets, seqnos rising per vbucket, every kind, UTF-8 keys."""
    seqnos = dict.fromkeys(range(4), 0)
    wires = []
    for _ in range(count):
        vb = rng.randrange(4)
        seqnos[vb] += rng.randint(1, 3)
        key = "".join(rng.choice("aé€𝄞z09") for _ in range(rng.randint(1, 12))).encode()
        cas, rev = rng.randrange(INT64_MAX + 1), rng.randrange(1, INT64_MAX + 1)
        kind = rng.random()
        if kind < 0.6:
            mutation = Mutation(vb, 7, seqnos[vb], key, rng.randbytes(rng.randint(0, 300)), cas,
                                rev, rng.getrandbits(32), rng.getrandbits(32))  # fmt: skip
            wires.append(encode_mutation(mutation))
        elif kind < 0.85:
            delete_time = rng.choice([None, rng.getrandbits(32)])
            wires.append(encode_deletion(Deletion(vb, 7, seqnos[vb], key, cas, rev, delete_time)))
        else:
            expiration = Expiration(vb, 7, seqnos[vb], key, cas, rev, rng.getrandbits(32))
            wires.append(encode_expiration(expiration))
    return b"".join(wires)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("vectorise", [True, False])
def test_rows_equal_the_per_row_conversion(seed: int, vectorise: bool) -> None:
    rng = random.Random(seed)
    columns = decode_batch(random_changes(rng, rng.choice([1, 5, 200])), vectorise=vectorise)
    changes = columns.changes
    snapshots = {vb: (rng.randint(0, 50), rng.randint(50, 700)) for vb in range(4)}
    for ends in (None, {vb: rng.randint(1, 400) for vb in range(4)}):
        expected, expected_reached = rows_one_by_one(changes, snapshots, ends)
        rows = ChangeRows()
        assert rows.append_changes(changes, snapshots, ends) == expected_reached
        batch = rows.to_batch()
        assert batch.schema == CHANGE_ROW_SCHEMA
        assert batch.to_pylist() == expected
        assert len(rows) == len(expected)
    # A slice (one Changes event of several) converts as its own columns would.
    half = len(changes) // 2
    rows = ChangeRows()
    rows.append_changes(changes.slice(half, len(changes)), snapshots)
    assert (
        rows.to_batch().to_pylist()
        == rows_one_by_one(changes.slice(half, len(changes)), snapshots, None)[0]
    )


def test_a_key_that_is_not_utf8_is_refused_and_nothing_of_the_call_is_kept() -> None:
    # Before the conversion was vectorised, such a key was appended and to_batch raised
    # (UnicodeEncodeError, a ValueError); now append_changes refuses it, naming the change.
    good = encode_mutation(Mutation(0, 7, 2, "ké".encode(), b""))
    bad = encode_mutation(Mutation(3, 7, 9, b"k\xff", b""))
    rows = ChangeRows()
    rows.append_changes(decoded(good), SNAPSHOTS)
    with pytest.raises(ValueError, match=r"vbucket 3 seqno 9: key b'k\\xff' is not UTF-8"):
        rows.append_changes(decoded(good, bad), SNAPSHOTS)
    assert len(rows) == 1
    assert rows.to_batch().column("key").to_pylist() == ["ké"]
    # Past the end seqno the key is never looked at (the row is not wanted).
    assert rows.append_changes(decoded(bad), SNAPSHOTS, {3: 8}) == {3}
    assert len(rows) == 1


@given(st.binary(min_size=1, max_size=12))
def test_arrow_accepts_exactly_the_keys_python_decodes(key: bytes) -> None:
    rows = ChangeRows()
    try:
        text: str | None = key.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    columns = decoded(encode_mutation(Mutation(0, 7, 2, key, b"")))
    if text is None:
        with pytest.raises(ValueError, match="is not UTF-8"):
            rows.append_changes(columns, SNAPSHOTS)
    else:
        rows.append_changes(columns, SNAPSHOTS)
        assert rows.to_batch().column("key").to_pylist() == [text]


def test_seqnos_over_int64_are_refused_like_a_cas() -> None:
    rows = ChangeRows()
    huge_rev = encode_mutation(Mutation(0, 7, 5, b"r", b"", rev_seqno=INT64_MAX + 1))
    with pytest.raises(ValueError, match=r"vbucket 0 seqno 5: rev_seqno 9223372036854775808"):
        rows.append_changes(decoded(huge_rev), SNAPSHOTS)
    huge_seqno = encode_mutation(Mutation(0, 7, INT64_MAX + 1, b"s", b""))
    with pytest.raises(ValueError, match="seqno 9223372036854775808 does not fit"):
        rows.append_changes(decoded(huge_seqno), SNAPSHOTS)
    assert len(rows) == 0


def test_batches_of_many_calls_concatenate_once() -> None:
    rows = ChangeRows()
    for seqno in range(1, 40):
        rows.append_changes(decoded(encode_mutation(Mutation(0, 7, seqno, b"k", b"v"))), SNAPSHOTS)
    rows.append_rollback(0, 3)
    first = rows.to_batch()
    assert first.num_rows == 40
    assert rows.to_batch() is first, "to_batch again costs nothing"
    assert first.column("seqno").to_pylist() == [*range(1, 40), 3]
