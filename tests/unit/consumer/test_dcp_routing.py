"""The sans-IO parts of the map-following ``DcpClient``: where a moved stream resumes, the
bounded retries of its placement, and reading the cluster config."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.consumer.dcp_routing import (
    Retries,
    RetryKind,
    apply_event,
    positions,
    read_cluster_config,
)
from changefeed.consumer.events import Changes, Event, Rollback, Snapshot, StreamOpened
from changefeed.consumer.session import SessionState
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp_items import Mutation, encode_mutation
from changefeed.vbmap import ClusterMap, NodeAddress

VBUCKETS = 4


def changes(items: list[tuple[int, int]]) -> Changes:
    """A ``Changes`` event of (vbucket, seqno) items, in this order, decoded from the wire."""
    wire = b"".join(
        encode_mutation(Mutation(vb, 1, seqno, b"k%d" % seqno, b"v", cas=seqno))
        for vb, seqno in items
    )
    batch = decode_batch(wire)
    assert not batch.controls and len(batch.changes) == len(items)
    return Changes(batch.changes)


@st.composite
def histories(draw: st.DrawFn) -> list[Event]:
    """Events of several vbuckets as a node streams them: per vbucket an opening, snapshots
    with rising seqnos, now and then a rollback; vbuckets interleaved, items of several
    vbuckets sharing one ``Changes`` event."""
    per_vb: dict[int, list[Event | tuple[int, int]]] = {}
    for vb in range(VBUCKETS):
        steps: list[Event | tuple[int, int]] = [StreamOpened(vb, [(1000 + vb, 0)])]
        seqno = 0
        for _ in range(draw(st.integers(0, 4))):
            if seqno and draw(st.booleans()) and draw(st.booleans()):
                seqno = draw(st.integers(0, seqno))
                steps.append(Rollback(vb, seqno))
            count = draw(st.integers(1, 5))
            steps.append(Snapshot(vb, seqno + 1, seqno + count, 1))
            steps.extend((vb, s) for s in range(seqno + 1, seqno + count + 1))
            seqno += count
        per_vb[vb] = steps
    merged: list[Event | tuple[int, int]] = []
    while any(per_vb.values()):
        vb = draw(st.sampled_from(sorted(v for v, steps in per_vb.items() if steps)))
        merged.append(per_vb[vb].pop(0))
    events: list[Event] = []
    run: list[tuple[int, int]] = []
    for step in merged:  # consecutive items, of any vbuckets, become one Changes event
        if isinstance(step, tuple):
            run.append(step)
            if draw(st.booleans()):
                continue
        if run:
            events.append(changes(run))
            run = []
        if not isinstance(step, tuple):
            events.append(step)
    if run:
        events.append(changes(run))
    return events


@settings(max_examples=150, deadline=None)
@given(histories(), st.data())
def test_positions_equal_taking_every_queued_event(
    events: list[Event], data: st.DataObject
) -> None:
    taken = data.draw(st.integers(0, len(events)))
    wanted = data.draw(st.sets(st.integers(0, VBUCKETS)))  # VBUCKETS itself: never streamed
    session = SessionState()
    for event in events[:taken]:
        apply_event(session, event)
    before = session.to_json()

    found = positions(session, events[taken:], sorted(wanted))

    model = SessionState.from_json(before)
    for event in events[taken:]:
        apply_event(model, event)
    assert session.to_json() == before  # the application's session is not touched
    assert sorted(found) == sorted(wanted)
    for vb in wanted:
        assert found[vb].to_dict() == model.get(vb).to_dict(), vb


def test_retries_back_off_per_kind_and_reset_when_the_stream_opens() -> None:
    retries = Retries((0.1, 1.0), {RetryKind.MOVED: 2, RetryKind.UNREACHABLE: 3}, random.Random(1))
    assert retries.next_delay(0.0) is None
    assert retries.schedule([3, 1, 2], RetryKind.UNREACHABLE, 0.0) == []
    delay = retries.next_delay(0.0)
    assert delay is not None and 0.05 <= delay < 0.15
    assert retries.take_due(0.04) == ([], False)
    # One jitter per call: the vbuckets of one node are due together (one connection attempt).
    assert retries.take_due(0.15) == ([1, 2, 3], True)
    assert retries.pending() == set()

    assert retries.schedule([1], RetryKind.UNREACHABLE, 1.0) == []  # attempt 2: 1.0 s x jitter
    assert retries.take_due(1.49) == ([], False)
    assert retries.take_due(2.5) == ([1], True)
    assert retries.schedule([1], RetryKind.MOVED, 3.0, immediate=True) == []  # own budget
    assert retries.take_due(3.0) == ([1], False)  # immediate: the newer map is known
    assert retries.schedule([1], RetryKind.UNREACHABLE, 3.0) == []  # attempt 3 of 3
    assert retries.schedule([1], RetryKind.UNREACHABLE, 3.0) == [1]  # spent: forgotten
    assert retries.pending() == set()

    assert retries.schedule([2], RetryKind.MOVED, 0.0) == []
    assert retries.schedule([2], RetryKind.MOVED, 0.0) == []
    retries.succeeded(2)  # the stream opened: a later move starts from attempt 1 again
    assert retries.schedule([2], RetryKind.MOVED, 0.0) == []
    assert retries.schedule([2], RetryKind.MOVED, 0.0) == []
    assert retries.schedule([2], RetryKind.MOVED, 0.0) == [2]


def test_hurry_makes_waiting_attempts_due_now_without_another_map_read() -> None:
    retries = Retries((5.0,), {RetryKind.MOVED: 2, RetryKind.UNREACHABLE: 3}, random.Random(1))
    retries.schedule([4, 7], RetryKind.UNREACHABLE, 0.0)  # due in 2.5-7.5 s
    assert retries.take_due(1.0) == ([], False)
    retries.hurry([7, 9], 1.0)  # 9 waits for nothing: ignored
    assert retries.take_due(1.0) == ([7], False)
    assert retries.pending() == {4}


def test_read_cluster_config_names_the_answering_node() -> None:
    nodes = (NodeAddress("a", "127.0.0.1", 1), NodeAddress("b", "127.0.0.1", 2))
    cmap = ClusterMap(7, nodes, ((0, 1), (1, 0)), 1)
    config = cmap.couchbase_config("default", this_node="b")
    found, server = read_cluster_config(config, "localhost:2")
    assert server == "127.0.0.1:2" and found.rev == 7
    assert [n.server for n in found.nodes] == ["127.0.0.1:1", "127.0.0.1:2"]
    assert found.active(1) == found.nodes[1]
    # No thisNode (another server's config): the address dialled.
    assert read_cluster_config(cmap.couchbase_config("default"), "h:9")[1] == "h:9"
    with pytest.raises(ValueError, match="not a cluster config"):
        read_cluster_config({"rev": 1}, "h:9")
