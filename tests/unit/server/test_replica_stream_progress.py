"""What a replica's acknowledgements count for once its stream opens again
(server/replication.py `ReplicationTracker.stream_opened`).

A replica that restarted asks from what its disk kept: the active must count only that much,
not the higher seqnos the replica's previous process acknowledged from memory, or the replica
would count as caught up (and as holding prepares) while it holds less (issue 25: an in-sync
member restarted since its record). Model: per (vb, replica), what it holds is the start of its
current stream raised by the acks on that stream.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.server.replication import ReplicationTracker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_restarted_replica_counts_only_what_its_new_stream_starts_from() -> None:
    clock = Clock()
    tracker = ReplicationTracker(lambda vb: 50, lag_max_s=10.0, clock=clock)
    tracker.stream_opened(0, "r", 0)
    tracker.acknowledged(0, "r", 50, 30)  # held 50 in memory, 30 on disk
    assert tracker.progress(0, "r").received_seqno == 50
    tracker.stream_closed(0, "r")
    clock.now += 1
    tracker.stream_opened(0, "r", 30)  # restarted: its disk kept 30
    progress = tracker.progress(0, "r")
    assert (progress.received_seqno, progress.persisted_seqno) == (30, 30)
    assert progress.opened_s == clock.now
    tracker.acknowledged(0, "r", 50, 40)
    assert tracker.progress(0, "r").received_seqno == 50


steps = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.integers(0, 40)),
        st.tuples(st.just("ack"), st.integers(0, 40), st.integers(0, 40)),
        st.tuples(st.just("close"), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=300)
@given(steps=steps)
def test_received_is_the_current_streams_start_raised_by_its_acks(
    steps: list[tuple[object, ...]],
) -> None:
    clock = Clock()
    tracker = ReplicationTracker(lambda vb: 40, lag_max_s=10.0, clock=clock)
    held: int | None = None  # the model: what the replica holds on its current stream
    persisted = 0
    for step in steps:
        clock.now += 0.1
        kind = step[0]
        if kind == "open":
            start = int(step[1])  # type: ignore[call-overload]
            tracker.stream_opened(0, "r", start)
            held, persisted = start, min(persisted, start)
        elif kind == "ack":
            received, on_disk = int(step[1]), int(step[2])  # type: ignore[call-overload]
            tracker.acknowledged(0, "r", received, on_disk)
            held = max(held or 0, received)
            persisted = max(persisted, min(on_disk, held))
        else:
            tracker.stream_closed(0, "r")
        if held is not None:
            assert tracker.progress(0, "r").received_seqno == held
            assert tracker.progress(0, "r").persisted_seqno == persisted


def test_an_old_connection_closing_late_does_not_disconnect_the_new_stream() -> None:
    """A replica that reconnects (its new connection took its name) may have its old
    connection's close arrive after the new stream opened: only the current stream's close
    marks it disconnected (before, the late close did, and durable writes then counted it
    unreachable and the in-sync set dropped it until its next stream)."""
    tracker = ReplicationTracker(lambda vb: 40, lag_max_s=10.0, clock=lambda: 1.0)
    old = tracker.stream_opened(0, "r1", 40)
    new = tracker.stream_opened(0, "r1", 40)
    assert old != new
    tracker.stream_closed(0, "r1", old)
    assert tracker.progress(0, "r1").connected and tracker.in_sync(0, "r1")
    tracker.stream_closed(0, "r1", new)
    assert not tracker.progress(0, "r1").connected
    tracker.forget(0)  # ids stay unique after the vbucket's progress is forgotten
    assert tracker.stream_opened(0, "r1", 40) not in (old, new)
