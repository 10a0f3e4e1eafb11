"""Record: the stored byte layout, DCP body reuse, and corrupt bytes."""

from __future__ import annotations

import dataclasses
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed import limits
from changefeed.storage import CorruptRecordError, Op, Record
from changefeed.storage.record import (
    DELETION_HEAD,
    MUTATION_HEAD,
    PREFIX,
    TAG_MUTATION,
    decode_record,
    encode_record,
    encode_stored,
)

U64 = 2**64 - 1
U32 = 2**32 - 1

keys = st.binary(min_size=1, max_size=limits.STORED_KEY_SIZE_MAX)
values = st.binary(max_size=300)
u64s = st.integers(0, U64)
u32s = st.integers(0, U32)
seqnos = st.integers(1, U64)
vbs = st.integers(0, limits.VBUCKETS_MAX - 1)
datatypes = st.integers(0, 7)

STORED_OPS = (Op.MUTATION, Op.DELETION, Op.EXPIRATION)  # PREPARE/ABORT are never records


@st.composite
def records(draw: st.DrawFn) -> Record:
    op = draw(st.sampled_from(STORED_OPS))
    mutation = op is Op.MUTATION
    return Record.create(
        draw(vbs),
        draw(seqnos),
        draw(keys),
        op,
        cas=draw(u64s),
        value=draw(values),
        rev_seqno=draw(u64s),
        flags=draw(u32s) if mutation else 0,
        expiry=draw(u32s) if mutation else 0,
        datatype=draw(datatypes),
        delete_time=0 if mutation else draw(u32s),
    )


@given(records())
def test_stored_form_round_trips(record: Record) -> None:
    stored = encode_stored(record)
    assert decode_record(record.vb, record.seqno, stored) == record
    assert stored[PREFIX.size :] == record.body


@given(records())
def test_body_is_the_dcp_body(record: Record) -> None:
    key_start = record.extras_len
    value_start = key_start + len(record.key)
    assert record.body[key_start:value_start] == record.key
    assert record.body[value_start:] == record.value
    if record.op is Op.MUTATION:
        assert record.extras_len == 31
        extras = struct.unpack(">QQIIIHB", record.body[:31])  # dcp-wire.md §7.3
        assert extras == (record.seqno, record.rev_seqno, record.flags, record.expiry, 0, 0, 0)
        assert not record.deleted
    else:
        assert record.extras_len == 21
        extras = struct.unpack(">QQIB", record.body[:21])  # dcp-wire.md §7.4 V2
        assert extras == (record.seqno, record.rev_seqno, record.delete_time, 0)
        assert record.deleted


@given(records())
def test_direct_construction_checks_and_equals_the_fast_path(record: Record) -> None:
    fields = {name: getattr(record, name) for name in Record.__dataclass_fields__}
    assert Record(**fields) == record
    with pytest.raises(ValueError, match="body"):
        Record(**{**fields, "body": record.body + b"x"})
    with pytest.raises(ValueError):
        Record(**{**fields, "extras_len": 52 - record.extras_len})


@given(records())
def test_from_dcp_body_reuses_a_stored_form_body(record: Record) -> None:
    body = bytes(record.body)
    rebuilt = Record.from_dcp_body(
        record.vb, record.op, body, extras_len=record.extras_len, key_len=len(record.key),
        cas=record.cas, datatype=record.datatype,
    )  # fmt: skip
    assert rebuilt == record
    assert rebuilt.body is body  # no copy, no re-encoding


def test_from_dcp_body_reencodes_other_wire_forms() -> None:
    key, value = b"k1", b"xattrs"
    expiration = struct.pack(">QQI", 9, 2, 1234) + key + value  # dcp-wire.md §7.5, 20 bytes
    record = Record.from_dcp_body(
        5, Op.EXPIRATION, expiration, extras_len=20, key_len=2, cas=3, datatype=4
    )
    assert record == Record.create(
        5, 9, key, Op.EXPIRATION, cas=3, value=value, rev_seqno=2, datatype=4, delete_time=1234
    )
    deletion_v1 = struct.pack(">QQH", 9, 2, 0) + key  # dcp-wire.md §7.4 V1, 18 bytes
    record = Record.from_dcp_body(
        5, Op.DELETION, deletion_v1, extras_len=18, key_len=2, cas=3, datatype=0
    )
    assert (record.extras_len, record.delete_time, record.key, record.value) == (21, 0, key, b"")
    nru_set = struct.pack(">QQIIIHB", 9, 2, 1, 0, 0, 0, 2) + key + value
    record = Record.from_dcp_body(
        5, Op.MUTATION, nru_set, extras_len=31, key_len=2, cas=3, datatype=0
    )
    assert record.body == struct.pack(">QQIIIHB", 9, 2, 1, 0, 0, 0, 0) + key + value


@pytest.mark.parametrize(
    ("op", "body", "extras_len", "key_len", "match"),
    [
        (Op.MUTATION, struct.pack(">QQIIIHB", 9, 2, 1, 0, 0, 1, 0) + b"k", 31, 1, "nmeta"),
        (Op.MUTATION, b"\x00" * 40, 21, 1, "extras"),
        (Op.DELETION, b"\x00" * 40, 20, 1, "extras"),
        (Op.MUTATION, b"\x00" * 31, 31, 1, "fit"),
        (Op.MUTATION, b"\x00" * 40, 31, 0, "fit"),
        (Op.MUTATION, struct.pack(">QQIIIHB", 0, 2, 1, 0, 0, 0, 0) + b"k", 31, 1, "seqno"),
    ],
)
def test_from_dcp_body_rejects_bad_bodies(
    op: Op, body: bytes, extras_len: int, key_len: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        Record.from_dcp_body(0, op, body, extras_len=extras_len, key_len=key_len, cas=0, datatype=0)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"seqno": 0}, "seqno"),
        ({"seqno": U64 + 1}, "seqno"),
        ({"key": b""}, "key length"),
        ({"key": b"k" * (limits.STORED_KEY_SIZE_MAX + 1)}, "key length"),
        ({"value": b"v" * (limits.VALUE_SIZE_MAX + 1)}, "VALUE_SIZE_MAX"),
        ({"datatype": 8}, "datatype"),
        ({"cas": -1}, "cas"),
        ({"cas": U64 + 1}, "cas"),
        ({"rev_seqno": U64 + 1}, "out of range"),
        ({"flags": U32 + 1}, "out of range"),
        ({"op": Op.DELETION, "flags": 1}, "tombstone"),
        ({"delete_time": 1}, "mutation"),
        ({"op": 1}, "Op"),
    ],
)
def test_encode_rejects_out_of_range_fields(fields: dict[str, object], match: str) -> None:
    arguments: dict[str, object] = {"op": Op.MUTATION, "seqno": 1, "key": b"k", "value": b"v"}
    arguments.update(fields)
    options = {
        k: arguments.pop(k) for k in list(arguments) if k not in ("op", "seqno", "key", "value")
    }
    options.setdefault("cas", 0)
    with pytest.raises(ValueError, match=match):
        encode_record(**arguments, **options)  # type: ignore[arg-type]


def test_boundary_values_round_trip() -> None:
    key = b"k" * limits.STORED_KEY_SIZE_MAX
    record = Record.create(
        limits.VBUCKETS_MAX - 1, U64, key, Op.MUTATION, cas=U64, value=b"", rev_seqno=U64,
        flags=U32, expiry=U32, datatype=7,
    )  # fmt: skip
    assert decode_record(record.vb, U64, encode_stored(record)) == record


def test_repr_shows_at_most_100_bytes_of_a_value() -> None:
    record = Record.create(0, 1, b"k", Op.MUTATION, cas=0, value=b"v" * 5000)
    assert "5000 bytes" in repr(record)
    assert len(repr(record)) < 400


# --- corrupt bytes -------------------------------------------------------------------------------


def stored_mutation(**fields: int) -> bytearray:
    values = {"tag": TAG_MUTATION, "datatype": 0, "key_len": 1, "cas": 0, "seqno": 7, "rev": 1}
    values.update(fields)
    head = MUTATION_HEAD.pack(
        values["tag"], values["datatype"], values["key_len"], values["cas"], values["seqno"],
        values["rev"], 0, 0, fields.get("lock_time", 0), fields.get("nmeta", 0),
        fields.get("nru", 0),
    )  # fmt: skip
    return bytearray(head + b"k" + b"value")


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (bytes(stored_mutation(tag=0x21)), "layout version 2"),
        (bytes(stored_mutation(tag=0x14)), "unknown tag"),
        (bytes(stored_mutation())[:40], "shorter than its 43-byte head"),
        (bytes(stored_mutation(tag=0x12))[:30], "shorter than its 33-byte head"),
        (bytes(stored_mutation(seqno=8)), "by_seqno 8"),
        (bytes(stored_mutation(lock_time=1)), "non-zero"),
        (bytes(stored_mutation(nmeta=1)), "non-zero"),
        (bytes(stored_mutation(nru=1)), "non-zero"),
        (bytes(stored_mutation(datatype=8)), "datatype"),
        (bytes(stored_mutation(key_len=0)), "key length 0"),
        (bytes(stored_mutation(key_len=300)), "key length 300"),
        (bytes(stored_mutation(key_len=7)), "shorter than its extras and key"),
    ],
)
def test_corrupt_bytes_raise_corrupt_record_error(data: bytes, match: str) -> None:
    with pytest.raises(CorruptRecordError, match=match) as caught:
        decode_record(3, 7, data)
    assert (caught.value.vb, caught.value.seqno) == (3, 7)
    assert "vb 3 seqno 7" in str(caught.value)


@given(records(), st.data())
def test_any_damage_decodes_or_raises_corrupt(record: Record, data: st.DataObject) -> None:
    stored = bytearray(encode_stored(record))
    damage = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if damage == "flip":
        position = data.draw(st.integers(0, len(stored) - 1))
        stored[position] ^= data.draw(st.integers(1, 255))
    elif damage == "truncate":
        del stored[data.draw(st.integers(0, len(stored) - 1)) :]
    else:
        stored += data.draw(st.binary(min_size=1, max_size=8))
    try:
        decoded = decode_record(record.vb, record.seqno, bytes(stored))
    except CorruptRecordError as error:
        assert (error.vb, error.seqno) == (record.vb, record.seqno)
    else:  # damage to a value, cas, flags... is not detectable; the layout still holds
        assert decoded.seqno == record.seqno
        assert encode_stored(decoded) == bytes(stored)


@given(st.binary(max_size=80))
def test_random_bytes_decode_or_raise_corrupt(data: bytes) -> None:
    try:
        decoded = decode_record(0, 1, data)
    except CorruptRecordError:
        return
    assert encode_stored(decoded) == data


@given(records())
def test_decoded_records_are_ordinary_frozen_records(record: Record) -> None:
    decoded = decode_record(record.vb, record.seqno, encode_stored(record))
    assert type(decoded) is Record
    assert hash(decoded) == hash(
        Record(**{n: getattr(record, n) for n in Record.__dataclass_fields__})
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        decoded.vb = 1  # type: ignore[misc]


def test_heads_against_literal_formats() -> None:
    # The heads are built from the protocol's extras declarations; these literals are the
    # independent oracle (module docstring: prefix, then mutation or deletion V2 extras).
    assert MUTATION_HEAD.format == ">BBHQQQIIIHB"
    assert DELETION_HEAD.format == ">BBHQQQIB"
    assert (MUTATION_HEAD.size, DELETION_HEAD.size) == (12 + 31, 12 + 21)
