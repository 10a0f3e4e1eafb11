"""vbmeta: checked metadata, its JSON form, and corrupt metadata."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed import limits
from changefeed.storage import CorruptRecordError, VBucketMeta
from changefeed.storage.vbmeta import (
    _COUNTERS,
    VB_STATES,
    VbState,
    check_failover_log,
    check_state,
    decode_vbstate,
    encode_vbstate,
)

U64 = 2**64 - 1


@st.composite
def vbstates(draw: st.DrawFn) -> VbState:
    high = draw(st.integers(0, U64))
    snap_start = draw(st.integers(0, U64))
    return VbState(
        state=draw(st.sampled_from(VB_STATES)),
        failover_log=tuple(
            draw(
                st.lists(
                    st.tuples(st.integers(0, U64), st.integers(0, U64)),
                    max_size=limits.FAILOVER_LOG_ENTRIES_MAX,
                )
            )
        ),
        high_seqno=high,
        purge_seqno=draw(st.integers(0, high)),
        snap_start=snap_start,
        snap_end=draw(st.integers(snap_start, U64)),
        item_count=draw(st.integers(0, U64)),
        high_completed_seqno=draw(st.integers(0, high)),
    )


@given(vbstates())
def test_round_trip(row: VbState) -> None:
    assert row.problem() is None
    assert decode_vbstate(1, encode_vbstate(row)) == row
    public = row.public()
    assert public == VBucketMeta(
        row.state, list(row.failover_log), row.high_seqno, row.purge_seqno, row.snap_start,
        row.snap_end, row.high_completed_seqno,
    )  # fmt: skip
    public.failover_log.append((1, 1))  # the view is a copy
    assert row.public() != public


@given(vbstates())
def test_encoding_is_json_dumps_of_the_document(row: VbState) -> None:
    """encode_vbstate formats its JSON by hand (it runs per vbucket on every flush round):
    byte for byte what json.dumps writes for the document, so stores written before read
    and compare the same."""
    document = {
        "v": 1,
        "state": str(row.state),
        "failover_log": [list(entry) for entry in row.failover_log],
        "high_seqno": row.high_seqno,
        "purge_seqno": row.purge_seqno,
        "snap_start": row.snap_start,
        "snap_end": row.snap_end,
        "item_count": row.item_count,
        "high_completed_seqno": row.high_completed_seqno,
    }
    assert encode_vbstate(row) == json.dumps(document, separators=(",", ":")).encode()


@given(vbstates())
def test_copy_is_equal_and_separate(row: VbState) -> None:
    assert row.counters() == tuple(getattr(row, name) for name in _COUNTERS)
    copy = row.copy()
    assert copy == row and copy is not row
    copy.high_seqno += 1
    assert copy != row


@pytest.mark.parametrize("bad", [-1, U64 + 1, True, 1.0, None])
@pytest.mark.parametrize("field", ["high_seqno", "purge_seqno", "snap_end", "item_count"])
def test_a_counter_that_is_not_a_u64_is_a_problem(field: str, bad: object) -> None:
    row = VbState("active", high_seqno=5, snap_end=5)  # type: ignore[arg-type]
    setattr(row, field, bad)
    assert row.problem() is not None


def test_metadata_written_before_sync_writes_reads_a_zero_high_completed_seqno() -> None:
    older = {
        "v": 1, "state": "replica", "failover_log": [[7, 0]], "high_seqno": 9,
        "purge_seqno": 0, "snap_start": 9, "snap_end": 9, "item_count": 4,
    }  # fmt: skip
    row = decode_vbstate(1, json.dumps(older).encode())
    assert (row.high_seqno, row.high_completed_seqno) == (9, 0)
    with pytest.raises(CorruptRecordError):
        decode_vbstate(1, json.dumps({**older, "unknown": 1}).encode())


def test_copy_is_independent() -> None:
    row = VbState("active", ((1, 0),), high_seqno=5)
    copy = row.copy()
    copy.high_seqno = 6
    assert row.high_seqno == 5


def test_checks_of_caller_input() -> None:
    assert check_state("replica") == "replica"
    with pytest.raises(ValueError, match="vbucket state"):
        check_state("zombie")
    assert check_failover_log([(1, 2), (3, 4)]) == ((1, 2), (3, 4))
    with pytest.raises(ValueError, match="FAILOVER_LOG_ENTRIES_MAX"):
        check_failover_log([(1, 1)] * (limits.FAILOVER_LOG_ENTRIES_MAX + 1))
    for bad in ([(1, -1)], [(1, U64 + 1)], [(1, 2, 3)], [(1.0, 2)]):
        with pytest.raises(ValueError, match="pair of u64"):
            check_failover_log(bad)  # type: ignore[arg-type]


GOOD = {
    "v": 1, "state": "active", "failover_log": [[7, 0]], "high_seqno": 5, "purge_seqno": 1,
    "snap_start": 2, "snap_end": 5, "item_count": 3,
}  # fmt: skip


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xff", "not JSON"),
        (b"{", "not JSON"),
        (b"[]", "fields"),
        (json.dumps({**GOOD, "extra": 1}).encode(), "fields"),
        (json.dumps({**GOOD, "v": 2}).encode(), "version"),
        (json.dumps({**GOOD, "state": "zombie"}).encode(), "state"),
        (json.dumps({**GOOD, "failover_log": [[1]]}).encode(), "pair"),
        (json.dumps({**GOOD, "failover_log": {"a": 1}}).encode(), "list of pairs"),
        (json.dumps({**GOOD, "high_seqno": -1}).encode(), "u64"),
        (json.dumps({**GOOD, "high_seqno": "5"}).encode(), "u64"),
        (json.dumps({**GOOD, "purge_seqno": 6}).encode(), "purge_seqno 6 > high_seqno 5"),
        (json.dumps({**GOOD, "snap_start": 6}).encode(), "snap_start 6 > snap_end 5"),
    ],
)
def test_corrupt_metadata_raises(data: bytes, match: str) -> None:
    assert decode_vbstate(4, json.dumps(GOOD).encode()).high_seqno == 5
    with pytest.raises(CorruptRecordError, match=match) as caught:
        decode_vbstate(4, data)
    assert (caught.value.vb, caught.value.seqno) == (4, None)
