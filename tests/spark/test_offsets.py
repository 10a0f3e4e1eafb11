"""``offsets``: the JSON form of Spark offsets and ``limit_offsets`` (maxOffsetsPerTrigger).

``limit_offsets`` properties, for any start, latest and budget: the vbuckets that move forward
move by at most the budget in total; no vbucket moves backwards unless its latest offset is
itself behind the start (a history that went back: the read then rolls back); nothing goes past
latest; the budget is used up when not everything fits, and latest is reached when it does.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.spark.offsets import (
    Offsets,
    VbOffset,
    limit_offsets,
    offsets_from_json,
    offsets_to_json,
)

SEQNO_MAX = 10**6
uuids = st.integers(min_value=1, max_value=2**64 - 1)
seqnos = st.integers(min_value=0, max_value=SEQNO_MAX)


@st.composite
def start_and_latest(draw: st.DrawFn) -> tuple[Offsets, Offsets]:
    vbuckets = draw(st.lists(st.integers(0, 63), min_size=1, max_size=24, unique=True))
    latest: Offsets = {}
    start: Offsets = {}
    for vb in vbuckets:
        high = draw(seqnos)
        uuid = draw(uuids)
        latest[vb] = VbOffset(uuid, high, high, high)
        shape = draw(st.sampled_from(["fresh", "behind", "ahead", "absent"]))
        if shape == "absent":
            continue  # a vbucket new to the query starts at 0
        if shape == "fresh":
            start[vb] = VbOffset()
        elif shape == "behind":
            at = draw(st.integers(0, high))
            start[vb] = VbOffset(uuid, at, at, at)
        else:  # the node's history went back below the start (restore, failover)
            at = draw(st.integers(high, SEQNO_MAX + 1000))
            start[vb] = VbOffset(draw(uuids), at, at, at)
    return start, latest


def advance(start: Offsets, end: Offsets) -> dict[int, int]:
    return {vb: o.seqno - start.get(vb, VbOffset()).seqno for vb, o in end.items()}


@settings(max_examples=400, deadline=None)
@given(start_and_latest(), st.integers(min_value=1, max_value=3 * SEQNO_MAX))
def test_limit_offsets_properties(offsets: tuple[Offsets, Offsets], budget: int) -> None:
    start, latest = offsets
    out = limit_offsets(start, latest, budget)
    assert set(out) == set(latest)
    moved = advance(start, out)
    wanted = {vb: max(0, n) for vb, n in advance(start, latest).items()}
    assert sum(n for n in moved.values() if n > 0) <= budget, "over the budget"
    for vb, o in out.items():
        begin = start.get(vb, VbOffset()).seqno
        assert o.seqno <= max(latest[vb].seqno, begin), "past latest"
        if latest[vb].seqno >= begin:
            assert begin <= o.seqno <= latest[vb].seqno, "moved backwards"
        else:
            assert o == latest[vb], "a history behind the start is taken as it is"
        assert o.vb_uuid == latest[vb].vb_uuid
        assert o.snap_start == o.snap_end == o.seqno, o
    if sum(wanted.values()) <= budget:
        assert out == latest, "latest not reached although the budget allowed it"
    else:
        assert sum(n for n in moved.values() if n > 0) == budget, "budget left unused"


@settings(max_examples=200, deadline=None)
@given(start_and_latest(), st.integers(min_value=1, max_value=5000))
def test_limit_offsets_repeated_reaches_latest(
    offsets: tuple[Offsets, Offsets], budget: int
) -> None:
    """Applied batch after batch (as micro-batches do), the offsets reach latest, never
    moving backwards after the first batch."""
    start, latest = offsets
    total = sum(max(0, n) for n in advance(start, latest).values())
    budget = max(budget, total // 64 + 1)  # at most ~64 batches per example
    position = limit_offsets(start, latest, budget)
    for _ in range(total // budget + 1):  # bounded: each batch uses the whole budget or ends
        following = limit_offsets(position, latest, budget)
        assert all(following[vb].seqno >= position[vb].seqno for vb in latest)
        position = following
    assert position == latest


def test_limit_offsets_shares_the_budget_fairly() -> None:
    start = {vb: VbOffset() for vb in range(4)}
    latest = {0: VbOffset(7, 1000, 1000, 1000), 1: VbOffset(7, 10, 10, 10)}
    latest |= {2: VbOffset(7, 1000, 1000, 1000), 3: VbOffset(7, 0, 0, 0)}
    out = limit_offsets(start, latest, 300)
    assert [out[vb].seqno for vb in range(4)] == [145, 10, 145, 0]


def test_limit_offsets_requires_a_budget() -> None:
    with pytest.raises(AssertionError):
        limit_offsets({}, {0: VbOffset(1, 5, 5, 5)}, 0)


@given(st.dictionaries(st.integers(0, 1023), st.tuples(st.integers(0, 2**64 - 1), seqnos)))
def test_json_round_trip(raw: dict[int, tuple[int, int]]) -> None:
    offsets = {vb: VbOffset(uuid, seqno, seqno, seqno) for vb, (uuid, seqno) in raw.items()}
    as_json = offsets_to_json(offsets)
    assert all(isinstance(k, str) for k in as_json)
    assert offsets_from_json(as_json) == offsets


def test_from_dict_defaults_the_snapshot_to_the_seqno() -> None:
    assert VbOffset.from_dict({"seqno": 9}) == VbOffset(0, 9, 9, 9)
    assert VbOffset.from_dict({"seqno": 9, "vb_uuid": 3, "snap_start": 5, "snap_end": 12}) == (
        VbOffset(3, 9, 5, 12)
    )


@pytest.mark.parametrize(
    "raw",
    [
        7,
        {},
        {"seqno": "x"},
        {"seqno": None},
        {"seqno": 5, "snap_start": 6},
        {"seqno": 5, "snap_end": 4},
        {"seqno": -1, "snap_start": -1, "snap_end": -1},
        {"seqno": 1, "vb_uuid": -3},
    ],
)
def test_from_dict_rejects_malformed_offsets(raw: object) -> None:
    with pytest.raises(ValueError, match="offset"):
        VbOffset.from_dict(raw)


def test_from_json_names_a_bad_vbucket_key() -> None:
    with pytest.raises(ValueError, match="'vb3' is not a vbucket id"):
        offsets_from_json({"vb3": {"seqno": 1}})


def test_session_resumes_from_the_offset() -> None:
    session = VbOffset(42, 10, 8, 12).session(5)
    assert (session.vbucket, session.seqno, session.snap_start, session.snap_end) == (5, 10, 8, 12)
    assert session.vb_uuid == 42
    assert VbOffset().session(1).failover_log is None, "no uuid: a fresh stream"
