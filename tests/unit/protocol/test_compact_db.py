"""COMPACT_DB (0x3a): kv_engine's 24-byte payload and our JSON summary. Round trips and hostile
input: the only outcomes of decoding a peer's bytes are a value or ProtocolError(EINVAL)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from changefeed import limits
from changefeed.protocol.kv import (
    COMPACT_DB_EXTRAS,
    CompactDb,
    CompactionSummary,
    decode_compact_db,
    decode_compaction_summary,
    encode_compact_db,
    encode_compaction_summary,
)
from changefeed.protocol.opcode import Opcode

from .helpers import SETTINGS, decode_single, expect_error, raw_frame

u64 = st.integers(0, limits.SEQNO_MAX)


@SETTINGS
@given(st.integers(0, 1023), st.integers(0, 2**32 - 1), u64, u64, st.booleans())
def test_round_trip(vb: int, opaque: int, ts: int, seq: int, drop: bool) -> None:
    request = CompactDb(vb, opaque, ts, seq, drop)
    data = encode_compact_db(request)
    frame = decode_single(data)
    assert (frame.opcode, len(frame.extras), frame.key, frame.value) == (
        Opcode.COMPACT_DB,
        24,
        b"",
        b"",
    )
    assert decode_compact_db(frame) == request
    assert Opcode.COMPACT_DB == 0x3A  # kv_engine's opcode


def test_layout_is_kv_engines() -> None:
    frame = decode_single(encode_compact_db(CompactDb(7, 1, 0x0102, 0x0304, True)))
    assert frame.vbucket == 7
    assert frame.extras == bytes.fromhex("000000000000010200000000000003040100000000000000")


def test_hostile_requests_are_einval() -> None:
    good = COMPACT_DB_EXTRAS.pack(1, 2, 1, 0, 0, 0)
    cases = [
        raw_frame(Opcode.COMPACT_DB, extras=good[:-1]),
        raw_frame(Opcode.COMPACT_DB, extras=b""),
        raw_frame(Opcode.COMPACT_DB, extras=good, key=b"k"),
        raw_frame(Opcode.COMPACT_DB, extras=good, value=b"v"),
        raw_frame(Opcode.COMPACT_DB, extras=COMPACT_DB_EXTRAS.pack(1, 2, 2, 0, 0, 0)),
        raw_frame(Opcode.COMPACT_DB, extras=COMPACT_DB_EXTRAS.pack(1, 2, 0, 1, 0, 0)),
        raw_frame(Opcode.COMPACT_DB, extras=COMPACT_DB_EXTRAS.pack(1, 2, 0, 0, 0, 7)),
    ]
    for data in cases:
        frame = decode_single(data)
        expect_error(lambda frame=frame: decode_compact_db(frame))


def test_summary_round_trip_and_hostile_values() -> None:
    summary = CompactionSummary(3, 10, 42, 100)
    assert decode_compaction_summary(encode_compaction_summary(summary)) == summary
    fields = {"vbucket": 3, "purged": 10, "purge_seqno": 42, "visited": 100}
    hostile = [
        b"",
        b"\xff",
        b"[]",
        b"null",
        json.dumps({**fields, "purged": -1}).encode(),
        json.dumps({**fields, "purge_seqno": 2**64}).encode(),
        json.dumps({**fields, "visited": "100"}).encode(),
        json.dumps({**fields, "vbucket": True}).encode(),
        json.dumps({k: v for k, v in fields.items() if k != "purged"}).encode(),
    ]
    for value in hostile:
        expect_error(lambda value=value: decode_compaction_summary(value))
