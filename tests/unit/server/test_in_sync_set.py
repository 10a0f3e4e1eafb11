"""The in-sync rule (server/replication.py) against a simple model, on a fake clock.

Model (Kafka's replica.lag.time.max.ms): a replica is in sync iff its stream is open and either
it has acknowledged the active's current high seqno, or at some time t within the last
`lag_max_s` it acknowledged a seqno at least the active's high seqno as of its previous ack.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.protocol.dcp import (
    SeqnoAcknowledged,
    decode_seqno_acknowledged,
    encode_seqno_acknowledged,
)
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.reader import FrameReader
from changefeed.server.replication import ReplicationTracker

LAG_MAX_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tracker_with(high: dict[int, int], clock: Clock) -> ReplicationTracker:
    return ReplicationTracker(lambda vb: high[vb], lag_max_s=LAG_MAX_S, clock=clock)


def test_a_replica_that_keeps_up_stays_in_and_a_silent_one_drops_out_after_lag_max() -> None:
    high, clock = {0: 0}, Clock()
    tracker = tracker_with(high, clock)
    tracker.stream_opened(0, "fast", 0)
    tracker.stream_opened(0, "silent", 0)
    assert tracker.in_sync_set(0) == ["fast", "silent"]
    for step in range(1, 30):
        clock.now += 1
        high[0] = step * 10
        tracker.acknowledged(0, "fast", high[0] - 3, high[0] - 5)  # a little behind, keeping up
        assert "fast" in tracker.in_sync_set(0)
    assert tracker.in_sync_set(0) == ["fast"]  # silent: acked nothing for > 10 s of writes
    tracker.acknowledged(0, "silent", high[0], 0)  # caught up at once: back in
    assert tracker.in_sync_set(0) == ["fast", "silent"]
    tracker.stream_closed(0, "fast")  # no stream: out at once
    assert tracker.in_sync_set(0) == ["silent"]


def test_an_idle_caught_up_replica_stays_in_sync_however_long() -> None:
    high, clock = {0: 5}, Clock()
    tracker = tracker_with(high, clock)
    tracker.stream_opened(0, "r", 0)
    tracker.acknowledged(0, "r", 5, 5)
    clock.now += 10_000
    assert tracker.in_sync(0, "r")
    status = next(tracker.snapshot())
    assert (status.lag_items, status.lag_s, status.persisted_seqno) == (0, 0.0, 5)


def test_catch_ups_are_counted_with_their_duration() -> None:
    high, clock = {0: 100}, Clock()
    tracker = tracker_with(high, clock)
    tracker.stream_opened(0, "r", 40)  # 60 behind
    clock.now += 2.5
    tracker.acknowledged(0, "r", 100, 100)
    counters = tracker.counters()
    assert counters["replication_catchups_started"] == 1
    assert counters["replication_catchups_finished"] == 1
    assert counters["replication_catchup_seconds_last"] == 2.5
    assert counters["replication_items_acked"] == 60


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=6),  # time passes
            st.integers(min_value=0, max_value=20),  # writes on the active
            st.one_of(st.none(), st.integers(min_value=0, max_value=25)),  # ack: how far behind
        ),
        max_size=40,
    )
)
def test_in_sync_matches_the_model(steps: list[tuple[float, int, int | None]]) -> None:
    high, clock = {0: 0}, Clock()
    tracker = tracker_with(high, clock)
    tracker.stream_opened(0, "r", 0)
    acked = 0
    last_caught_up = clock.now
    high_at_previous_ack = 0
    for elapsed, writes, behind in steps:
        clock.now += elapsed
        high[0] += writes
        if behind is not None:
            ack = max(acked, high[0] - behind)  # acks never move back
            tracker.acknowledged(0, "r", ack, ack)
            if ack >= high[0] or ack >= high_at_previous_ack:
                last_caught_up = clock.now
            high_at_previous_ack = high[0]
            acked = ack
        expected = acked >= high[0] or clock.now - last_caught_up <= LAG_MAX_S
        assert tracker.in_sync(0, "r") == expected


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 1023))
def test_seqno_acknowledged_round_trips_and_refuses_persisted_above_received(
    received: int, persisted: int, vb: int
) -> None:
    for message in (
        SeqnoAcknowledged(vb, 7, received),
        SeqnoAcknowledged(vb, 7, received, persisted),
    ):
        reader = FrameReader(1 << 20)
        reader.feed(encode_seqno_acknowledged(message))
        frame = reader.next_frame()
        if message.persisted is not None and persisted > received:
            try:
                decode_seqno_acknowledged(frame)  # type: ignore[arg-type]
            except ProtocolError as error:
                assert "above received" in str(error)
            else:
                raise AssertionError("persisted above received was accepted")
            continue
        assert decode_seqno_acknowledged(frame) == message  # type: ignore[arg-type]
