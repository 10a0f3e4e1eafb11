"""A local reader's session state is bounded however long it runs (issue 27, item 1).

The session (``consumer/session.py``) is driven the three ways a local reader drives it — ring
batches (``local_stream._merge``, one consistent point per batch that ends a snapshot), DCP
catch-up (markers and runs of items), rollbacks — plus save/load round trips, and compared
after every step with a simple model that keeps *every* consistent point ever recorded:

* bound: at most ``CONSISTENT_POINTS_MAX`` points, ascending, positive, at or below the seqno;
* safe: every kept point is a true one (in the model), so a rollback never lands on a point
  the consumer did not hold whole;
* exact where it matters: the newest ``CONSISTENT_POINTS_MAX // 2`` points equal the model's,
  and the oldest stays (old history is covered, with coarser steps).

A state file written by an older build (hundreds of points per vbucket, unsorted, repeated) is
repaired on load, and a DCP client resumes from it: before the fix it raised AssertionError.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.consumer.session import (
    CONSISTENT_POINTS_MAX,
    SessionState,
    VbSession,
    thin_consistent_points,
)
from changefeed.ipc.local_stream import _merge

GROUP = (3,)
VB = GROUP[0]


class Model:
    """Every consistent point, never thinned; and the seqno."""

    def __init__(self) -> None:
        self.points: list[int] = []
        self.seqno = 0

    def add(self, seqno: int) -> None:
        if not self.points or self.points[-1] < seqno:
            self.points.append(seqno)

    def rollback(self, seqno: int, kept: list[int]) -> None:
        """After a rollback the points below it are the session's thinned ones (what it knows
        whole there): the model takes them, checked to be true points, and stays exact from
        there on."""
        assert set(kept[:-1]) <= set(self.points), sorted(set(kept) - set(self.points))
        self.points = list(kept)
        self.seqno = seqno


def check(session: VbSession, model: Model) -> None:
    session.check_invariants()
    points = session.consistent_points
    assert session.seqno == model.seqno, (session.seqno, model.seqno)
    assert set(points) <= set(model.points), sorted(set(points) - set(model.points))
    exact = min(len(model.points), CONSISTENT_POINTS_MAX // 2)
    if exact:
        assert points[-exact:] == model.points[-exact:]
        assert points[0] == model.points[0]
    for probe in (0, model.seqno // 3, model.seqno // 2, model.seqno):
        got = session.consistent_point_at_or_below(probe)
        best = max((p for p in model.points if p <= probe), default=0)
        assert got <= best, (probe, got, best)
        assert got == 0 or got in model.points, got


ring = st.tuples(st.just("ring"), st.integers(1, 40), st.booleans())
dcp = st.tuples(st.just("dcp"), st.integers(1, 40), st.booleans())
rollback = st.tuples(st.just("rollback"), st.integers(0, 100), st.booleans())
reload = st.tuples(st.just("reload"), st.just(0), st.booleans())
steps = st.lists(
    st.one_of(ring, ring, ring, dcp, rollback, reload),
    min_size=1,
    max_size=400,
)


def positions(seqno: int, snap_start: int, snap_end: int, before: int) -> np.ndarray:
    return np.array([[7, seqno, snap_start, snap_end, before]], np.uint64)


@settings(max_examples=150, deadline=None)
@given(steps)
def test_session_state_stays_bounded_and_safe_against_the_model(
    ops: list[tuple[str, int, bool]],
) -> None:
    state = SessionState({VB: VbSession(VB)})
    model = Model()
    for kind, amount, at_end in ops:
        session = state.get(VB)
        seqno = session.seqno
        if kind == "ring":  # one shared-memory batch: the publisher's positions after it
            snap_start = seqno + 1
            last = seqno + amount
            snap_end = last if at_end else last + 5
            state = _merge(GROUP, state, positions(last, snap_start, snap_end, seqno))
            model.seqno = last
            if at_end:
                model.add(last)
        elif kind == "dcp":  # a marker and its items over TCP (some runs end the snapshot)
            snap_start = seqno + 1
            snap_end = seqno + amount + (0 if at_end else 3)
            session.on_marker(snap_start, snap_end)
            session.on_items(np.arange(seqno + 1, seqno + amount + 1, dtype=np.uint64))
            model.seqno = seqno + amount
            if at_end:
                model.add(seqno + amount)
        elif kind == "rollback":  # as the DCP client does: to a consistent point at or below
            target = seqno * amount // 100
            point = session.consistent_point_at_or_below(target) if at_end else target
            assert point == 0 or not at_end or point in model.points, point
            session.rollback_to(point)
            model.rollback(point, session.consistent_points)
        else:
            state = SessionState.from_json(state.to_json())
        check(state.get(VB), model)
    assert len(json.dumps(state.to_dict())) < 64 * CONSISTENT_POINTS_MAX


def test_thousands_of_ring_batches_then_dcp_then_reload() -> None:
    """The field failure: ~90 batches made the first DCP catch-up raise AssertionError."""
    state: SessionState | None = None
    for i in range(1, 5001):  # 5,000 batches, each ending a snapshot
        state = _merge(GROUP, state, positions(10 * i, 10 * i - 9, 10 * i, 10 * (i - 1)))
        assert len(state.get(VB).consistent_points) <= CONSISTENT_POINTS_MAX
    assert state is not None
    session = state.get(VB)
    assert session.consistent_points[-1] == 50_000
    assert session.consistent_points[0] == 10
    session.on_marker(50_001, 50_010)  # the DCP catch-up
    session.on_items(np.arange(50_001, 50_011, dtype=np.uint64))
    again = SessionState.from_json(state.to_json())
    again.get(VB).check_invariants()
    assert again.to_json() == state.to_json()


def old_build_state(points: int) -> dict[str, object]:
    """What an older build saved after ~`points` shared-memory batches: one point each."""
    listed = [10 * i for i in range(1, points + 1)]
    listed = listed[::-1] + listed[:5] + [10 * points + 999]  # unsorted, repeats, past seqno
    return {
        str(VB): {
            "seqno": 10 * points,
            "snap_start": 10 * points - 9,
            "snap_end": 10 * points,
            "purge_seqno": 0,
            "failover_log": [[7, 0]],
            "consistent_points": listed,
        }
    }


@pytest.mark.parametrize("points", [65, 90, 445, 20_000])
def test_an_oversized_state_from_an_older_build_is_repaired_on_load(points: int) -> None:
    state = SessionState.from_json(json.dumps(old_build_state(points)))
    session = state.get(VB)
    session.check_invariants()
    assert session.consistent_points[-1] == 10 * points
    assert session.consistent_points[0] == 10
    exact = CONSISTENT_POINTS_MAX // 2
    assert session.consistent_points[-exact:] == [
        10 * i for i in range(points - exact + 1, points + 1)
    ]
    # The first DCP catch-up after it (the step that raised before): items and a snapshot end.
    session.on_marker(10 * points + 1, 10 * points + 4)
    session.on_items(np.arange(10 * points + 1, 10 * points + 5, dtype=np.uint64))
    session.check_invariants()
    assert session.consistent_points[-1] == 10 * points + 4


@given(st.lists(st.integers(1, 10**9), unique=True, max_size=3000), st.integers(4, 200))
@settings(max_examples=200, deadline=None)
def test_thinning_keeps_the_ends_and_the_newest_half(raw: list[int], bound: int) -> None:
    points = sorted(raw)
    thin = thin_consistent_points(list(points), bound)
    assert len(thin) <= bound
    assert set(thin) <= set(points)
    assert thin == sorted(thin)
    if points:
        assert thin[0] == points[0] and thin[-1] == points[-1]
        exact = min(len(points), bound // 2)
        assert thin[-exact:] == points[-exact:]
    if len(points) <= bound:
        assert thin == points
