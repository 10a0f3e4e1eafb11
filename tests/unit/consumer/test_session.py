"""``consumer/session.py``: a run of items recorded at once (``on_items``, what ``DcpClient``
does per ``Changes`` event) leaves exactly the state ``on_item`` per item leaves — seqno,
consistent points — and still refuses seqnos that do not rise (invariant 3)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.consumer.dcp_routing import apply_event
from changefeed.consumer.events import CollectionEvent
from changefeed.consumer.session import CONSISTENT_POINTS_MAX, SessionState, VbSession
from changefeed.protocol.collections import SystemEvent, SystemEventMessage


def runs(rng: random.Random) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Markers and runs of items of a few vbuckets: ``(snap_start, snap_end, items)`` where
    ``items`` is wire order ``(vbucket, seqno)``; seqnos rise per vbucket."""
    seqnos = dict.fromkeys(range(3), 0)
    out = []
    for _ in range(rng.randint(1, 40)):
        snap_start = max(seqnos.values()) + 1
        snap_end = snap_start + rng.randint(0, 6)
        items = []
        for _ in range(rng.randint(0, 12)):
            vb = rng.randrange(3)
            seqnos[vb] = max(seqnos[vb] + 1, rng.choice([seqnos[vb] + 1, snap_end]))
            items.append((vb, seqnos[vb]))
        out.append((snap_start, snap_end, items))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_a_run_at_once_equals_item_by_item(seed: int) -> None:
    rng = random.Random(seed)
    one_by_one, at_once = SessionState(), SessionState()
    for snap_start, snap_end, items in runs(rng):
        for state in (one_by_one, at_once):
            for vb in range(3):
                state.get(vb).on_marker(snap_start, snap_end)
        for vb, seqno in items:
            one_by_one.get(vb).on_item(seqno)
        vbuckets = np.array([vb for vb, _ in items], np.uint16)
        at_once.on_items(vbuckets, np.array([s for _, s in items], np.uint64))
    assert at_once.to_json() == one_by_one.to_json()


def test_consistent_points_are_kept_bounded_through_runs() -> None:
    session = VbSession(0)
    for end in range(1, 3 * CONSISTENT_POINTS_MAX):
        session.on_marker(end, end)
        session.on_items(np.array([end], np.uint64))
    assert session.seqno == 3 * CONSISTENT_POINTS_MAX - 1
    assert len(session.consistent_points) <= CONSISTENT_POINTS_MAX
    assert session.consistent_points[-1] == session.seqno


def test_a_run_that_does_not_rise_is_refused() -> None:
    session = VbSession(5, seqno=10)
    with pytest.raises(AssertionError):
        session.on_items(np.array([10, 11], np.uint64))  # not past the last seqno
    with pytest.raises(AssertionError):
        session.on_items(np.array([11, 13, 12], np.uint64))  # falls inside the run
    assert session.seqno == 10, "nothing of a refused run is recorded"
    session.on_items(np.array([], np.uint64))
    assert session.seqno == 10
    state = SessionState()
    state.on_items(np.array([2, 1, 2], np.uint16), np.array([5, 9, 6], np.uint64))
    assert (state.get(1).seqno, state.get(2).seqno) == (9, 6), "rising per vbucket is enough"


@given(
    st.lists(st.tuples(st.integers(1, 5), st.integers(0, 2**40)), min_size=1, max_size=20),
    st.integers(0, 30),
)
def test_the_manifest_uid_is_the_newest_seen_kept_through_rollback_and_json(
    events: list[tuple[int, int]], rollback_to: int
) -> None:
    """Model: the uid a session presents is the maximum over its system events; a rollback
    keeps it (a node's manifest never goes back); JSON keeps it (hex), and a state without
    one (an older build's) reads as 0."""
    session = VbSession(7)
    seqno = 0
    for step, uid in events:
        seqno += step
        session.on_system_event(seqno, uid)
    newest = max(uid for _, uid in events)
    assert session.manifest_uid == newest
    assert session.seqno == seqno
    session.rollback_to(min(rollback_to, session.seqno))
    assert session.manifest_uid == newest
    back = VbSession.from_dict(7, session.to_dict())
    assert back.manifest_uid == newest
    assert back.copy().manifest_uid == newest
    older = session.to_dict()
    older.pop("manifest_uid", None)
    assert VbSession.from_dict(7, older).manifest_uid == 0
    for bad in (5, "xyz", "-1"):
        with pytest.raises(ValueError, match="vbucket 7"):
            VbSession.from_dict(7, {**older, "manifest_uid": bad})


def test_a_collection_event_moves_the_manifest_uid_of_its_vbucket_only() -> None:
    state = SessionState()
    message = SystemEventMessage(2, 0, 5, SystemEvent.BEGIN_COLLECTION, 9, 8, 10, b"orders")
    apply_event(state, CollectionEvent(2, message))
    assert state.get(2).manifest_uid == 9 and state.get(2).seqno == 5
    assert state.get(1).manifest_uid == 0
